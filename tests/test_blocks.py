"""ParallelMLP, ParallelSelfAttention (GQA, RoPE) and TransformerLayer vs single-process
references built from the same full weights, tp 1/2/4 with SP on and off; exact
collective counts per block."""
import pytest
import torch

from commcount import count_collectives
from dist import run
from layer_checks import (RefAttention, RefMLP, RefTransformerLayer, assert_close,
                          check_weight_grads, randomize, seq_shard)

LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]
S, B, H = 8, 2, 16


def _compare(par, ref, st, sp, *args_par, ref_kwargs=None, what=""):
    torch.manual_seed(11)
    x = torch.randn(S, B, H)
    dy = torch.randn(S, B, H)
    xr, xp = x.clone().requires_grad_(), seq_shard(x, st, sp).requires_grad_()
    yr = ref(xr, **(ref_kwargs or {}))
    yp = par(xp, *args_par)
    assert_close(yp, seq_shard(yr, st, sp), f"{what} out")
    yr.backward(dy)
    yp.backward(seq_shard(dy, st, sp))
    assert_close(xp.grad, seq_shard(xr.grad, st, sp), f"{what} input grad")
    check_weight_grads(par, ref, st, what)


def _blocks(tp, sp):
    import tpkit
    from tpkit.checkpoint import load_full_state_dict
    from tpkit.nn import ParallelMLP, ParallelSelfAttention, RotaryEmbedding, TransformerLayer
    st = tpkit.init_parallel(tp=tp, sequence_parallel=sp, seed=5)
    for act in ("gelu", "swiglu"):
        ref = RefMLP(H, 32, act)
        randomize(ref, 1)
        par = ParallelMLP(H, 32, activation=act)
        load_full_state_dict(par, ref.state_dict())
        _compare(par, ref, st, sp, what=f"mlp[{act}]")
    rope = RotaryEmbedding(H // 4)
    freqs = rope(S)
    for groups, use_rope in ((None, False), (4, True), (tp, True)):
        ref = RefAttention(H, 4, groups)
        randomize(ref, 2)
        par = ParallelSelfAttention(H, 4, num_gqa_groups=groups)
        load_full_state_dict(par, ref.state_dict())
        args = (freqs,) if use_rope else ()
        kw = {"rope_pos": torch.arange(S)} if use_rope else None
        _compare(par, ref, st, sp, *args, ref_kwargs=kw, what=f"attention[g={groups}]")
    for norm in ("LayerNorm", "RMSNorm"):
        ref = RefTransformerLayer(H, 32, 4, 2 if tp <= 2 else 4, normalization=norm)
        randomize(ref, 3)
        par = TransformerLayer(H, 32, 4, num_gqa_groups=2 if tp <= 2 else 4,
                               normalization=norm)
        load_full_state_dict(par, ref.state_dict())
        _compare(par, ref, st, sp, freqs, ref_kwargs={"rope_pos": torch.arange(S)},
                 what=f"transformer[{norm}]")
    return True


@pytest.mark.parametrize("tp,sp", LAYOUTS)
def test_blocks_match_reference(tp, sp):
    assert run(_blocks, tp, tp, sp) == [True] * tp


def _counts(sp):
    import tpkit
    from tpkit.nn import ParallelMLP, ParallelSelfAttention
    st = tpkit.init_parallel(tp=2, sequence_parallel=sp, seed=5)
    mlp, attn = ParallelMLP(H, 32), ParallelSelfAttention(H, 4, num_gqa_groups=2)
    x = torch.randn(S // 2 if sp else S, B, H, requires_grad=True)
    with count_collectives() as fwd:
        y = mlp(x) + attn(x)
    with count_collectives() as bwd:
        y.sum().backward()
    assert x.grad is not None and st.tp_size == 2
    return fwd.summary(), bwd.summary()


@pytest.mark.parametrize("sp", [False, True])
def test_collective_counts_are_the_analytical_minimum(sp):
    fwd, bwd = run(_counts, 2, sp)[0]
    if sp:
        # one all-gather before each column layer, one reduce-scatter after each row layer
        assert fwd == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, fwd
        assert bwd == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, bwd
    else:
        # g after each row layer forward, f before each column layer backward (QKV: one)
        assert fwd == {"all_reduce": 2}, fwd
        assert bwd == {"all_reduce": 2}, bwd
