"""The per-rank hang watchdog: no progress for ``timeout`` seconds -> stacks, a verdict
naming the stuck rank(s), and an exit the launcher can restart from.

Every rank runs one watchdog thread, fed by ``beat()`` once per step. When a rank has not
beaten for ``timeout`` seconds (in a hang all of them stop within a step of each other):
1. it dumps its Python stacks (``faulthandler``, every thread) and, where the process
   group keeps one, the flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE`` on nccl, which
   tpkit-launch sets; ``TORCH_FR_BUFFER_SIZE`` on gloo) beside its torchrun error file,
   i.e. in the launcher's log directory;
2. it reports where its main thread is to the rendezvous store (a TCP store that works
   while collectives hang). A rank whose innermost frame is inside torch.distributed (or
   tpkit's shared-memory transport) is *waiting* for peers; one elsewhere is *stuck*
   (sleeping, looping, blocked on I/O); one that never reports is dead or holds the GIL;
3. rank 0 writes the verdict (:func:`hang_verdict`) back to the store; every rank records
   it as its error (``HangError`` in torchrun's error file, which tpkit-launch prints as
   its last line) and exits with ``EXIT_HANG`` (124), so ``--max-restarts`` restarts the
   job (and ``--auto-resume`` continues it).
A ``faulthandler`` timer ``timeout + exchange_timeout + 20`` seconds after the last beat
is the backstop for a rank whose Python thread cannot run (dumps, exits 1).
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
import traceback
import types

import torch
import torch.distributed as dist

from ..layout.planning import format_ranks

EXIT_HANG = 124
REPORTED_ENV = "TPKIT_HANG_REPORTED"   # set once the watchdog fired: tpkit-launch's worker
_KEY = "tpkit_hang/"                   # wrapper then leaves the error report to it
_TORCH_DIST = os.path.join(os.path.dirname(torch.__file__), "distributed") + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
_SHM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shm.py")


class HangError(RuntimeError):
    """What a rank records when its watchdog fired; the message is the verdict."""


def _rel(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def describe_stack(stack: list[traceback.FrameSummary]) -> dict:
    """Where a main thread is: its innermost frame, whether that is a wait for peers, and
    the innermost frame outside torch (the user's line that issued the collective)."""
    if not stack:
        return {"frame": "no Python frame", "waiting": False, "caller": None}
    where = [f"{_rel(fs.filename)}:{fs.lineno} in {fs.name}" for fs in stack]
    inner = stack[-1].filename
    caller = next((w for fs, w in zip(reversed(stack), reversed(where))
                   if not fs.filename.startswith(_TORCH)), None)
    return {"frame": where[-1], "waiting": inner.startswith(_TORCH_DIST) or inner == _SHM,
            "caller": caller}


def _by_place(reports: dict[int, dict], key: str) -> str:
    groups: dict[str, list[int]] = {}
    for r, info in sorted(reports.items()):
        groups.setdefault(info.get(key) or info["frame"], []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1]))  # minority first
    return ", ".join(f"rank{'s' * (len(rs) > 1)} {format_ranks(rs)} at {place}"
                     for place, rs in ordered)


def hang_verdict(reports: dict[int, dict], world: int, timeout: float) -> str:
    """One line from every rank's report (``describe_stack`` plus ``step`` and ``dump``):
    the stuck ranks and where, the ranks that did not report, the ranks waiting for them."""
    missing = [r for r in range(world) if r not in reports]
    busy = {r: i for r, i in reports.items() if not i["waiting"]}
    waiting = {r: i for r, i in reports.items() if i["waiting"]}
    steps = [i["step"] for i in reports.values() if i.get("step") is not None]
    parts = [f"no progress for {timeout:g} s"
             + (f" after step {min(steps)}" if steps else "")]
    if busy:
        parts.append("stuck: " + _by_place(busy, "frame"))
    if missing:
        parts.append(f"rank{'s' * (len(missing) > 1)} {format_ranks(missing)} did not "
                     "report (dead, or holding the GIL)")
    if waiting:
        label = ("waiting for them in collectives" if busy or missing else
                 "every rank waits in a collective (mismatched collectives or a network "
                 "fault: compare the flight recorder dumps)")
        parts.append(f"{label}: " + _by_place(waiting, "caller"))
    first = min(busy or waiting or reports, default=None)
    if first is not None and reports[first].get("dump"):
        parts.append(f"stacks: {reports[first]['dump']} (each rank's beside its log)")
    return "; ".join(parts)


def _traceback_of(frame) -> types.TracebackType | None:
    tb = None
    while frame is not None:
        tb = types.TracebackType(tb, frame, frame.f_lasti, frame.f_lineno)
        frame = frame.f_back
    return tb


def _flight_recorder() -> bytes | None:
    """The process group's flight recorder, if one is recording."""
    c10d = torch._C._distributed_c10d
    nccl = dist.is_initialized() and "nccl" in str(dist.get_backend())
    on = os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE" if nccl else "TORCH_FR_BUFFER_SIZE")
    fn = getattr(c10d, "_dump_nccl_trace" if nccl else "_dump_fr_trace", None)
    if fn is None or not on or on == "0":
        return None
    return fn()


class HangWatchdog:
    """See the module docstring. ``start()`` from the training thread; ``beat(step)``
    after every step (and around anything long, like a save); ``stop()`` at the end."""

    def __init__(self, timeout: float, *, dump_dir: str | None = None,
                 exchange_timeout: float = 10.0):
        if not timeout > 0:
            raise ValueError(f"hang timeout {timeout!r} must be > 0 seconds (longer than "
                             "the slowest step or save); leave it unset to disable")
        self.timeout, self.exchange_timeout = float(timeout), float(exchange_timeout)
        err = os.environ.get("TORCHELASTIC_ERROR_FILE")
        self.dump_dir = dump_dir or (os.path.dirname(err) if err else None)
        self._last, self._step = time.monotonic(), None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ident = None

    def start(self) -> "HangWatchdog":
        self._ident = threading.get_ident()
        self._thread = threading.Thread(target=self._run, name="tpkit-hang-watchdog",
                                        daemon=True)
        self.beat(None)
        self._thread.start()
        return self

    def beat(self, step: int | None = None) -> None:
        self._last, self._step = time.monotonic(), step
        if self._thread is not None:
            faulthandler.dump_traceback_later(self.timeout + self.exchange_timeout + 20,
                                              exit=True)

    def stop(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def _run(self) -> None:
        poll = min(1.0, self.timeout / 10)
        while not self._stop.wait(poll):
            if time.monotonic() - self._last > self.timeout:
                self._fire()

    # --- firing ---------------------------------------------------------------------
    def _fire(self) -> None:
        os.environ[REPORTED_ENV] = "1"
        faulthandler.cancel_dump_traceback_later()
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        frame = sys._current_frames().get(self._ident)
        info = describe_stack(traceback.extract_stack(frame) if frame is not None else [])
        info.update(step=self._step, dump=self._dump(rank, frame))
        recorded = []

        def record(verdict: str) -> None:
            """stderr and torchrun's error file, with the main thread's stack as the
            traceback. Rank 0 records before it publishes its verdict: the others exit as
            soon as they read it, and the agent then stops rank 0."""
            os.write(2, (f"hang watchdog: {verdict}\n" if rank == 0 else
                         f"rank {rank}: hang watchdog fired; stacks: {info['dump']}\n").encode())
            try:
                from torch.distributed.elastic.multiprocessing.errors import get_error_handler
                raise HangError(verdict).with_traceback(_traceback_of(frame))
            except HangError as e:
                get_error_handler().record_exception(e)
            except Exception:  # noqa: BLE001 - the exit below matters more than the record
                pass
            recorded.append(verdict)

        verdict = self._exchange(rank, world, info, record)
        if verdict is None:
            verdict = (f"rank {rank}: {hang_verdict({rank: info}, 1, self.timeout)} (rank 0's "
                       "verdict did not reach it)")
        if not recorded:
            record(verdict)
        os._exit(EXIT_HANG)

    def _dump(self, rank: int, frame) -> str | None:
        if self.dump_dir is None:
            faulthandler.dump_traceback(all_threads=True)  # stderr
            return None
        os.makedirs(self.dump_dir, exist_ok=True)
        path = os.path.join(self.dump_dir, f"hang-rank{rank}.txt")
        with open(path, "w") as f:
            f.write(f"rank {rank}: no progress for {self.timeout:g} s after step "
                    f"{self._step}\n\nmain thread:\n")
            f.write("".join(traceback.format_stack(frame)) if frame is not None else "-\n")
            f.write("\nevery thread (faulthandler):\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        try:
            trace = _flight_recorder()
        except Exception as e:  # noqa: BLE001 - a failed dump must not stop the report
            trace = None
            os.write(2, f"rank {rank}: flight recorder dump failed: {e}\n".encode())
        if trace is not None:
            with open(os.path.join(self.dump_dir, f"flight-recorder-rank{rank}.pkl"), "wb") as f:
                f.write(trace)
        return _rel(path)

    def _exchange(self, rank: int, world: int, info: dict, record=None) -> str | None:
        """Reports to the store, rank 0's verdict back (None if it never comes). Rank 0
        calls ``record(verdict)`` before it publishes the verdict."""
        try:
            store = dist.distributed_c10d._get_default_store() if world > 1 else None
        except Exception:  # noqa: BLE001 - no default group: a verdict from this rank only
            store = None
        if store is None:
            return hang_verdict({rank: info}, world, self.timeout) if world == 1 else None
        store.set(f"{_KEY}report/{rank}", json.dumps(info))
        store.add(f"{_KEY}reports", 1)
        deadline = time.monotonic() + self.exchange_timeout
        if rank != 0:
            while time.monotonic() < deadline + 5:
                if store.check([f"{_KEY}verdict"]):
                    store.add(f"{_KEY}read", 1)
                    return store.get(f"{_KEY}verdict").decode()
                time.sleep(0.1)
            return None
        while store.add(f"{_KEY}reports", 0) < world and time.monotonic() < deadline:
            time.sleep(0.1)
        reports = {r: json.loads(store.get(f"{_KEY}report/{r}")) for r in range(world)
                   if store.check([f"{_KEY}report/{r}"])}
        verdict = hang_verdict(reports, world, self.timeout)
        if record is not None:
            record(verdict)
        store.set(f"{_KEY}verdict", verdict)
        until = time.monotonic() + 5  # the store may live in this process: let them read
        while store.add(f"{_KEY}read", 0) < len(reports) - 1 and time.monotonic() < until:
            time.sleep(0.1)
        return verdict
