"""CP attention properties: balanced ring work, O(S/cp) saved memory, exact collective
counts, dropout in the tracker's stream, and clear errors. One 4-rank call does it all."""
import pytest

from dist import run

HEADS, D, B = 4, 8, 1


def _qkv(s_local, requires_grad=True, groups=HEADS):
    import torch
    g = torch.Generator().manual_seed(7)
    return [torch.randn(s_local, B, h, D, generator=g).requires_grad_(requires_grad)
            for h in (HEADS, groups, groups)]


def _balance_and_memory():
    """Ring FLOPs per rank (causal, load-balanced) and bytes saved for backward, on the
    reference kernels and on the fused ones. The forward blocks are counted by wrapping
    the block function the reference ring calls and the fused CPU op's forward."""
    import tpkit.nn.ring_attention as ring
    from tpkit.nn.attention_ops import CpuFlashOp

    real, real_op, stats = ring.block_forward, CpuFlashOp.forward, {}

    def count(q, k):
        b, g, r, nq, d = q.shape
        stats["blocks"] = stats.get("blocks", 0) + 1
        stats["flops"] = stats.get("flops", 0) + 4 * b * g * r * nq * k.shape[-2] * d

    def counting(q, k, *args, **kwargs):
        count(q, k)
        return real(q, k, *args, **kwargs)

    def counting_op(self, q, k, *args, **kwargs):
        count(q, k)
        return real_op(self, q, k, *args, **kwargs)

    ring.block_forward, CpuFlashOp.forward = counting, counting_op
    try:
        return {**_balance_and_memory_counted(stats, False),
                **_balance_and_memory_counted(stats, True)}
    finally:
        ring.block_forward, CpuFlashOp.forward = real, real_op


def _balance_and_memory_counted(stats, fused):
    import os
    import torch
    import tpkit
    from tpkit.nn.dot_product_attention import DotProductAttention

    out = {}
    s_full = 256
    os.environ["TPKIT_FUSED_ATTN"] = "1" if fused else "0"  # the pool's processes live on
    try:
        for tp, cp, comm, a2a in ((1, 1, "p2p", None), (1, 2, "p2p", None), (1, 4, "p2p", None),
                                  (1, 4, "a2a+p2p", 2), (1, 4, "all_gather", None)):
            st = tpkit.init_parallel(tp=tp, cp=cp, cp_comm_type=comm, cp_a2a_size=a2a)
            dpa = DotProductAttention(HEADS, D, attn_mask_type="causal")
            stats.clear()
            q, k, v = _qkv(s_full // cp)
            saved = []

            def pack(t):
                saved.append(t.numel() * t.element_size())
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                o = dpa(q, k, v)
            o.sum().backward()
            out[(cp, comm, fused)] = {"flops": stats.get("flops", 0),
                                      "blocks": stats.get("blocks", 0), "saved": sum(saved),
                                      "cp_rank": st.cp_rank, "kernel": dpa.kernel}
            tpkit.destroy_parallel()
    finally:
        del os.environ["TPKIT_FUSED_ATTN"]
    return out


def _counts(fused=False):
    """Collectives issued by forward and backward for each comm type (cp=4 / a2a 2x2),
    and the bytes this rank's point-to-point sends carried (forward, backward)."""
    import os
    import torch.distributed as dist
    import tpkit
    from commcount import count_collectives
    from tpkit.nn.dot_product_attention import DotProductAttention

    from tpkit.comm.shm import ShmP2P

    real, real_shm, sent = dist.batch_isend_irecv, ShmP2P.start, [0]

    def sizing(ops):
        sent[0] += sum(o.tensor.numel() * o.tensor.element_size() for o in ops
                       if o.op is dist.isend)
        return real(ops)

    def shm_sizing(self, sends, recvs, tag):   # CP groups on CPU: shared memory
        sent[0] += sum(t.numel() * t.element_size() for t, _ in sends)
        return real_shm(self, sends, recvs, tag)

    out = {}
    os.environ["TPKIT_FUSED_ATTN"] = "1" if fused else "0"  # the pool's processes live on
    dist.batch_isend_irecv, ShmP2P.start = sizing, shm_sizing
    try:
        for comm, a2a in (("p2p", None), ("all_gather", None), ("a2a", None), ("a2a+p2p", 2)):
            tpkit.init_parallel(cp=4, cp_comm_type=comm, cp_a2a_size=a2a)
            dpa = DotProductAttention(HEADS, D, attn_mask_type="causal")
            q, k, v = _qkv(8)
            sent[0] = 0
            with count_collectives() as fwd:
                o = dpa(q, k, v)
            fwd_bytes = sent[0]
            with count_collectives() as bwd:
                o.sum().backward()
            out[comm] = (fwd.summary(), bwd.summary(), sorted({c.group_size for c in fwd + bwd}),
                         (fwd_bytes, sent[0] - fwd_bytes), dpa.kernel)
            tpkit.destroy_parallel()
    finally:
        dist.batch_isend_irecv, ShmP2P.start = real, real_shm
        del os.environ["TPKIT_FUSED_ATTN"]
    return out


def _dropout():
    """Dropout is drawn from the tracker's model-parallel stream, not the default one, and
    the ring kernels' backward replays forward's masks (checked by finite differences of
    the global loss along a random direction)."""
    import torch
    import torch.distributed as dist
    import tpkit
    from tpkit.nn.dot_product_attention import DotProductAttention
    from tpkit.layout.random import get_rng_tracker

    out = {}
    for comm, a2a in (("all_gather", None), ("a2a", None), ("p2p", None), ("a2a+p2p", 2)):
        st = tpkit.init_parallel(cp=4, cp_comm_type=comm, cp_a2a_size=a2a, seed=11)
        dpa = DotProductAttention(HEADS, D, attention_dropout=0.5)
        q, k, v = _qkv(8)
        ref = DotProductAttention(HEADS, D).eval()(q, k, v)
        default_before = torch.get_rng_state()
        tracker_before = get_rng_tracker().get_states()
        w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(st.cp_rank))
        o = dpa(q, k, v)
        (o * w).sum().backward()
        res = {
            "default_untouched": torch.equal(torch.get_rng_state(), default_before),
            "tracker_advanced": not all(torch.equal(a, tracker_before[n])
                                        for n, a in get_rng_tracker().get_states().items()),
            "changed": not torch.allclose(o, ref),
            "eval_exact": torch.allclose(dpa.eval()(q, k, v), ref, atol=0, rtol=0),
        }
        dpa.train()
        dirs = [torch.randn(t.shape, generator=torch.Generator().manual_seed(40 + i))
                for i, t in enumerate((q, k, v))]
        analytic = torch.tensor(sum((t.grad * d_).sum().item() for t, d_ in zip((q, k, v), dirs)))
        dist.all_reduce(analytic, group=st.cp_group)
        eps, losses = 1e-2, []
        for sign in (1, -1):
            get_rng_tracker().set_states(tracker_before)  # the same masks as above
            with torch.no_grad():
                pert = [t + sign * eps * d_ for t, d_ in zip((q, k, v), dirs)]
                loss = torch.tensor((dpa(*pert) * w).sum().item())
            dist.all_reduce(loss, group=st.cp_group)
            losses.append(loss.item())
        fd = (losses[0] - losses[1]) / (2 * eps)
        res["fd_rel_err"] = abs(fd - analytic.item()) / abs(analytic.item())
        out[comm] = res
        tpkit.destroy_parallel()
    return out


def _errors():
    import torch
    import tpkit
    from tpkit.nn.dot_product_attention import DotProductAttention

    errs = {}

    def catch(name, fn):
        try:
            fn()
            errs[name] = None
        except ValueError as e:
            errs[name] = str(e)
    st = tpkit.init_parallel(cp=4, cp_comm_type="p2p")
    catch("odd_local_seq", lambda: DotProductAttention(HEADS, D)(*_qkv(7)))
    catch("a2a_heads", lambda: DotProductAttention(8, D, num_gqa_groups=2, cp_comm_type="a2a"))
    catch("a2a+p2p_no_hier", lambda: DotProductAttention(HEADS, D, cp_comm_type="a2a+p2p"))
    catch("a2a+p2p_one_group", lambda: DotProductAttention(HEADS, D).set_context_parallel_group(
        st.cp_group, st.cp_global_ranks, None, "a2a+p2p"))
    catch("lb_strategy", lambda: DotProductAttention(HEADS, D).set_context_parallel_group(
        st.cp_group, st.cp_global_ranks, None, "p2p", "striped"))
    catch("mask_arbitrary", lambda: DotProductAttention(HEADS, D, attn_mask_type="arbitrary"))
    catch("attention_mask", lambda: DotProductAttention(HEADS, D)(
        *_qkv(8), attention_mask=torch.ones(1, dtype=torch.bool)))
    catch("bad_comm", lambda: DotProductAttention(HEADS, D, cp_comm_type="ring"))
    tpkit.destroy_parallel()
    return errs


def _all():
    return {"bm": _balance_and_memory(), "counts": _counts(), "counts_fused": _counts(True),
            "dropout": _dropout(),
            "errors": _errors()}


@pytest.fixture(scope="module")
def results():
    return run(_all, 4, timeout=240)


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
def test_ring_work_is_balanced(results, fused):
    for key in ((4, "p2p", fused), (2, "p2p", fused), (4, "a2a+p2p", fused)):
        flops = {r["bm"][key]["flops"] for r in results}
        assert len(flops) == 1 and flops.pop() > 0, key  # imbalance 0
        assert results[0]["bm"][key]["kernel"] == ("cpu_flash" if fused else "reference")
    # cp=4, local 64 tokens = chunks of c=32: one diagonal 64x64 block + 3 blocks of 32x64
    per_block = 4 * B * HEADS * D
    assert results[0]["bm"][(4, "p2p", fused)]["flops"] == per_block * (64 * 64 + 3 * 32 * 64)
    # the reference ring computes a received K/V block whole; the fused one piece by piece
    assert results[0]["bm"][(4, "p2p", fused)]["blocks"] == (7 if fused else 4)


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
def test_saved_memory_scales_as_one_over_cp(results, fused):
    for r in results:
        m1, m2, m4 = (r["bm"][(cp, "p2p", fused)]["saved"] for cp in (1, 2, 4))
        assert m2 * 2 == m1 and m4 * 4 == m1, (m1, m2, m4)
        # exactly q, k, v, out (fp32) and lse: nothing gathered is kept
        s = 256 // 4
        assert m4 == 4 * s * B * HEADS * D * 4 + s * B * HEADS * 4
        ag = r["bm"][(4, "all_gather", fused)]["saved"]
        if fused:  # q, out, lse of the shard and the gathered K/V, no probabilities
            assert ag == (2 * s + 2 * 256) * B * HEADS * D * 4 + s * B * HEADS * 4
        else:
            assert ag > m1  # gathered K/V and S x S/cp probs


def test_collective_counts(results):
    for r in results:
        c = r["counts"]
        # ring: n-1 K/V hops forward; backward n-1 K/V hops + n dK/dV hops
        assert c["p2p"][:2] == ({"batch_isend_irecv": 3}, {"batch_isend_irecv": 7})
        assert c["all_gather"][:2] == ({"all_gather_into_tensor": 2}, {"reduce_scatter_tensor": 2})
        assert c["a2a"][:2] == ({"all_to_all_single": 4}, {"all_to_all_single": 4})
        assert c["a2a+p2p"][:2] == ({"all_to_all_single": 4, "batch_isend_irecv": 1},
                                    {"all_to_all_single": 4, "batch_isend_irecv": 3})
        assert c["a2a+p2p"][2] == [2] and c["p2p"][2] == [4]


def test_fused_p2p_sends_only_what_the_causal_mask_needs(results):
    """The fused p2p kernel sends a lower rank only the first chunk of its K/V (the
    reference ring sends whole shards): over cp=4 ranks of s=8 rows (chunks of 4), 6 of
    the 12 (rank, peer) pairs move 4 rows of K and V, the other 6 move 8; backward moves
    the same K/V again and as many dK/dV rows back. Other comm types issue the
    reference's collectives."""
    row = B * HEADS * D * 4  # one fp32 row of K (or V) for all heads
    fwd_total = (6 * 2 * 4 + 6 * 2 * 8) * row
    sums = [sum(r["counts_fused"]["p2p"][3][i] for r in results) for i in (0, 1)]
    assert sums == [fwd_total, 2 * fwd_total], (sums, fwd_total)
    for r in results:
        c, ref = r["counts_fused"], r["counts"]
        assert {v[4] for v in c.values()} == {"cpu_flash"}
        assert set(c["p2p"][0]) == set(c["p2p"][1]) == {"batch_isend_irecv"}
        assert c["p2p"][2] == [4] and c["a2a+p2p"][2] == [2]
        for comm in ("all_gather", "a2a"):
            assert c[comm][:3] == ref[comm][:3], comm
        assert c["a2a+p2p"][0]["all_to_all_single"] == 4
        # reference ring: 3 hops of 8 rows of K and V per rank
        assert sum(r_["counts"]["p2p"][3][0] for r_ in results) == 12 * 2 * 8 * row


def test_dropout_runs_in_tracker_stream(results):
    for r in results:
        d = r["dropout"]
        for comm in ("all_gather", "a2a", "p2p", "a2a+p2p"):
            fd = d[comm].pop("fd_rel_err")
            assert fd < 1e-2, (comm, fd)
            assert d[comm] == {"default_untouched": True, "tracker_advanced": True,
                               "changed": True, "eval_exact": True}, comm


def test_clear_errors(results):
    e = results[0]["errors"]
    assert "odd" in e["odd_local_seq"] and "2*cp = 8" in e["odd_local_seq"]
    assert "2 local gqa groups" in e["a2a_heads"]
    assert "cp_a2a_size" in e["a2a+p2p_no_hier"]
    assert "[a2a_group, p2p_group]" in e["a2a+p2p_one_group"]
    assert "'striped'" in e["lb_strategy"] and "dual_chunk_swap" in e["lb_strategy"]
    assert "'arbitrary'" in e["mask_arbitrary"]
    assert "attention_mask" in e["attention_mask"]
    assert "'ring'" in e["bad_comm"]


def test_ring_dropout_masks_match_autograd_reference():
    """One ring block with dropout vs autograd on the same masks (drawn from the stream)."""
    import torch
    from tpkit.nn.attention_math import causal_mask
    from tpkit.nn.ring_attention import _stream_generator, ring_attention
    from tpkit.layout.random import get_rng_tracker

    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 2, 8, 4, generator=g, requires_grad=True)  # [b, g, r, s, d]
        k, v = (torch.randn(1, 2, 1, 8, 4, generator=g, requires_grad=True) for _ in range(2))
        keep = torch.rand((1, 2, 2, 8, 8), generator=_stream_generator(q.device)) >= 0.3
        out = ring_attention(q, k, v, None, causal=True, scale=0.5, dropout_p=0.3)
        w = torch.randn(out.shape, generator=g)
        grads = torch.autograd.grad((out * w).sum(), (q, k, v))
        s = (q @ k.transpose(-1, -2) * 0.5).masked_fill(causal_mask(8, 8, "cpu"), float("-inf"))
        ref = (torch.softmax(s, -1) * keep / 0.7) @ v
        ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
        assert (out - ref).abs().max() < 1e-5
        for a, b in zip(grads, ref_grads):
            assert (a - b).abs().max() < 1e-5
        assert not torch.allclose(out, ((torch.softmax(s, -1)) @ v))
    finally:
        tracker.reset()


@pytest.mark.parametrize("n,s,m,tile,max_rows", [(2, 64, 8, 4, 64), (4, 32, 4, 2, 8),
                                                  (8, 48, 6, 2, None)])
def test_backward_units_have_equal_work_and_cover_the_causal_mask(n, s, m, tile, max_rows):
    """The fused p2p backward's schedule (pure function, no ranks): the (query, key)
    pairs each rank computes in its exchange units, plus its local causal diagonal, are
    exactly the causally visible pairs of its queries, each once (global positions of the
    load-balanced layout, written here: rank r holds chunks r and 2n-1-r); and at every
    unit position all ranks compute the same number of scores, so no rank idles while
    its peer finishes a longer unit (the units pair up: each settles the peer's dK/dV
    partial of the previous unit)."""
    from tpkit.nn.fused_cp import ring_schedule
    c = s // 2

    def pos(r, j):  # global position of local row j of rank r
        return r * c + j if j < c else (2 * n - 1 - r) * c + j - c

    scheds = [ring_schedule(r, n, True, s, m, tile, balanced=True, max_tile_rows=max_rows)
              for r in range(n)]
    assert len({len(u) for u in scheds}) == 1
    for r, units in enumerate(scheds):
        seen = {(pos(r, i), pos(r, j)) for i in range(s) for j in range(i + 1)}  # diagonal
        count = len(seen)
        for u in units:
            if u.recv is None:
                continue
            src, (a, b) = u.recv
            for qa, qb in u.q_tiles:
                pairs = {(pos(r, i), pos(src, j)) for i in range(qa, qb) for j in range(a, b)}
                assert all(k <= q for q, k in pairs), (r, u)  # unmasked blocks only
                seen |= pairs
                count += len(pairs)
        want = {(pos(r, i), k) for i in range(s) for k in range(pos(r, i) + 1)}
        assert seen == want and count == len(want), r
    for k in range(len(scheds[0])):
        work = set()
        for units in scheds:
            u = units[k]
            rows = 0 if u.recv is None else u.recv[1][1] - u.recv[1][0]
            work.add(rows * sum(b - a for a, b in u.q_tiles))
        assert len(work) == 1, (k, work)
