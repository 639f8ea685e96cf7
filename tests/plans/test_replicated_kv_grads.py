"""Gradients of replicated key/value heads (fewer kv heads than TP ranks: ReplicatedKV)
for *every* parameter of the replicated module and its neighbours, biases included
(issue 52), at tp=4 with and without sequence parallelism, one pool call of 4 ranks:

- tpkit's own ``ParallelSelfAttention`` with q/k/v and output biases, 1 and 2 kv heads:
  each parameter's full gradient (after the TP sum of the ``sequence_parallel``-tagged
  ones, tpkit.grads.sync_sequence_parallel_grads, what TPKitStrategy does after each
  backward) against a reference written here in plain torch from the same full weights
  (q/k/v projections, query heads ``[i*g, (i+1)*g)`` on kv head ``i``, causal
  ``F.scaled_dot_product_attention``, the output projection), float64;
- a Hugging Face Qwen2 (q/k/v biases, 2 kv heads) through tpkit.parallelize's ready plan:
  every parameter after one SGD step with lr=1 (the update is the gradient) against
  transformers' own model stepped the same way.

Every parameter is named in the failure, so a gradient missing its TP sum (a tag not set
on the bias beside the weight) or summed twice shows where."""
import copy

import pytest
import torch
import torch.nn.functional as F

from dist import run

pytestmark = pytest.mark.slow

H, HEADS, S, B = 32, 4, 8, 2


def _reference_grads(full, x, w_out, kv_heads):
    """{name: gradient} of sum(attention(x) * w_out) in plain torch from ``full``."""
    p = {k: v.detach().clone().requires_grad_() for k, v in full.items()}
    d = H // HEADS
    q = F.linear(x, p["linear_qkv.weight"], p["linear_qkv.bias"])         # [S, B, HEADS*d]
    kv = F.linear(x, p["linear_kv.weight"], p["linear_kv.bias"])          # [S, B, 2*kv*d]
    k, v = kv.split(kv_heads * d, -1)
    q = q.view(S, B, HEADS, d).permute(1, 2, 0, 3)
    k, v = (t.view(S, B, kv_heads, d).permute(1, 2, 0, 3) for t in (k, v))
    g = HEADS // kv_heads                                     # query heads per kv head
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ctx = ctx.permute(2, 0, 1, 3).reshape(S, B, HEADS * d)
    out = F.linear(ctx, p["linear_proj.weight"], p["linear_proj.bias"])
    (out * w_out).sum().backward()
    return {k: t.grad for k, t in p.items()}


def _native(sp, kv_heads):
    import tpkit
    from tpkit.checkpoint import full_state_dict
    from tpkit.grads import sync_sequence_parallel_grads
    from tpkit.nn import ParallelSelfAttention
    state = tpkit.init_parallel(tp=4, sequence_parallel=sp, seed=3)
    torch.set_default_dtype(torch.float64)
    try:
        attn = ParallelSelfAttention(H, HEADS, num_gqa_groups=kv_heads, bias=True,
                                     init_method=lambda w: torch.nn.init.normal_(w, 0, 0.3))
        assert attn.replicated_kv
        with torch.no_grad():      # biases non-zero, the same on every rank
            for name, prm in attn.named_parameters():
                if name.endswith("bias"):
                    g = torch.Generator().manual_seed(len(name))
                    prm.copy_(torch.randn(prm.shape, generator=g) * 0.5)
        full = {k: v.clone() for k, v in full_state_dict(attn, state).items()}
        g = torch.Generator().manual_seed(7)
        x = torch.randn(S, B, H, generator=g)
        w_out = torch.randn(S, B, H, generator=g)
        mine = x.chunk(4)[state.tp_rank] if sp else x
        w_mine = w_out.chunk(4)[state.tp_rank] if sp else w_out
        (attn(mine) * w_mine).sum().backward()
        sync_sequence_parallel_grads(attn, state)
        with torch.no_grad():      # the gradient gathered by the parameters' TP tags
            for prm in attn.parameters():
                prm -= prm.grad
        after = full_state_dict(attn, state)
        want = _reference_grads(full, x, w_out, kv_heads)
        assert sorted(want) == sorted(full), sorted(full)
        return {k: ((full[k] - after[k]) - want[k]).abs().max().item() /
                max(want[k].abs().max().item(), 1e-30) for k in want}
    finally:
        torch.set_default_dtype(torch.float32)
        tpkit.destroy_parallel()


def _qwen2(sp):
    import tpkit
    from tpkit.checkpoint import full_state_dict
    from tpkit.grads import sync_sequence_parallel_grads
    from byom_models import hf_qwen2, model_loss
    state = tpkit.init_parallel(tp=4, sequence_parallel=sp)
    try:
        ref = hf_qwen2()
        with torch.no_grad():      # transformers zeroes the biases: make them count
            g = torch.Generator().manual_seed(5)
            for name, prm in ref.named_parameters():
                if name.endswith("bias"):
                    prm.copy_(torch.randn(prm.shape, generator=g) * 0.2)
        model = tpkit.parallelize(copy.deepcopy(ref))
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 64, (2, 16), generator=g)
        model_loss(ref, x, None).backward()
        model_loss(model, x, None).backward()
        sync_sequence_parallel_grads(model, state)
        for m in (ref, model):
            with torch.no_grad():
                for prm in m.parameters():
                    prm -= prm.grad
        full, want = full_state_dict(model, state), ref.state_dict()
        return {k: (full[k] - want[k]).abs().max().item() for k in want}
    finally:
        tpkit.destroy_parallel()


def _all():
    out = {}
    for sp in (False, True):
        for kv in (1, 2):
            out[f"native sp={sp} kv={kv}"] = _native(sp, kv)
        out[f"qwen2 sp={sp}"] = _qwen2(sp)
    return out


def test_every_parameter_of_replicated_kv_heads_gets_its_gradient_tp4():
    for rank, res in enumerate(run(_all, 4)):
        for case, errs in res.items():
            assert any("linear_kv.bias" in k or "k_proj.bias" in k for k in errs), errs
            bad = {k: e for k, e in errs.items() if not e <= 1e-5}
            assert not bad, (rank, case, bad)
