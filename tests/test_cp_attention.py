"""DotProductAttention with context parallelism vs full-sequence SDPA (outputs and grads)."""

from dist import run

TOL = 1e-5


def _run_case(comm, mask, heads, groups, fmt, b=2, s=16, d=4):
    """One attention case under the current state; returns max abs errors vs SDPA."""
    import torch
    import torch.nn.functional as F
    import tpkit
    from tpkit.data import shard_sequence, unshard_sequence
    from tpkit.nn.dot_product_attention import DotProductAttention

    st = tpkit.get_parallel_state()
    g = torch.Generator().manual_seed(1000 + heads * 10 + groups)
    q = torch.randn(b, heads, s, d, generator=g, dtype=torch.float32)
    k = torch.randn(b, groups, s, d, generator=g)
    v = torch.randn(b, groups, s, d, generator=g)
    gout = torch.randn(b, heads, s, d, generator=g)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=(mask == "causal"),
                                         enable_gqa=True)
    ref.backward(gout)
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
    go = shard_sequence(lay(gout[:, hs]), sd).flatten(2)
    (out * go).sum().backward()
    errs = {"out": (unshard_sequence(out.detach(), sd) - lay(ref.detach()[:, hs]).flatten(2))}
    for name, t, r, sl in zip("qkv", local, ref_in, (hs, gs, gs)):
        errs["d" + name] = unshard_sequence(t.grad, sd) - lay(r.grad[:, sl])
    return {k_: e.abs().max().item() for k_, e in errs.items()}


def _cases_worker(plan):
    import tpkit
    results = {}
    for (tp, cp, comm, a2a), cases in plan:
        tpkit.init_parallel(tp=tp, cp=cp, cp_comm_type=comm, cp_a2a_size=a2a)
        for (mask, heads, groups, fmt) in cases:
            key = (tp, cp, comm, mask, heads, groups, fmt)
            results[key] = _run_case(comm, mask, heads, groups, fmt)
        tpkit.destroy_parallel()
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


def test_cp_attention_matches_sdpa():
    n_cases = sum(len(cases) for _, cases in PLAN)
    for res in run(_cases_worker, 4, PLAN, timeout=300):
        assert len(res) == n_cases
        bad = {key: errs for key, errs in res.items() if not max(errs.values()) <= TOL}
        assert not bad, bad
