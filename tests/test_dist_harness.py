"""The multi-rank harness itself: results by rank, first failing traceback, hang timeout."""
import pytest

from dist import RankError, run


def _rank_and_sum():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on(bad_rank):
    import torch.distributed as dist
    if dist.get_rank() == bad_rank:
        raise ZeroDivisionError(f"boom on {bad_rank}")
    return dist.get_rank()


def _hang_on_one():
    import time
    import torch.distributed as dist
    if dist.get_rank() == 1:
        time.sleep(60)
    return dist.get_rank()


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_results_by_rank(n):
    assert run(_rank_and_sum, n) == [(r, float(sum(range(n)))) for r in range(n)]


def test_first_failing_rank_traceback():
    with pytest.raises(RankError, match=r"(?s)rank 1:.*ZeroDivisionError: boom on 1"):
        run(_fail_on, 2, 1)
    assert run(_rank_and_sum, 2) == [(0, 1.0), (1, 1.0)]  # pool rebuilt, usable


def test_hang_fails_within_timeout():
    with pytest.raises(TimeoutError, match=r"ranks \[1\]"):
        run(_hang_on_one, 2, timeout=3)
    assert run(_rank_and_sum, 2) == [(0, 1.0), (1, 1.0)]


def _count_worker():
    import torch
    import torch.distributed as dist
    import tpkit
    from commcount import count_collectives
    s = tpkit.init_parallel(tp=2, cp=2)
    with count_collectives() as calls:
        t = torch.ones(2)
        dist.all_reduce(t, group=s.tp_group)
        dist.all_reduce(t, group=s.dp_group)
        dist.all_reduce(t)
    return calls.summary(), calls.count("all_reduce", min_group_size=2), dist.all_reduce.__name__


def test_collective_counter():
    for summary, real, name in run(_count_worker, 4):
        assert summary == {"all_reduce": 3} and real == 2 and name == "all_reduce"


def test_shared_launch_runs_once_and_a_failure_once(tmp_path_factory):
    """tests/shared.py's ``once``: the build runs once per session (a second asker reads
    its result), and a build that failed is not run again: later askers fail with its
    message (planted: without the failure record, the second call ran the build again)."""
    from shared import once
    calls = []

    def build(work):
        calls.append(work)
        return {"work": work, "n": len(calls)}

    first = once(tmp_path_factory, "harness-ok", build)
    assert once(tmp_path_factory, "harness-ok", build) == first and len(calls) == 1

    def broken(work):
        calls.append(work)
        raise RuntimeError("rank 2 exited 1")

    with pytest.raises(RuntimeError, match="rank 2 exited 1"):
        once(tmp_path_factory, "harness-broken", broken)
    with pytest.raises(AssertionError, match="failed earlier in this session:\nRuntimeError: "
                                             "rank 2 exited 1"):
        once(tmp_path_factory, "harness-broken", broken)
    assert len(calls) == 2
