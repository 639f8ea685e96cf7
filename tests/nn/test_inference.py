"""TE's ``InferenceParams`` through ``tpkit.te_api``'s attention layers at tp=2 with GQA
(float64): a prompt and then one or a few tokens per call through the KV cache give, at
every position, the output of one forward over the whole sequence without a cache
(1e-10): a ``TransformerLayer`` stack (sbhd, RoPE from TE's full table, the cache keyed
by ``layer_number``), ``MultiheadAttention`` (bshd) and ``DotProductAttention``;
``swap_key_value_dict`` reorders the cached rows (the decode of the swapped batch is the
swapped batch's forward). Also: the cache refuses what does not fit it (ValueError)."""
import pytest
import torch

from dist import run

S, B, H, HEADS, GROUPS, P = 10, 3, 32, 4, 2, 4


def _steps(call, x, seq_dim: int, params, sizes):
    """``call(chunk)`` over consecutive chunks of ``x`` along ``seq_dim``, TE's rule:
    ``sequence_len_offset`` advanced after each complete forward."""
    outs, start = [], 0
    for n in sizes:
        outs.append(call(x.narrow(seq_dim, start, n)))
        start += n
        params.sequence_len_offset += n
    return torch.cat(outs, seq_dim)


def _layers_check():
    import tpkit
    import tpkit.te_api as te
    from tpkit.nn import RotaryEmbedding
    st = tpkit.init_parallel(tp=2, seed=4)
    torch.set_default_dtype(torch.float64)
    errs = {}
    try:
        kw = dict(tp_group=st.tp_group, set_parallel_mode=True, hidden_dropout=0.0,
                  attention_dropout=0.0, num_gqa_groups=GROUPS, normalization="RMSNorm",
                  activation="swiglu", init_method=lambda w: torch.nn.init.normal_(w, 0, 0.2))
        layers = [te.TransformerLayer(H, 64, HEADS, layer_number=i + 1, **kw) for i in range(2)]
        freqs = RotaryEmbedding(H // HEADS)(S)
        x = torch.randn(S, B, H)

        def stack(h, params=None):
            for layer in layers:
                h = layer(h, rotary_pos_emb=freqs, inference_params=params)
            return h
        full = stack(x)
        params = te.InferenceParams(B, S)
        cached = _steps(lambda c: stack(c, params), x, 0, params, [P] + [1] * (S - P))
        errs["transformer_layer"] = (cached - full).abs().max().item()
        mem = params.key_value_memory_dict
        assert sorted(mem) == [1, 2], sorted(mem)
        assert tuple(mem[1][0].shape) == (S, B, GROUPS // 2, H // HEADS), mem[1][0].shape

        # swap_key_value_dict: the rows reordered after the prompt
        order = [2, 0, 1]
        params = te.InferenceParams(B, S)
        stack(x[:P], params)
        params.sequence_len_offset = P
        params.swap_key_value_dict(order)
        swapped = _steps(lambda c: stack(c, params), x[P:, order], 0, params, [1] * (S - P))
        errs["swap"] = (swapped - full[P:, order]).abs().max().item()

        mha = te.MultiheadAttention(H, HEADS, num_gqa_groups=GROUPS, qkv_format="bshd",
                                    attention_dropout=0.0, input_layernorm=True,
                                    layer_number=3, tp_group=st.tp_group,
                                    set_parallel_mode=True,
                                    init_method=lambda w: torch.nn.init.normal_(w, 0, 0.2))
        xb = torch.randn(B, S, H)
        full = mha(xb, rotary_pos_emb=freqs)
        params = te.InferenceParams(B + 1, S + 2)    # a larger cache than the calls use
        cached = _steps(lambda c: mha(c, rotary_pos_emb=freqs, inference_params=params),
                        xb, 1, params, [3, 3, 2, 1, 1])
        errs["mha_bshd"] = (cached - full).abs().max().item()

        dpa = te.DotProductAttention(HEADS, H // HEADS, num_gqa_groups=GROUPS,
                                     tp_group=st.tp_group)
        q = torch.randn(S, B, HEADS // 2, H // HEADS)
        k, v = (torch.randn(S, B, GROUPS // 2, H // HEADS) for _ in range(2))
        full = dpa(q, k, v)
        params = te.InferenceParams(B, S)
        outs, start = [], 0
        for n in (5, 2, 3):
            sl = slice(start, start + n)
            outs.append(dpa(q[sl], k[sl], v[sl], inference_params=params))
            start += n
            params.sequence_len_offset += n
        errs["dpa"] = (torch.cat(outs) - full).abs().max().item()
    finally:
        torch.set_default_dtype(torch.float32)
        tpkit.destroy_parallel()
    return errs


def test_te_api_layers_cached_decode_equals_full_forward_tp2():
    for rank, errs in enumerate(run(_layers_check, 2)):
        assert set(errs) == {"transformer_layer", "swap", "mha_bshd", "dpa"}
        for what, err in errs.items():
            assert err <= 1e-10, (rank, what, err)


def test_inference_params_refuses_what_does_not_fit():
    import tpkit.te_api as te
    from tpkit.nn import DotProductAttention
    from tpkit.nn.inference import InferenceParams
    assert te.InferenceParams is InferenceParams
    with pytest.raises(ValueError, match="max_batch_size=0"):
        te.InferenceParams(0, 8)
    with pytest.raises(ValueError, match="the cache is empty"):
        te.InferenceParams(2, 8).swap_key_value_dict([1, 0])
    from tpkit.layout.config import ParallelConfig
    from tpkit.layout.planning import fake_state
    with fake_state(ParallelConfig(), 1) as state:
        dpa = DotProductAttention(2, 4, state=state)
        q = torch.randn(6, 2, 2, 4)
        with pytest.raises(ValueError, match=r"sequence_len_offset=0 \+ 6 new tokens exceeds "
                                             r"InferenceParams\(max_sequence_length=5\)"):
            dpa(q, q, q, inference_params=InferenceParams(2, 5))
        with pytest.raises(ValueError, match=r"batch 2 exceeds InferenceParams\(max_batch_size=1"):
            dpa(q, q, q, inference_params=InferenceParams(1, 8))
        params = InferenceParams(2, 8)
        params.sequence_len_offset = 2
        with pytest.raises(ValueError, match="sequence_len_offset=2 but this layer has no "
                                             "cache; the first call"):
            dpa(q[:1], q[:1], q[:1], inference_params=params)
