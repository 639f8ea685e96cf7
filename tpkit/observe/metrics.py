"""Per-step metrics of a training loop: ``MetricsLogger``.

The loop passes 0-based step indices; rows are written at the number of steps done
(``step + 1``: TensorBoard's step, the CSV's ``step`` column, the progress line's count).

Every ``every`` steps (a *window*), one all-gather over the job's ranks collects each
rank's step-time breakdown and measured memory; rank 0 then writes one row of scalars to
TensorBoard (``tensorboard`` event files) and ``metrics.csv`` under ``log_dir`` through
Lightning Fabric's loggers (W&B too when asked), prints the progress line, and returns
the row. The scalars, named as the CSV's columns and TensorBoard's tags:

``loss``, ``lr``, ``grad_norm`` (and anything else the loop passes), ``val_loss`` (``log``)
    the loop's figures, as given (rank 0's: pass values already reduced over the job);
``tokens_per_s``, ``step_time_s``
    tokens of the window over rank 0's wall time of the window, and that time per step;
``tflops_per_device``, ``mfu``, ``mfu_fp8``
    model TFLOP/s of one device and MFU against the datasheet dense peak (tpkit.observe.flops;
    ``mfu`` against the bf16 peak for bf16 and fp8 runs, ``mfu_fp8`` against the fp8 peak
    for fp8 runs; both absent on CPU);
``time_data_s``, ``time_fwd_bwd_s``, ``time_optimizer_s``, ``time_checkpoint_s``
    seconds per step in each phase (``with logger.phase(name):``), averaged over the
    window on each rank and then over the ranks;
``slowest_rank``, ``slowest_ratio``, ``stragglers``
    the rank whose own time (its phases together) was longest, its ratio to the median,
    and how many ranks exceed ``straggler_threshold`` x the median (recovery's
    ``straggler_report``: in synchronous training a slow rank shows in its own phases,
    the others wait for it inside collectives);
``memory_peak_allocated_gib``, ``memory_peak_reserved_gib`` (CUDA) or ``memory_rss_gib``,
``memory_peak_rss_gib`` (CPU), ``memory_max_rank``
    measured memory of the rank that used most (peaks since the last window on CUDA, the
    process's resident set and its high-water mark on CPU).

Phases on CUDA end with ``torch.cuda.synchronize()`` (``synchronize=False`` skips it)
so that each phase owns its kernels' time.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather
from ..recovery.signals import flag_device
from ..recovery.stragglers import straggler_report
from .flops import mfu, peak_tflops as _peak_tflops, tflops_per_device
from .profile import StepProfiler, parse_profile_steps
from .progress import ProgressLine

__all__ = ["MetricsLogger", "PHASES", "measured_memory", "moe_scalars"]

PHASES = ("data", "fwd_bwd", "optimizer", "checkpoint")
_GIB = 2.0 ** 30


def measured_memory(device: torch.device) -> dict[str, float]:
    """This process's measured memory in GiB: on CUDA the peak allocated and reserved
    since the last call (the peaks are reset), on CPU the resident set now and its
    high-water mark."""
    if device.type == "cuda":
        out = {"memory_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / _GIB,
               "memory_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / _GIB}
        torch.cuda.reset_peak_memory_stats(device)
        return out
    import resource
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux
    return {"memory_rss_gib": rss / _GIB, "memory_peak_rss_gib": max(peak, rss) / _GIB}


def moe_scalars(model: torch.nn.Module, state=None) -> dict[str, float]:
    """The router figures of the model's last forward: ``moe_aux_loss`` (summed over the
    MoE layers) and the tokens per expert summed over the layers (``moe_load_min``,
    ``moe_load_max``, ``moe_load_imbalance`` = max / mean), this rank's data-parallel
    replica's view. Collective over ``pp_group`` when pipelined (every stage calls it);
    {} for a model without MoE layers."""
    from ..nn import MoE
    from ..layout.topology import resolve_state
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.last_routing is not None]
    s = resolve_state(state)
    experts = max((m.num_experts for m in layers), default=0)
    if s.pp_size > 1:   # stages without MoE layers take part with the others' width
        experts = int(all_gather(torch.tensor([experts], device=s.device), s.pp_group).max())
    if not experts:
        return {}
    stats = torch.zeros(1 + max(experts, 1), dtype=torch.float64)
    for m in layers:
        stats[0] += float(m.aux_loss.detach())
        stats[1:1 + m.num_experts] += m.last_routing.tokens_per_expert.detach().cpu().double()
    if s.pp_size > 1:
        from ..comm.collectives import all_reduce_sum
        stats = all_reduce_sum(stats.to(s.device), s.pp_group).cpu()
    load = stats[1:]
    if not float(load.sum()):
        return {}
    return {"moe_aux_loss": float(stats[0]), "moe_load_min": float(load.min()),
            "moe_load_max": float(load.max()),
            "moe_load_imbalance": float(load.max() / load.mean())}


def _rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class MetricsLogger:
    """Logs a training loop's steps (the module docstring lists the scalars).

    ``log_dir``: where TensorBoard's event files and ``metrics.csv`` go (created on rank
    0; None: no files, the progress line and the returned rows only). ``tokens_per_step``: the global batch's tokens (``step(tokens=)`` overrides it per
    step). ``flops_per_token``: model FLOPs per token (``model_flops_per_token``; None: no
    TFLOP/s). ``total_steps``: for the progress line's ETA. ``every``: steps per window
    (each window's end is collective: every rank calls ``step``). ``precision``: the
    compute dtype, "bf16", "fp16", "fp8" or "fp32" (Lightning's "bf16-mixed" too): which
    peak MFU divides by. ``peak_tflops`` / ``peak_tflops_fp8``: override the table's
    dense peak. ``wandb``: True or a dict of ``lightning.pytorch.loggers.WandbLogger``
    arguments (``{"offline": True}`` needs no network) also logs to W&B (needs ``pip
    install wandb``). ``profile_steps``: "A:B" or (A, B), the steps ``A <= step < B`` to
    trace with torch.profiler (``StepProfiler``, under ``log_dir/profile``). ``progress``:
    print the progress line on rank 0 (to ``stream``). After a window, rank 0's
    ``ranks`` holds each rank's phase times (the rows hold their mean). ``group``: the ranks to gather
    over (default: the world). Construction is collective over ``group`` (a barrier)."""

    def __init__(self, log_dir: str | None, *, tokens_per_step: int, flops_per_token: float | None = None,
                 total_steps: int | None = None, every: int = 10, device=None,
                 precision: str = "bf16", peak_tflops: float | None = None,
                 peak_tflops_fp8: float | None = None, wandb=None, profile_steps=None,
                 start_step: int = 0, progress: bool = True, stream=None,
                 synchronize: bool | None = None, straggler_threshold: float = 1.2,
                 group=None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"MetricsLogger(every={every!r}): the logging interval must be a "
                             "positive number of steps")
        if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, int) \
                or tokens_per_step < 1:
            raise ValueError(f"MetricsLogger(tokens_per_step={tokens_per_step!r}) must be the "
                             "global batch's token count, a positive integer")
        if not straggler_threshold > 1.0:
            raise ValueError(f"MetricsLogger(straggler_threshold={straggler_threshold}) must "
                             "be > 1 (a ratio to the median)")
        if profile_steps is not None:
            profile_steps = parse_profile_steps(profile_steps)
        if log_dir is None and (profile_steps is not None or wandb):
            raise ValueError(f"MetricsLogger(log_dir=None, profile_steps={profile_steps!r}, "
                             f"wandb={wandb!r}): a profile and W&B write files; pass log_dir")
        for name, v in (("peak_tflops", peak_tflops), ("peak_tflops_fp8", peak_tflops_fp8)):
            if v is not None and not v > 0:
                raise ValueError(f"MetricsLogger({name}={v!r}) must be a positive TFLOP/s")
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))
        from .flops import _dtype_name
        self.precision = _dtype_name(precision)
        low = "bf16" if self.precision == "fp8" else self.precision
        self.peak = peak_tflops if peak_tflops is not None else _peak_tflops(self.device, low)
        self.peak_fp8 = None
        if self.precision == "fp8":
            self.peak_fp8 = peak_tflops_fp8 if peak_tflops_fp8 is not None else \
                _peak_tflops(self.device, "fp8")
        if self.device.type == "cuda" and not self.peak and _rank_zero():
            import warnings
            warnings.warn(f"MFU is not logged: no dense {low} peak is known for "
                          f"{torch.cuda.get_device_name(self.device)!r}; pass "
                          "MetricsLogger(peak_tflops=...) from its datasheet", stacklevel=2)
        self.log_dir, self.every = None if log_dir is None else str(log_dir), every
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.total_steps, self.group, self.threshold = total_steps, group, straggler_threshold
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank0 = _rank_zero()
        self.synchronize = self.device.type == "cuda" if synchronize is None else synchronize
        self._loggers = self._make_loggers(wandb) if self.rank0 and log_dir is not None \
            else []
        self.progress = ProgressLine(total_steps, stream=stream) if progress and self.rank0 \
            else None
        self.profiler = StepProfiler(profile_steps, os.path.join(self.log_dir, "profile"),
                                     start_step=start_step) if profile_steps else None
        self._phase = dict.fromkeys(PHASES, 0.0)
        self._steps, self._tokens = 0, 0
        if dist.is_initialized() and self.world > 1:
            # Rank 0 spent its time building the loggers: start every rank's first window
            # together, or the others' first phase would hold their wait for rank 0.
            dist.barrier(group)
        self._t_window = time.perf_counter()
        self.last: dict | None = None   # rank 0: the last row written
        self.ranks: list[dict] = []     # rank 0: the last window's phase times, by rank

    # --- loggers ------------------------------------------------------------------------
    def _make_loggers(self, wandb) -> list:
        try:
            from lightning.fabric.loggers import CSVLogger, TensorBoardLogger
            import tensorboard  # noqa: F401 (Fabric's TensorBoardLogger needs it or tensorboardX)
        except ImportError as e:
            raise ValueError(f"MetricsLogger writes TensorBoard files and needs the tensorboard "
                             f"package ({e}); pip install 'tpkit[observe]'") from e
        os.makedirs(self.log_dir, exist_ok=True)
        csv = os.path.join(self.log_dir, "metrics.csv")
        if os.path.exists(csv):   # a restarted run: Lightning's CSVLogger would delete it
            n = 1
            while os.path.exists(os.path.join(self.log_dir, f"metrics-{n}.csv")):
                n += 1
            os.replace(csv, os.path.join(self.log_dir, f"metrics-{n}.csv"))
        out = [CSVLogger(self.log_dir, name="", version="", flush_logs_every_n_steps=1),
               TensorBoardLogger(self.log_dir, name="", version="", default_hp_metric=False)]
        import warnings
        with warnings.catch_warnings():   # its "will be deleted" concerns metrics.csv, moved
            warnings.filterwarnings("ignore", "Experiment logs directory")
            out[0].experiment
        if wandb:
            try:
                from lightning.pytorch.loggers import WandbLogger
                import wandb as _wandb  # noqa: F401
            except ImportError as e:
                raise ValueError(f"MetricsLogger(wandb={wandb!r}) needs the wandb package "
                                 f"({e}); pip install wandb, or leave wandb off") from e
            kw = dict(wandb) if isinstance(wandb, dict) else {}
            kw.setdefault("save_dir", self.log_dir)
            out.append(WandbLogger(**kw))
        return out

    # --- the loop's calls ---------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block as phase ``name`` of this step (one of PHASES)."""
        if name not in self._phase:
            raise ValueError(f"phase {name!r} is not one of {PHASES}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.synchronize:
                torch.cuda.synchronize(self.device)
            self._phase[name] += time.perf_counter() - t0

    def step(self, step: int, *, tokens: int | None = None, **scalars) -> dict | None:
        """End of step ``step`` with the loop's scalars (floats or 0-d tensors; None is
        left out). At the end of a window (``(step + 1) % every == 0``, or the last step)
        this is collective over ``group``; rank 0 writes and returns the row, other ranks
        and other steps return None."""
        self._steps += 1
        self._tokens += self.tokens_per_step if tokens is None else tokens
        if self.profiler is not None:
            self.profiler.step_done(step)
        last = self.total_steps is not None and step + 1 >= self.total_steps
        if (step + 1) % self.every and not last:
            return None
        return self._window(step, scalars)

    def log(self, step: int, **scalars) -> dict | None:
        """Write ``scalars`` (validation loss, ...) for ``step`` now; rank 0 only, not
        collective. Returns the row on rank 0."""
        if not self.rank0:
            return None
        row = {k: _num(v) for k, v in scalars.items() if v is not None}
        self._write(row, step + 1)
        if self.progress is not None:
            self.progress.note(step, row)
        return row

    def close(self) -> None:
        """Flush and close the loggers (and a profile still running)."""
        if self.profiler is not None:
            self.profiler.close()
        for lg in self._loggers:
            lg.finalize("success")
        self._loggers = []
        if self.progress is not None:
            self.progress.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- the window -----------------------------------------------------------------------
    def _window(self, step: int, scalars: dict) -> dict | None:
        wall = time.perf_counter() - self._t_window
        n = self._steps
        mem = measured_memory(self.device)
        mine = [self._phase[p] / n for p in PHASES]
        mine += [sum(mine)] + list(mem.values())
        table = torch.tensor(mine, dtype=torch.float64, device=flag_device())
        if dist.is_initialized() and self.world > 1:
            table = all_gather(table[None], self.group)
        table = table.reshape(-1, len(mine)).cpu()
        tokens = self._tokens
        self._phase = dict.fromkeys(PHASES, 0.0)
        self._steps = self._tokens = 0
        self._t_window = time.perf_counter()
        if not self.rank0:
            return None
        row = {k: _num(v) for k, v in scalars.items() if v is not None}
        row["tokens_per_s"] = tokens / wall
        row["step_time_s"] = wall / n
        if self.flops_per_token is not None:
            t = tflops_per_device(row["tokens_per_s"], self.flops_per_token, self.world)
            row["tflops_per_device"] = t
            if self.peak:
                row["mfu"] = mfu(t, self.peak)
            if self.peak_fp8:
                row["mfu_fp8"] = mfu(t, self.peak_fp8)
        for i, p in enumerate(PHASES):
            row[f"time_{p}_s"] = float(table[:, i].mean())
        self.ranks = [{f"time_{p}_s": float(t[i]) for i, p in enumerate(PHASES)}
                      for t in table]
        rep = straggler_report(table[:, len(PHASES)].tolist(), self.threshold)
        row.update(slowest_rank=rep["slowest"], slowest_ratio=rep["ratio"],
                   stragglers=len(rep["flagged"]))
        mem_cols = table[:, len(PHASES) + 1:]
        top = int(mem_cols[:, 0].argmax())
        row.update({k: float(mem_cols[top, j]) for j, k in enumerate(mem)})
        row["memory_max_rank"] = top
        self._write(row, step + 1)
        if self.progress is not None:
            self.progress.update(step, row)
        self.last = row
        return row

    def _write(self, row: dict, step: int) -> None:
        for lg in self._loggers:
            lg.log_metrics(row, step=step)
        for lg in self._loggers:
            lg.save()


def _num(v) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().item())
    return float(v)
