"""Estimates as text (``format_estimate``, ``format_roles``, ``format_layout``) and the measured
peak next to the estimate (``measured_peak_bytes``, ``format_measured``)."""
from __future__ import annotations

from typing import Iterable

from ..layout.config import ParallelConfig
from .job import GiB, MemoryEstimate, MemoryJob


# --- text ------------------------------------------------------------------------------
def _g(n: float) -> str:
    """A term's size: GiB, or MiB below 0.1 GiB."""
    return f"{n / GiB:.2f} GiB" if n >= 0.1 * GiB else f"{n / 2 ** 20:.2f} MiB"


def format_estimate(est: MemoryEstimate, device_bytes: float | None = None) -> list[str]:
    """The lines of one role: every term (GiB, MiB below 0.1 GiB), then ``estimated
    peak: X.XX GiB per rank`` (a stable line scripts can read)."""
    lines = [f"  {est.role}" + (f" (ranks {est.ranks})" if est.ranks else "") + ":"]
    for k, v in est.terms.items():
        if k == "pipeline in-flight micro-batches":
            lines.append(f"    {k:<44} {str(v):>13}")
        else:
            lines.append(f"    {k:<44} {_g(v):>13}")
    for n in est.notes:
        lines.append(f"    ({n})")
    lines.append(f"    peak during: {est.phase}")
    lines.append(f"  estimated peak: {est.peak / GiB:.2f} GiB per rank")
    return lines


def format_roles(estimates: Iterable[MemoryEstimate], device_bytes: float | None = None
                 ) -> list[str]:
    lines = []
    for est in estimates:
        lines += format_estimate(est, device_bytes)
    return lines


def format_layout(c: ParallelConfig, j: MemoryJob) -> str:
    s = f"--tp {c.tp} --cp {c.cp} --pp {c.pp} --dp {c.dp}"
    if c.sequence_parallel:
        s += " --sequence-parallel"
    if c.ep > 1:
        s += f" --ep {c.ep}"
    if j.recompute:
        s += " (recompute)"
    if j.data_parallel == "fsdp":
        s += " (fsdp)"
    return s


# --- measured -------------------------------------------------------------------------
def measured_peak_bytes(device=None) -> int | None:
    """The allocator's peak on a CUDA ``device`` since the last reset
    (``torch.cuda.max_memory_allocated``); None on CPU (no allocator statistics)."""
    import torch
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def format_measured(estimate: MemoryEstimate, measured: int | None, *,
                    step: int | None = None) -> str:
    """One line for a training loop's first step: the estimate next to the measured peak
    (GiB, MiB below 0.1 GiB); ``step``: the steps done, named as ``memory after step N:``."""
    head = "memory:" if step is None else f"memory after step {step}:"
    # after the first step: its peak (the optimizer states appear in its optimizer step)
    peak = estimate.first_step if step == 1 and estimate.first_step else estimate.peak
    if measured is None:
        return (f"{head} estimated peak {_g(peak)} per rank "
                "(no allocator statistics on this device)")
    ratio = measured / peak if peak else float("nan")
    return (f"{head} estimated peak {_g(peak)} per rank, measured "
            f"{_g(measured)} ({ratio:.0%} of the estimate)")
