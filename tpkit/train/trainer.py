"""Trainer: one job (a checked JobConfig) built in one straight line, and its loop.

``Trainer(job).__init__`` resolves the layout once (the parallelism section over
tpkit-launch's TPKIT_* variables, checked against the world) and hands it to the Fabric
strategy; then builds the precision plugin, the model (the reference GPT drawn at full
size from the seed and sharded, or a Hugging Face model), the optimizer, the learning-rate
schedule, the data and the recovery manager. ``fit()`` runs the loop and returns the
global mean loss of every step. Only tpkit's public API is used: this file is also the
worked example of a user's own training script. The pieces it puts together are built in
``build`` (shared with the memory plan and the pre-flight); ``prelaunch`` holds tpkit-launch's
hook (``preflight``); this module keeps the loop and the entry points (``main``, ``cli``).

The global batch of step k is the same at every layout (every rank computes it and keeps
its share), so runs at different layouts follow the same loss curve (tests/train).
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from .config import JobConfig, parse
from .build import (CorpusData, DatasetData, WarmupCosine, _launched, adamw, build_model,
                    check_hf_dir, check_vocab, fsdp_options, full_init, memory_job, model_shape,
                    resolve_layout, resolve_resume, resume_line, steps_done)
from .prelaunch import pipeline_stages, preflight, verify_job


# --- the trainer ----------------------------------------------------------------------------
class Trainer:
    """Builds ``job`` (a checked JobConfig) and trains it with ``fit()``."""

    #: the signals that save a checkpoint and stop (with checkpoint.save); () where the
    #: engine stops the workers itself (Ray Train runs the loop off the main thread)
    save_signals = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, job: JobConfig):
        from lightning.fabric import Fabric
        from tpkit.fabric import TPKitStrategy
        from tpkit.recovery import Recovery

        self.job = job
        if job.model.init_from_hf:
            check_hf_dir(job)                       # before any process group
        self.layout = resolve_layout(job)           # once; the strategy receives it
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        strategy = TPKitStrategy(
            layout=self.layout, data_parallel=job.parallelism.data_parallel,
            seed=job.training.seed, **fsdp_options(job),
            microbatches=job.pipeline.microbatches if self.layout.pp > 1 else None,
            pp_schedule=job.pipeline.schedule, virtual_stages=job.pipeline.virtual_stages)
        self.fabric = Fabric(accelerator="cuda" if torch.cuda.is_available() else "cpu",
                             devices=local, num_nodes=max(1, self.layout.world_size // local),
                             strategy=strategy, plugins=[self._precision()])
        self.fabric.launch()
        self.state = state = self.fabric.strategy.parallel_state
        job.check_layout(state)
        check_vocab(job, state.tp_size)

        self.raw_model = build_model(job, state)
        if job.training.compile:   # in place: names, checkpoints and stages are unchanged
            from tpkit.nn import compile_blocks
            compile_blocks(self.raw_model, backend=job.training.compile_backend)
        # Set the module up first, then build the optimizer from what it holds: FSDP2
        # replaces the parameters by sharded ones, and pipeline stages keep only theirs.
        self.model = self.fabric.setup_module(self.raw_model)
        self.optimizer = self.fabric.setup_optimizers(
            adamw(self.model.parameters(), job, self.fabric.device))
        self.schedule = WarmupCosine(job.optimizer.lr, job.optimizer.warmup, job.training.steps)
        self.data = CorpusData(job, state) if job.data.path is None else \
            DatasetData(job, state)
        self.val_losses: list[tuple[int, float]] = []

        c = job.checkpoint
        self.saved = {"model": self.model, "optimizer": self.optimizer}
        self.recovery = Recovery(
            c.save, save_every=c.save_every, keep=c.keep,
            hang_timeout=job.recovery.hang_timeout, async_save=c.async_save,
            signals=self.save_signals if c.save else (),
            straggler_every=job.logging.log_every if state.world_size > 1 else None)
        self.start = 0
        strict = not c.resume_partial
        if c.resume:
            path = resolve_resume(job)
            self.start = steps_done(job, path, self.fabric.load(path, self.saved,
                                                                 strict=strict))
            self._say(resume_line(job, path, self.start))
        if job.recovery.auto_resume:
            self.start = self.recovery.resume(self.saved, strict=strict)
            if self.recovery.resumed_from:
                self._say(resume_line(job, self.recovery.resumed_from, self.start))

    def _say(self, line: str) -> None:
        if self.state.rank == 0:
            print(line, flush=True)

    def _precision(self):
        p = self.job.precision
        from tpkit.fabric import TPKitPrecision
        if p.mode != "fp8":
            return TPKitPrecision(p.mode)
        fallback = {"float32": None, "bfloat16": torch.bfloat16}[p.fp8_compute_dtype]
        return TPKitPrecision("fp8", fallback_compute_dtype=fallback, recipe=p.fp8_recipe)

    def batch(self, step: int):
        """Step ``step``'s data on this rank: ("packed", (args, kwargs, labelled tokens)) or
        ("tokens", (inputs, targets))."""
        if self.job.data.pack:
            return "packed", self.data.packed(step, self.fabric.device)
        return "tokens", self.data.tokens(step, self.fabric.device)

    def step_loss(self, step: int, batch=None) -> torch.Tensor:
        """Forward and backward of step ``step``'s batch (``batch(step)`` unless given);
        this rank's loss (pp > 1: every stage gets it from the last, tpkit.distributed.pipeline)."""
        fabric, state = self.fabric, self.state
        kind, data = self.batch(step) if batch is None else batch
        if kind == "packed":
            args, kw, labelled = data
            # the summed loss scaled so that DDP's average over dp x cp is the global mean
            loss = self.model(*args, **kw) * (state.dp_cp_size / max(1, labelled))
            fabric.backward(loss)
            return loss
        x, y = data
        if state.pp_size > 1:
            return fabric.strategy.pipeline_step(x, target=y)
        m = self.job.microbatches(1)
        total = 0.0
        for i, (xi, yi) in enumerate(zip(x.chunk(m), y.chunk(m))):   # gradient accumulation
            with fabric.no_backward_sync(self.model, enabled=i < m - 1):
                loss = self.model(xi, yi) / m
                fabric.backward(loss)
            total = total + loss.detach()
        return total

    def metrics_logger(self):
        """tpkit.observe's MetricsLogger for this job (docs/observe.md, "Wiring it into a
        trainer"); collective: every rank builds it."""
        from tpkit.observe import MetricsLogger, model_flops_per_token
        job, t, lg = self.job, self.job.training, self.job.logging
        wandb = None if lg.wandb is None else {"offline": lg.wandb == "offline",
                                               "project": "tpkit-train"}
        return MetricsLogger(
            lg.log_dir, tokens_per_step=t.global_batch * t.seq_len,
            flops_per_token=model_flops_per_token(self.raw_model, t.seq_len),
            total_steps=t.steps, every=lg.log_every, device=self.fabric.device,
            precision=job.precision.mode,
            peak_tflops=lg.peak_tflops, wandb=wandb, profile_steps=lg.profile_steps,
            start_step=self.start)

    def memory_line(self, steps_done: int = 1) -> str:
        """tpkit.memory's estimate for this rank next to the measured peak (one line)."""
        from tpkit.memory import estimate_memory, format_measured, measured_peak_bytes
        est = memory_job(self.job, self.layout, device=self.fabric.device.type)
        if est is None:
            return (f"memory after step {steps_done}: no estimate (the model's config.json "
                    "is not there)")
        estimate = estimate_memory(est, self.layout, rank=self.state.rank)
        return format_measured(estimate, measured_peak_bytes(self.fabric.device),
                               step=steps_done)

    def evaluate(self, step: int) -> float:
        """The validation loss after step ``step`` (DatasetData.validation_loss), kept in
        ``self.val_losses`` as ``(step, loss)`` (``fit`` logs it as ``val_loss``)."""
        self.model.eval()
        with torch.no_grad():
            val = self.data.validation_loss(self.model, self.fabric.device)
        self.model.train()
        self.val_losses.append((step, val))
        return val

    def fit(self) -> list[float]:
        """Run the loop from the start step; the global mean loss of every step run. Each
        step is logged through tpkit.observe's MetricsLogger (its phases data, fwd_bwd,
        optimizer and checkpoint; loss, lr, grad_norm and the MoE router's figures), and
        after the first step rank 0 prints the memory estimate next to the measured peak."""
        from tpkit.observe import moe_scalars
        job, state, t = self.job, self.state, self.job.training
        every = job.logging.log_every
        log = self.metrics_logger()
        losses = []
        try:
            for step in range(self.start, t.steps):
                t_step = time.perf_counter()
                with log.phase("data"):
                    batch = self.batch(step)
                with log.phase("fwd_bwd"):
                    lr = self.schedule.apply(self.optimizer, step)
                    loss = self.step_loss(step, batch)
                with log.phase("optimizer"):
                    norm = None
                    if job.optimizer.clip > 0:
                        norm = self.fabric.clip_gradients(self.model, self.optimizer,
                                                          max_norm=job.optimizer.clip)
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                own_time = time.perf_counter() - t_step   # before the step's last wait
                report = loss.detach().float().clone()
                dist.all_reduce(report, group=state.dp_cp_group)
                losses.append(report.item() / state.dp_cp_size)
                last = step == t.steps - 1
                window = (step + 1) % every == 0 or last
                moe = moe_scalars(self.raw_model, state) if window else {}   # pp: collective
                tokens = None
                if batch[0] == "packed":   # the documents' tokens, labelled + one each
                    tokens = batch[1][2] + t.global_batch
                if step == self.start:     # before log.step resets the allocator's peak
                    line = self.memory_line(step + 1)
                    if state.rank == 0:
                        print(line, flush=True)
                val = None
                if job.data.eval_every and ((step + 1) % job.data.eval_every == 0 or last):
                    val = self.evaluate(step)
                with log.phase("checkpoint"):
                    stop = self.recovery.step_end(step, self.saved, last=last,
                                                  seconds=own_time)
                log.step(step, tokens=tokens, loss=losses[-1], lr=lr, grad_norm=norm, **moe)
                if val is not None:
                    log.log(step, val_loss=val)
                if stop:
                    break
        finally:
            log.close()
        self.recovery.close()
        if self.recovery.stopped_by:
            raise SystemExit(self.recovery.exit_code)
        if job.checkpoint.export_hf:
            from tpkit.models import hf
            hf.save_hf(self.raw_model, job.checkpoint.export_hf)
        return losses


# --- entry points ----------------------------------------------------------------------------
DESCRIPTION = """Train the reference GPT (tpkit.models.GPT), a Llama from scratch (--arch llama,
--hf-config) or a Hugging Face Llama-family model on the built-in corpus with Fabric + TPKitStrategy + TPKitPrecision (docs/train.md).

    tpkit-launch --tp 2 --cp 2 launch/train.py                     # CPU: 4 gloo ranks
    tpkit-launch --tp 2 --cp 2 -m tpkit.train --config job.toml --training.steps 100
    tpkit-train --print-config > job.toml                           # every field, documented

Values: defaults < --config FILE (TOML) < flags (--section.field VALUE, or the short names).
"""


def main(argv=None, prog: str | None = None) -> list[float]:
    """Parse ``argv``, train, print a summary on rank 0; the losses. Outside a launcher a
    bad value is one line on stderr and exit 2; inside one it raises (the launcher's
    pre-flight has reported it already, or the worker wrapper records it)."""
    try:
        job, ns = parse(argv, prog=prog, description=DESCRIPTION)
        if ns.print_config:
            print(job.to_toml(), end="")
            return []
        trainer = Trainer(job)
    except ValueError as e:
        if _launched():
            raise
        print(f"{prog or 'tpkit-train'}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    losses = trainer.fit()
    if losses and trainer.state.rank == 0:
        k = max(1, len(losses) // 10)
        first, final = sum(losses[:k]) / k, sum(losses[-k:]) / k
        print(f"done: mean loss of first {k} steps {first:.4f} -> last {k} steps {final:.4f}",
              flush=True)
    return losses


def cli(prog: str | None = None) -> None:
    """The console script ``tpkit-train`` and ``python -m tpkit.train``: main, then the
    layout and the process group torn down."""
    main(prog=prog)
    import tpkit
    from tpkit.layout.parallel_state import release_default_group
    tpkit.destroy_parallel()
    release_default_group()   # now, not at interpreter finalization (its docstring)
