"""Straggler report: every ``every`` steps, one all-gather of each rank's mean step time;
rank 0 gets the slowest rank, its ratio to the median and every rank above ``threshold``
times the median.

What to time: in synchronous training ranks wait for each other inside every collective,
so the wall time of a whole step is the same on every rank. Time the part of a step a
rank does on its own, before it waits for the others at the end of the step (in
``launch/train.py``: from the step's start until the loss is reported, so a rank slow in
its data loading, host work or optimizer step stands out); a rank slow *between* two
collectives of the model makes every rank's step slower alike (tokens/s falls).
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather, group_rank
from ..layout.planning import format_ranks
from .signals import flag_device


def straggler_report(times: list[float], threshold: float = 1.2) -> dict:
    """The slowest rank of ``times`` (seconds, by rank), its ratio to the median, and the
    ranks above ``threshold`` x the median."""
    med = statistics.median(times)
    slow = max(range(len(times)), key=lambda r: times[r])
    ratio = times[slow] / med if med > 0 else 1.0
    flagged = [r for r, t in enumerate(times) if med > 0 and t > threshold * med]
    return {"slowest": slow, "time": times[slow], "median": med, "ratio": ratio,
            "flagged": flagged, "threshold": threshold}


def format_report(rep: dict) -> str:
    line = (f"stragglers: slowest rank {rep['slowest']} {rep['time'] * 1e3:.1f} ms/step = "
            f"{rep['ratio']:.2f}x the median {rep['median'] * 1e3:.1f} ms")
    if rep["flagged"]:
        line += f"; SLOW (> {rep['threshold']:g}x): ranks {format_ranks(rep['flagged'])}"
    return line


class StragglerMonitor:
    """``step(seconds)`` after every step; every ``every``-th call is collective over
    ``group`` (default: the world) and returns the report on rank 0 (None elsewhere and
    in between)."""

    def __init__(self, every: int, *, threshold: float = 1.2, group=None):
        if every < 1:
            raise ValueError(f"straggler report every={every} steps must be >= 1")
        if not threshold > 1.0:
            raise ValueError(f"straggler threshold={threshold} must be > 1 (a ratio to the "
                             "median step time)")
        self.every, self.threshold, self.group = every, threshold, group
        self._sum, self._n = 0.0, 0

    def step(self, seconds: float) -> dict | None:
        self._sum, self._n = self._sum + seconds, self._n + 1
        if self._n < self.every:
            return None
        mean = self._sum / self._n
        self._sum, self._n = 0.0, 0
        if not dist.is_initialized():
            return straggler_report([mean], self.threshold)
        t = torch.tensor([mean], dtype=torch.float64, device=flag_device())
        times = all_gather(t, self.group).tolist()
        if group_rank(self.group) != 0:
            return None
        return straggler_report(times, self.threshold)
