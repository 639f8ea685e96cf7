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
    from tpkit.nn import ParallelMLP, ParallelSelfAttention, TransformerLayer
    st = tpkit.init_parallel(tp=2, sequence_parallel=sp, seed=5)
    mlp, attn = ParallelMLP(H, 32), ParallelSelfAttention(H, 4, num_gqa_groups=2)
    x = torch.randn(S // 2 if sp else S, B, H, requires_grad=True)
    with count_collectives() as fwd:
        y = mlp(x) + attn(x)
    with count_collectives() as bwd:
        y.sum().backward()
    assert x.grad is not None and st.tp_size == 2
    layer = TransformerLayer(H, 32, 4, num_gqa_groups=2)
    with count_collectives() as lfwd:
        y = layer(x)
    with count_collectives() as lbwd:
        y.sum().backward()
    # the norms, residuals and dropout add nothing: same counts for the whole layer
    assert (lfwd.summary(), lbwd.summary()) == (fwd.summary(), bwd.summary())
    return fwd.summary(), bwd.summary()


@pytest.mark.parametrize("sp", [False, True])
def test_collective_counts_are_the_analytical_minimum(sp):
    for rank, (fwd, bwd) in enumerate(run(_counts, 2, sp)):   # every rank issues them
        if sp:
            # one all-gather before each column layer, one reduce-scatter after each row layer
            want = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
        else:
            # g after each row layer forward, f before each column layer backward (QKV: one)
            want = {"all_reduce": 2}
        assert fwd == want and bwd == want, (rank, fwd, bwd)


def _dropout(sp):
    import torch.distributed as dist
    import tpkit
    from tpkit.nn import TransformerLayer
    from tpkit.layout.random import MODEL_PARALLEL_RNG, get_rng_tracker
    st = tpkit.init_parallel(tp=2, sequence_parallel=sp, seed=5)
    torch.manual_seed(0)
    layer = TransformerLayer(H, 32, 4, hidden_dropout=0.5, attention_dropout=0.5)
    x = torch.randn(S, B, H)  # the same full input on both ranks
    before = get_rng_tracker().get_states()[MODEL_PARALLEL_RNG]
    y = layer(seq_shard(x, st, sp))
    advanced = not torch.equal(before, get_rng_tracker().get_states()[MODEL_PARALLEL_RNG])
    layer.eval()
    y_eval = layer(seq_shard(x, st, sp))
    full = [torch.empty_like(y) for _ in range(2)]
    dist.all_gather(full, y.contiguous(), group=st.tp_group)
    det = torch.equal(y_eval, layer(seq_shard(x, st, sp)))
    layer.train()
    mask = layer._dropout(torch.ones(S // 2, B, H)) == 0  # the hidden-dropout mask itself
    return advanced, full, det, mask


@pytest.mark.parametrize("sp", [False, True])
def test_dropout_streams(sp):
    results = run(_dropout, 2, sp)
    (_, full, _, m0), (_, full1, _, m1) = results
    for rank, (adv, gathered, det, mask) in enumerate(results):
        assert adv, rank  # attention dropout drew from the model-parallel stream
        assert det, rank  # eval mode: no dropout
        assert mask.any(), rank
        assert all(torch.equal(a, b) for a, b in zip(gathered, full)), rank  # one all-gather
    if not sp:
        # replicated activations: hidden-dropout masks (default stream) agree across TP,
        # so the layer output is identical on both ranks
        assert torch.equal(m0, m1)
        assert torch.equal(full[0], full[1])
    else:
        # SP: each rank drops its own tokens with its own (forked) stream
        assert not torch.equal(m0, m1)


def test_block_input_checks():
    from tpkit import ParallelConfig
    from tpkit.layout.planning import fake_state
    from tpkit.layout.random import get_rng_tracker
    get_rng_tracker().reset()
    get_rng_tracker().add("model-parallel-rng", 9)
    with fake_state(ParallelConfig(tp=2), 2) as st:   # rank 0 of tp=2, no workers
        _block_input_checks(st)
    get_rng_tracker().reset()


def _block_input_checks(st):
    from tpkit.nn import ParallelMLP, ParallelSelfAttention, TransformerLayer
    with pytest.raises(ValueError, match="num_attention_heads=3 is not divisible"):
        ParallelSelfAttention(12, 3, state=st)
    with pytest.raises(ValueError, match="num_gqa_groups=3 is not divisible"):
        ParallelSelfAttention(24, 6, num_gqa_groups=3, state=st)
    # fewer kv heads than TP ranks: replicated (issue 35), each rank keeps its query heads' one
    assert ParallelSelfAttention(16, 4, num_gqa_groups=1, state=st).replicated_kv
    with pytest.raises(ValueError, match="num_gqa_groups=4"):
        ParallelSelfAttention(24, 6, num_gqa_groups=4, state=st)
    with pytest.raises(ValueError, match="ffn_hidden_size=5"):
        ParallelMLP(8, 5, state=st)
    with pytest.raises(ValueError, match="activation='tanh'"):
        ParallelMLP(8, 8, activation="tanh", state=st)
    with pytest.raises(ValueError, match="attn_mask_type='arbitrary'"):
        ParallelSelfAttention(16, 4, attn_mask_type="arbitrary", state=st)
    with pytest.raises(ValueError, match="normalization='BatchNorm'"):
        TransformerLayer(16, 32, 4, normalization="BatchNorm", state=st)
    attn = ParallelSelfAttention(16, 4, state=st)
    with pytest.raises(ValueError, match=r"\[s, b, 16\] \(3 dims"):
        attn(torch.zeros(8, 16))
    mlp = ParallelMLP(16, 32, state=st)
    with pytest.raises(ValueError, match="3 dims"):
        mlp(torch.zeros(2, 8, 2, 16))


def _tiny_gpt(tp, sp):
    """Embedding -> TransformerLayer -> vocab-parallel head -> cross entropy, as in the
    README, vs nn.Embedding / reference layer / nn.Linear / F.cross_entropy."""
    import torch.nn.functional as F
    import tpkit
    from tpkit.checkpoint import load_full_state_dict
    from tpkit.nn import (ColumnParallelLinear, RotaryEmbedding, TransformerLayer,
                          VocabParallelEmbedding, vocab_parallel_cross_entropy)
    st = tpkit.init_parallel(tp=tp, sequence_parallel=sp, seed=5)
    V, G = 32, max(2, tp)
    ref = torch.nn.ModuleDict({"emb": torch.nn.Embedding(V, H),
                               "layer": RefTransformerLayer(H, 32, 4, G, "RMSNorm", "swiglu"),
                               "head": torch.nn.Linear(H, V, bias=False)})
    randomize(ref, 7)
    par = torch.nn.ModuleDict({"emb": VocabParallelEmbedding(V, H),
                               "layer": TransformerLayer(H, 32, 4, num_gqa_groups=G,
                                                         normalization="RMSNorm",
                                                         activation="swiglu"),
                               "head": ColumnParallelLinear(H, V, bias=False)})
    load_full_state_dict(par, ref.state_dict())
    torch.manual_seed(8)
    ids, target = torch.randint(0, V, (S, B)), torch.randint(0, V, (S, B))
    target[1, 0] = -100
    n = (target != -100).sum()
    pos = torch.arange(S)
    lr = F.cross_entropy(ref["head"](ref["layer"](ref["emb"](ids), pos)).view(-1, V),
                         target.view(-1), label_smoothing=0.1)
    logits = par["head"](par["layer"](par["emb"](ids), RotaryEmbedding(H // 4)(S)))
    lp = vocab_parallel_cross_entropy(logits, target, label_smoothing=0.1).sum() / n
    assert_close(lp, lr, "tiny gpt loss")
    lr.backward()
    lp.backward()
    check_weight_grads(par, ref, st, "tiny gpt")
    return True


@pytest.mark.parametrize("tp,sp", [(2, True), (4, False)])
def test_tiny_gpt_end_to_end(tp, sp):
    assert run(_tiny_gpt, tp, tp, sp) == [True] * tp


def _deepcopy():
    import copy
    import tpkit
    from tpkit.nn import TransformerLayer
    st = tpkit.init_parallel(tp=2, sequence_parallel=True, seed=5)
    layer = TransformerLayer(H, 32, 4)
    twin = copy.deepcopy(layer)  # EMA / framework copies: groups are shared, not copied
    assert twin.state is st and twin.self_attention.linear_qkv.group is st.tp_group
    assert twin.mlp.linear_fc1.weight is not layer.mlp.linear_fc1.weight
    assert twin.mlp.linear_fc1.weight.tp_partition_dim == 0
    assert twin.input_layernorm.weight.sequence_parallel
    assert twin.self_attention.linear_proj.bias.sequence_parallel
    assert twin.self_attention.linear_qkv.weight.tp_partition_sizes == (16, 16, 16)
    x = torch.randn(S // 2, B, H)
    return torch.equal(twin(x), layer(x))


def test_deepcopy_shares_the_parallel_state():
    assert run(_deepcopy, 2) == [True, True]
