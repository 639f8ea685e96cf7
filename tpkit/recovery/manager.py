"""``Recovery``: auto-resume, periodic and on-signal saves, keep-last-K, the hang
watchdog and the straggler report, tied to one training loop.

    with Recovery("ckpt", save_every=100, keep=3, hang_timeout=600) as rec:
        start = rec.resume(state)                  # newest complete checkpoint, or 0
        for step in range(start, steps):
            ...                                    # one training step
            if rec.step_end(step, state, last=step == steps - 1):
                break                              # a signal: saved; exit with rec.exit_code
    sys.exit(rec.exit_code)                        # 0, or 128 + the signal

``state`` is what ``tpkit.checkpoint.save`` takes (modules, optimizers, objects with
``state_dict()``, plain values; Lightning Fabric's wrapped module and optimizer too);
checkpoints are ``save_dir/stepNNNNNN`` (steps done) and hold ``state`` plus ``"step"``
(the index of the last step done), the format of ``launch/train.py --save``.
"""
from __future__ import annotations

import os
import time

import torch.distributed as dist

from .. import checkpoint
from ..checkpoint._dcp_fs import is_url, name
from ..checkpoint._dcp_verify import check_mode
from . import checkpoints as dirs
from .hang import HangWatchdog
from .signals import DEFAULT_SIGNALS, SignalStop, exit_code
from .stragglers import StragglerMonitor, format_report


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _broadcast(obj):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _say(msg: str) -> None:
    if _rank() == 0:
        print(f"recovery: {msg}", flush=True)


def _unwrap(state: dict) -> dict:
    """Fabric's wrappers (what ``fabric.setup`` returns) -> what ``fabric.save`` saves."""
    if not any(type(v).__module__.startswith("lightning") for v in state.values()):
        return dict(state)
    from lightning.fabric.wrappers import _unwrap_objects
    return _unwrap_objects(dict(state))


class Recovery:
    """See the module docstring. Every argument is checked here, before any collective:
    ``save_every`` (0: only ``last``), ``keep`` (None: keep all), ``hang_timeout``
    (seconds, None: no watchdog), ``async_save``, ``signals`` (() : none handled),
    ``straggler_every`` (steps, None: no report; ``step_end`` then needs ``seconds``),
    ``mode`` (the checkpoint files' mode, e.g. 0o600; None: the umask's)."""

    def __init__(self, save_dir: str | os.PathLike | None, *, save_every: int = 0,
                 keep: int | None = None, hang_timeout: float | None = None,
                 async_save: bool = False, signals=DEFAULT_SIGNALS,
                 straggler_every: int | None = None, straggler_threshold: float = 1.2,
                 mode: int | None = None):
        if save_every < 0:
            raise ValueError(f"save_every={save_every} must be >= 0 (0: save at the end only)")
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep} must be >= 1 (or None to keep every checkpoint)")
        if save_dir is None and (save_every or keep or async_save or signals):
            raise ValueError("saving, keep, async_save and save-on-signal need a save "
                             "directory; pass save_dir (or signals=() with nothing to save)")
        self.mode = check_mode(mode)
        self.save_dir = None if save_dir is None else save_dir if is_url(save_dir) \
            else os.path.abspath(os.fspath(save_dir))
        self.save_every, self.keep, self.async_save = save_every, keep, async_save
        self.watchdog = HangWatchdog(hang_timeout) if hang_timeout is not None else None
        self.stragglers = StragglerMonitor(straggler_every, threshold=straggler_threshold) \
            if straggler_every else None
        self.signals = SignalStop(signals).install() if signals else None
        self.resumed_from: str | None = None
        self.stopped_by = None
        self._pending: checkpoint.PendingSave | None = None
        self._saved_step: int | None = None
        self._buffers: dict = {}           # async_save's CPU copies, reused save to save
        self._group = dist.new_group(backend="gloo") \
            if async_save and dist.is_initialized() else None
        if self.watchdog is not None:
            self.watchdog.start()

    @property
    def exit_code(self) -> int:
        """0, or 128 + the signal the run stopped on (after saving)."""
        return exit_code(self.stopped_by) if self.stopped_by else 0

    # --- resume ---------------------------------------------------------------------
    def resume(self, state: dict, *, strict: bool = True) -> int:
        """Load the newest complete checkpoint of ``save_dir`` (written at any layout) into
        ``state``, passing over (and naming) newer ones that are incomplete or damaged;
        returns the index of the next step (0, and says so, when there is none).
        ``strict``: as ``tpkit.checkpoint.load``'s. Collective."""
        found, skipped = _broadcast((dirs.latest_checkpoint(self.save_dir),
                                     dirs.skipped_checkpoints(self.save_dir))
                                    if _rank() == 0 else None)
        for path, why in skipped:
            _say(f"skipping {name(path)}: {why}")
        if found is None:
            _say(f"no complete checkpoint in {self.save_dir}: starting fresh")
            return 0
        loaded = checkpoint.load(found, {**_unwrap(state), "step": None}, strict=strict)
        self.resumed_from = found
        _say(f"resuming from {found} ({int(loaded['step']) + 1} steps done)")
        self._beat(loaded["step"])
        return int(loaded["step"]) + 1

    # --- every step -----------------------------------------------------------------
    def step_end(self, step: int, state: dict, *, last: bool = False,
                 seconds: float | None = None) -> bool:
        """Call after step ``step`` on every rank (collective). Beats the watchdog, reports
        stragglers, commits a finished async save, saves when due, and on a signal any
        rank got saves now and returns True: stop, then exit with ``exit_code``."""
        self._beat(step)
        if self.stragglers is not None:
            if seconds is None:
                raise ValueError("straggler_every is set: pass seconds= (this rank's own "
                                 "time of the step) to step_end")
            report = self.stragglers.step(seconds)
            if report is not None:
                _say(format_report(report))
        if self._pending is not None and self._pending.done():
            self._committed(self._pending.path)
            self._pending = None
        sig = self.signals.agree() if self.signals is not None else None
        due = self.save_dir is not None and (
            last or (self.save_every and (step + 1) % self.save_every == 0))
        if sig is not None:
            self.stopped_by = sig
            if self._saved_step != step:
                self.save(step, state, wait=True)
            self._wait_pending()
            _say(f"{sig.name}: saved after step {step}; exiting with {self.exit_code}")
            return True
        if due:
            self.save(step, state, wait=last)
        return False

    def save(self, step: int, state: dict, *, wait: bool = False) -> None:
        """Save ``state`` after step ``step`` (asynchronously with ``async_save`` unless
        ``wait``); waits for the previous save first. Collective."""
        path = dirs.checkpoint_path(self.save_dir, step + 1)
        sd = {**_unwrap(state), "step": step}
        self._wait_pending()
        self._beat(step)
        if self.async_save and not wait:
            self._pending = checkpoint.async_save(path, sd, process_group=self._group,
                                                  buffers=self._buffers, mode=self.mode)
        else:
            checkpoint.save(path, sd, mode=self.mode)
            self._committed(path)
        self._saved_step = step
        self._beat(step)

    def close(self) -> None:
        """Wait for a save in flight, stop the watchdog, restore the signal handlers."""
        self._wait_pending()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.signals is not None:
            self.signals.uninstall()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    def __enter__(self) -> "Recovery":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------
    def _beat(self, step) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(step)

    def _wait_pending(self) -> None:
        if self._pending is not None:
            t0 = time.perf_counter()
            self._pending.wait()
            self._committed(self._pending.path, waited=time.perf_counter() - t0)
            self._pending = None

    def _committed(self, path: str, waited: float | None = None) -> None:
        if _rank() != 0:
            return
        gone = dirs.prune(self.save_dir, self.keep, protect=[self.resumed_from or ""]) \
            if self.keep else []
        extra = f"; removed {', '.join(name(p) for p in gone)}" if gone else ""
        note = f" (waited {waited:.2f} s for the background write)" if waited else ""
        _say(f"saved {path}{note}{extra}")
