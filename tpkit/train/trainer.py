"""Trainer: one job (a checked JobConfig) built in one straight line, and its loop.

``Trainer(job).__init__`` resolves the layout once (the parallelism section over
tpkit-launch's TPKIT_* variables, checked against the world) and hands it to the Fabric
strategy; then builds the precision plugin, the model (the reference GPT drawn at full
size from the seed and sharded, or a Hugging Face model), the optimizer, the learning-rate
schedule, the data and the recovery manager. ``fit()`` runs the loop and returns the
global mean loss of every step. Only tpkit's public API is used: this file is also the
worked example of a user's own training script.

The global batch of step k is the same at every layout (every rank computes it and keeps
its share), so runs at different layouts follow the same loss curve (tests/train).
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from . import corpus
from . import arch
from .arch import vocab_size
from .config import JobConfig, parse


# --- the layout, once per process ----------------------------------------------------------
def _launched() -> bool:
    """Started by a launcher (tpkit-launch, torchrun, Slurm) or inside a process group."""
    return "WORLD_SIZE" in os.environ or (dist.is_available() and dist.is_initialized())


def resolve_layout(job: JobConfig, env=None):
    """The job's layout (JobConfig.layout: its parallelism section over the layout
    tpkit-launch exported, which already holds the job's sizes) checked against this
    world: a ``tpkit.config.Layout``; ValueError naming the sizes, where they came from
    and the fix."""
    config = job.layout(env)
    world = dist.get_world_size() if dist.is_initialized() else \
        int(os.environ.get("WORLD_SIZE", 1))
    if not _launched() and config.model_size > 1:
        sizes = " ".join(f"--{k} {getattr(config, k)}" for k in ("tp", "cp", "pp")
                         if getattr(config, k) > 1)
        raise ValueError(
            f"tp*cp*pp = {config.tp}*{config.cp}*{config.pp} needs {config.model_size} "
            "processes and this is one, started without a launcher; run it under tpkit-launch:"
            f" tpkit-launch --nproc-per-node {config.model_size} {sizes} launch/train.py ...")
    return config.validate(world)


# --- pieces the Trainer puts together ------------------------------------------------------
class WarmupCosine:
    """Linear warmup to ``lr``, then cosine decay to a tenth of it at ``steps``."""

    def __init__(self, lr: float, warmup: int, steps: int):
        self.lr, self.warmup, self.steps = lr, warmup, steps

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        frac = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def apply(self, optimizer, step: int) -> float:
        lr = self(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr


class CorpusData:
    """The built-in corpus (tpkit.train.corpus): step ``k``'s global batch, the same at
    every layout, and this rank's share of it."""

    def __init__(self, job: JobConfig, state):
        self.job, self.state = job, state
        self.train, _ = corpus.split(corpus.tokens())
        self.docs = corpus.documents(self.train) if job.data.pack else None

    def rows(self) -> torch.Tensor:
        """The global batch's rows this dp rank trains on. With m micro-batches, micro-batch
        i of the step is the same global rows [i*G/m, (i+1)*G/m) at every layout, each dp
        rank taking its contiguous share of it (the MoE load-balancing loss, computed per
        micro-batch over the dp ranks, is then the same at every layout)."""
        s = self.state
        m, dp = self.job.microbatches(s.pp_size), s.dp_size
        per = self.job.training.global_batch // (m * dp)
        return torch.cat([torch.arange(per) + i * per * dp + s.dp_rank * per
                          for i in range(m)])

    def tokens(self, step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.job.training
        x, y = corpus.batch(self.train, step, t.global_batch, t.seq_len, seed=t.seed)
        rows = self.rows()
        return x[rows].to(device), y[rows].to(device)

    def packed(self, step: int, device):
        """(this rank's shard of its packed row as model kwargs, labelled tokens of the
        whole global batch)."""
        from tpkit.data import pack_sequences
        t, s = self.job.training, self.state
        batch = corpus.doc_batch(self.train, self.docs, step, t.global_batch, t.seq_len,
                                 t.seed)
        labelled = sum(len(d) - 1 for d in batch)          # the same number on every rank
        per = t.global_batch // s.dp_size
        local = pack_sequences(batch[s.dp_rank * per:(s.dp_rank + 1) * per],
                               state=s).shard(s)
        kw = {k: v.to(device) if torch.is_tensor(v) else v
              for k, v in local.attention_kwargs().items()}
        args = (local.tokens.to(device), local.labels.to(device),
                local.position_ids.to(device))
        return args, kw, labelled


class DatasetData:
    """data.path (tpkit.data.build_data): step ``k``'s global batch is the samples at stream
    position ``k * global_batch`` of the layout-independent order, so a resume from step
    ``k`` at any layout reads what an uninterrupted run reads; this rank's rows as
    CorpusData's."""

    def __init__(self, job: JobConfig, state):
        from tpkit.data import build_data, dp_rows
        d, t = job.data, job.training
        self.job, self.state = job, state
        self.data = build_data(d.path, seq_len=t.seq_len, global_batch=t.global_batch,
                               seed=t.seed, split=d.split, pack=d.pack, format=d.format,
                               tokenizer=d.tokenizer, vocab_size=vocab_size(job),
                               dp_rank=state.dp_rank, dp_size=state.dp_size)
        m = 1 if d.pack else job.microbatches(state.pp_size)
        self.rows = dp_rows(t.global_batch, state.dp_rank, state.dp_size, m)
        if d.eval_every and self.data.valid is None:
            raise job.bad("data.eval_every", f"needs a held-out split: {job.show('data.split')}"
                                             " gives none; use e.g. --split 98,2")
        self.valid_batches = self.data.valid_batches

    def tokens(self, step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.data.train.at(step * self.job.training.global_batch, self.rows)
        x, y = self.data.batch(rows)
        return x.to(device), y.to(device)

    def validation_loss(self, model, device) -> float:
        """The token-mean loss over the first data.eval_batches global batches of the
        held-out split, no gradients: the same batches, hence the same value, at every
        layout (each DP rank its rows, each CP rank its shard; sums over dp x cp)."""
        from tpkit.data import count_targets
        s, d = self.state, self.job.data
        stats = torch.zeros(2, dtype=torch.float64, device=device)   # loss sum, targets
        for rows in self.valid_batches(d.eval_batches):
            if d.pack:
                local = self.data.batch(rows, s).shard(s)
                kw = {k: v.to(device) if torch.is_tensor(v) else v
                      for k, v in local.attention_kwargs().items()}
                stats[0] += float(model(local.tokens.to(device), local.labels.to(device),
                                        local.position_ids.to(device), **kw))
            else:   # the mean over this rank's tokens: every rank holds as many
                x, y = self.data.batch(rows)
                n = count_targets(rows)
                stats[0] += float(model(x.to(device), y.to(device))) * n / s.cp_size
            stats[1] += count_targets(rows) / s.cp_size
        dist.all_reduce(stats, group=s.dp_cp_group)
        return float(stats[0] / stats[1])

    def packed(self, step: int, device):
        from tpkit.data import count_targets
        G, s = self.job.training.global_batch, self.state
        train = self.data.train
        labelled = count_targets(train.at(step * G, range(G)))   # the whole global batch
        local = self.data.batch(train.at(step * G, self.rows), s).shard(s)
        kw = {k: v.to(device) if torch.is_tensor(v) else v
              for k, v in local.attention_kwargs().items()}
        args = (local.tokens.to(device), local.labels.to(device),
                local.position_ids.to(device))
        return args, kw, labelled


def model_shape(job: JobConfig):
    """The shape of the model this job trains (``tpkit.models.shape.ModelShape``: its
    FLOPs and memory plan derive from it): ``model.init_from_hf``'s config.json (None
    while it is not there), a Llama from scratch's config (tpkit.train.arch), else the
    reference GPT's config, the tokenizer's vocabulary
    included."""
    from tpkit.models.shape import ModelShape
    if arch.is_llama(job):
        return ModelShape.of(arch.llama_config(job, impl="torch"))
    if job.model.init_from_hf:
        path = os.path.join(job.model.init_from_hf, "config.json")
        return ModelShape.from_hf_config(path) if os.path.isfile(path) else None
    return ModelShape.of(gpt_config(job, impl="torch"))


def memory_job(job: JobConfig, layout, device: str = "cpu"):
    """The job at ``layout`` on ``device``'s kernels as tpkit.memory estimates it (None:
    no model config yet)."""
    from tpkit.memory import MemoryJob
    return MemoryJob.from_job(job, model_shape(job), dp=layout.dp, pp=layout.pp,
                              device=device)


def gpt_config(job: JobConfig, impl: str | None = None):
    from tpkit.models import GPTConfig
    m, e = job.model, job.experts
    return GPTConfig(vocab_size=vocab_size(job), hidden_size=m.hidden, num_layers=m.layers,
                     num_heads=m.heads, num_gqa_groups=m.gqa_groups, ffn_hidden_size=m.ffn,
                     dropout=m.dropout, recompute=job.training.recompute,
                     backend=impl or m.impl, moe_experts=e.num, moe_topk=e.topk,
                     moe_every=e.every, moe_aux_coeff=e.aux_coeff,
                     moe_capacity_factor=e.capacity_factor,
                     cpu_offload_layers=job.training.cpu_offload_layers,
                     vocab_multiple=job.model.vocab_multiple)


def check_vocab(job: JobConfig, tp: int) -> None:
    """The model's padded vocabulary (tpkit.models.vocab) must split over ``tp``: ValueError
    naming the vocabulary, where it came from and the model.vocab_multiple to use."""
    from tpkit.models.vocab import padded_vocab_size
    m = job.model
    if m.init_from_hf:   # (a dry run may plan a download: no config.json yet)
        if not os.path.isfile(os.path.join(m.init_from_hf, "config.json")):
            return
        from tpkit.models.hf import read_config
        vocab, where = read_config(m.init_from_hf)[0].vocab_size, \
            f"{job.show('model.init_from_hf')}'s"
    elif m.hf_config is not None:
        vocab, where = arch.llama_config(job).vocab_size, f"{job.show('model.hf_config')}'s"
    else:
        vocab = vocab_size(job)
        where = (f"{job.show('data.tokenizer')}'s" if job.data.path is not None
                 else "the built-in corpus'")
    padded = padded_vocab_size(vocab, m.vocab_multiple)
    if padded % tp:
        raise ValueError(f"{where} vocabulary of {vocab}, padded to a multiple of "
                         f"{job.show('model.vocab_multiple')}, is {padded}, "
                         f"which tp={tp} does not divide; use --vocab-multiple "
                         f"{math.lcm(job.model.vocab_multiple, tp)} or a multiple of it (the "
                         "padded rows are masked out of the loss and of generation)")


def full_init(model: torch.nn.Module, seed: int) -> None:
    """Layout-independent initialisation: draw every parameter at its full (unsharded)
    shape from a generator seeded by (seed, parameter index), then shard it in."""
    from tpkit.checkpoint import full_shapes, load_full_state_dict
    new = {}
    own = model.state_dict()
    shapes, split = _one_process_shapes(model, full_shapes(model))
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        g = torch.Generator().manual_seed(seed * 10_007 + i)
        if name.endswith("_extra_state"):                  # TE's fp8 metadata
            new[name] = own[name]
        elif name.endswith("weight") and len(shape) == 1:   # norm scales
            new[name] = torch.ones(shape)
        elif len(shape) == 1:                              # biases
            new[name] = torch.zeros(shape)
        else:
            std = 0.02 / math.sqrt(2 * model.cfg.num_layers) if "proj" in name or "fc2" in name \
                else 0.02
            new[name] = torch.randn(shape, generator=g, dtype=torch.float32).mul_(std)
    for fused, (q, kv, rows) in split.items():   # back to this layout's names
        w = new.pop(fused)
        new[q], new[kv] = w[:rows], w[rows:]
    load_full_state_dict(model, new)


def adamw(params, job: JobConfig, device) -> torch.optim.AdamW:
    """The job's AdamW (betas 0.9, 0.95, no weight decay): torch's fused kernel
    (``fused=True``) on CUDA or with optimizer.impl fused, its multi-tensor one
    (``foreach=True``) otherwise (docs/train.md, "The optimizer step")."""
    impl = job.optimizer.impl
    fused = impl == "fused" or (impl == "auto" and torch.device(device).type == "cuda")
    return torch.optim.AdamW(params, lr=job.optimizer.lr, betas=(0.9, 0.95),
                             weight_decay=0.0, fused=fused or None, foreach=not fused)


def _one_process_shapes(model: torch.nn.Module, shapes: dict):
    """``shapes`` under one process's names: with fewer kv heads than tp
    (tpkit.nn.ReplicatedKV) an attention's ``linear_qkv`` holds the queries and
    ``linear_kv`` the keys and values; one process has them fused as ``linear_qkv``
    ([Q; K; V]). Returns (shapes, {fused name: (q name, kv name, q rows)}), so that the
    same seed draws the same weights at every tp."""
    shapes, split = dict(shapes), {}
    for prefix, mod in model.named_modules():
        if not getattr(mod, "replicated_kv", False):
            continue
        for kind in ("weight", "bias"):
            q, kv = f"{prefix}.linear_qkv.{kind}", f"{prefix}.linear_kv.{kind}"
            if q in shapes and kv in shapes:
                sq, skv = shapes.pop(q), shapes.pop(kv)
                shapes[q] = torch.Size([sq[0] + skv[0], *sq[1:]])
                split[q] = (q, kv, sq[0])
    return shapes, split


def fsdp_options(job: JobConfig) -> dict:
    """TPKitStrategy's FSDP2 keywords of this job (none with DDP)."""
    par = job.parallelism
    if par.data_parallel != "fsdp":
        return {}
    return dict(fsdp_replicate=par.dp_replicate,
                fsdp_mixed_precision=par.fsdp_mixed_precision)


def check_hf_dir(job: JobConfig):
    """model.init_from_hf's LlamaConfig; ValueError unless it is a model tpkit reads whose
    vocabulary holds the corpus' byte ids."""
    from tpkit.models.hf import read_config
    cfg, _ = read_config(job.model.init_from_hf)
    if cfg.vocab_size < corpus.VOCAB_SIZE:
        raise ValueError(f"{job.show('model.init_from_hf')}: vocab_size={cfg.vocab_size} "
                         f"cannot hold the corpus' {corpus.VOCAB_SIZE} byte ids; use a model "
                         "with a larger vocabulary")
    return cfg


def build_model(job: JobConfig, state) -> torch.nn.Module:
    """The job's model on ``state``: a Hugging Face model, or the reference GPT with
    full-size weights drawn from the seed."""
    m = job.model
    if m.init_from_hf:
        from tpkit.models import hf
        return hf.from_hf(m.init_from_hf, state, backend=m.impl,
                          recompute=job.training.recompute, hidden_dropout=m.dropout,
                          attention_dropout=m.dropout, vocab_multiple=m.vocab_multiple)
    from tpkit.models import GPT, Llama
    from .arch import is_llama, llama_config
    model = Llama(llama_config(job), state) if is_llama(job) else GPT(gpt_config(job), state)
    full_init(model, job.training.seed)
    return model


def resolve_resume(job: JobConfig) -> str:
    """checkpoint.resume itself if it is a checkpoint, else the latest SAVE/stepNNNNNN."""
    from tpkit.checkpoint import _dcp_fs as fs
    path = job.checkpoint.resume
    if not fs.isdir(path):
        raise job.bad("checkpoint.resume", "is not a directory; pass a checkpoint written by "
                                           "--save (SAVE/stepNNNNNN) or the --save directory "
                                           "(its latest)")
    steps = sorted(d for d in fs.listdir(path) if d.startswith("step") and d[4:].isdigit())
    if not steps:
        return path
    return fs.join(path, steps[-1]) if fs.is_url(path) else os.path.join(path, steps[-1])


def steps_done(job: JobConfig, path: str, extras: dict) -> int:
    """The steps the checkpoint at ``path`` has done (its ``step`` entry + 1); ValueError
    when it has none, or when they reach training.steps (nothing would train)."""
    if "step" not in extras:
        raise job.bad("checkpoint.resume", f"-> {path} has no 'step' entry: it was not "
                                           "written by tpkit-train --save; resume from one "
                                           "that was")
    done = int(extras["step"]) + 1
    if done >= job.training.steps:
        raise job.bad("checkpoint.resume", f"-> {path} has {done} steps done, which reaches "
                                           f"{job.show('training.steps')}: nothing to train; "
                                           f"raise --steps above {done} to train on")
    return done


def resume_line(job: JobConfig, path: str, done: int) -> str:
    """What a resume restores, in one line: the steps done and where the data goes on."""
    t = job.training
    if done >= t.steps:   # --auto-resume of a finished job
        return (f"resumed from {path}: {done} steps done, which reaches "
                f"{job.show('training.steps')}: nothing to train; raise --steps above {done} "
                "to train on")
    return (f"resumed from {path}: {done} steps done; training steps {done + 1}..{t.steps} "
            f"from the data stream's sample {done * t.global_batch} (step {done + 1}'s "
            f"batch of {t.global_batch})")


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
        this rank's loss (pp > 1: every stage gets it from the last, tpkit.pipeline)."""
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


# --- before any worker starts (tpkit-launch calls the script's tpkit_preflight) ------------
def pipeline_stages(job: JobConfig, state) -> list[str]:
    """The dry run's lines: which stages and blocks every pp rank (and its ranks) runs."""
    from tpkit.pipeline import plan_pipeline
    from tpkit.planning import format_ranks
    from .arch import num_layers
    layers = num_layers(job)
    plan = plan_pipeline(pp=state.pp_size, num_blocks=layers,
                         microbatches=job.microbatches(state.pp_size),
                         schedule=job.pipeline.schedule,
                         virtual_stages=job.pipeline.virtual_stages)
    rows = state.rank_table(nproc_per_node=1)
    lines = [f"pipeline (tpkit-train): {plan.schedule}, {plan.microbatches} micro-batches, "
             f"{plan.num_stages} stages of {layers // plan.num_stages} block(s)"]
    for r in range(plan.pp):
        ranks = [row["rank"] for row in rows if row["pp"] == r]
        parts = []
        for st in plan.stages_of(r):
            blocks = plan.blocks_of(st)
            what = f"layers {blocks.start}-{blocks.stop - 1}" if len(blocks) > 1 \
                else f"layer {blocks.start}"
            if st == 0:
                what = "embedding + " + what
            if st == plan.num_stages - 1:
                what += " + final_norm, output, loss"
            parts.append(f"stage {st} ({what})")
        lines.append(f"  pp rank {r} (ranks {format_ranks(ranks)}): " + "; ".join(parts))
    return lines


def preflight(argv, launch):
    """tpkit-launch's pre-flight (docs/launch.md, "Pre-flight checks"): the JobConfig's
    checks, the layout it gives under this launch, the model built on the meta device of
    that planned layout (the layers' own checks) and checkpoint.resume against that model.
    Returns the job's layout (tpkit-launch launches, prints and exports that one: a size
    given to both tpkit-launch and the job with two values is refused) and its
    ``tpkit.memory.MemoryJob`` for tpkit-launch's memory estimate.
    ValueError (or argparse's exit 2) stops the launch; --print-config and --help answer
    instead of launching."""
    from tpkit.checkpoint import verify
    from tpkit.planning import fake_state
    from tpkit.random import get_rng_tracker, model_parallel_seed
    job, ns = parse(argv)
    if ns.print_config:
        print(job.to_toml(), end="")
        raise SystemExit(0)
    config = job.layout(launch.config)   # a size given twice with two values: refused
    try:
        config = config.validate(launch.world_size)
    except ValueError as e:
        raise ValueError(f"{e} [world size {launch.world_size} = {launch.nnodes} node(s) x "
                         f"{launch.nproc_per_node} processes: this launch]") from None
    if job.model.impl == "te" and not launch.dry_run:   # the workers run here: TE as here
        from tpkit.te import require_te
        try:
            require_te()
        except (ImportError, RuntimeError) as e:
            raise ValueError(f"{job.show('model.impl')}: {e}") from None
    # a dry run may plan a download: the directory is read only when workers will start
    hf_cfg = check_hf_dir(job) if job.model.init_from_hf and not launch.dry_run else None
    with fake_state(config, launch.world_size) as state:
        job.check_layout(state)
        check_vocab(job, state.tp_size)
        try:
            with torch.random.fork_rng(devices=[]):   # the layers: on the meta state.device
                model_parallel_seed(job.training.seed, state)   # the layers draw TP shards
                if hf_cfg is not None:   # its shapes at this layout, no weights read
                    dataclasses.replace(hf_cfg, vocab_multiple=job.model.vocab_multiple
                                        ).validate().check_tp(state.tp_size)
                from tpkit.models import GPT
                from .arch import is_llama, llama_config
                if is_llama(job):   # its shapes at this layout (RoPE's table needs data)
                    llama_config(job, impl="torch").check_tp(state.tp_size)
                # the layers create their tensors on state.device: meta here, so that
                # a 70B model's shapes cost no memory and no time
                model = None if job.model.init_from_hf or is_llama(job) else GPT(
                    gpt_config(job, impl="torch"),   # shapes: impl-independent
                    dataclasses.replace(state, device=torch.device("meta")))
        except ValueError as e:
            m = job.model
            what = (f"--init-from-hf {m.init_from_hf}" if m.init_from_hf else
                    f"--hidden {m.hidden} --heads {m.heads} --gqa-groups {m.gqa_groups} "
                    f"--ffn {m.ffn}")
            raise ValueError(f"the model ({what}) does not fit tp={config.tp}: {e}") from None
        finally:
            get_rng_tracker().reset()
        if launch.dry_run and state.pp_size > 1:
            print("\n".join(pipeline_stages(job, state)))
        if job.checkpoint.resume and not launch.dry_run:   # a dry run may plan a future save
            from tpkit.checkpoint import read
            path = resolve_resume(job)
            verify(path, None if model is None else {"model": model}, state=state,
                   strict=not job.checkpoint.resume_partial)
            steps_done(job, path, read(path, keys=["step"]))
    if job.training.verify and not launch.dry_run:
        report = verify_job(job, config)
        print(report, flush=True)
        if not report.ok:
            raise ValueError(f"--verify: the model differs from one process at layout "
                             f"{report.results[0].layout} (the report above names the first "
                             "module); fix it, or train without --verify")
    return config, memory_job(job, config)   # the layout, and the model and batch to estimate


def verify_job(job: JobConfig, config):
    """``--verify``: tpkit.verify on this job's model (build_model) and the corpus' batches
    at the job's layout (tp x cp x dp, sp), on CPU with gloo; a tpkit.verifier.Report."""
    from tpkit.verifier import Layout, verify
    if config.pp > 1 or config.ep > 1:
        raise ValueError(f"--verify at pp={config.pp}, ep={config.ep}: pipeline and expert "
                         "layouts are not verified yet; verify at pp=1, ep=1")
    if job.precision.mode not in ("32-true", "bf16-mixed"):
        raise ValueError(f"--verify with --precision {job.precision.mode}: verified in "
                         "32-true or bf16-mixed only")
    t = job.training
    train, _ = corpus.split(corpus.tokens())
    layout = Layout(config.tp, config.cp, config.dp, bool(config.sequence_parallel))
    return verify(lambda: build_model(job, None),
                  lambda step: corpus.batch(train, step, t.global_batch, t.seq_len, seed=t.seed),
                  layouts=[str(layout)], steps=min(3, t.steps), seed=t.seed,
                  precision="bf16-mixed" if job.precision.mode == "bf16-mixed" else "32")


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
    from tpkit.parallel_state import release_default_group
    tpkit.destroy_parallel()
    release_default_group()   # now, not at interpreter finalization (its docstring)
