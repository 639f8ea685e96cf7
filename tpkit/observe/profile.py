"""``--profile-steps A:B``: a ``torch.profiler`` trace of steps ``A <= step < B`` per rank
(Chrome trace format, ``rank<R>.pt.trace.json``: chrome://tracing, Perfetto and
TensorBoard's profiler plugin read it) and, on CUDA, a memory snapshot of the same steps
(``rank<R>.memory.pickle``: https://pytorch.org/memory_viz). The range is half-open, as
Megatron-LM's ``--profile-step-start/--profile-step-end``."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["StepProfiler", "parse_profile_steps"]


def parse_profile_steps(value, where: str = "--profile-steps") -> tuple[int, int]:
    """``"A:B"`` (or ``(A, B)``) -> (A, B) with 0 <= A < B; ValueError naming ``where``."""
    try:
        a, b = (value.split(":") if isinstance(value, str) else value)
        a, b = int(a), int(b)
    except (ValueError, TypeError):
        raise ValueError(f"{where}={value!r} is not A:B (two step numbers, e.g. 10:12 traces "
                         "steps 10 and 11)") from None
    if not 0 <= a < b:
        raise ValueError(f"{where}={value!r}: need 0 <= A < B (steps A..B-1 are traced)")
    return a, b


class StepProfiler:
    """Call ``step_done(step)`` at the end of every step: profiling runs from the start of
    step A (the end of step A-1, or construction when A is ``start_step``) to the end of
    step B-1, then this rank's trace (and CUDA memory snapshot) is written to
    ``out_dir``. ``memory``: record the CUDA snapshot (default: when CUDA is available)."""

    def __init__(self, steps, out_dir: str, *, start_step: int = 0, rank: int | None = None,
                 memory: bool | None = None):
        self.start, self.stop = parse_profile_steps(steps)
        self.out_dir = out_dir
        self.rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self.memory = torch.cuda.is_available() if memory is None else memory
        self.trace_path = os.path.join(out_dir, f"rank{self.rank}.pt.trace.json")
        self.memory_path = os.path.join(out_dir, f"rank{self.rank}.memory.pickle") \
            if self.memory else None
        self._prof = None
        self.done = False
        if start_step >= self.stop:
            self.done = True
        elif start_step >= self.start:
            self._begin()

    def _begin(self) -> None:
        import warnings
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        # A schedule marks each step in the trace: ProfilerStep#0 is step A.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Profiler won't be using warmup")
            sched = torch.profiler.schedule(wait=0, warmup=0, active=self.stop - self.start,
                                            repeat=1)
            self._prof = torch.profiler.profile(activities=acts, schedule=sched,
                                                on_trace_ready=self._write,
                                                record_shapes=True, profile_memory=True)
        self._prof.__enter__()

    def _write(self, prof) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        prof.export_chrome_trace(self.trace_path)
        if self.memory:
            torch.cuda.memory._dump_snapshot(self.memory_path)
            torch.cuda.memory._record_memory_history(enabled=None)
        self.done = True

    def step_done(self, step: int) -> None:
        if self.done:
            return
        if self._prof is None and step + 1 == self.start:
            self._begin()
        elif self._prof is not None:
            self._prof.step()
            if step + 1 >= self.stop:
                self.close()

    def close(self) -> None:
        """Stop (writing what was recorded, if the range was cut short); a no-op once
        written or before step A."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        if not self.done:
            self._write(prof)
