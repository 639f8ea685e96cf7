"""JobConfig: one typed description of a training job, from a TOML file and flags.

Every value comes from exactly one of: the field's default, the TOML file given with
``--config job.toml``, or a flag (``--training.steps 100``, or the short name the old
script had: ``--steps 100``); flags win over the file, the file over defaults, and
nothing else changes a value (``recovery.hang_timeout`` alone falls back to
``$TPKIT_HANG_TIMEOUT``, which the Slurm templates set). Every field is declared once,
with its type, default and a one-line doc; the flags, ``--help``, ``--print-config`` and
docs/train.md are all generated from those declarations.

Each section checks its own values (``check``) and ``JobConfig.check`` checks the ones
that involve several sections; what needs the layout (the data-parallel size, the
sequence shards, the pipeline stages) is ``check_layout(state)``. Every error is one
line naming the field, the value, where the value came from (``job.toml:12``, the flag
``--steps``, the default) and the fix. No torch import here: ``--help`` stays fast.

To add a field: declare it in its section with ``opt(default, doc)``; to add a section:
a dataclass of such fields and an entry of ``JobConfig``. Nothing else needs to change.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from ..config import CP_COMM_TYPES, FP8_RECIPES

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "fp8")
IMPLS = ("torch", "te", "auto")


def opt(default, doc: str, *, short: str | tuple = (), choices=None):
    """A JobConfig field: its default, its one-line doc, today's short flag(s), and the
    values it may take (checked when the config is read)."""
    short = (short,) if isinstance(short, str) else tuple(short)
    return field(default=default,
                 metadata={"doc": doc, "short": short, "choices": choices})


def output_dir_problem(path: str) -> str | None:
    """Why the job could not write the directory ``path`` (checked before any worker
    starts, not at the first save hours in), or None. An fsspec URL (``s3://...``) is
    its store's to refuse."""
    if "://" in path:
        return None
    probe = os.path.abspath(path)
    if os.path.exists(probe) and not os.path.isdir(probe):
        return "is a file"
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"is under {probe}, which is a file"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"cannot be written: {probe} is not writable by this user"
    return None


# --- the sections ------------------------------------------------------------------------
@dataclass
class Parallelism:
    """The layout. Sizes left unset come from tpkit-launch (its TPKIT_* variables), else
    1; dp is what is left of the world."""
    tp: int | None = opt(None, "tensor-parallel size", short="--tp")
    cp: int | None = opt(None, "context-parallel size", short="--cp")
    pp: int | None = opt(None, "pipeline stages (see [pipeline])", short="--pp")
    ep: int | None = opt(None, "expert-parallel size (needs experts.num > 0)", short="--ep")
    etp: int | None = opt(None, "expert-tensor-parallel size (default tp; needs experts.num "
                                "> 0)", short="--etp")
    sequence_parallel: bool | None = opt(
        None, "shard the activations outside attention over TP too (needs tp >= 2)",
        short="--sequence-parallel")
    cp_comm_type: str | None = opt(None, "how context-parallel attention communicates",
                                   short="--cp-comm-type", choices=CP_COMM_TYPES)
    data_parallel: str = opt("ddp", "DDP or FSDP2 over the dp x cp ranks (fsdp: a unit per "
                                    "transformer block, tpkit.fsdp)",
                             short="--data-parallel", choices=("ddp", "fsdp"))
    dp_replicate: int = opt(1, "HSDP: the dp x cp ranks as dp_replicate replicas x the rest "
                               "sharded (within a node where tp x shard fits one; needs "
                               "data_parallel fsdp; 1: plain FSDP)", short="--dp-replicate")
    fsdp_mixed_precision: str | None = opt(
        None, "FSDP2's mixed-precision policy: bf16 gathers and compute, fp32 gradient "
              "reduction and sharded parameters (needs data_parallel fsdp)",
        short="--fsdp-mixed-precision", choices=("bf16",))

    def check(self, job: "JobConfig") -> None:
        for name in ("tp", "cp", "pp", "ep", "etp"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise job.bad(f"parallelism.{name}", "must be >= 1 (or unset: tpkit-launch's "
                                                     "value, else 1)")
        if self.dp_replicate < 1:
            raise job.bad("parallelism.dp_replicate", "must be >= 1 (1: plain FSDP)")
        for name in ("dp_replicate", "fsdp_mixed_precision"):
            if not job.is_default(f"parallelism.{name}") and self.data_parallel != "fsdp":
                raise ValueError(f"{job.show('parallelism.' + name)} needs --data-parallel "
                                 f"fsdp ({job.show('parallelism.data_parallel')}); add "
                                 "--data-parallel fsdp or drop it")


@dataclass
class Model:
    """The reference GPT (tpkit.models.GPT) or a Llama (tpkit.models.Llama) from a random
    init, or a Hugging Face model to fine-tune."""
    arch: str = opt("gpt", "the architecture trained from scratch: the reference GPT (GELU "
                           "MLP) or Llama (RMSNorm, SwiGLU, RoPE, grouped-query attention, "
                           "untied head) at the sizes below", short="--arch",
                    choices=("gpt", "llama"))
    impl: str = opt("torch", "the transformer blocks' implementation: tpkit's torch layers, "
                             "Transformer Engine's (GPUs), or TE where it can run",
                    choices=IMPLS)
    hidden: int = opt(128, "hidden size", short="--hidden")
    layers: int = opt(2, "transformer blocks", short="--layers")
    heads: int = opt(8, "attention heads", short="--heads")
    gqa_groups: int = opt(4, "key/value head groups (grouped-query attention)",
                          short="--gqa-groups")
    ffn: int = opt(512, "MLP hidden size (each expert's, with experts)", short="--ffn")
    dropout: float = opt(0.0, "hidden and attention dropout", short="--dropout")
    vocab_multiple: int = opt(128, "pad the model's vocabulary to a multiple of this "
                                   "(Megatron's make-vocab-size-divisible-by; the padded logits"
                                   " are masked out of the loss and of generation)",
                              short="--vocab-multiple")
    rope_theta: float = opt(10000.0, "with arch llama: RoPE's base (Llama 3: 500000)",
                            short="--rope-theta")
    hf_config: str | None = opt(
        None, "train from a random init the Llama-family model of this Hugging Face "
              "config.json (or its directory; no weights read): sizes, RoPE and its "
              "scaling, vocabulary (at least the data's)", short="--hf-config")
    init_from_hf: str | None = opt(
        None, "fine-tune the model of this Hugging Face directory (config.json + "
              "*.safetensors) instead of the reference GPT; its vocabulary must hold the "
              "corpus' 256 byte ids", short="--init-from-hf")

    def check(self, job: "JobConfig") -> None:
        for name in ("hidden", "layers", "heads", "gqa_groups", "ffn", "vocab_multiple"):
            if getattr(self, name) < 1:
                raise job.bad(f"model.{name}", "must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise job.bad("model.dropout", "must be in [0, 1)")
        if self.init_from_hf:
            given = [job.show(f"model.{n}") for n in ("hidden", "layers", "heads",
                                                      "gqa_groups", "ffn")
                     if not job.is_default(f"model.{n}")]
            if given:
                raise ValueError(f"{', '.join(given)} cannot be combined with "
                                 f"{job.show('model.init_from_hf')} (the sizes come from "
                                 f"{self.init_from_hf}/config.json); drop them")
        from .arch import check
        check(job)


@dataclass
class Data:
    """What the model reads: the built-in corpus, or your own data (docs/data.md); windows
    of training.seq_len tokens, or whole documents packed."""
    pack: bool = opt(False, "train on whole corpus documents packed into one row per rank "
                            "(training.global_batch documents of at most training.seq_len "
                            "tokens per step; attention stays inside each document)",
                     short="--pack")
    path: str | None = opt(None, "your data instead of the built-in corpus: an indexed "
                                 "dataset PREFIX (tpkit-data's PREFIX_text_document), a token "
                                 "file, jsonl/parquet/text, or Megatron's blend 'W1 PREFIX1 W2 "
                                 "PREFIX2' (docs/data.md)", short="--data-path")
    tokenizer: str | None = opt(None, "the local Hugging Face tokenizer of data.path (the "
                                      "model's vocabulary is its size)", short="--tokenizer")
    format: str = opt("auto", "data.path's format", short="--data-format",
                      choices=("auto", "indexed", "tokens", "text", "sft"))
    split: str = opt("98,2", "Megatron's train,validation weights over data.path's documents",
                     short="--split")
    eval_every: int = opt(0, "the validation loss (val_loss) on data.path's held-out split "
                             "every N steps and at the last (0: never)", short="--eval-every")
    eval_batches: int = opt(4, "global batches of the held-out split per evaluation",
                            short="--eval-batches")

    def check(self, job: "JobConfig") -> None:
        if self.eval_every < 0 or self.eval_batches < 1:
            name = "eval_every" if self.eval_every < 0 else "eval_batches"
            raise job.bad(f"data.{name}", "must be >= 0" if name == "eval_every"
                          else "must be >= 1")
        if self.path is None:
            for name in ("tokenizer", "eval_every"):
                if not job.is_default(f"data.{name}"):
                    raise job.bad(f"data.{name}", "needs data.path (--data-path)")
            return
        if self.tokenizer is None:
            raise job.bad("data.path", "needs data.tokenizer (--tokenizer DIR): the model's "
                                       "vocabulary is the tokenizer's size")
        from ..data import check_data
        try:
            check_data(self.path, split=self.split, format=self.format,
                       tokenizer=self.tokenizer)
        except ValueError as e:
            raise job.bad("data.path", f"is refused: {e}") from None
        if job.model.init_from_hf:
            raise job.bad("data.path", f"with {job.show('model.init_from_hf')} is not "
                                       "supported yet (the reference GPT only); drop one")


@dataclass
class Training:
    """The loop: how long, on how much, from which seed."""
    steps: int = opt(300, "optimizer steps", short="--steps")
    global_batch: int = opt(8, "sequences per step over all data-parallel ranks (the same "
                               "global batch at every layout)", short="--global-batch")
    seq_len: int = opt(128, "tokens per sequence", short="--seq-len")
    seed: int = opt(1234, "seed of the weights (drawn at full size, then sharded) and of the "
                          "batches", short="--seed")
    recompute: bool = opt(False, "recompute each block's activations in the backward pass",
                          short="--recompute")
    cpu_offload_layers: int = opt(0, "move the activations of the first N blocks off the "
                                     "compute device until their backward (TE's "
                                     "get_cpu_offload_context; 0: off)",
                                  short="--cpu-offload-layers")
    verify: bool = opt(False, "before the workers start, tpkit-launch's pre-flight proves the "
                              "model's parallelization at this layout on CPU (tpkit.verify, "
                              "docs/verify.md: 3 steps against one process) and stops on a "
                              "difference", short="--verify")
    compile: bool = opt(False, "compile each transformer block with torch.compile("
                               "fullgraph=True) (tpkit.compile_blocks; docs/layers.md)",
                        short="--compile")
    compile_backend: str = opt("inductor", "with compile: torch.compile's backend (aot_eager: "
                                           "traced, no code generation)",
                               short="--compile-backend",
                               choices=("inductor", "aot_eager", "eager"))

    def check(self, job: "JobConfig") -> None:
        for name in ("steps", "global_batch", "seq_len"):
            if getattr(self, name) < 1:
                raise job.bad(f"training.{name}", "must be >= 1")
        if self.seed < 0:
            raise job.bad("training.seed", "must be >= 0")
        n = self.cpu_offload_layers
        if n and not 0 < n < job.model.layers:
            raise job.bad("training.cpu_offload_layers",
                          f"must be from 0 to model.layers - 1 = {job.model.layers - 1} (the "
                          "last block's activations are needed first in backward)")
        if n and job.model.init_from_hf:
            raise job.bad("training.cpu_offload_layers",
                          f"with {job.show('model.init_from_hf')} is not supported yet (the "
                          "reference GPT only); drop one")
        if self.compile:
            self._check_compile(job)

    @staticmethod
    def _check_compile(job: "JobConfig") -> None:
        """The combinations tpkit.compile_blocks cannot compile yet, refused before any
        worker starts (compile_blocks and fp8_autocast refuse them again at run time)."""
        clash = [(job.model.impl == "te", "model.impl", "needs tpkit's torch blocks "
                  "(--model.impl torch or auto)"),
                 (job.model.dropout > 0, "model.dropout", "must be 0 (dropout under "
                  "torch.compile is not supported yet)"),
                 (job.precision.mode == "fp8", "precision.mode", "cannot be fp8 (emulated "
                  "fp8 under torch.compile is not supported yet)"),
                 (job.data.pack, "data.pack", "cannot be set (packed attention under "
                  "torch.compile is not supported yet)"),
                 (job.parallelism.data_parallel == "fsdp", "parallelism.data_parallel",
                  "must be ddp (FSDP2's hooks on compiled blocks are not supported yet)"),
                 (job.training.cpu_offload_layers > 0, "training.cpu_offload_layers", "must be "
                  "0 (activation offload's hooks under torch.compile are not supported yet)")]
        for bad, path, problem in clash:
            if bad:
                raise ValueError(f"{job.show('training.compile')} with {job.show(path)}: "
                                 f"{path} {problem}; or drop --compile")


@dataclass
class Optimizer:
    """AdamW (betas 0.9, 0.95; no weight decay) with linear warmup and cosine decay to
    a tenth of the peak."""
    lr: float = opt(3e-3, "peak learning rate", short="--lr")
    warmup: int = opt(10, "linear warmup steps (0: none)", short="--warmup")
    clip: float = opt(1.0, "clip the gradient norm to this (0: off)", short="--clip")
    impl: str = opt("auto", "AdamW's implementation: fused (torch's fused=True: one kernel "
                            "per dtype and device for all parameters), foreach (torch's "
                            "multi-tensor), or auto: fused on CUDA, foreach elsewhere",
                    short="--optimizer-impl", choices=("auto", "fused", "foreach"))

    def check(self, job: "JobConfig") -> None:
        if not self.lr > 0:
            raise job.bad("optimizer.lr", "must be > 0, e.g. 3e-3")
        for name in ("warmup", "clip"):
            if getattr(self, name) < 0:
                raise job.bad(f"optimizer.{name}", "must be >= 0 (0: off)")


@dataclass
class Precision:
    """TPKitPrecision's settings."""
    mode: str = opt("32-true", "the precision plugin", short="--precision", choices=PRECISIONS)
    fp8_recipe: str | None = opt(
        None, "with mode fp8: TE's recipe (default: delayed on impl torch, TE's own on te)",
        short="--fp8-recipe", choices=tuple(sorted(FP8_RECIPES)))
    fp8_compute_dtype: str = opt(
        "float32", "with mode fp8: the dtype of what fp8 does not cover",
        short="--fp8-compute-dtype", choices=("float32", "bfloat16"))

    def check(self, job: "JobConfig") -> None:
        for name, given in (("fp8_recipe", self.fp8_recipe is not None),
                            ("fp8_compute_dtype", self.fp8_compute_dtype != "float32")):
            if given and self.mode != "fp8":
                raise ValueError(f"{job.show('precision.' + name)} needs --precision fp8 "
                                 f"({job.show('precision.mode')} here); add --precision fp8 "
                                 "or drop it")


@dataclass
class Checkpoint:
    """Sharded, reshardable checkpoints (tpkit.checkpoint) and the Hugging Face export."""
    save: str | None = opt(None, "directory for sharded checkpoints, written as "
                                 "SAVE/stepNNNNNN", short="--save")
    save_every: int = opt(0, "save every N steps (0: only at the end)", short="--save-every")
    resume: str | None = opt(None, "a checkpoint (SAVE/stepNNNNNN) or a save directory (its "
                                   "latest), written at any layout", short="--resume")
    resume_partial: bool = opt(False, "with resume: load only the tensors the checkpoint "
                                      "and this model share (the others stay as initialized;"
                                      " shapes must still match)", short="--resume-partial")
    keep: int | None = opt(None, "keep the newest N checkpoints in save (never the one "
                                 "resumed from; unset: all)", short="--keep")
    async_save: bool = opt(False, "write checkpoints in the background (the next save waits "
                                  "for it)", short="--async-save")
    export_hf: str | None = opt(None, "write the trained model there as a Hugging Face "
                                      "checkpoint (needs a Llama: model.arch llama, "
                                      "model.hf_config or model.init_from_hf)",
                                short="--export-hf")

    def check(self, job: "JobConfig") -> None:
        if self.save_every < 0:
            raise job.bad("checkpoint.save_every", "must be >= 0 (0: only at the end)")
        for name, what in (("save", "checkpoints go in SAVE/stepNNNNNN"),
                           ("export_hf", "config.json and the weights go there")):
            problem = getattr(self, name) and output_dir_problem(getattr(self, name))
            if problem:
                raise job.bad(f"checkpoint.{name}", f"{problem}; pass a directory ({what})")
        for name in ("save_every", "keep", "async_save"):
            if getattr(self, name) and not self.save:
                raise job.bad(f"checkpoint.{name}", "needs --save DIR (checkpoint.save: "
                                                    "where to write them)")
        if self.resume_partial and not (self.resume or job.recovery.auto_resume):
            raise job.bad("checkpoint.resume_partial", "needs --resume CKPT or --auto-resume "
                                                       "(what to load partially)")
        if self.keep is not None and self.keep < 1:
            raise job.bad("checkpoint.keep", "must be >= 1 (how many checkpoints to keep); "
                                             "leave it unset to keep them all")
        from .arch import is_llama
        if self.export_hf and not (job.model.init_from_hf or is_llama(job)):
            raise ValueError(f"{job.show('checkpoint.export_hf')} needs a Llama (--arch llama,"
                             " --hf-config or --init-from-hf): the reference GPT has no "
                             "Hugging Face architecture")


@dataclass
class Recovery:
    """tpkit.recovery: with checkpoint.save, SIGTERM/SIGUSR1 save a checkpoint after the
    current step and exit with 128 + the signal."""
    auto_resume: bool = opt(False, "resume from the newest complete checkpoint in "
                                   "checkpoint.save (any layout), else start fresh",
                            short="--auto-resume")
    hang_timeout: float | None = opt(
        None, "no progress for this many seconds: dump stacks, name the stuck ranks, exit 124 "
              "(unset: $TPKIT_HANG_TIMEOUT, else off)", short="--hang-timeout")

    def check(self, job: "JobConfig") -> None:
        if self.auto_resume and not job.checkpoint.save:
            raise job.bad("recovery.auto_resume", "needs --save DIR (checkpoint.save: the "
                                                  "checkpoint directory)")
        if self.auto_resume and job.checkpoint.resume:
            raise ValueError(f"{job.show('recovery.auto_resume')} and "
                             f"{job.show('checkpoint.resume')} both choose the checkpoint to "
                             "start from; pass one")
        if self.hang_timeout is not None and not self.hang_timeout > 0:
            if job.origin.get("recovery.hang_timeout", "").startswith("$"):
                raise ValueError(f"TPKIT_HANG_TIMEOUT={os.environ.get('TPKIT_HANG_TIMEOUT')!r}"
                                 " must be a number of seconds > 0 (e.g. 900); unset it to "
                                 "turn the hang watchdog off")
            raise job.bad("recovery.hang_timeout", "must be > 0 seconds (longer than the "
                                                   "slowest step or save); leave it unset for "
                                                   "no watchdog")


@dataclass
class Pipeline:
    """Pipeline schedules (tpkit.pipeline; docs/pipeline.md); the stage count is
    parallelism.pp."""
    microbatches: int | None = opt(
        None, "micro-batches per step and dp rank (default 2 x pp; at pp=1 gradient "
              "accumulation over that many)", short="--microbatches")
    schedule: str = opt("1F1B", "torch.distributed.pipelining schedule", short="--pp-schedule")
    virtual_stages: int | None = opt(None, "stages per rank for the interleaved schedules "
                                           "(default 2)", short="--virtual-stages")

    def check(self, job: "JobConfig") -> None:
        from ..pipeline import SCHEDULES   # imports torch: only when a job is checked
        if self.schedule not in SCHEDULES:
            raise job.bad("pipeline.schedule", f"is unknown; use one of {list(SCHEDULES)}")
        if self.microbatches is not None and self.microbatches < 1:
            raise job.bad("pipeline.microbatches", "must be >= 1")


@dataclass
class Experts:
    """Mixture of experts (docs/moe.md): every ``every``-th block's MLP becomes a
    tpkit.nn.MoE."""
    num: int = opt(0, "experts per MoE layer (0: dense MLPs)", short="--moe-experts")
    topk: int = opt(2, "experts per token", short="--moe-topk")
    every: int = opt(1, "every k-th block is MoE", short="--moe-every")
    aux_coeff: float = opt(1e-2, "load-balancing loss coefficient", short="--moe-aux-coeff")
    capacity_factor: float | None = opt(None, "drop tokens beyond this capacity (unset: "
                                              "dropless)", short="--moe-capacity-factor")

    def check(self, job: "JobConfig") -> None:
        if not self.num:
            for path in ("parallelism.ep", "parallelism.etp", "experts.capacity_factor"):
                if job.get(path) is not None:
                    raise ValueError(f"{job.show(path)} needs --moe-experts > 0 (experts.num)")
            return
        if job.data.pack:
            raise ValueError(f"{job.show('experts.num')} with {job.show('data.pack')} is not "
                             "supported yet (packed rows hold unequal token counts, which the "
                             "aux loss's share assumes equal); drop one of them")
        from ..nn.moe import check_moe_args
        try:
            check_moe_args(self.num, self.topk, self.capacity_factor)
        except ValueError as e:
            raise ValueError(f"{job.show('experts.num')}: {e}") from None
        if job.parallelism.data_parallel == "fsdp":   # TPKitStrategy.setup_module's refusal
            raise ValueError(f"{job.show('experts.num')} with "
                             f"{job.show('parallelism.data_parallel')}: FSDP2 does not shard "
                             "expert weights yet (they are summed over the expert-data-parallel"
                             " ranks, docs/moe.md); use --data-parallel ddp")
        ep = job.parallelism.ep   # tpkit-launch's --ep: check_layout, at the final layout
        if ep is not None and self.num % ep:
            raise ValueError(f"{job.show('experts.num')} is not divisible by ep={ep}; use a "
                             f"multiple of {ep}")
        if not 1 <= self.every <= job.model.layers:
            raise job.bad("experts.every", f"must be between 1 and model.layers="
                                           f"{job.model.layers}")


@dataclass
class Logging:
    """tpkit.observe's MetricsLogger (docs/observe.md): rank 0's progress line every
    ``log_every`` steps; with ``log_dir``, TensorBoard event files and metrics.csv there
    (and W&B, a profile when asked)."""
    log_every: int = opt(10, "one progress line and metrics row (loss, lr, tokens/s, TFLOP/s, "
                             "step-time phases, memory) every N steps", short="--log-every")
    log_dir: str | None = opt(None, "write TensorBoard event files and metrics.csv there "
                                    "(needs pip install 'tpkit[observe]'; unset: the "
                                    "progress line only)", short="--log-dir")
    peak_tflops: float | None = opt(None, "the device's dense peak TFLOP/s that MFU divides "
                                          "by (unset: the datasheet table's; none on CPU)",
                                    short="--peak-tflops")
    profile_steps: str | None = opt(None, "A:B traces steps A..B-1 (0-based) with "
                                          "torch.profiler to LOG_DIR/profile/rank<R>.pt.trace"
                                          ".json (needs log_dir)", short="--profile-steps")
    wandb: str | None = opt(None, "also log to Weights & Biases, online or offline (needs "
                                  "log_dir and pip install wandb)", short="--wandb",
                            choices=("online", "offline"))

    def check(self, job: "JobConfig") -> None:
        import importlib.util
        if self.log_every < 1:
            raise job.bad("logging.log_every", "must be >= 1")
        if self.log_dir is not None:
            problem = output_dir_problem(self.log_dir)
            if problem:
                raise job.bad("logging.log_dir", f"{problem}; pass a directory (TensorBoard "
                                                 "files and metrics.csv go there)")
            if importlib.util.find_spec("tensorboard") is None:
                raise job.bad("logging.log_dir", "needs the tensorboard package to write "
                                                 "event files; pip install 'tpkit[observe]'")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise job.bad("logging.peak_tflops", "must be > 0 (the device's dense TFLOP/s "
                                                 "from its datasheet, e.g. 989.4)")
        for name in ("profile_steps", "wandb"):
            if getattr(self, name) is not None and self.log_dir is None:
                raise job.bad(f"logging.{name}", "needs --log-dir DIR (logging.log_dir: "
                                                 "where its files go)")
        if self.profile_steps is not None:
            steps = self.profile_steps.split(":")
            if len(steps) != 2 or not all(re.fullmatch(r"\d+", x.strip()) for x in steps) \
                    or not int(steps[0]) < int(steps[1]):
                raise job.bad("logging.profile_steps", "is not A:B with 0 <= A < B (steps "
                                                       "A..B-1 are traced, e.g. 2:4)")
            if int(steps[0]) >= job.training.steps:
                raise job.bad("logging.profile_steps", f"starts after the last step "
                                                       f"(training.steps={job.training.steps}"
                                                       "); choose A < training.steps")
        if self.wandb is not None and importlib.util.find_spec("wandb") is None:
            raise job.bad("logging.wandb", "needs the wandb package; pip install wandb, or "
                                           "drop --wandb")


SECTIONS: dict[str, type] = {
    "parallelism": Parallelism, "model": Model, "data": Data, "training": Training,
    "optimizer": Optimizer, "precision": Precision, "checkpoint": Checkpoint,
    "recovery": Recovery, "pipeline": Pipeline, "experts": Experts, "logging": Logging,
}


# --- the job --------------------------------------------------------------------------------
@dataclass
class JobConfig:
    """A whole job: one instance of every section. ``origin`` maps ``section.field`` to
    where a value that is not the default came from (``job.toml:12``, ``--steps``,
    ``$TPKIT_HANG_TIMEOUT``)."""
    parallelism: Parallelism = field(default_factory=Parallelism)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    precision: Precision = field(default_factory=Precision)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    recovery: Recovery = field(default_factory=Recovery)
    pipeline: Pipeline = field(default_factory=Pipeline)
    experts: Experts = field(default_factory=Experts)
    logging: Logging = field(default_factory=Logging)
    origin: dict = field(default_factory=dict, repr=False, compare=False)

    # --- values and where they came from ---------------------------------------------
    def get(self, path: str):
        section, name = path.split(".")
        return getattr(getattr(self, section), name)

    def is_default(self, path: str) -> bool:
        section, name = path.split(".")
        f = {f.name: f for f in fields(getattr(self, section))}[name]
        return self.get(path) == f.default

    def show(self, path: str) -> str:
        """``path``'s value and where it came from, as an error message names it:
        ``--steps=0 (training.steps)``, ``training.steps=0 (job.toml:3)``,
        ``training.steps=300 (default)``."""
        where, value = self.origin.get(path), self.get(path)
        if where and where.startswith("--"):
            if value is True:
                return f"{where} ({path})"
            return f"{where}={value!r} ({path})"
        return f"{path}={value!r} ({where or 'default'})"

    def bad(self, path: str, problem: str) -> ValueError:
        return ValueError(f"{self.show(path)} {problem}")

    # --- checks ----------------------------------------------------------------------
    def check(self) -> "JobConfig":
        """Every check that needs no layout: the data-vs-model clashes, then each section's
        own, in table order (a section may read the others). ValueError, one line, on the
        first bad value."""
        if self.data.pack and self.model.impl == "te":
            raise ValueError(f"{self.show('data.pack')} needs --model.impl torch or auto (TE's"
                             " TransformerLayer is built with attn_input_format='sbhd'); drop "
                             "--pack or set --model.impl torch")
        if self.data.pack and self.model.init_from_hf:
            raise ValueError(f"{self.show('data.pack')} trains the reference GPT; drop "
                             "--init-from-hf or --pack")
        for name in SECTIONS:
            getattr(self, name).check(self)
        return self

    def microbatches(self, pp: int) -> int:
        """Micro-batches per step and dp rank at ``pp`` stages."""
        if self.pipeline.microbatches is not None:
            return self.pipeline.microbatches
        return 2 * pp if pp > 1 else 1

    def check_layout(self, state) -> None:
        """The checks that need the layout ``state`` (a ParallelState, real or planned):
        the batch against dp, the sequence against its shards, the pipeline plan."""
        from ..data import check_sequence_length
        t, p = self.training, self.pipeline
        if self.experts.num and self.experts.num % state.ep_size:
            raise ValueError(f"{self.show('experts.num')} is not divisible by ep="
                             f"{state.ep_size}; use a multiple of {state.ep_size}")
        if t.global_batch % state.dp_size:
            raise self.bad("training.global_batch", f"is not divisible by dp={state.dp_size};"
                                                    f" use a multiple of {state.dp_size}")
        if self.data.pack:
            return   # packing pads every document to the layout's multiple itself
        try:
            check_sequence_length(t.seq_len, state)
        except ValueError as e:
            raise ValueError(f"{self.show('training.seq_len')}: {e}") from None
        pp, m = state.pp_size, self.microbatches(state.pp_size)
        if pp > 1 and self.data.eval_every:
            raise self.bad("data.eval_every", f"with pipeline stages (pp={pp}) is not "
                                              "supported yet; drop one of them")
        if pp == 1:
            given = [self.show(f"pipeline.{n}") for n in ("virtual_stages", "schedule")
                     if not self.is_default(f"pipeline.{n}")]
            if given:
                raise ValueError(f"{', '.join(given)} only apply with pipeline stages (pp=1 "
                                 "here); add --pp N (N > 1) or drop them")
        else:
            for path, bad, why in (
                    ("model.init_from_hf", self.model.init_from_hf, "Hugging Face "
                     "weights are not loaded into pipeline stages yet (a Llama from scratch, "
                     "--arch llama, trains at --pp N)"),
                    ("parallelism.data_parallel", self.parallelism.data_parallel == "fsdp",
                     "FSDP2 units inside pipeline stages are not wired yet (the stages' "
                     "gradients are averaged by one all-reduce per step)"),
                    ("training.cpu_offload_layers", t.cpu_offload_layers > 0, "activation "
                     "offload inside pipeline stages is not wired yet")):
                if bad:
                    raise ValueError(f"{self.show(path)} with --pp {pp}: {why}; drop it or "
                                     "use --pp 1")
            from ..pipeline import plan_pipeline
            from .arch import num_layers
            try:
                plan_pipeline(pp=pp, num_blocks=num_layers(self), microbatches=m,
                              schedule=p.schedule, virtual_stages=p.virtual_stages,
                              recompute=t.recompute)
            except ValueError as e:
                raise ValueError(f"--pp {pp} --layers {num_layers(self)} --microbatches {m} "
                                 f"--pp-schedule {p.schedule}: {e}") from None
        r = self.parallelism.dp_replicate
        if state.dp_cp_size % r:
            raise self.bad("parallelism.dp_replicate",
                           f"does not divide the data ranks dp x cp = {state.dp_size} x "
                           f"{state.cp_size} = {state.dp_cp_size}; use a divisor of "
                           f"{state.dp_cp_size}")
        if (t.global_batch // state.dp_size) % m:
            raise ValueError(f"{self.show('training.global_batch')} does not split into dp x "
                             f"microbatches = {state.dp_size} x {m}; use a multiple of "
                             f"{state.dp_size * m} (or change --microbatches)")

    def layout(self, launch=None):
        """The job's layout, not yet checked against a world size (ParallelConfig.validate):
        the parallelism section over the launcher's. ``launch``: tpkit-launch's layout as
        its pre-flight sees it (a ParallelConfig whose ``origin`` names where each value
        came from; every value when it has none): a size given to tpkit-launch's flags and
        here with two values is a ValueError naming both (one run has one layout), and the
        launch then runs this layout (its dry run prints it, its workers read it back).
        Else an environment (default os.environ): its ``TPKIT_*`` are defaults that the
        job's values win over (``ParallelConfig.from_env``)."""
        from ..config import ENV_VARS, ParallelConfig
        job = self

        class _Where(str):   # ParallelConfig's messages name each value's origin
            def format(self, name, flag):
                return job.origin.get(f"parallelism.{name}", f"parallelism.{name}")

        par = self.parallelism
        mine = {n: getattr(par, n) for n in ENV_VARS if getattr(par, n, None) is not None}
        if not isinstance(launch, ParallelConfig):
            return ParallelConfig.from_env(launch, given_as=_Where("job"), **mine)
        given = launch.origin if launch.origin is not None else \
            dict.fromkeys(ENV_VARS, "the launch's layout")
        given = {n: o for n, o in given.items() if getattr(launch, n) is not None}
        for name, value in mine.items():
            if name in given and not given[name].startswith("$") \
                    and getattr(launch, name) != value:
                raise ValueError(
                    f"{self.show(f'parallelism.{name}')} conflicts with {name}="
                    f"{getattr(launch, name)!r} from {given[name]}: one run has one layout; "
                    f"give {name} in one place, or the same value in both")
        env = {var: value for var, value in launch.to_env().items()
               if any(ENV_VARS[n] == var for n in given)}
        config = ParallelConfig.from_env(env, given_as=_Where("job"), **mine)
        origin = {**config.origin, **{n: o for n, o in given.items()
                                      if n in config.origin and n not in mine}}
        return dataclasses.replace(config, origin=origin)

    # --- TOML out --------------------------------------------------------------------
    def to_toml(self) -> str:
        """The resolved job as TOML, every field with its doc; unset (None) fields are
        commented out. ``--config`` of this text reproduces the job."""
        lines = ["# tpkit-train job (tpkit-train --print-config); run it with "
                 "tpkit-train --config FILE"]
        for name in SECTIONS:
            section = getattr(self, name)
            lines += ["", f"[{name}]"]
            for f in fields(section):
                lines.append(f"# {f.metadata['doc']}")
                v = getattr(section, f.name)
                lines.append(f"# {f.name} =   # unset" if v is None
                             else f"{f.name} = {_toml_value(v)}")
        return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)   # a TOML basic string


# --- reading a file and flags -----------------------------------------------------------
def _field_type(f) -> tuple[type, bool]:
    """(int/float/str/bool, may be None) from the annotation's text."""
    parts = [p.strip() for p in str(f.type).split("|")]
    base = {"int": int, "float": float, "str": str, "bool": bool}[parts[0]]
    return base, "None" in parts


def _coerce(f, value, where: str, path: str):
    """``value`` as field ``f``'s type, or ValueError naming it."""
    base, _ = _field_type(f)
    ok = (isinstance(value, bool) if base is bool else
          isinstance(value, int) and not isinstance(value, bool) if base is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if base is float
          else isinstance(value, str))
    if not ok:
        example = {int: "an integer, e.g. 1", float: "a number, e.g. 0.5",
                   str: 'a string, e.g. "x"', bool: "true or false"}[base]
        raise ValueError(f"{path}={value!r} ({where}) must be {example}")
    value = float(value) if base is float else value
    choices = f.metadata["choices"]
    if choices is not None and value not in choices:
        raise ValueError(f"{path}={value!r} ({where}) is not one of {list(choices)}; use one "
                         "of them")
    return value


def _toml_lines(text: str) -> dict[str, int]:
    """``section`` and ``section.key`` -> the line that sets it (for error messages)."""
    out, section = {}, ""
    for i, line in enumerate(text.splitlines(), 1):
        m = re.match(r"\s*\[\s*([^\]\s]+)\s*\]", line)
        if m:
            section = m.group(1)
            out.setdefault(section, i)
            continue
        m = re.match(r"\s*([A-Za-z0-9_\-\"']+)\s*=", line)
        if m:
            out.setdefault(f"{section}.{m.group(1).strip(chr(34) + chr(39))}"
                           if section else m.group(1), i)
    return out


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def read_toml(path: str, job: JobConfig) -> None:
    """Set ``job``'s fields from the TOML file ``path`` (origin ``path:line``)."""
    try:
        import tomllib
    except ImportError:   # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError(f"--config {path}: reading TOML on Python < 3.11 needs the "
                             "'tomli' package; pip install tomli") from None
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}; pass an existing TOML file "
                         "(tpkit-train --print-config writes one)") from None
    text = raw.decode("utf-8", errors="replace")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not valid TOML: {e}; fix that line") from None
    lines = _toml_lines(text)
    for name, table in data.items():
        at = f"{path}:{lines.get(name, '?')}"
        if name not in SECTIONS:
            if not isinstance(table, dict):
                owners = [s for s, cls in SECTIONS.items()
                          if name in {f.name for f in fields(cls)}]
                fix = f"put it under [{owners[0]}]" if owners else "put it under a section"
                raise ValueError(f"{at}: {name} = {table!r} is outside any section; {fix}")
            raise ValueError(f"{at}: unknown section [{name}]; {_suggest(name, SECTIONS)}use "
                             f"one of {list(SECTIONS)}")
        if not isinstance(table, dict):
            raise ValueError(f"{at}: {name} must be a section ([{name}]), not a value")
        section = getattr(job, name)
        known = {f.name: f for f in fields(section)}
        for key, value in table.items():
            where = f"{path}:{lines.get(f'{name}.{key}', '?')}"
            if key not in known:
                raise ValueError(f"{where}: unknown key {key!r} in [{name}]; "
                                 f"{_suggest(key, known)}use one of {list(known)}")
            setattr(section, key, _coerce(known[key], value, where, f"{name}.{key}"))
            job.origin[f"{name}.{key}"] = where


class _Flag(argparse.Action):
    """Stores (value, the option string used) so that errors can name the flag."""
    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const if values is None or values == [] else values
        getattr(namespace, "_flags").append((self.dest, value, option_string))


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def _parse_number(base: type) -> Callable:
    def parse(text: str):
        try:
            return base(text)
        except ValueError:
            kind = "an integer" if base is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
    parse.__name__ = base.__name__
    return parse


def build_parser(prog: str | None = None, description: str | None = None
                 ) -> argparse.ArgumentParser:
    """The flags of every field: ``--section.field`` and the field's short names;
    ``--help`` shows each with its doc and default."""
    ap = argparse.ArgumentParser(
        prog=prog, description=description, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter, argument_default=argparse.SUPPRESS)
    ap.add_argument("--config", metavar="FILE", default=None, action="append",
                    help="a TOML job file (flags override its values); one")
    ap.add_argument("--print-config", action="store_true", default=False,
                    help="print the resolved job as TOML and exit")
    for name, cls in SECTIONS.items():
        group = ap.add_argument_group(f"[{name}]", (cls.__doc__ or "").split("\n\n")[0]
                                      .replace("\n", " ").strip())
        for f in fields(cls):
            base, _ = _field_type(f)
            dest = f"{name}.{f.name}"
            doc = f.metadata["doc"] + f" (default: {f.default})"
            choices = f.metadata["choices"]
            if base is bool:
                group.add_argument(f"--{dest}", dest=dest, action=_Flag, nargs="?",
                                   const=True, type=_parse_bool, metavar="true|false",
                                   help=doc)
                if f.metadata["short"]:
                    group.add_argument(*f.metadata["short"], dest=dest, action=_Flag,
                                       nargs=0, const=True, help=f"same as --{dest}")
            else:
                group.add_argument(f"--{dest}", *f.metadata["short"], dest=dest,
                                   action=_Flag, choices=choices,
                                   type=str if base is str else _parse_number(base),
                                   metavar=None if choices else base.__name__.upper(),
                                   help=doc)
    return ap


_OLD_BACKEND = ("--backend {value}: the trainer's layer implementation (torch, te or auto) is "
                "--model.impl now; use --model.impl {value} (--backend is tpkit-launch's "
                "process-group backend, nccl or gloo, given before the script)")


def parse(argv=None, *, prog: str | None = None, description: str | None = None,
          env=None, defaults: dict | None = None) -> tuple[JobConfig, argparse.Namespace]:
    """(the checked JobConfig, the parsed namespace: ``config``, ``print_config``) from
    ``argv``: defaults < ``defaults`` (``{"section.field": (value, origin)}``, e.g. the
    Ray run's storage as checkpoint.save) < ``--config`` file < flags. Flag mistakes exit
    2 through argparse; value mistakes raise ValueError (one line: field, value, origin,
    fix)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if env is None else env
    for i, a in enumerate(argv):
        if a == "--backend" or a.startswith("--backend="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv)
                                                         else "torch")
            raise ValueError(_OLD_BACKEND.format(value=value))
        m = re.match(r"(--\w+\.)([\w-]+)(=.*)?$", a)
        if m:   # --model.gqa-groups is --model.gqa_groups
            argv[i] = m.group(1) + m.group(2).replace("-", "_") + (m.group(3) or "")
    ap = build_parser(prog, description)
    ns = argparse.Namespace(_flags=[])
    ns = ap.parse_args(argv, namespace=ns)
    job = JobConfig()
    if ns.config and len(ns.config) > 1:   # the second silently replaced the first
        raise ValueError(f"--config given {len(ns.config)} times ({', '.join(ns.config)}); "
                         "pass one job file (flags override its values; tpkit-train "
                         "--config A --print-config > B writes one to edit)")
    ns.config = ns.config[0] if ns.config else None
    for dest, (value, origin) in (defaults or {}).items():
        setattr(getattr(job, dest.split(".")[0]), dest.split(".")[1], value)
        job.origin[dest] = origin
    if ns.config:
        read_toml(ns.config, job)
    for dest, value, flag in ns._flags:
        section, name = dest.split(".")
        setattr(getattr(job, section), name, value)
        job.origin[dest] = flag
    if job.recovery.hang_timeout is None and env.get("TPKIT_HANG_TIMEOUT", "").strip():
        raw = env["TPKIT_HANG_TIMEOUT"].strip()
        try:
            job.recovery.hang_timeout = float(raw)
        except ValueError:
            job.recovery.hang_timeout = -1.0
        job.origin["recovery.hang_timeout"] = "$TPKIT_HANG_TIMEOUT"
    return job.check(), ns


def field_docs() -> list[tuple[str, str, Any, str, tuple]]:
    """(section.field, type, default, doc, short flags) of every field, in order: the
    table docs/train.md shows (tests/train/test_job_config.py checks it)."""
    out = []
    for name, cls in SECTIONS.items():
        for f in fields(cls):
            out.append((f"{name}.{f.name}", str(f.type), f.default, f.metadata["doc"],
                        f.metadata["short"]))
    return out


def markdown_table() -> str:
    """docs/train.md's table of every field (section by section): its TOML key, flags,
    type, default and doc."""
    out = []
    for name, cls in SECTIONS.items():
        out += [f"**[{name}]** {' '.join((cls.__doc__ or '').split())}", "",
                "| key | flags | type | default | what |", "| --- | --- | --- | --- | --- |"]
        for f in fields(cls):
            flags = ", ".join(f"`{x}`" for x in (f"--{name}.{f.name}", *f.metadata["short"]))
            default = "unset" if f.default is None else f"`{_toml_value(f.default)}`"
            choices = f.metadata["choices"]
            doc = f.metadata["doc"] + (f"; one of {', '.join(map(str, choices))}"
                                       if choices else "")
            out.append(f"| `{f.name}` | {flags} | {str(f.type).replace('|', 'or')} | "
                       f"{default} | {doc} |")
        out.append("")
    return "\n".join(out)


__all__ = ["JobConfig", "SECTIONS", "parse", "read_toml", "build_parser", "field_docs",
           "markdown_table",
           *[cls.__name__ for cls in SECTIONS.values()]]
