"""DotProductAttention with context parallelism vs full-sequence SDPA (outputs and grads),
in fp32, in float64 (which must stay float64: gradcheck-grade agreement) and in bf16
(which must still accumulate in fp32). Every case runs on the fused block kernels
(tpkit.nn.attention_ops; the module must report that it chose one) and, in fp32 and
float64, again on the plain-torch reference kernels (TPKIT_FUSED_ATTN=0)."""

import pytest
from dist import run

TOL = 1e-5
TOL64 = 1e-10  # float64 kernels vs float64 SDPA; float32 math anywhere shows as ~1e-7


def _run_case(comm, mask, heads, groups, fmt, b=2, s=16, d=4, dtype="float32"):
    """One attention case under the current state; returns max abs errors vs SDPA of the
    full sequence in the same dtype (bf16: vs fp32 SDPA of the same bf16 values, errors
    relative to the reference's magnitude)."""
    import torch
    import torch.nn.functional as F
    import tpkit
    from tpkit.data import shard_sequence, unshard_sequence
    from tpkit.nn.dot_product_attention import DotProductAttention

    st = tpkit.get_parallel_state()
    dt = getattr(torch, dtype)
    ref_dt = torch.float32 if dt == torch.bfloat16 else dt
    g = torch.Generator().manual_seed(1000 + heads * 10 + groups)
    q, k, v, gout = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64).to(dt)
                     for h in (heads, groups, groups, heads))
    ref_in = [t.to(ref_dt, copy=True).requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=(mask == "causal"),
                                         enable_gqa=True)
    ref.backward(gout.to(ref_dt))
    hl, gl = heads // st.tp_size, groups // st.tp_size
    hs, gs = slice(st.tp_rank * hl, (st.tp_rank + 1) * hl), slice(st.tp_rank * gl, (st.tp_rank + 1) * gl)
    # the module's layout: sbhd [s, b, h, d] or bshd [b, s, h, d]
    lay = (lambda t: t.permute(2, 0, 1, 3)) if fmt == "sbhd" else (lambda t: t.permute(0, 2, 1, 3))
    sd = 0 if fmt == "sbhd" else 1
    local = [shard_sequence(lay(t), sd).contiguous().requires_grad_()
             for t in (q[:, hs], k[:, gs], v[:, gs])]
    dpa = DotProductAttention(heads, d, num_gqa_groups=groups, attn_mask_type=mask,
                              qkv_format=fmt, cp_comm_type=comm)
    out = dpa(*local)
    kernel = dpa.kernel
    go = shard_sequence(lay(gout[:, hs]), sd).flatten(2)
    out.backward(go)
    got = {"out": unshard_sequence(out.detach(), sd)}
    want = {"out": lay(ref.detach()[:, hs]).flatten(2)}
    for name, t, r, sl in zip("qkv", local, ref_in, (hs, gs, gs)):
        got["d" + name], want["d" + name] = unshard_sequence(t.grad, sd), lay(r.grad[:, sl])
    assert all(t.dtype == dt for t in got.values()), {n: t.dtype for n, t in got.items()}
    if dt == torch.bfloat16:  # relative errors: per element (floor 1e-3 of the largest), and
        errs = {}             # in units of the largest element ("<name>_max")
        for n in got:
            e, w = (got[n].double() - want[n].double()).abs(), want[n].double().abs()
            errs[n] = (e / (w + 1e-3 * w.max())).max().item()
            errs[n + "_max"] = (e.max() / w.max()).item()
        return errs, kernel
    return {n: (got[n] - want[n]).abs().max().item() for n in got}, kernel


def _cases_worker(plan, dtype="float32", fused=True):
    """Runs ``plan`` with the fused kernels on (default) or off; results per case, and
    the kernels the module chose (all cp > 1 cases)."""
    import os
    import tpkit
    results, kernels = {}, set()
    os.environ["TPKIT_FUSED_ATTN"] = "1" if fused else "0"  # the pool's processes live on
    try:
        for (tp, cp, comm, a2a), cases in plan:
            tpkit.init_parallel(tp=tp, cp=cp, cp_comm_type=comm, cp_a2a_size=a2a)
            for (mask, heads, groups, fmt) in cases:
                key = (tp, cp, comm, mask, heads, groups, fmt)
                results[key], kernel = _run_case(comm, mask, heads, groups, fmt, dtype=dtype)
                if cp > 1:
                    kernels.add(kernel)
            tpkit.destroy_parallel()
    finally:
        del os.environ["TPKIT_FUSED_ATTN"]
    assert kernels == {"cpu_flash" if fused else "reference"}, (fused, kernels)
    return results


# (mask, global heads, global gqa groups, qkv_format): MHA and GQA, both masks and formats
CASES = [("causal", 8, 8, "sbhd"), ("causal", 8, 4, "sbhd"), ("no_mask", 8, 4, "bshd"),
         ("no_mask", 8, 8, "sbhd")]
GQA2 = [("causal", 8, 2, "bshd"), ("no_mask", 8, 2, "sbhd")]  # 2 groups: a2a over <= 2 ranks
# (tp, cp, comm, cp_a2a_size) on 4 ranks: cp=4, tp=2 x cp=2, and cp=2 x dp=2
PLAN = ([((1, 4, c, a), CASES) for c, a in (("p2p", None), ("all_gather", None),
                                           ("a2a", None), ("a2a+p2p", 2))]
        + [((1, 4, "p2p", None), GQA2), ((1, 4, "all_gather", None), GQA2)]
        + [((2, 2, c, None), CASES) for c in ("p2p", "all_gather", "a2a")]
        + [((1, 2, c, None), CASES[:2] + GQA2) for c in ("p2p", "all_gather", "a2a")]
        + [((1, 1, "p2p", None), CASES[:2])])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
def test_cp_attention_matches_sdpa(fused):
    n_cases = sum(len(cases) for _, cases in PLAN)
    for res in run(_cases_worker, 4, PLAN, fused=fused, timeout=300):
        assert len(res) == n_cases
        bad = {key: errs for key, errs in res.items() if not max(errs.values()) <= TOL}
        assert not bad, bad


# Every comm type at cp=2 and cp=4 (a2a+p2p needs cp >= 4), both masks, MHA and GQA, and
# no CP (PyTorch's SDPA itself); tp=2 x cp=2 checks the TP head slicing in float64 too.
PLAN64 = ([((1, cp, c, None), CASES[:3]) for cp in (2, 4) for c in ("p2p", "all_gather", "a2a")]
          + [((1, 4, "a2a+p2p", 2), CASES[:3]), ((2, 2, "p2p", None), CASES[:2]),
             ((1, 1, "p2p", None), CASES[:3])])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
def test_float64_stays_float64(fused):
    """A float64 user (gradcheck, a float64 reference) gets float64 math on every path:
    output and q/k/v gradients within 1e-10 of float64 SDPA, returned as float64."""
    n_cases = sum(len(cases) for _, cases in PLAN64)
    for res in run(_cases_worker, 4, PLAN64, "float64", fused=fused, timeout=300):
        assert len(res) == n_cases
        bad = {key: errs for key, errs in res.items() if not max(errs.values()) <= TOL64}
        assert not bad, bad


def test_bf16_accumulates_in_fp32():
    """bf16 in, bf16 out, math in fp32: each element is the fp32 SDPA of the same bf16
    values rounded to bf16 (2**-8 relative; with the math in bf16 elements are 20-500 %
    off). One exception by design: all_gather reduce-scatters dK/dV in the input dtype
    (as TE does), a bf16 sum over the CP ranks, so those are bounded relative to their
    largest element (2**-7; measured 0.005) instead of per element."""
    plan = [((1, 4, c, a), CASES[:3]) for c, a in (("p2p", None), ("all_gather", None),
                                                   ("a2a", None), ("a2a+p2p", 2))]
    for res in run(_cases_worker, 4, plan, "bfloat16", timeout=300):
        bad = {}
        for key, errs in res.items():
            summed = ("dk", "dv") if key[2] == "all_gather" else ()
            for n in ("out", "dq", "dk", "dv"):
                e, tol = (errs[n + "_max"], 2 ** -7) if n in summed else (errs[n], 2 ** -8)
                if not e <= tol:
                    bad[key + (n,)] = e
        assert not bad, bad


def _pieces_worker(fwd_rows):
    """The p2p ring as it runs on long sequences, at test sizes: K/V pieces of 2 rows in
    backward (8 per chunk at cp=2, 4 at cp=4, query tiles of two pieces) and, forward,
    ``fwd_rows``-row pieces (2) or whole chunks (the CPU op's default). Errors vs SDPA of
    the full sequence per case, and the K/V lengths of this rank's forward op calls
    (cp=2, causal, MHA)."""
    import tpkit
    from tpkit.nn.attention_ops import CpuFlashOp

    real = CpuFlashOp.min_piece_rows, CpuFlashOp.min_fwd_piece_rows, CpuFlashOp.forward
    calls = []

    def counting(self, q, k, *args, **kwargs):
        calls.append(k.shape[-2])
        return real[2](self, q, k, *args, **kwargs)

    CpuFlashOp.min_piece_rows, CpuFlashOp.min_fwd_piece_rows = 2, fwd_rows
    CpuFlashOp.forward = counting
    results, kv_rows = {}, None
    try:
        for tp, cp, comm, a2a in ((1, 2, "p2p", None), (1, 4, "p2p", None),
                                  (1, 4, "a2a+p2p", 2), (2, 2, "p2p", None)):
            st = tpkit.init_parallel(tp=tp, cp=cp, cp_comm_type=comm, cp_a2a_size=a2a)
            for mask, heads, groups, fmt in CASES + GQA2:
                calls.clear()
                results[(tp, cp, comm, mask, heads, groups, fmt)], _ = _run_case(
                    comm, mask, heads, groups, fmt, s=64)
                if (tp, cp, comm, mask, heads, groups) == (1, 2, "p2p", "causal", 8, 8):
                    kv_rows = (st.cp_rank, list(calls))
            tpkit.destroy_parallel()
    finally:
        CpuFlashOp.min_piece_rows, CpuFlashOp.min_fwd_piece_rows, CpuFlashOp.forward = real
    return results, kv_rows


@pytest.mark.parametrize("fwd_rows", [2, 1 << 30], ids=["fwd-pieces", "fwd-whole-chunks"])
def test_ring_pieces_match_sdpa(fwd_rows):
    """Backward in pieces and query tiles, forward in pieces or whole chunks (so the two
    directions run different schedules): outputs and gradients still match SDPA of the
    full sequence, and forward made one op call per piece it received."""
    for res, (rank, kv_rows) in run(_pieces_worker, 4, fwd_rows, timeout=300):
        bad = {key: errs for key, errs in res.items() if not max(errs.values()) <= TOL}
        assert not bad, bad
        # S=64 at cp=2: local 32 rows = chunks of 16; rank 0 receives both of rank 1's
        # chunks, rank 1 only rank 0's first; the first call is the local diagonal block
        received = 2 if rank == 0 else 1
        assert kv_rows == [32] + ([2] * 8 * received if fwd_rows == 2 else [16] * received)
