"""Packed sequences (THD): tpkit.data's packing and per-document CP layout, and
DotProductAttention(qkv_format="thd") at cp 1, 2, 4 on every comm type, against an
independent reference: each document run on its own through PyTorch's SDPA (one process,
no packing, no CP), outputs and q/k/v gradients, in float32 and float64."""
import os
from types import SimpleNamespace

import pytest
import torch

from dist import run
from paths import SCRIPTS
from shared import register_trainer_script, script_output
from te_fake import cuda, fake_te  # noqa: F401  (fixtures)

TOL, TOL64 = 1e-6, 1e-10
# lengths: not multiples of anything, a document of one token, and one longer than the
# others together (13 > 1 + 5 + 3 + 2)
DOCS = [5, 1, 13, 3, 2]


def fake(cp, rank, tp=1, sp=False):
    return SimpleNamespace(cp_size=cp, cp_rank=rank, tp_size=tp, sequence_parallel=sp)


def test_pack_sequences_rows_labels_positions():
    from tpkit.data import pack_sequences
    docs = [[11, 12, 13], [21], [31, 32, 33, 34, 35]]
    pb = pack_sequences(docs, state=fake(2, 0))          # every document to a multiple of 4
    assert pb.cu_seqlens.tolist() == [0, 3, 4, 9]
    assert pb.cu_seqlens_padded.tolist() == [0, 4, 8, 16]
    assert pb.cu_seqlens.dtype == pb.cu_seqlens_padded.dtype == torch.int32
    assert pb.max_seqlen == 8
    assert pb.tokens.tolist() == [11, 12, 13, 0, 21, 0, 0, 0, 31, 32, 33, 34, 35, 0, 0, 0]
    x = -100
    assert pb.labels.tolist() == [12, 13, x, x, x, x, x, x, 32, 33, 34, 35, x, x, x, x]
    assert pb.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    sp = pack_sequences(docs, state=fake(2, 0, tp=2, sp=True))   # 2*cp*tp = 8
    assert sp.cu_seqlens_padded.tolist() == [0, 8, 16, 24]
    assert pack_sequences(docs, state=fake(1, 0)).cu_seqlens_padded.tolist() == [0, 3, 4, 9]


def test_per_document_layout():
    """Rank r keeps chunks r and 2cp-1-r of *each* document (TE's THD DUAL_CHUNK_SWAP)."""
    from tpkit.cp import packed_cp_indices, shard_packed
    cup = [0, 8, 12, 28]                                  # cp=2: chunks of 2, 1, 4 tokens
    want = {0: [0, 1, 6, 7, 8, 11, 12, 13, 14, 15, 24, 25, 26, 27],
            1: [2, 3, 4, 5, 9, 10, 16, 17, 18, 19, 20, 21, 22, 23]}
    for r in (0, 1):
        assert packed_cp_indices(cup, r, 2).tolist() == want[r]
        row = torch.arange(28 * 2).view(2, 28)
        assert torch.equal(shard_packed(row, cup, 1, fake(2, r)), row[:, want[r]])
    seen = sorted(i for r in range(4) for i in packed_cp_indices([0, 16, 24], r, 4).tolist())
    assert seen == list(range(24))


def test_packing_errors():
    from tpkit.cp import packed_cp_indices, shard_packed
    from tpkit.data import pack_sequences
    with pytest.raises(ValueError, match=r"document 1 has padded length 6, not a multiple "
                                         r"of 2\*cp = 4"):
        packed_cp_indices([0, 4, 10], 0, 2)
    with pytest.raises(ValueError, match="document 1 has shape"):
        pack_sequences([[1, 2], []])
    with pytest.raises(ValueError, match="no documents"):
        pack_sequences([])
    with pytest.raises(ValueError, match="multiple=0"):
        pack_sequences([[1]], multiple=0)
    with pytest.raises(ValueError, match="has 9 tokens along dim 0, but cu_seqlens_padded "
                                         "says 8"):
        shard_packed(torch.zeros(9), [0, 8], 0, fake(2, 0))


def _thd_case(comm, causal, heads, groups, dtype, d=4):
    """Errors of one THD case under the current state vs per-document SDPA."""
    import torch.nn.functional as F
    import tpkit
    from tpkit.data import pack_sequences, shard_packed, unshard_packed
    from tpkit.nn import DotProductAttention

    st = tpkit.get_parallel_state()
    dt = getattr(torch, dtype)
    pb = pack_sequences([list(range(n)) for n in DOCS], multiple=2 * st.cp_size)
    cu, cup = pb.cu_seqlens.tolist(), pb.cu_seqlens_padded.tolist()
    T = cup[-1]
    g = torch.Generator().manual_seed(7 + heads + groups)
    q, k, v, gout = (torch.randn(T, h, d, generator=g, dtype=torch.float64).to(dt)
                     for h in (heads, groups, groups, heads))
    # reference: every document alone, full heads, plain SDPA
    ref_out = torch.zeros(T, heads, d, dtype=dt)
    ref_grad = [torch.zeros_like(t) for t in (q, k, v)]
    for i in range(len(DOCS)):
        a, n = cup[i], cu[i + 1] - cu[i]
        qi, ki, vi = (t[a:a + n].permute(1, 0, 2).clone().requires_grad_() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, enable_gqa=True)
        o.backward(gout[a:a + n].permute(1, 0, 2))
        ref_out[a:a + n] = o.detach().permute(1, 0, 2)
        for rg, t in zip(ref_grad, (qi, ki, vi)):
            rg[a:a + n] = t.grad.permute(1, 0, 2)
    hl, gl = heads // st.tp_size, groups // st.tp_size
    hs = slice(st.tp_rank * hl, (st.tp_rank + 1) * hl)
    gs = slice(st.tp_rank * gl, (st.tp_rank + 1) * gl)
    local = [shard_packed(t[:, s], pb.cu_seqlens_padded).clone().requires_grad_()
             for t, s in ((q, hs), (k, gs), (v, gs))]
    dpa = DotProductAttention(heads, d, num_gqa_groups=groups, qkv_format="thd",
                              attn_mask_type="padding_causal" if causal else "padding",
                              cp_comm_type=comm)
    out = dpa(*local, **pb.attention_kwargs())
    assert dpa.kernel == "packed"
    out.backward(shard_packed(gout[:, hs].flatten(1), pb.cu_seqlens_padded))
    got = {"out": unshard_packed(out.detach(), pb.cu_seqlens_padded)}
    want = {"out": ref_out[:, hs].flatten(1)}
    for name, t, r, s in zip("qkv", local, ref_grad, (hs, gs, gs)):
        got["d" + name], want["d" + name] = unshard_packed(t.grad, pb.cu_seqlens_padded), r[:, s]
    assert all(t.dtype == dt for t in got.values()), {n: t.dtype for n, t in got.items()}
    # errors relative to the reference's largest element (fp32 rounding of O(1) values
    # is ~5e-7 absolute)
    return {n: ((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in got}


def _thd_worker(plan, dtypes):
    import tpkit
    results = {}
    for (tp, cp, comm, a2a), cases in plan:
        tpkit.init_parallel(tp=tp, cp=cp, cp_comm_type=comm, cp_a2a_size=a2a)
        for causal, heads, groups in cases:
            for dtype in dtypes:
                results[(tp, cp, comm, causal, heads, groups, dtype)] = _thd_case(
                    comm, causal, heads, groups, dtype)
        tpkit.destroy_parallel()
    return results


CASES = [(True, 8, 8), (True, 8, 4), (False, 8, 4)]   # causal or not, MHA and GQA
PLAN = ([((1, 4, c, a), CASES) for c, a in (("p2p", None), ("all_gather", None),
                                           ("a2a", None), ("a2a+p2p", 2))]
        + [((1, 2, c, None), CASES[1:]) for c in ("p2p", "all_gather", "a2a")]
        + [((2, 2, "p2p", None), CASES[1:2]), ((1, 1, "p2p", None), CASES)])


def test_thd_attention_matches_per_document_sdpa():
    """fp32 to 1e-6 and float64 to 1e-10 relative to the largest element (float64
    computed in float32 anywhere shows as ~1e-7)."""
    n = sum(len(c) for _, c in PLAN) * 2
    for res in run(_thd_worker, 4, PLAN, ("float32", "float64"), timeout=300):
        assert len(res) == n
        bad = {key: e for key, e in res.items()
               if not max(e.values()) <= (TOL64 if key[-1] == "float64" else TOL)}
        assert not bad, bad


def _layer_worker(plan):
    """A TransformerLayer over one packed row (RoPE from the row's position ids) under each
    layout vs the single-process reference layer (tests/layer_checks.py) run on every
    document alone with positions 0..n-1, float64: output, input grad, weight grads. Also
    the position ids and RoPE angles of every shard, unsharded, against the row's."""
    import torch.distributed as dist
    import tpkit
    from layer_checks import RefTransformerLayer, check_weight_grads, randomize, rel
    from tpkit.checkpoint import load_full_state_dict
    from tpkit.comm.collectives import all_gather
    from tpkit.data import pack_sequences, shard_packed, unshard_packed
    from tpkit.nn import RotaryEmbedding, TransformerLayer

    h, ffn, heads, groups = 32, 64, 4, 2
    out = {}
    for tp, cp, comm, sp in plan:
        st = tpkit.init_parallel(tp=tp, cp=cp, cp_comm_type=comm, sequence_parallel=sp)
        g = torch.Generator().manual_seed(5)
        pb = pack_sequences([torch.randint(0, 50, (n,), generator=g) for n in DOCS])
        cu, cup = pb.cu_seqlens.tolist(), pb.cu_seqlens_padded.tolist()
        T = cup[-1]
        ref = RefTransformerLayer(h, ffn, heads, groups, normalization="RMSNorm").double()
        randomize(ref, seed=3)
        x = torch.randn(T, 1, h, generator=g, dtype=torch.float64)
        gout = torch.randn(T, 1, h, generator=g, dtype=torch.float64)
        real = torch.zeros(T, dtype=torch.bool)
        ref_out, ref_dx = torch.zeros_like(x), torch.zeros_like(x)
        for i in range(len(DOCS)):
            a, n = cup[i], cu[i + 1] - cu[i]
            real[a:a + n] = True
            xi = x[a:a + n].clone().requires_grad_()
            o = ref(xi, rope_pos=torch.arange(n))
            o.backward(gout[a:a + n])
            ref_out[a:a + n], ref_dx[a:a + n] = o.detach(), xi.grad
        gout[~real] = 0  # padding tokens carry no loss
        par = TransformerLayer(h, ffn, heads, num_gqa_groups=groups, normalization="RMSNorm",
                               hidden_dropout=0.0, dtype=torch.float64)
        load_full_state_dict(par, ref.state_dict())
        local = pb.shard()
        # RoPE: every shard's positions and angles, unsharded, are the row's (restarting)
        rope = RotaryEmbedding(h // heads)
        pos_back = unshard_packed(local.position_ids, pb.cu_seqlens_padded)
        ang_back = unshard_packed(rope(local.position_ids), pb.cu_seqlens_padded)
        restart = torch.cat([torch.arange(b - a) for a, b in zip(cup[:-1], cup[1:])])
        pos_ok = torch.equal(pos_back, restart) and torch.equal(ang_back, rope(restart))

        def sp_cut(t):
            return t.chunk(tp, 0)[st.tp_rank] if sp else t
        xl = sp_cut(shard_packed(x, pb.cu_seqlens_padded)).clone().requires_grad_()
        y = par(xl, rotary_pos_emb=rope(local.position_ids), **pb.attention_kwargs())
        y.backward(sp_cut(shard_packed(gout, pb.cu_seqlens_padded)))
        for p in par.parameters():   # each CP rank holds its tokens' share of a weight grad
            dist.all_reduce(p.grad, group=st.cp_group)

        def whole(t):
            t = all_gather(t.contiguous(), st.tp_group, 0) if sp else t
            return unshard_packed(t, pb.cu_seqlens_padded)
        errs = {"out": rel(whole(y.detach())[real], ref_out[real]),
                "dx": rel(whole(xl.grad)[real], ref_dx[real])}
        try:
            check_weight_grads(par, ref, st, "weights", tol=1e-6)
            errs["weights"] = 0.0
        except AssertionError as e:
            errs["weights"] = str(e)
        out[(tp, cp, comm, sp)] = (errs, pos_ok)
        tpkit.destroy_parallel()
    return out


LAYER_PLAN = [(1, 1, "p2p", False), (1, 4, "p2p", False), (2, 2, "all_gather", True),
              (1, 2, "a2a", False)]


def test_transformer_layer_on_packed_rows_matches_per_document_layer():
    """1e-6: RotaryEmbedding's angles are float32 (TE's too), the reference's float64; the
    attention alone is held to 1e-10 in float64 above."""
    for res in run(_layer_worker, 4, LAYER_PLAN, timeout=300):
        for key, (errs, pos_ok) in res.items():
            assert pos_ok, (key, "positions/RoPE do not restart per document")
            assert errs["weights"] == 0.0, (key, errs)
            assert errs["out"] <= 1e-6 and errs["dx"] <= 1e-6, (key, errs)


def test_te_backend_passes_thd_arguments_through(fake_te, cuda):
    """DotProductAttention(backend="te") is TE's module: the THD call reaches it unchanged
    (the same tensor objects), and ParallelSelfAttention hands a TE core the packed call
    (qkv_format="thd", the padding form of its mask type, TE's cu_seqlens names)."""
    from tpkit import ParallelConfig
    from tpkit.data import pack_sequences
    from tpkit.nn import DotProductAttention, ParallelSelfAttention
    from tpkit.layout.planning import build_fake_state, destroy_fake_state
    s = build_fake_state(ParallelConfig(), 1)
    try:
        pb = pack_sequences([[1, 2, 3], [4]], multiple=4)
        kw = pb.attention_kwargs()
        te_dpa = DotProductAttention(4, 8, qkv_format="thd", attn_mask_type="padding_causal",
                                     state=s, backend="te")
        assert type(te_dpa) is fake_te.DotProductAttention
        assert te_dpa.init_args["qkv_format"] == "thd"
        assert te_dpa.init_args["attn_mask_type"] == "padding_causal"
        q = torch.zeros(8, 4, 8)
        te_dpa(q, q, q, **kw)
        name, args = te_dpa.calls[-1]
        assert name == "forward" and args["query_layer"] is q
        assert all(args[k] is v for k, v in kw.items()), args
        layer = ParallelSelfAttention(32, 4, state=s)
        layer.core_attention = DotProductAttention(4, 8, state=s, backend="te")
        y = layer(torch.zeros(8, 1, 32), **kw)
        assert y.shape == (8, 1, 32)
        name, args = layer.core_attention.calls[-1]
        assert args["qkv_format"] == "thd" and args["attn_mask_type"] == "padding_causal"
        assert args["query_layer"].shape == (8, 4, 8)
        assert all(args[k] is v for k, v in kw.items()), args
    finally:
        destroy_fake_state(s)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_padding_masks_match_sdpa_of_the_real_tokens(fmt):
    """attn_mask_type="padding"/"padding_causal" with TE's mask [b, 1, 1, s] (True:
    padding, anywhere in the row) equals SDPA over each row's real tokens alone, float64;
    padding rows give zeros and no gradient."""
    import torch.nn.functional as F
    from tpkit import ParallelConfig
    from tpkit.nn import DotProductAttention
    from tpkit.layout.planning import build_fake_state, destroy_fake_state
    s_ = build_fake_state(ParallelConfig(), 1)
    try:
        b, s, h, g_, d = 3, 9, 4, 2, 8
        gen = torch.Generator().manual_seed(11)
        pad = torch.rand(b, s, generator=gen) < 0.4
        pad[0] = False                 # a row without padding
        pad[1, :] = True
        pad[1, 4] = False              # a row with one real token
        for causal in (True, False):
            q, k, v, go = (torch.randn(b, s, n, d, generator=gen, dtype=torch.float64)
                           for n in (h, g_, g_, h))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            lay = (lambda t: t.transpose(0, 1)) if fmt == "sbhd" else (lambda t: t)
            dpa = DotProductAttention(h, d, num_gqa_groups=g_, qkv_format=fmt, state=s_,
                                      attn_mask_type="padding_causal" if causal else "padding")
            out = dpa(*(lay(t) for t in leaves), pad[:, None, None, :])
            out.backward(lay(go.flatten(2)))
            out = lay(out).view(b, s, h, d)
            for i in range(b):
                keep = ~pad[i]
                qi, ki, vi = (t[i, keep].transpose(0, 1).clone().requires_grad_()
                              for t in (q, k, v))
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal,
                                                   enable_gqa=True)
                o.backward(go[i, keep].transpose(0, 1))
                assert (out[i, keep] - o.transpose(0, 1)).abs().max() < TOL64
                assert not out[i, ~keep].any()
                for leaf, r in zip(leaves, (qi, ki, vi)):
                    assert (leaf.grad[i, keep] - r.grad.transpose(0, 1)).abs().max() < TOL64
                    assert not leaf.grad[i, ~keep].any()
    finally:
        destroy_fake_state(s_)


# --- launch/train.py --pack ------------------------------------------------------------------
PACK = ["--pack", "--steps", "20", "--hidden", "32", "--layers", "2", "--heads", "4",
        "--gqa-groups", "2", "--ffn", "64", "--seq-len", "32", "--global-batch", "4",
        "--warmup", "5", "--log-every", "100"]


def _train_packed(tp, cp, extra=()):
    from tpkit.train import trainer as train
    return train.main(PACK + ["--tp", str(tp), "--cp", str(cp)] + list(extra))


@pytest.fixture(scope="module")
def packed_reference():
    (ref,) = run(_train_packed, 1, 1, 1, timeout=300)
    assert ref[-1] < ref[0] - 0.5, ref   # it learns
    return ref


@pytest.mark.parametrize("tp,cp,extra", [(2, 2, ()), (1, 2, ()), (2, 1, ("--sequence-parallel",))],
                         ids=["tp2cp2", "cp2dp2", "tp2dp2-sp"])
def test_train_pack_same_curve_at_every_layout(packed_reference, tp, cp, extra):
    """(tp, cp, dp) = (2,2,1), (1,2,2), (2,1,2)+SP give the (1,1,1) curve: 20 losses within
    1e-5 (relative), every rank reporting the same global token mean."""
    res = run(_train_packed, 4, tp, cp, extra, timeout=300)
    for losses in res:
        assert losses == res[0]
    bad = [(i, a, b) for i, (a, b) in enumerate(zip(res[0], packed_reference))
           if not abs(a - b) <= 1e-5 * abs(b)]
    assert len(res[0]) == 20 and not bad, bad


register_trainer_script("packed", os.path.join(SCRIPTS, "packed.py"),
                        flags=("--tp", "2", "--cp", "2"))


@pytest.mark.slow
def test_packed_launched(tmp_path_factory):
    """tests/launch_scripts/packed.py as under ``tpkit-launch --nproc-per-node 4 --tp 2 --cp
    2`` (in tests/shared.py's trainer launch, with the variables those flags export; public
    API): per-document positions, THD attention on three comm types vs per-document SDPA in
    float64, and bad inputs refused on every rank before any collective."""
    out = script_output(tmp_path_factory, "packed")   # the launch exited 0
    assert out.count("PACKED OK") == 4, out[-2000:]
