"""Cross entropy over vocabulary-parallel logits (global softmax across the TP shards).

Reduction: like Megatron, the loss is returned PER TOKEN (shape of ``target``), with 0 at
``ignore_index`` positions, i.e. ``F.cross_entropy(..., reduction="none")``. The mean
that ``F.cross_entropy`` returns by default is
``loss.sum() / (target != ignore_index).sum()``.

Label smoothing uses the GLOBAL vocab size V = tp * V_local:
``loss = (1 - eps) * nll + eps * mean_j(-log p_j)``, exactly F.cross_entropy's definition
(unlike Megatron issues #737 / #7464, which mixed in the local shard size).

Collectives: two all-reduces over the group (max; then the target logit, the sum of
exps and, with smoothing, the sum of logits packed in one tensor); none backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm.collectives import all_reduce_max, all_reduce_sum, group_rank, group_size
from ..layout.topology import get_parallel_state
from .export import check_exportable, is_onnx_export

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, smoothing, ignore_index, group):
        n = group_size(group)
        v_local = logits.shape[-1]
        vocab = v_local * n
        start = group_rank(group) * v_local
        in_dtype = logits.dtype
        ignored = target == ignore_index
        bad = ~(ignored | ((target >= 0) & (target < vocab)))
        if target.device.type == "cpu":
            if bad.any():
                raise ValueError(f"target ids must be in [0, {vocab}) (the global vocab) or "
                                 f"ignore_index={ignore_index}; got {target[bad][:5].tolist()}")
        else:  # no host sync on accelerators: fail asynchronously like F.cross_entropy
            torch._assert_async(~bad.any())
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        lmax = logits.max(dim=-1)[0]
        if n > 1:
            all_reduce_max(lmax, group)
        shifted = logits - lmax.unsqueeze(-1)
        local_t = target - start
        outside = (local_t < 0) | (local_t >= v_local) | ignored
        local_t = local_t.masked_fill(outside, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        parts = [picked, exp.sum(dim=-1)]
        if smoothing > 0:
            parts.append(shifted.sum(dim=-1))
        packed = torch.stack(parts)
        if n > 1:
            all_reduce_sum(packed, group)
        picked, sum_exp = packed[0], packed[1]
        log_z = sum_exp.log()
        loss = log_z - picked                                    # -log p_target
        if smoothing > 0:
            mean_neg_logp = log_z - packed[2] / vocab            # mean_j(-log p_j)
            loss = (1.0 - smoothing) * loss + smoothing * mean_neg_logp
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside, ignored)
        ctx.smoothing, ctx.vocab, ctx.in_dtype = smoothing, vocab, in_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, outside, ignored = ctx.saved_tensors
        grad = softmax                                           # d loss / d logits
        s = ctx.smoothing
        onehot_w = (1.0 - s) * (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -onehot_w.unsqueeze(-1))
        if s > 0:
            grad.sub_(s / ctx.vocab)
        grad.mul_((grad_loss.masked_fill(ignored, 0.0)).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *,
                                 label_smoothing: float = 0.0, ignore_index: int = -100,
                                 group=None) -> torch.Tensor:
    """Per-token cross entropy of ``logits [..., V/tp]`` (this rank's vocab shard, e.g. the
    output of a ColumnParallelLinear without gather_output) against global ``target [...]``.
    ``group`` defaults to the current state's TP group."""
    if group is None:
        group = get_parallel_state().tp_group
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} must "
                         "agree on every dim but the last (vocab)")
    if target.dtype.is_floating_point:
        raise ValueError(f"target must hold integer class ids, got {target.dtype}")
    if is_onnx_export():
        # torch.export cannot trace the autograd Function's host-side id check; on one
        # rank the loss is F.cross_entropy's (same definition, global smoothing = local)
        check_exportable(group_size(group), "vocab_parallel_cross_entropy")
        loss = F.cross_entropy(logits.float().flatten(0, -2), target.flatten(),
                               ignore_index=ignore_index, label_smoothing=label_smoothing,
                               reduction="none")
        return loss.view(target.shape)
    return _VocabParallelCE.apply(logits, target, float(label_smoothing), ignore_index, group)
