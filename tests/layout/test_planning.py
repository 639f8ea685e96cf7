"""tpkit.layout.planning in one process: the fake-process-group state, and the rank table and
group summary as text (what tpkit-launch --dry-run prints), against tables written out
by hand here."""
import pytest
import torch.distributed as dist

from tpkit.layout.config import ParallelConfig
from tpkit.layout.planning import (build_fake_state, destroy_fake_state, fake_state,
                                   format_rank_table, format_ranks, group_summary,
                                   planned_rank_table)


@pytest.mark.parametrize("ranks,text", [
    ([5], "5"), ([0, 1], "0-1"), ([3, 4, 5, 6, 7], "3-7"), ([0, 2], "0,2"),
    ([1, 5, 9, 13], "1,5,9,13"), ([1, 5, 9, 13, 17], "1..17/4"), (range(0, 64, 8), "0..56/8"),
    ([0, 1, 3], "0,1,3"), (list(range(8)) + [20], "0,1,2,3,4,5,6,7,..."),
    ([0, 1, 2, 3, 4, 5, 6, 9], "0,1,2,3,4,5,6,9"), ([6, 4, 2], "6,4,2"),
    ([0, 4, 6, 8, 10], "0,4,6,8,10"),   # the later steps are smaller, not equal
    (range(0, 5000, 1000), "0..4000/1000"), ([9, 8, 7, 6, 5], "9..5/-1"),
])
def test_format_ranks(ranks, text):
    assert format_ranks(ranks) == text


TABLE = """\
rank  node  local_rank  tp  cp  dp  pp  tp_group  cp_group  dp_group  pp_group  etp  ep  edp
   0     0           0   0   0   0   0       0-1       0,2       0,4         0    0   0    0
   1     0           1   1   0   0   0       0-1       1,3       1,5         1    0   1    0
   2     0           2   0   1   0   0       2-3       0,2       2,6         2    0   0    1
   3     0           3   1   1   0   0       2-3       1,3       3,7         3    0   1    1
   4     1           0   0   0   1   0       4-5       4,6       0,4         4    0   0    2
   5     1           1   1   0   1   0       4-5       5,7       1,5         5    0   1    2
   6     1           2   0   1   1   0       6-7       4,6       2,6         6    0   0    3
   7     1           3   1   1   1   0       6-7       5,7       3,7         7    0   1    3"""

SUMMARY_RANK5 = """\
  tp      size      2 x      4 groups   rank 5's: 4-5
  cp      size      2 x      4 groups   rank 5's: 5,7
  dp      size      2 x      4 groups   rank 5's: 1,5
  pp      size      1 x      8 groups   rank 5's: 5
  dp_cp   size      4 x      2 groups   rank 5's: 1,3,5,7
  tp_cp   size      4 x      2 groups   rank 5's: 4-7
  mp      size      2 x      4 groups   rank 5's: 4-5
  amax    size      8 x      1 groups   rank 5's: 0-7
  etp     size      1 x      8 groups   rank 5's: 5
  ep      size      2 x      4 groups   rank 5's: 4-5
  edp     size      4 x      2 groups   rank 5's: 1,3,5,7
  etp_ep  size      2 x      4 groups   rank 5's: 4-5"""


def test_table_and_summary_of_an_expert_layout():
    cfg = ParallelConfig(tp=2, cp=2, ep=2, etp=1)
    rows = planned_rank_table(cfg, 8, 4)
    assert not dist.is_initialized()
    assert format_rank_table(rows) == TABLE
    lines = TABLE.splitlines()   # "..." right-aligned in the rank column
    assert format_rank_table(rows, limit=4) == "\n".join(
        lines[:3] + [" ..."] + lines[-2:])
    assert format_rank_table(rows, limit=5) == "\n".join(lines[:3] + [" ..."] + lines[-3:])
    assert format_rank_table(rows, limit=8) == format_rank_table(rows, limit=20) == TABLE
    assert format_rank_table(rows[:1]) == "\n".join(lines[:2])
    with pytest.raises(TypeError):   # limit is keyword-only
        format_rank_table(rows, 4)
    with fake_state(cfg, 8, 5) as s:
        assert "\n".join(group_summary(s)) == SUMMARY_RANK5
        assert s.rank == 5 and dist.is_initialized()
    assert not dist.is_initialized()
    # no expert decomposition: no expert columns, and no cp_a2a/etp lines
    dense = planned_rank_table(ParallelConfig(tp=2, pp=2), 8, 8)
    head = format_rank_table(dense).splitlines()[0].split()
    assert head[-1] == "pp_group" and len(head) == 11
    assert format_rank_table([]) == "  ".join(head[:3] + ["tp", "cp", "dp", "pp"] + head[7:])


def test_fake_state_needs_no_group_and_frees_it():
    s = build_fake_state(ParallelConfig(tp=2), 4, rank=3)
    try:
        assert (s.tp_rank, s.dp_rank, s.world_size) == (1, 1, 4)
        with pytest.raises(RuntimeError, match="needs a process without a default process "
                                               "group"):
            build_fake_state(ParallelConfig(tp=2), 4)
    finally:
        destroy_fake_state(s)
    assert not dist.is_initialized()
    destroy_fake_state(s)   # twice: nothing left to free, no error
    s = build_fake_state(ParallelConfig(tp=2), 4)   # rank 0 by default
    try:
        assert s.rank == 0
    finally:
        destroy_fake_state(s)
    with fake_state(ParallelConfig(tp=2), 4) as s:
        assert s.rank == 0
    # a layout the world cannot hold fails before any group exists, and one that fails
    # while building frees the group again
    with pytest.raises(ValueError, match="world size 6 is not divisible by tp"):
        build_fake_state(ParallelConfig(tp=4), 6)
    assert not dist.is_initialized()
    with pytest.raises(ValueError):
        with fake_state(ParallelConfig(tp=2), 4):
            raise ValueError("inside")
    assert not dist.is_initialized()


def test_a_failed_build_frees_the_group(monkeypatch):
    import tpkit.layout.planning as planning

    def broken(config, device_type):
        assert dist.is_initialized()
        raise RuntimeError("the build failed")
    monkeypatch.setattr(planning, "build_state", broken)
    with pytest.raises(RuntimeError, match="the build failed"):
        build_fake_state(ParallelConfig(tp=2), 4)
    assert not dist.is_initialized()
