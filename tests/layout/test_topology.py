"""ParallelState groups on real gloo ranks and on the fake process group."""
import random as pyrandom
import time

import pytest

from dist import run

LAYOUTS = [  # (tp, cp, dp, pp) covering 8 ranks
    (2, 2, 2, 1), (4, 2, 1, 1), (2, 1, 2, 2), (1, 8, 1, 1), (1, 1, 8, 1), (2, 2, 1, 2),
]


def coords(r, tp, cp, dp, pp):
    return r % tp, (r // tp) % cp, (r // (tp * cp)) % dp, r // (tp * cp * dp)


def rank_of(t, c, d, p, tp, cp, dp):
    return t + tp * (c + cp * (d + dp * p))


def expected_groups(r, tp, cp, dp, pp, a2a=None):
    t, c, d, p = coords(r, tp, cp, dp, pp)
    R = lambda t_, c_, d_, p_: rank_of(t_, c_, d_, p_, tp, cp, dp)  # noqa: E731
    g = {
        "tp": [R(i, c, d, p) for i in range(tp)],
        "cp": [R(t, i, d, p) for i in range(cp)],
        "dp": [R(t, c, i, p) for i in range(dp)],
        "pp": [R(t, c, d, i) for i in range(pp)],
        "dp_cp": [R(t, j, i, p) for i in range(dp) for j in range(cp)],
        "tp_cp": [R(j, i, d, p) for i in range(cp) for j in range(tp)],
        "mp": [R(j, c, d, i) for i in range(pp) for j in range(tp)],
        "amax": [R(k, j, i, p) for i in range(dp) for j in range(cp) for k in range(tp)],
    }
    if a2a:
        # TE's ordering: cp index = p2p_rank * a2a_size + a2a_rank
        g["cp_a2a"] = [R(t, (c // a2a) * a2a + i, d, p) for i in range(a2a)]
        g["cp_p2p"] = [R(t, i * a2a + c % a2a, d, p) for i in range(cp // a2a)]
    return g


def _groups_worker(tp, cp, dp, pp, comm, a2a):
    import torch
    import torch.distributed as dist
    import tpkit
    from tpkit.layout import parallel_state as ps

    s = tpkit.init_parallel(tp=tp, cp=cp, pp=pp, dp=dp, cp_comm_type=comm, cp_a2a_size=a2a)
    world = dist.get_world_size()
    out = {"ranks": {}, "sums": {}, "coords": (s.tp_rank, s.cp_rank, s.dp_rank, s.pp_rank),
           "cp_global_ranks": s.cp_global_ranks,
           "sizes": (s.tp_size, s.cp_size, s.dp_size, s.pp_size)}
    for name, group in s.all_groups().items():
        out["ranks"][name] = dist.get_process_group_ranks(group)
        onehot = torch.zeros(world)
        onehot[dist.get_rank()] = 1.0
        dist.all_reduce(onehot, group=group)
        out["sums"][name] = onehot.nonzero().flatten().tolist()
        # group-rank order: the i-th group rank is the i-th listed global rank
        out.setdefault("order", {})[name] = dist.get_global_rank(group, 0)
    out["getters"] = (ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank(),
                      ps.get_data_parallel_world_size(with_context_parallel=True),
                      ps.get_data_parallel_group_ranks(with_context_parallel=True),
                      ps.get_amax_reduction_group() is s.amax_group)
    out["table"] = s.rank_table(nproc_per_node=4)
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=[str(l) for l in LAYOUTS])
def test_groups_match_formula(layout):
    tp, cp, dp, pp = layout
    results = run(_groups_worker, tp * cp * dp * pp, tp, cp, dp, pp, "p2p", None)
    for r, out in enumerate(results):
        exp = expected_groups(r, tp, cp, dp, pp)
        assert out["coords"] == coords(r, tp, cp, dp, pp)
        assert out["sizes"] == (tp, cp, dp, pp)
        for name, members in exp.items():
            assert out["ranks"][name] == members, (r, name)
            assert out["sums"][name] == sorted(members), (r, name)
            assert out["order"][name] == members[0]
        assert out["cp_global_ranks"] == exp["cp"]
        assert out["getters"][:2] == coords(r, tp, cp, dp, pp)[:2]
        assert out["getters"][2] == dp * cp and out["getters"][3] == exp["dp_cp"]
        assert out["getters"][4]
        # the rank table every rank computes is the same, and right
        assert out["table"] == results[0]["table"]
        row = out["table"][r]
        assert (row["tp"], row["cp"], row["dp"], row["pp"]) == coords(r, tp, cp, dp, pp)
        assert (row["node"], row["local_rank"]) == (r // 4, r % 4)
        assert list(row["tp_group"]) == exp["tp"] and list(row["dp_group"]) == exp["dp"]


@pytest.mark.parametrize("layout,a2a", [((1, 4, 2, 1), 2), ((2, 4, 1, 1), 2), ((1, 8, 1, 1), 4)])
def test_hierarchical_cp_levels(layout, a2a):
    tp, cp, dp, pp = layout
    results = run(_groups_worker, 8, tp, cp, dp, pp, "a2a+p2p", a2a)
    for r, out in enumerate(results):
        exp = expected_groups(r, tp, cp, dp, pp, a2a)
        for name in ("cp_a2a", "cp_p2p", "cp"):
            assert out["ranks"][name] == exp[name], (r, name)
            assert out["sums"][name] == sorted(exp[name])
        # index = p2p_rank * a2a_size + a2a_rank reproduces the CP rank
        c = coords(r, tp, cp, dp, pp)[1]
        a2a_rank = out["ranks"]["cp_a2a"].index(r)
        p2p_rank = out["ranks"]["cp_p2p"].index(r)
        assert p2p_rank * a2a + a2a_rank == c


def _reinit_worker():
    import torch
    import torch.distributed as dist
    import tpkit
    world = dist.group.WORLD
    first = tpkit.init_parallel(tp=2, cp=2)
    with pytest.raises(RuntimeError, match="destroy_parallel"):
        tpkit.init_parallel(tp=4)
    tpkit.destroy_parallel()
    assert dist.is_initialized() and dist.group.WORLD is world  # layouts come and go
    with pytest.raises(RuntimeError, match="not initialised"):
        tpkit.get_parallel_state()
    from tpkit.layout import parallel_state as ps
    with pytest.raises(RuntimeError, match="not initialised"):
        ps.get_tensor_model_parallel_rank()
    assert not ps.model_parallel_is_initialized()
    second = tpkit.init_parallel(tp=4)
    t = torch.ones(1)
    dist.all_reduce(t, group=second.tp_group)
    return first.tp_size, second.tp_size, second.cp_size, t.item()


def test_destroy_then_reinit_other_layout():
    """In the pool the default group is the harness's, so this passed while the same
    script hung under tpkit-launch, where tpkit created (and re-created) the default
    group (issue 14); test_userpath runs the launched version."""
    assert run(_reinit_worker, 4) == [(2, 4, 1, 4.0)] * 4


def _gloo_loops() -> int:
    """gloo's TCP loop threads of this process (one per live gloo context)."""
    import os
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:   # a thread that just ended
            pass
    return names.count("gloo_tcp_loop")


def _cycles_release_groups():
    """Layouts built and destroyed with the cyclic GC off: each destroy must free its
    groups at once (their gloo loop threads end), however the meshes refer to each
    other. Returns the loop-thread counts before, while a layout lives, and after each
    destroy."""
    import gc

    import tpkit
    gc.collect()
    gc.disable()
    try:
        before, live, after = _gloo_loops(), [], []
        for layout in ({"tp": 2, "cp": 2}, {"tp": 2, "cp": 2},
                       {"cp": 4, "cp_comm_type": "a2a+p2p", "cp_a2a_size": 2},
                       {"tp": 2, "ep": 2}, {"pp": 2, "tp": 2}):
            st = tpkit.init_parallel(**layout)
            live.append(_gloo_loops())
            del st
            tpkit.destroy_parallel()
            after.append(_gloo_loops())
        return before, live, after
    finally:
        gc.enable()


def test_destroy_frees_the_groups_at_once():
    for before, live, after in run(_cycles_release_groups, 4):
        assert min(live) > before            # the layouts made groups of their own
        assert after == [before] * len(after), (before, live, after)


def _bad_world_worker():
    import tpkit
    with pytest.raises(ValueError, match="world size 4"):
        tpkit.init_parallel(tp=3)
    with pytest.raises(ValueError, match="backend='mpi'"):
        tpkit.init_parallel(tp=2, backend="mpi")
    # the default group (gloo here) lives as long as the process: another backend is an
    # error, not silently gloo (CUDA faked so the check, not the "no GPUs" one, answers)
    import torch
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        with pytest.raises(ValueError, match="backend='nccl' was asked for, but the default "
                                             "process group of this process runs 'gloo'"):
            tpkit.init_parallel(tp=2, backend="nccl")
    finally:
        torch.cuda.is_available = real
    assert not tpkit.is_initialized()
    return True


def test_init_rejects_bad_layout_before_building():
    assert run(_bad_world_worker, 4) == [True] * 4


def test_fake_pg_65536_ranks(record_property):
    """Build the state of sampled ranks in a 65,536-rank world on the fake process group."""
    from tpkit.layout.config import ParallelConfig
    from tpkit.layout.planning import build_fake_state, destroy_fake_state

    tp, cp, dp, pp = 8, 4, 512, 4
    cfg = ParallelConfig(tp=tp, cp=cp, pp=pp, cp_comm_type="a2a+p2p", cp_a2a_size=2)
    world = 65536
    rng = pyrandom.Random(0)
    times = []
    for r in [0, world - 1] + rng.sample(range(world), 2):
        t0 = time.perf_counter()
        s = build_fake_state(cfg, world, rank=r)
        times.append(time.perf_counter() - t0)
        try:
            exp = expected_groups(r, tp, cp, dp, pp, a2a=2)
            for name, members in exp.items():
                assert s.group_ranks(name) == members, (r, name)
            assert (s.tp_rank, s.cp_rank, s.dp_rank, s.pp_rank) == coords(r, tp, cp, dp, pp)
            assert s.dp_size == dp and s.world_size == world
            if r == 0:
                t1 = time.perf_counter()
                table = s.rank_table(nproc_per_node=8)
                record_property("rank_table_s", round(time.perf_counter() - t1, 3))
                assert len(table) == world
                for q in rng.sample(range(world), 50):
                    row = table[q]
                    assert (row["tp"], row["cp"], row["dp"], row["pp"]) == coords(q, tp, cp, dp, pp)
                    assert list(row["cp_group"]) == expected_groups(q, tp, cp, dp, pp)["cp"]
        finally:
            destroy_fake_state(s)
    record_property("build_s", [round(t, 3) for t in times])
    print(f"fake 65,536-rank build times (s): {[round(t, 3) for t in times]}")
