"""Gradient finalisation for TP/SP/CP/DP: sequence-parallel sums, a TP-aware norm and
clipping. Used by TPKitStrategy, launch/train.py and hand-written loops alike.

All work on the *local* tensors: with FSDP2 a gradient is a DTensor over the dp(x cp)
mesh and its local shard is what this rank owns. Which parameters are TP shards and
which need a TP sum is read off their tags (tpkit.layout.param_tags).
"""
from __future__ import annotations

import math
import sys
from typing import Callable, Iterable

import torch
from torch import nn

from .comm.collectives import all_reduce_flat, all_reduce_max, all_reduce_sum
from .layout.param_tags import is_expert, is_sequence_parallel, tp_spec
from .layout.topology import resolve_state

__all__ = ["sync_sequence_parallel_grads", "reduce_expert_grads", "grad_norm",
           "clip_grad_norm", "clip_grad_value", "snapshot_grads", "reduce_since",
           "reduced_here"]


def _is_dtensor(t) -> bool:
    """isinstance(t, DTensor) without importing torch.distributed.tensor (half a CPU-second
    in every process that imports tpkit.nn): a DTensor exists only once it is imported."""
    m = sys.modules.get("torch.distributed.tensor")
    return m is not None and isinstance(t, m.DTensor)


def reduced_here(p) -> bool:
    """An expert weight whose gradient reduce_expert_grads sums over edp: every expert
    weight but those FSDP2 shards (DTensors, which FSDP2 reduces over edp itself)."""
    return is_expert(p) and not _is_dtensor(p)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _tagged_grads(module_or_params, tagged) -> list[torch.Tensor]:
    """The local gradients of the parameters (of a module, or an iterable) ``tagged``."""
    params = module_or_params.parameters() if isinstance(module_or_params, nn.Module) \
        else module_or_params
    return [_local(p.grad) for p in params if tagged(p) and p.grad is not None]


def snapshot_grads(params: Iterable[nn.Parameter]) -> list:
    """``(param, a copy of its local gradient)`` for each parameter holding one: the
    part of the gradients ``reduce_since`` sets aside."""
    return [(p, _local(p.grad).detach().clone()) for p in params if p.grad is not None]


def reduce_since(snapshot: list, reduce: Callable[[], object]) -> None:
    """Run ``reduce`` (an in-place reduction of gradients over ranks) on only what was
    added to the gradients since ``snapshot`` (``snapshot_grads``): the earlier part is
    subtracted first and added back after. For a reduction that is not idempotent (a sum
    over ranks) when gradients accumulate over several backwards or steps."""
    deltas = [(g, base) for p, base in snapshot if (g := _local(p.grad)) is not None]
    for g, base in deltas:
        g.sub_(base)
    reduce()
    for g, base in deltas:
        g.add_(base)


def sync_sequence_parallel_grads(module_or_params: nn.Module | Iterable[nn.Parameter],
                                 state=None) -> int:
    """Sum over TP the gradients of the parameters tagged ``sequence_parallel=True``
    (replicated weights fed sequence-sharded activations, e.g. norm weights under SP: each
    TP rank holds the gradient of its own tokens; Megatron's ``_allreduce_layernorm_grads``).
    ``module_or_params`` is a module (its parameters) or an iterable of parameters. One
    flattened all-reduce per dtype; call after backward, before clipping or the optimizer
    step. Returns the number of gradients reduced."""
    state = resolve_state(state)
    grads = _tagged_grads(module_or_params, is_sequence_parallel)
    if state.tp_size > 1:
        all_reduce_flat(grads, state.tp_group)
    return len(grads)


def reduce_expert_grads(module_or_params: nn.Module | Iterable[nn.Parameter], state=None, *,
                        average: bool = True) -> int:
    """Sum the gradients of expert weights (tagged ``expert_parallel``, tpkit.nn.MoE) over
    the expert-data-parallel group, where each replica holds the gradient of the tokens it
    processed; with ``average`` divide by dp*cp, the factor DDP applies to the dense
    parameters (Megatron-Core's expert gradient scaling). Expert weights must stay out
    of DDP/FSDP over dp x cp, which would mix different experts' gradients. One
    flattened all-reduce per dtype; returns the number of gradients reduced."""
    state = resolve_state(state)   # (FSDP2's expert weights, DTensors: FSDP2 reduces them)
    grads = _tagged_grads(module_or_params, reduced_here)
    if state.edp_size > 1:
        all_reduce_flat(grads, state.edp_group)
    if average and state.dp_cp_size > 1 and grads:
        torch._foreach_mul_(grads, 1.0 / state.dp_cp_size)
    return len(grads)


def grad_norm(params: Iterable[torch.nn.Parameter], state, norm_type: float = 2.0) -> torch.Tensor:
    """The global gradient norm of a TP(/FSDP)-sharded model, as if computed on the full
    parameters in one process: TP-sharded gradients contribute every shard, replicated ones
    once (not ``tp`` times); expert weights (tpkit.nn.MoE) count every (etp, ep) shard
    once. One all-reduce over TP (plus one over dp(x cp) under FSDP, and one over etp x ep
    when the model has expert weights and ep*etp > 1).
    Under pipeline parallelism (``pp > 1``) ``params`` are this rank's stages'
    (tpkit.distributed.pipeline: every parameter lives on exactly one pp rank) and the norm is all-reduced over
    ``pp_group`` too, so every stage sees the whole model's norm, each parameter counted once.
    Every pp rank must call it (it is collective over ``pp_group``)."""
    params = [p for p in params if p.grad is not None]
    norm_type = float(norm_type)
    pp = getattr(state, "pp_size", 1) > 1
    if not params and not pp:
        return torch.tensor(0.0)
    device = _local(params[0].grad).device if params else _device(state)
    tp = state.tp_size
    inf = math.isinf(norm_type)
    fsdp = any(_is_dtensor(p.grad) for p in params)
    # Replicated gradients are identical on every TP rank: their p-th powers are pre-divided
    # by tp so the TP sum below counts them once (one collective instead of two).
    experts = [_local(p.grad).detach() for p in params if is_expert(p)]
    # FSDP2 shards expert weights over edp (tpkit.distributed.fsdp): each edp rank a piece
    sharded_experts = any(_is_dtensor(p.grad) for p in params if is_expert(p))
    dense = [p for p in params if not is_expert(p)]
    sharded = [_local(p.grad).detach() for p in dense if tp_spec(p) is not None]
    replicated = [_local(p.grad).detach() for p in dense if tp_spec(p) is None]
    # fp32 accumulation (fp64 when a gradient is fp64: norms never narrow)
    acc_dtype = torch.float64 if any(_local(p.grad).dtype == torch.float64 for p in params) \
        else torch.float32
    acc = torch.zeros((), dtype=acc_dtype, device=device)
    for grads, weight in ((sharded, 1.0), (replicated, 1.0 / tp)):
        grads = [g for g in grads if g.numel()]
        if not grads:
            continue
        norms = torch.stack(torch._foreach_norm(grads, norm_type, dtype=acc_dtype))
        if inf:
            acc = torch.maximum(acc, norms.max())
        else:
            acc = acc + norms.pow(norm_type).sum() * weight
    reduce = all_reduce_max if inf else all_reduce_sum
    if fsdp and state.dp_cp_size > 1:
        for group in _shard_groups(dense):   # HSDP: over the shards, not the replicas
            acc = reduce(acc, group)
    if tp > 1:
        acc = reduce(acc, state.tp_group)
    if experts:
        norms = torch.stack(torch._foreach_norm(experts, norm_type, dtype=acc_dtype))
        e_acc = norms.max() if inf else norms.pow(norm_type).sum()
        if sharded_experts and state.edp_size > 1:
            e_acc = reduce(e_acc.contiguous(), state.edp_group)
        if state.etp_size * state.ep_size > 1:
            e_acc = reduce(e_acc.contiguous(), state.etp_ep_group)
        acc = torch.maximum(acc, e_acc) if inf else acc + e_acc
    if pp:   # stages hold disjoint parameters: their sums (maxima) add up once each
        acc = reduce(acc, state.pp_group)
    return acc if inf else acc.pow(1.0 / norm_type)


def _shard_groups(params) -> list:
    """The groups of the mesh dimensions FSDP2 shards the (dense) gradients over: the
    dp x cp group, or under HSDP only the shard dimension's (the replicas hold the same
    pieces, which a sum over dp x cp would count once per replica)."""
    g = next((p.grad for p in params if _is_dtensor(p.grad)), None)
    if g is None:
        return []
    return [g.device_mesh.get_group(i) for i, pl in enumerate(g.placements) if pl.is_shard()]


def _device(state) -> torch.device:
    """The device of the layout's collectives (a rank without gradients still joins them)."""
    dev = getattr(state, "device", None)
    return torch.device(dev) if dev is not None else torch.device("cpu")


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, state, *,
                   norm_type: float = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
    """Scale gradients so the global norm (grad_norm) is at most ``max_norm``; returns the
    norm before clipping, like torch.nn.utils.clip_grad_norm_."""
    params = [p for p in params if p.grad is not None]
    total = grad_norm(params, state, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total gradient norm of order {norm_type} is {total.item()}; "
                           "pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    by_dtype: dict = {}
    for p in params:
        g = _local(p.grad)
        by_dtype.setdefault((g.device, g.dtype), []).append(g)
    for (_, dtype), gs in by_dtype.items():
        torch._foreach_mul_(gs, coef.to(device=gs[0].device, dtype=dtype))
    return total


def clip_grad_value(params: Iterable[torch.nn.Parameter], clip_value: float) -> None:
    """Clamp every gradient to ``[-clip_value, clip_value]``, like
    torch.nn.utils.clip_grad_value_, on the local tensors (TP shards and FSDP pieces clamp
    as the full gradient would). Sequence-parallel gradients must be summed first."""
    clip_value = float(clip_value)
    for p in params:
        if p.grad is not None:
            _local(p.grad).clamp_(min=-clip_value, max=clip_value)
