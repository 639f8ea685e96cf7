"""Count the torch.distributed collectives a block of code really issues.

``with count_collectives() as calls: ...`` replaces the public collective functions of
``torch.distributed`` (looked up there at call time, as tpkit.comm.collectives and torch's
own callers do) and tpkit.comm.shm's shared-memory all-reduce with counting wrappers, and
records one ``Call(op, group_size)`` per call. Calls on a group of one rank are recorded
too, so a test can assert that none were made. ``calls.count("all_reduce")`` counts by
name, optionally ``min_group_size=2``. Pass ``group=`` by keyword: a group passed
positionally is counted as the world.

One op has one name: torch 2.13's ``all_gather_single``/``reduce_scatter_single`` are
recorded as the ``all_gather_into_tensor``/``reduce_scatter_tensor`` every torch has.
``isend``/``irecv`` are left alone (``P2POp`` accepts only the real ones); a ring hop is
counted as its ``batch_isend_irecv``, whether gloo or tpkit.comm.shm's point-to-point
transport (CP groups on CPU) carries it.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch.distributed as dist

from tpkit.comm.shm import ShmAllReduce, ShmP2P

OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
       "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
       "all_to_all_single", "broadcast", "reduce", "send", "recv", "batch_isend_irecv",
       "barrier", "gather", "scatter", "all_gather_object", "broadcast_object_list")
NAMES = {"all_gather_single": "all_gather_into_tensor",
         "reduce_scatter_single": "reduce_scatter_tensor"}


@dataclasses.dataclass(frozen=True)
class Call:
    op: str
    group_size: int


class Calls(list):
    def count(self, op: str, *, min_group_size: int = 1) -> int:  # type: ignore[override]
        return sum(1 for c in self if c.op == op and c.group_size >= min_group_size)

    def summary(self, *, min_group_size: int = 1) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self:
            if c.group_size >= min_group_size:
                out[c.op] = out.get(c.op, 0) + 1
        return out


def _group_of(op: str, args, kwargs):
    if "group" in kwargs:
        return kwargs["group"]
    if op == "batch_isend_irecv":
        ops = args[0] if args else kwargs.get("p2p_op_list", [])
        return ops[0].group if ops else None
    return None


@contextlib.contextmanager
def count_collectives():
    calls = Calls()
    originals = {op: getattr(dist, op) for op in OPS if hasattr(dist, op)}

    def wrap(op, fn):
        def inner(*args, **kwargs):
            group = _group_of(op, args, kwargs)
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            calls.append(Call(NAMES.get(op, op), size))
            return fn(*args, **kwargs)
        return inner

    # tpkit.comm.shm's shared-memory all-reduce (TP groups on CPU) bypasses torch.distributed:
    # count it as the all_reduce it is.
    shm_orig = ShmAllReduce.all_reduce_

    def shm_inner(self, x):
        calls.append(Call("all_reduce", self.size))
        return shm_orig(self, x)

    p2p_orig = ShmP2P.start

    def p2p_inner(self, sends, recvs, tag):
        if sends or recvs:
            calls.append(Call("batch_isend_irecv", self.size))
        return p2p_orig(self, sends, recvs, tag)

    for op, fn in originals.items():
        setattr(dist, op, wrap(op, fn))
    ShmAllReduce.all_reduce_ = shm_inner
    ShmP2P.start = p2p_inner
    try:
        yield calls
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)
        ShmAllReduce.all_reduce_ = shm_orig
        ShmP2P.start = p2p_orig
