"""The build step: the one place a job becomes objects (the layout once per process, the model
and its shape, the optimizer, the schedule, the data, where to resume). The Trainer, the memory
plan and the pre-flight all build through here."""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from . import corpus
from . import arch
from .arch import vocab_size
from .config import JobConfig


# --- the layout, once per process ----------------------------------------------------------
def _launched() -> bool:
    """Started by a launcher (tpkit-launch, torchrun, Slurm) or inside a process group."""
    return "WORLD_SIZE" in os.environ or (dist.is_available() and dist.is_initialized())


def resolve_layout(job: JobConfig, env=None):
    """The job's layout (JobConfig.layout: its parallelism section over the layout
    tpkit-launch exported, which already holds the job's sizes) checked against this
    world: a ``tpkit.layout.config.Layout``; ValueError naming the sizes, where they came from
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
                          attention_dropout=m.dropout, vocab_multiple=m.vocab_multiple,
                          cpu_offload_layers=job.training.cpu_offload_layers,
                          pipeline=pipeline_plan(job, state))
    from tpkit.models import GPT, Llama
    from .arch import is_llama, llama_config
    model = Llama(llama_config(job), state) if is_llama(job) else GPT(gpt_config(job), state)
    full_init(model, job.training.seed)
    return model


def pipeline_plan(job: JobConfig, state):
    """The PipelinePlan the Fabric strategy splits this job's model by at ``state`` (None at
    pp=1): from_hf reads only this rank's stages."""
    if state is None or state.pp_size == 1:
        return None
    from tpkit.distributed.pipeline import plan_pipeline
    p = job.pipeline
    return plan_pipeline(pp=state.pp_size, num_blocks=arch.num_layers(job),
                         microbatches=job.microbatches(state.pp_size), schedule=p.schedule,
                         virtual_stages=p.virtual_stages, recompute=job.training.recompute)


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
