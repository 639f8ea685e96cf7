"""Surviving what big jobs meet: killed ranks, preemption, hangs and stragglers.

- ``Recovery`` (``manager``): one object for a training loop: auto-resume from the
  newest complete checkpoint, saves every N steps (``async_save``: in the background),
  keep the last K, save-and-exit on SIGTERM/SIGUSR1, the hang watchdog, the straggler
  report. ``launch/train.py --save DIR --auto-resume`` uses it; so can any loop, Fabric's
  included.
- The parts, each usable alone: ``checkpoints`` (``is_complete``, ``latest_checkpoint``,
  ``prune``, ``skipped_checkpoints``), ``signals.SignalStop``, ``hang.HangWatchdog``,
  ``stragglers.StragglerMonitor``.

Exit codes of a rank: 128 + N after saving on signal N (143 for SIGTERM), ``EXIT_HANG``
(124) when the watchdog stopped it. How tpkit-launch reports them: docs/launch.md.
"""
from .checkpoints import (checkpoint_path, is_complete, latest_checkpoint, list_checkpoints,
                          prune, skipped_checkpoints, unfinished_saves)
from .hang import EXIT_HANG, HangError, HangWatchdog, hang_verdict
from .manager import Recovery
from .signals import DEFAULT_SIGNALS, SignalStop, exit_code
from .stragglers import StragglerMonitor, format_report, straggler_report

__all__ = ["Recovery", "checkpoint_path", "is_complete", "latest_checkpoint",
           "list_checkpoints", "prune", "skipped_checkpoints", "unfinished_saves", "EXIT_HANG",
           "HangError", "HangWatchdog", "hang_verdict", "DEFAULT_SIGNALS", "SignalStop", "exit_code",
           "StragglerMonitor", "straggler_report", "format_report"]
