"""Core TP/SP layers vs single-process torch references (same full weights), tp 1/2/4,
sequence parallelism on and off, fp32 on CPU: outputs, input grads, gathered weight grads."""
import types

import pytest
import torch

from dist import run
from layer_checks import assert_close, check_weight_grads, seq_shard, shard

LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]
S, B = 8, 2


def _linears(tp, sp):
    import tpkit
    from tpkit.checkpoint import load_full_state_dict
    from tpkit.nn import ColumnParallelLinear, RowParallelLinear
    st = tpkit.init_parallel(tp=tp, sequence_parallel=sp, seed=3)
    torch.manual_seed(0)
    h, o = 12, 16
    x = torch.randn(S, B, h)
    dy_col = torch.randn(S, B, o)
    # --- column, sharded output (and gather_output) ---
    for gather in (False, True):
        ref = torch.nn.Linear(h, o)
        col = ColumnParallelLinear(h, o, gather_output=gather)
        assert col.sequence_parallel == sp and col.weight.tp_partition_dim == 0
        load_full_state_dict(col, ref.state_dict())
        xr, xp = x.clone().requires_grad_(), seq_shard(x, st, sp).requires_grad_()
        yr, yp = ref(xr), col(xp)
        assert_close(yp, yr if gather else shard(yr, -1, st), f"column(gather={gather}) out")
        yr.backward(dy_col)
        yp.backward(dy_col if gather else shard(dy_col, -1, st))
        assert_close(xp.grad, seq_shard(xr.grad, st, sp), "column input grad")
        check_weight_grads(col, ref, st, "column")
    # --- column with skip_bias_add / return_bias: bias returned, not added ---
    col = ColumnParallelLinear(h, o, return_bias=True)
    out, bias = col(seq_shard(x, st, sp))
    assert bias is col.bias
    assert_close(out + bias, torch.nn.functional.linear(
        x, *[torch.cat(t, 0) for t in _gathered(col, st)]).chunk(tp, -1)[st.tp_rank], "ret b")
    # --- row, input parallel (and not) ---
    dy_row = torch.randn(S, B, h)
    for parallel_in in ([True, False] if not sp else [True]):
        ref = torch.nn.Linear(o, h)
        row = RowParallelLinear(o, h, input_is_parallel=parallel_in)
        assert row.weight.tp_partition_dim == 1
        assert getattr(row.bias, "sequence_parallel", False) == sp
        assert not hasattr(row.bias, "tp_partition_dim")
        load_full_state_dict(row, ref.state_dict())
        xin = torch.randn(S, B, o)
        xr = xin.clone().requires_grad_()
        xp = (shard(xin, -1, st) if parallel_in else xin).clone().requires_grad_()
        yr, yp = ref(xr), row(xp)
        assert_close(yp, seq_shard(yr, st, sp), f"row(parallel_in={parallel_in}) out")
        yr.backward(dy_row)
        yp.backward(seq_shard(dy_row, st, sp))
        assert_close(xp.grad, shard(xr.grad, -1, st) if parallel_in else xr.grad, "row in grad")
        check_weight_grads(row, ref, st, "row")
    return True


def _gathered(col, st):
    import torch.distributed as dist
    out = []
    for p in (col.weight, col.bias):
        parts = [torch.empty_like(p) for _ in range(st.tp_size)]
        dist.all_gather(parts, p.detach().contiguous(), group=st.tp_group)
        out.append(parts)
    return out


@pytest.mark.parametrize("tp,sp", LAYOUTS)
def test_linear_layers_match_nn_linear(tp, sp):
    assert run(_linears, tp, tp, sp) == [True] * tp


def _embedding(tp, sp):
    import tpkit
    from tpkit.checkpoint import load_full_state_dict
    from tpkit.nn import VocabParallelEmbedding
    st = tpkit.init_parallel(tp=tp, sequence_parallel=sp, seed=3)
    torch.manual_seed(1)
    vocab, h = 20, 6
    ref = torch.nn.Embedding(vocab, h)
    emb = VocabParallelEmbedding(vocab, h)
    assert emb.weight.tp_partition_dim == 0
    load_full_state_dict(emb, ref.state_dict())
    ids = torch.randint(0, vocab, (S, B))
    ids[0, 0], ids[1, 1] = 0, vocab - 1
    yr, yp = ref(ids), emb(ids)
    assert_close(yp, seq_shard(yr, st, sp), "embedding out")
    dy = torch.randn(S, B, h)
    yr.backward(dy)
    yp.backward(seq_shard(dy, st, sp))
    check_weight_grads(emb, ref, st, "embedding")
    return True


@pytest.mark.parametrize("tp,sp", LAYOUTS)
def test_vocab_parallel_embedding_matches_nn_embedding(tp, sp):
    assert run(_embedding, tp, tp, sp) == [True] * tp


def _cross_entropy(tp):
    import torch.nn.functional as F
    import tpkit
    from tpkit.nn import vocab_parallel_cross_entropy
    st = tpkit.init_parallel(tp=tp, seed=3)
    torch.manual_seed(2)
    vocab = 24
    logits = torch.randn(S, B, vocab) * 3
    target = torch.randint(0, vocab, (S, B))
    mark = torch.zeros(S, B, dtype=torch.bool)
    mark[0, 0] = mark[5, 0] = True
    target[3, 1] = 3
    for eps in (0.0, 0.1):
        for ignore in (-100, 3):
            target = target.masked_fill(mark, ignore)
            lr = logits.clone().requires_grad_()
            lp = shard(logits, -1, st).clone().requires_grad_()
            ref = F.cross_entropy(lr.view(-1, vocab), target.view(-1), label_smoothing=eps,
                                  ignore_index=ignore, reduction="none").view(S, B)
            got = vocab_parallel_cross_entropy(lp, target, label_smoothing=eps,
                                               ignore_index=ignore)
            assert got.shape == target.shape
            assert_close(got, ref, f"ce loss eps={eps} ignore={ignore}")
            assert torch.all(got[target == ignore] == 0)
            # the documented mean equals F.cross_entropy's default reduction
            mean = got.sum() / (target != ignore).sum()
            ref_mean = F.cross_entropy(lr.view(-1, vocab), target.view(-1),
                                       label_smoothing=eps, ignore_index=ignore)
            assert_close(mean, ref_mean, "ce mean")
            ref_mean.backward()
            mean.backward()
            assert_close(lp.grad, shard(lr.grad, -1, st), f"ce grad eps={eps} ignore={ignore}")
    with pytest.raises(ValueError, match=rf"\[0, {vocab}\) .* got \[{vocab}, {vocab}\]"):
        vocab_parallel_cross_entropy(shard(logits, -1, st), target.masked_fill(mark, vocab))
    return True


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(tp):
    assert run(_cross_entropy, tp, tp) == [True] * tp


def _norms(tp, sp):
    import tpkit
    from tpkit.checkpoint import load_full_state_dict
    from tpkit.nn import LayerNorm, RMSNorm
    st = tpkit.init_parallel(tp=tp, sequence_parallel=sp, seed=3)
    torch.manual_seed(3)
    h = 10
    for par, ref in ((LayerNorm(h, eps=1e-5), torch.nn.LayerNorm(h, eps=1e-5)),
                     (RMSNorm(h, eps=1e-6), torch.nn.RMSNorm(h, eps=1e-6))):
        with torch.no_grad():
            ref.weight.normal_()
            if getattr(ref, "bias", None) is not None:
                ref.bias.normal_()
        load_full_state_dict(par, ref.state_dict())
        assert all(getattr(p, "sequence_parallel", False) == sp for p in par.parameters())
        x = torch.randn(S, B, h)
        xr, xp = x.clone().requires_grad_(), seq_shard(x, st, sp).requires_grad_()
        yr, yp = ref(xr), par(xp)
        assert_close(yp, seq_shard(yr, st, sp), f"{type(par).__name__} out")
        dy = torch.randn(S, B, h)
        yr.backward(dy)
        yp.backward(seq_shard(dy, st, sp))
        assert_close(xp.grad, seq_shard(xr.grad, st, sp), "norm input grad")
        check_weight_grads(par, ref, st, type(par).__name__)
    return True


@pytest.mark.parametrize("tp,sp", LAYOUTS)
def test_norms_match_torch(tp, sp):
    assert run(_norms, tp, tp, sp) == [True] * tp


def _norm_drift(sync):
    import tpkit
    from tpkit.nn import LayerNorm, sync_sequence_parallel_grads
    st = tpkit.init_parallel(tp=2, sequence_parallel=True, seed=3)
    torch.manual_seed(4)
    norm = LayerNorm(8)
    opt = torch.optim.SGD(norm.parameters(), lr=0.1)
    x = torch.randn(S, B, 8)
    norm(seq_shard(x, st, True)).pow(2).sum().backward()
    if sync:
        assert sync_sequence_parallel_grads(norm) == 2
    opt.step()
    return torch.cat([p.detach().flatten() for p in norm.parameters()])


@pytest.mark.parametrize("sync", [True, False])
def test_sp_norm_weights_stay_identical_only_with_grad_sync(sync):
    w0, w1 = run(_norm_drift, 2, sync)
    if sync:
        assert torch.equal(w0, w1)
    else:
        assert (w0 - w1).abs().max() > 1e-3  # drifted: each rank saw only its tokens


def _stub(tp=2, sp=False):
    return types.SimpleNamespace(tp_size=tp, tp_rank=0, tp_group=None, sequence_parallel=sp,
                                 device=torch.device("cpu"))


def test_input_checks_raise_clear_value_errors():
    from tpkit.nn import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                          vocab_parallel_cross_entropy)
    from tpkit.layout.random import get_rng_tracker
    get_rng_tracker().reset()
    init = torch.nn.init.zeros_
    with pytest.raises(ValueError, match="out_features=6 is not divisible .* 4"):
        ColumnParallelLinear(4, 6, state=_stub(4), init_method=init)
    with pytest.raises(ValueError, match="in_features=6 is not divisible"):
        RowParallelLinear(6, 4, state=_stub(4), init_method=init)
    with pytest.raises(ValueError, match="num_embeddings .*=10 is not divisible"):
        VocabParallelEmbedding(10, 4, state=_stub(4), init_method=init)
    with pytest.raises(ValueError, match="model-parallel stream"):
        ColumnParallelLinear(4, 8, state=_stub(2))
    get_rng_tracker().add("model-parallel-rng", 5)
    col = ColumnParallelLinear(4, 8, state=_stub(2), init_method=init)
    with pytest.raises(ValueError, match="last dim is 4"):
        col(torch.zeros(3, 2, 5))
    row = RowParallelLinear(8, 4, state=_stub(2, sp=True), init_method=init)
    with pytest.raises(ValueError, match="last dim is 4"):
        row(torch.zeros(3, 2, 8))
    with pytest.raises(ValueError, match="divisible by tp=2"):
        row(torch.zeros(3, 2, 4))
    with pytest.raises(ValueError, match="input_is_parallel"):
        RowParallelLinear(8, 4, input_is_parallel=False, state=_stub(2, sp=True),
                          init_method=init)
    emb = VocabParallelEmbedding(8, 4, state=_stub(2, sp=True), init_method=init)
    with pytest.raises(ValueError, match="divisible by tp=2"):
        emb(torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long),
                                     label_smoothing=1.5, group=object())
    get_rng_tracker().reset()


def _linear_fn_hook():
    import tpkit
    import tpkit.nn.linear as lin
    from tpkit.nn import ParallelMLP, ParallelSelfAttention
    tpkit.init_parallel(tp=2, seed=3)
    seen, original = [], lin.linear_fn

    def spy(layer, x, weight, bias):
        seen.append((type(layer).__name__, tuple(weight.shape)))
        return original(layer, x, weight, bias)

    lin.linear_fn = spy
    try:
        x = torch.randn(4, 2, 16)
        ParallelMLP(16, 32)(x)
        ParallelSelfAttention(16, 4, num_gqa_groups=2)(x)
    finally:
        lin.linear_fn = original
    return seen


def test_every_parallel_matmul_goes_through_linear_fn():
    # the single hook tpkit.fp8 patches: fc1, fc2, qkv (one fused matmul), proj
    assert run(_linear_fn_hook, 2) == [[   # on every rank
        ("ColumnParallelLinear", (16, 16)), ("RowParallelLinear", (16, 16)),
        ("ColumnParallelLinear", (16, 16)), ("RowParallelLinear", (16, 8))]] * 2
