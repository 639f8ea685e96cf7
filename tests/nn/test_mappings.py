"""Autograd collectives: forward values, gradients (vs their transposes), collective counts,
no communication on one rank; full <-> sharded state dicts incl. segmented (fused) params."""
import pytest
import torch

from commcount import count_collectives
from dist import run


def _mappings(tp):
    import torch.distributed as dist
    import tpkit
    from tpkit.nn import mappings as m
    st = tpkit.init_parallel(tp=tp, seed=1)
    g, r = st.tp_group, st.tp_rank
    torch.manual_seed(0)
    full = torch.randn(8, 4, 4 * tp)          # same on every rank
    local = full.chunk(tp, -1)[r]
    seq_local = full.chunk(tp, 0)[r]
    mine = full * (r + 1)                     # differs per rank
    total = sum(full * (k + 1) for k in range(tp))
    cases = []
    with count_collectives() as calls:
        # f: identity forward, all-reduce backward
        x = mine.clone().requires_grad_()
        y = m.copy_to_tp_region(x, g)
        assert torch.equal(y, mine)
        y.backward(mine)
        assert torch.allclose(x.grad, total)
        cases.append(calls.count("all_reduce", min_group_size=2))
        # g: all-reduce forward, identity backward (input untouched)
        x = mine.clone().requires_grad_()
        y = m.reduce_from_tp_region(x, g)
        assert torch.allclose(y, total) and torch.equal(x, mine)
        y.backward(full)
        assert torch.equal(x.grad, full)
        # scatter / gather along the last dim and along dim 1
        for dim in (-1, 1):
            x = full.clone().requires_grad_()
            y = m.scatter_to_tp_region(x, g, dim)
            assert torch.equal(y, full.chunk(tp, dim)[r])
            y.backward(y.detach() * (r + 1))
            expect = torch.cat([c * (k + 1) for k, c in enumerate(full.chunk(tp, dim))], dim)
            assert torch.equal(x.grad, expect)
        x = local.clone().requires_grad_()
        y = m.gather_from_tp_region(x, g)
        assert torch.equal(y, full)
        y.backward(full * 2)
        assert torch.equal(x.grad, local * 2)
        # SP gather / reduce-scatter along dim 0 (transposes of each other)
        x = seq_local.clone().requires_grad_()
        y = m.gather_from_sp_region(x, g)
        assert torch.equal(y, full)
        y.backward(mine)
        assert torch.allclose(x.grad, total.chunk(tp, 0)[r])
        x = mine.clone().requires_grad_()
        y = m.reduce_scatter_to_sp_region(x, g)
        assert torch.allclose(y, total.chunk(tp, 0)[r])
        y.backward(seq_local)
        assert torch.equal(x.grad, full)
        # all-to-all: sequence-sharded -> head-sharded and back
        x = seq_local.clone().requires_grad_()
        y = m.all_to_all(x, g, scatter_dim=2, gather_dim=0)
        assert torch.equal(y, full.chunk(tp, 2)[r])
        z = m.all_to_all(y, g, scatter_dim=0, gather_dim=2)
        assert torch.equal(z, seq_local)
        z.backward(seq_local * 3)
        assert torch.equal(x.grad, seq_local * 3)
    return cases, calls.summary(min_group_size=2), dist.get_world_size(g)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mappings_values_and_gradients(tp):
    for cases, summary, n in run(_mappings, tp, tp):
        assert n == tp
        if tp == 1:
            assert summary == {}  # no collective at all on a group of one
        else:
            assert cases == [1]
            assert summary == {"all_reduce": 2, "all_gather_into_tensor": 5,
                               "reduce_scatter_tensor": 2, "all_to_all_single": 4}, summary


def _state_dict_roundtrip(tp):
    import tpkit
    from tpkit.checkpoint import full_state_dict, load_full_state_dict
    from tpkit.nn import (ColumnParallelLinear, LayerNorm, RowParallelLinear,
                          VocabParallelEmbedding)
    tpkit.init_parallel(tp=tp, seed=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        ColumnParallelLinear(8, 16, partition_sizes=(8, 4, 4)),
        RowParallelLinear(16, 8), LayerNorm(8), VocabParallelEmbedding(16, 8),
        ColumnParallelLinear(8, 16, bias=False))
    model[4].weight = model[3].weight  # tied input/output embedding
    full = {k: torch.randn_like(v) if k != "0.weight" else v for k, v in
            {"0.weight": torch.arange(16 * 8.).view(16, 8), "0.bias": torch.randn(16),
             "1.weight": torch.randn(8, 16), "1.bias": torch.randn(8),
             "2.weight": torch.randn(8), "2.bias": torch.randn(8)}.items()}
    full["3.weight"] = full["4.weight"] = torch.randn(16, 8)
    load_full_state_dict(model, full)
    # fused segments: this rank holds its chunk of every segment, concatenated
    rows = model[0].weight[:, 0].long().div(8, rounding_mode="floor").tolist()
    back = full_state_dict(model)
    ok = sorted(back) == sorted(full) and all(torch.equal(back[k], full[k]) for k in full)
    with pytest.raises(KeyError, match=r"missing \['1.bias'\]"):   # Fabric's type
        load_full_state_dict(model, {k: v for k, v in full.items() if k != "1.bias"})
    with pytest.raises(ValueError, match="0.bias"):
        load_full_state_dict(model, {**full, "0.bias": torch.zeros(12)})
    return ok, rows


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_full_state_dict_roundtrip_with_segments(tp):
    res = run(_state_dict_roundtrip, tp, tp)
    for r, (ok, rows) in enumerate(res):
        assert ok
        q, k, v = range(0, 8), range(8, 12), range(12, 16)
        expect = [list(seg)[r * len(seg) // tp:(r + 1) * len(seg) // tp] for seg in (q, k, v)]
        assert rows == expect[0] + expect[1] + expect[2]
