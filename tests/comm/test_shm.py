"""tpkit.comm.shm: the shared-memory all-reduce TP groups use on CPU, against gloo's all-reduce
on the same data, and the ways it must fail or step aside.

Pool (tests/dist.py): equivalent for the transport, which only needs the TP group and the
host; segments set up and released across many layouts in one process are also checked
launched (test_userpath's reinit.py sums a TP MLP through it after every rebuild)."""
import glob
import os

import pytest
import torch
from commcount import count_collectives
from dist import run


def _sums(tp, dtype, numels, seed):
    """Per size: |shm - gloo| max, whether equal bitwise, and a digest of the result's bytes."""
    import hashlib

    import torch.distributed as dist

    import tpkit
    from tpkit.comm import shm
    st = tpkit.init_parallel(tp=tp, seed=None)
    t = shm.get(st.tp_group)
    assert t is not None and t.size == tp
    out = []
    for i, n in enumerate(numels):
        g = torch.Generator().manual_seed(seed + 1000 * i + st.rank)
        x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype) * 10 ** (st.rank % 3)
        ref = x.clone()
        dist.all_reduce(ref, group=st.tp_group)
        got = t.all_reduce_(x.clone())
        out.append(((got.to(torch.float64) - ref.to(torch.float64)).abs().max().item(),
                    bool(torch.equal(got, ref)),
                    hashlib.sha1(got.view(torch.uint8).numpy().tobytes()).hexdigest()))
    return out, t.seq


# sizes: tiny, odd, exactly one slot of fp32, several slots plus a remainder
NUMELS = [1, 1000, (1 << 20) // 4, 3 * (1 << 20) // 4 + 17]


@pytest.mark.parametrize("tp", [2, 4])
def test_matches_gloo_allreduce(tp):
    res = run(_sums, tp, tp, torch.float32, NUMELS, 7)
    for r in res:
        out, seq = r
        assert seq == 1 + 1 + 1 + 4          # one round per slot-sized chunk
        for err, equal, _ in out:
            if tp == 2:
                assert equal                 # a + b: bitwise what gloo computes
            assert err <= 1e-4
    # every rank holds the same bits
    for i in range(len(NUMELS)):
        assert len({r[0][i][2] for r in res}) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_dtypes(dtype):
    res = run(_sums, 2, 2, dtype, [5, 300_001], 3)
    for out, _ in res:
        for err, equal, _ in out:
            assert equal, (dtype, err)


def _parity_reuse():
    """Many back-to-back rounds with ranks racing ahead: the double buffer must never let
    a fast rank overwrite a slot a slow rank still reads."""
    import time

    import tpkit
    from tpkit.comm import shm
    st = tpkit.init_parallel(tp=2, seed=None)
    t = shm.get(st.tp_group)
    bad = 0
    for i in range(400):
        if st.tp_rank == i % 2 and i % 7 == 0:
            time.sleep(0.002)                # make one rank late now and then
        x = torch.full((64 + i,), float(st.rank + 1) * (i + 1))
        t.all_reduce_(x)
        bad += int(not torch.all(x == 3.0 * (i + 1)))
    return bad


def test_rounds_never_mix():
    assert run(_parity_reuse, 2) == [0, 0]


def _setup_facts():
    import tpkit
    from tpkit.comm import shm
    st = tpkit.init_parallel(tp=2, seed=None)
    t = shm.get(st.tp_group)
    left = glob.glob(f"/dev/shm/tpkit-{os.getpid()}-*")
    return t is not None, left, os.getpid()


def test_segment_is_unlinked_after_setup():
    res = run(_setup_facts, 2)
    assert all(ok for ok, _, _ in res)
    assert all(left == [] for _, left, _ in res)
    for _, _, pid in res:
        assert glob.glob(f"/dev/shm/tpkit-{pid}-*") == []


def _killed_rank0_leftover():
    """A rank 0 SIGKILLed between creating its segment and unlinking it (the set-up
    window), as a real process: returns the file it left in /dev/shm."""
    import subprocess
    import sys
    code = ("import os, signal\nfrom tpkit.comm import shm\n"
            "path, mm = shm._create(shm._HEADER + 4 * shm.SLOT_BYTES, shm._HEADER, b'0' * 16)\n"
            "print(path, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == -9, proc.stderr
    return proc.stdout.strip()


def test_segment_of_a_killed_rank0_is_removed_by_the_next_setup():
    from tpkit.comm import shm
    left = _killed_rank0_leftover()
    assert os.path.exists(left)            # what a SIGKILL in the window leaves behind
    live = f"/dev/shm/tpkit-{os.getpid()}-{'ab' * 6}"   # a live process's segment: kept
    open(live, "wb").close()
    try:
        # rank 0's first step of every set-up
        path, mm = shm._create(shm._HEADER + 4 * shm.SLOT_BYTES, shm._HEADER, b"1" * 16)
        mm.close()
        os.unlink(path)
        assert not os.path.exists(left)
        assert os.path.exists(live)
    finally:
        os.unlink(live)
        if os.path.exists(left):
            os.unlink(left)


def _layers_count(disable):
    import tpkit
    from tpkit.comm import shm
    from tpkit.nn import ParallelMLP
    if disable:
        os.environ["TPKIT_SHM_ALLREDUCE"] = "0"
    try:
        st = tpkit.init_parallel(tp=2, seed=3)
    finally:
        os.environ.pop("TPKIT_SHM_ALLREDUCE", None)
    mlp = ParallelMLP(8, 16)
    x = torch.randn(4, 2, 8, requires_grad=True)
    used = shm.get(st.tp_group) is not None
    seq0 = shm.get(st.tp_group).seq if used else 0
    with count_collectives() as calls:
        y = mlp(x)
        y.sum().backward()
    seq1 = shm.get(st.tp_group).seq if used else 0
    return used, calls.summary(min_group_size=2), seq1 - seq0, y.detach(), x.grad


def test_mlp_through_shm_or_gloo_same_result_and_count():
    on = run(_layers_count, 2, False)
    off = run(_layers_count, 2, True)
    for (u1, c1, n1, y1, g1), (u0, c0, n0, y0, g0) in zip(on, off):
        assert u1 and not u0
        assert c1 == c0 == {"all_reduce": 2}
        assert n1 == 2 and n0 == 0           # the two counted all-reduces went through shm
        assert torch.equal(y1, y0) and torch.equal(g1, g0)


def _late_peer():
    import tpkit
    from tpkit.comm import shm
    st = tpkit.init_parallel(tp=2, seed=None)
    t = shm.get(st.tp_group)
    t.timeout_s = 0.3
    if st.tp_rank == 1:
        return "skipped"
    try:
        t.all_reduce_(torch.ones(4))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_missing_peer_times_out_naming_it():
    msg, other = run(_late_peer, 2)
    assert other == "skipped"
    assert "ranks [1] never arrived" in msg and "timed out after" in msg, msg


def _group_of_one_has_none():
    import tpkit
    from tpkit.comm import shm
    st = tpkit.init_parallel(tp=1, seed=None)
    return shm.get(st.tp_group) is None


def test_no_transport_for_a_group_of_one():
    assert run(_group_of_one_has_none, 1) == [True]


def _no_space():
    import errno
    import warnings

    import tpkit
    from tpkit.comm import shm

    def full(nbytes, header, token):
        raise OSError(errno.ENOSPC, "No space left on device")

    orig, shm._create = shm._create, full
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            st = tpkit.init_parallel(tp=2, seed=None)
    finally:
        shm._create = orig  # the worker is reused by later tests
    return shm.get(st.tp_group) is None, [str(x.message) for x in w
                                          if issubclass(x.category, RuntimeWarning)]


def test_no_segment_warns_and_keeps_gloo():
    for none, msgs in run(_no_space, 2):
        assert none
        assert any("use gloo, not shared memory" in m and "No space left" in m
                   for m in msgs), msgs


def _shared_and_bypassed():
    import torch.distributed as dist

    import tpkit
    from tpkit.comm import shm
    from tpkit.layout.topology import build_state
    st = tpkit.init_parallel(tp=2, seed=None)
    t = shm.get(st.tp_group)
    again = build_state(st.config)          # the same (world) TP group: the same transport
    same = shm.get(again.tp_group) is t and again.tp_group is st.tp_group
    x = torch.full((3,), float(st.rank + 1))
    with shm.bypassed(st.tp_group):
        with count_collectives() as calls:
            from tpkit.comm.collectives import all_reduce_sum
            all_reduce_sum(x, st.tp_group)
        inside = (shm.get(st.tp_group) is None, t.seq, calls.summary())
    all_reduce_sum(x, st.tp_group)
    dist.barrier()
    mine = {id(g) for g in st.mesh.get_all_groups()}
    for g in again.mesh.get_all_groups():   # its own size-1 groups: keep the pool clean
        if id(g) not in mine:
            dist.destroy_process_group(g)
    return same, inside, shm.get(st.tp_group) is t, t.seq, x.tolist()


def test_states_sharing_a_group_share_its_transport_and_bypass_uses_gloo():
    for same, inside, back, seq, x in run(_shared_and_bypassed, 2):
        assert same
        assert inside == (True, 0, {"all_reduce": 1})   # via dist, the transport untouched
        assert back and seq == 1
        assert x == [6.0, 6.0, 6.0]                      # (1 + 2) summed twice
