"""fp8 weights (tpkit.fp8.fp8_model_init) under tensor parallelism (issue 52), one pool
call of 2 ranks with sequence parallelism:

- the tags a sharded ``FP8Weight`` parameter carries are the layer's: a fused
  column-parallel weight ``tp_partition_dim=0`` and its ``tp_partition_sizes``, a
  row-parallel one ``tp_partition_dim=1``, the replicated SP biases ``sequence_parallel``
  (written here by hand, and equal to the same layers built without fp8); its master
  weight (``with_master_weights``) carries them too;
- what the tags drive: ``full_state_dict`` gathers each rank's fp8 shard (its own codes
  and scale) into the full weight, checked against a quantiser written here (per-tensor
  current scaling of each rank's shard: ``448 / amax``, E4M3 round-to-nearest, saturated)
  applied to the full float weight cut by the segments; the SP gradient sum and the TP
  gradient norm equal their values computed here from the gathered gradients."""
import math

import pytest
import torch

from dist import run

H, SEG, S, B = 16, 8, 4, 2        # fused column: 3 segments of 8 rows


def _quantised_shard(full, rank, tp, dim, segments=None):
    """This rank's shard of ``full`` (by segments along dim 0), through E4M3 at 448/amax."""
    if segments:
        parts = full.split(list(segments), dim)
        shard = torch.cat([p.chunk(tp, dim)[rank] for p in parts], dim)
    else:
        shard = full.chunk(tp, dim)[rank]
    scale = 448.0 / shard.abs().max().float()
    codes = (shard.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes.float() * (1.0 / scale)          # TE dequantises with scale_inv


def _assemble(shards, dim, segments=None, tp=2):
    """The full tensor from the ranks' shards (inverse of the cut above)."""
    if not segments:
        return torch.cat(shards, dim)
    per = [s.split([n // tp for n in segments], dim) for s in shards]
    return torch.cat([torch.cat([p[i] for p in per], dim) for i in range(len(segments))], dim)


def _worker():
    import tpkit
    from tpkit import fp8
    from tpkit.checkpoint import full_state_dict, load_full_state_dict
    from tpkit.grads import grad_norm, sync_sequence_parallel_grads
    from tpkit.nn import ColumnParallelLinear, RowParallelLinear
    from tpkit.layout.param_tags import tags_of
    state = tpkit.init_parallel(tp=2, sequence_parallel=True, seed=1)
    fp8.reset()

    def build():
        torch.manual_seed(0)
        col = ColumnParallelLinear(H, 3 * SEG, partition_sizes=(SEG, SEG, SEG),
                                   init_method=lambda w: torch.nn.init.normal_(w, 0, 0.5))
        row = RowParallelLinear(3 * SEG, H,
                                init_method=lambda w: torch.nn.init.normal_(w, 0, 0.5))
        return torch.nn.ModuleDict({"col": col, "row": row})

    plain = build()
    with fp8.fp8_model_init():
        model = build()
    # known full weights, loaded by the tags (copy_ into an FP8Weight quantises the shard)
    g = torch.Generator().manual_seed(4)
    known = {"col.weight": torch.randn(3 * SEG, H, generator=g),
             "col.bias": torch.randn(3 * SEG, generator=g),
             "row.weight": torch.randn(H, 3 * SEG, generator=g),
             "row.bias": torch.randn(H, generator=g)}
    for m in (plain, model):
        load_full_state_dict(m, known, state)
    out = {"types": {n: type(p).__name__ for n, p in model.named_parameters()},
           "tags": {n: tags_of(p) for n, p in model.named_parameters()},
           "plain_tags": {n: tags_of(p) for n, p in plain.named_parameters()}}
    full_plain = full_state_dict(plain, state)
    assert all(torch.equal(full_plain[k], known[k]) for k in known)
    out["full_fp8"] = full_state_dict(model, state)
    out["rank"] = state.tp_rank
    out["full_plain"] = full_plain
    # a backward at SP: the replicated biases' gradients summed over TP by their tag
    g = torch.Generator().manual_seed(2)
    x = torch.randn(S, B, H, generator=g).chunk(2)[state.tp_rank]
    y = model["row"](model["col"](x))
    (y * torch.arange(y.numel()).view_as(y).float()).sum().backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    sync_sequence_parallel_grads(model, state)
    out["grads_local"] = local
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    out["norm"] = grad_norm(list(model.parameters()), state).item()
    opt = fp8.with_master_weights(torch.optim.SGD(model.parameters(), lr=0.1))
    out["master_tags"] = {name: tags_of(m) for name, p in model.named_parameters()
                          for q, m in opt.fp8_masters if q is p}
    tpkit.destroy_parallel()
    return out


def test_sharded_fp8_weights_carry_their_tags_and_gather_tp2_sp():
    res = run(_worker, 2)
    by_rank = sorted(res, key=lambda r: r["rank"])
    r0 = by_rank[0]
    assert r0["types"] == {"col.weight": "FP8Weight", "col.bias": "Parameter",
                           "row.weight": "FP8Weight", "row.bias": "Parameter"}, r0["types"]
    want = {"col.weight": {"tp_partition_dim": 0, "tp_partition_sizes": (SEG, SEG, SEG)},
            "col.bias": {"tp_partition_dim": 0, "tp_partition_sizes": (SEG, SEG, SEG)},
            "row.weight": {"tp_partition_dim": 1},
            "row.bias": {"sequence_parallel": True}}
    for r in by_rank:
        assert r["tags"] == want, r["tags"]
        assert r["plain_tags"] == want, r["plain_tags"]
        assert r["master_tags"] == {k: want[k] for k in ("col.weight", "row.weight")}, \
            r["master_tags"]
    # the gathered fp8 weights: each rank's shard quantised on its own
    full = r0["full_plain"]
    for name, dim, segs in (("col.weight", 0, (SEG, SEG, SEG)), ("row.weight", 1, None)):
        shards = [_quantised_shard(full[name], k, 2, dim, segs) for k in range(2)]
        expect = _assemble(shards, dim, segs)
        for r in by_rank:
            got = r["full_fp8"][name]
            assert got.shape == full[name].shape, (name, got.shape)
            err = (got.float() - expect).abs().max().item()     # float32 rounding of the
            assert err <= 1e-6 * expect.abs().max().item(), (name, err)   # scale at most
    # the SP bias: its gradient is the sum of the ranks' own
    summed = sum(r["grads_local"]["row.bias"] for r in by_rank)
    for r in by_rank:
        assert torch.allclose(r["grads"]["row.bias"], summed), r["grads"]["row.bias"]
    # the TP gradient norm from the gathered gradients (sharded: every shard once;
    # replicated: once)
    sq = sum(r["grads"][n].double().pow(2).sum() for r in by_rank
             for n in ("col.weight", "col.bias", "row.weight"))
    sq = sq + r0["grads"]["row.bias"].double().pow(2).sum()
    for r in by_rank:
        assert r["norm"] == pytest.approx(math.sqrt(sq), rel=1e-5), (r["norm"], math.sqrt(sq))
