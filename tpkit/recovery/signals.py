"""Stop on SIGTERM / SIGUSR1 at a step boundary that every rank agrees on.

Slurm sends SIGTERM on preemption and (``--signal``) USR1 before the time limit; torchrun
and tpkit-launch pass SIGTERM (and, under tpkit-launch, USR1) on to every worker, but the
ranks get them at slightly different moments, possibly in different steps. The handler
only notes the signal; ``agree()`` (one all-reduce of one number, at the end of a step)
tells every rank whether any rank got one, so all of them stop after the same step, save
one checkpoint together and exit with ``exit_code(sig)`` = 128 + the signal number (the
code the signal itself would have given; 143 for SIGTERM, 138 for SIGUSR1).

A second signal (Slurm signals every process of the step *and* tpkit-launch forwards
its own; an impatient Ctrl-C) is reported and ignored: the save in progress finishes,
and were the process killed anyway, the atomic rename keeps the previous checkpoint.
"""
from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from ..comm.collectives import all_reduce_max

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def exit_code(sig: int) -> int:
    """The exit code of a rank that saved and stopped on signal ``sig``: 128 + ``sig``."""
    return 128 + int(sig)


def _write(msg: str) -> None:
    os.write(2, msg.encode())  # not print(): a handler may interrupt a print (reentrancy)


def flag_device() -> torch.device:
    """Where a small tensor for a default-group collective must live."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class SignalStop:
    """Note ``signals`` instead of dying; ``agree()`` turns them into a common stop."""

    def __init__(self, signals=DEFAULT_SIGNALS):
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: signal.Signals | None = None
        self.agreed: signal.Signals | None = None
        self._previous: dict = {}

    def install(self) -> "SignalStop":
        """Install the handlers (main thread only); ``uninstall`` restores the old ones."""
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, old in self._previous.items():
            signal.signal(s, old)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = signal.Signals(signum)
            _write(f"rank {rank}: {name}: finishing this step, then saving a checkpoint "
                   f"and exiting with {exit_code(signum)}\n")
        else:
            _write(f"rank {rank}: {name} again: ignored (one save, then the exit; the "
                   "previous checkpoint stays intact either way)\n")

    def agree(self, group=None) -> signal.Signals | None:
        """Collective over ``group`` (default: the world): the signal any rank received
        (the highest number if several), or None. Every rank gets the same answer."""
        if self.agreed is not None:
            return self.agreed
        got = int(self.received or 0)
        if dist.is_initialized():
            t = torch.tensor([got], dtype=torch.int32, device=flag_device())
            got = int(all_reduce_max(t, group).item())
        if got:
            self.agreed = signal.Signals(got)
        return self.agreed
