"""tpkit.comm.shm's point-to-point transport (CP groups on CPU): every message arrives whole and
in order, whatever its size, dtype, layout or how many are in flight, and the ring
attention it carries computes the same bits as over gloo. Expected contents are written
from a formula in the test (the sender's rank, the receiver's, the message index), not by
the transport.

Pool (tests/dist.py); the launched road (tpkit-launch, cp=2) runs through it in
test_userpath and test_launch's train.py runs, and reinit.py checks each rebuilt CP group
has its own transport."""
import pytest
import torch
from dist import run


def _expected(src: int, dst: int, i: int, numel: int, dtype) -> torch.Tensor:
    x = torch.arange(numel, dtype=torch.float64) * 1e-3 + src * 100 + dst * 10 + i
    if dtype == torch.bool:
        return (torch.arange(numel) + src + dst + i) % 3 == 0
    return x.to(dtype)


def _exchange(cp, dtype, numels, in_flight, reverse_waits):
    """Every rank sends every other rank ``numels`` messages per batch, ``in_flight``
    batches posted before any is waited on; returns the mismatches and the transport's
    slot size."""
    import tpkit
    from tpkit.comm import shm
    from tpkit.comm.collectives import start_p2p
    st = tpkit.init_parallel(cp=cp, seed=None)
    t = shm.get_p2p(st.cp_group)
    assert t is not None and t.size == cp
    ranks = [r for r in range(cp) if r != st.rank]   # cp spans the world here
    batches = []
    for b in range(in_flight):
        sends, recvs, want = [], [], []
        for peer in ranks:
            for i, n in enumerate(numels):
                sends.append((_expected(st.rank, peer, b * 100 + i, n, dtype), peer))
                buf = torch.empty(n, dtype=dtype)
                recvs.append((buf, peer))
                want.append((buf, _expected(peer, st.rank, b * 100 + i, n, dtype)))
        batches.append((start_p2p(sends, recvs, st.cp_group, tag=5), want))
    bad = []
    for works, want in (reversed(batches) if reverse_waits else batches):
        for w in works:
            w.wait()
        bad += [i for i, (got, exp) in enumerate(want) if not torch.equal(got, exp)]
    slot = t.slot
    tpkit.destroy_parallel()
    return bad, slot


@pytest.mark.parametrize("cp", [2, 4])
def test_messages_arrive_whole_and_in_order(cp):
    """Empty, tiny, odd, one slot and several slots plus a remainder, to and from every
    peer at once: more than a mailbox holds, so it only finishes if waits move the
    others' chunks too."""
    from tpkit.comm.shm import _p2p_layout
    slot = _p2p_layout(cp)[2] // 4     # fp32 elements per slot
    numels = [0, 1, 1001, slot, 3 * slot + 17]
    res = run(_exchange, cp, cp, torch.float32, numels, 3, cp == 4)
    for bad, got_slot in res:
        assert bad == [] and got_slot == slot * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, torch.int64, torch.bool])
def test_dtypes(dtype):
    assert [bad for bad, _ in run(_exchange, 2, 2, dtype, [3, 70_001], 2, False)] == [[], []]


def _layouts():
    """A non-contiguous send and a non-contiguous receive buffer."""
    import tpkit
    from tpkit.comm import shm
    from tpkit.comm.collectives import start_p2p
    st = tpkit.init_parallel(cp=2, seed=None)
    peer = 1 - st.rank
    mine = (torch.arange(12.0).view(3, 4) + 100 * st.rank).t()          # [4, 3], strided
    into = torch.zeros(3, 4).t()                                          # strided buffer
    for w in start_p2p([(mine, peer)], [(into, peer)], st.cp_group, tag=1):
        w.wait()
    ok = torch.equal(into, (torch.arange(12.0).view(3, 4) + 100 * peer).t())
    used = shm.get_p2p(st.cp_group) is not None
    tpkit.destroy_parallel()
    return ok, used


def test_strided_tensors():
    assert run(_layouts, 2) == [(True, True), (True, True)]


def _mismatch(kind):
    """Rank 1 sends what rank 0 did not post (another tag, or another size); or rank 1
    posts nothing and rank 0 waits out a short timeout, or (``dead``) sees rank 1's
    process gone."""
    import tpkit
    from tpkit.comm import shm
    from tpkit.comm.collectives import start_p2p
    st = tpkit.init_parallel(cp=2, seed=None)
    t = shm.get_p2p(st.cp_group)
    msg = "no error"
    if st.rank == 0:
        t.timeout_s = 0.5
        if kind == "dead":   # rank 1 "exited": its process id line names a reaped process
            import subprocess
            import sys
            proc = subprocess.Popen([sys.executable, "-c", "pass"])
            proc.wait()
            t.timeout_s, t._flags[t._pid_at[1]] = 60.0, proc.pid
        try:
            for w in start_p2p([], [(torch.empty(8), 1)], st.cp_group, tag=2):
                w.wait()
        except RuntimeError as e:
            msg = str(e)
    elif kind not in ("silent", "dead"):
        n, tag = (8, 3) if kind == "tag" else (9, 2)
        for w in start_p2p([(torch.ones(n), 0)], [], st.cp_group, tag=tag):
            w.wait()
    tpkit.destroy_parallel()
    return msg


def test_mismatched_posts_raise_naming_both_ranks():
    tag, _ = run(_mismatch, 2, "tag")
    assert "rank 1 sent rank 0 a chunk with tag 3 of 32 bytes where tag 2 of 32 bytes" in tag
    size, _ = run(_mismatch, 2, "size")
    assert "tag 2 of 36 bytes where tag 2 of 32 bytes" in size


def test_missing_peer_times_out_naming_it():
    msg, other = run(_mismatch, 2, "silent")
    assert other == "no error"
    assert "rank 0 waited 0.5 s" in msg and "with ranks [1]" in msg, msg


def test_exited_peer_is_named_before_the_timeout():
    import time
    t0 = time.monotonic()
    msg, other = run(_mismatch, 2, "dead")
    assert other == "no error" and time.monotonic() - t0 < 30
    assert "rank 1 (pid" in msg and "exited while rank 0 waited" in msg, msg


def _ring(disable):
    """Fused CP attention (fwd + bwd, causal, cp=2) with the transport or over gloo."""
    import os

    import tpkit
    from tpkit.comm import shm
    from tpkit.data import shard_sequence
    from tpkit.nn.dot_product_attention import DotProductAttention
    if disable:
        os.environ["TPKIT_SHM_P2P"] = "0"
    try:
        st = tpkit.init_parallel(cp=2, seed=None)
    finally:
        os.environ.pop("TPKIT_SHM_P2P", None)
    used = shm.get_p2p(st.cp_group) is not None
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (shard_sequence(torch.randn(64, 2, 4, 16, generator=g), 0).contiguous()
                     for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    dpa = DotProductAttention(4, 16, attn_mask_type="causal")
    out = dpa(q, k, v)
    out.backward(dout.flatten(2))
    res = [x.detach().clone() for x in (out, q.grad, k.grad, v.grad)]
    tpkit.destroy_parallel()
    return used, dpa.kernel, res


def test_ring_attention_same_bits_over_shm_and_gloo():
    on, off = run(_ring, 2, False), run(_ring, 2, True)
    for (u1, k1, r1), (u0, k0, r0) in zip(on, off):
        assert (u1, u0) == (True, False) and k1 == k0 == "cpu_flash"
        assert all(torch.equal(a, b) for a, b in zip(r1, r0))
