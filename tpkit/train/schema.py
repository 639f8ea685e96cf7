"""The job's sections: every field declared once with its type, default and doc (``opt``), and
each section's own checks. ``tpkit.train.config`` puts them together into JobConfig."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ..layout.config import CP_COMM_TYPES, FP8_RECIPES


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
                                    "transformer block, tpkit.distributed.fsdp)",
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
        from .arch import num_layers   # --init-from-hf's: its config.json's
        if n and not 0 < n < num_layers(job):
            raise job.bad("training.cpu_offload_layers",
                          f"must be from 0 to model.layers - 1 = {num_layers(job) - 1} (the "
                          "last block's activations are needed first in backward)")
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
                  "torch.compile is not supported yet)")]
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
    """Pipeline schedules (tpkit.distributed.pipeline; docs/pipeline.md); the stage count is
    parallelism.pp."""
    microbatches: int | None = opt(
        None, "micro-batches per step and dp rank (default 2 x pp; at pp=1 gradient "
              "accumulation over that many)", short="--microbatches")
    schedule: str = opt("1F1B", "torch.distributed.pipelining schedule", short="--pp-schedule")
    virtual_stages: int | None = opt(None, "stages per rank for the interleaved schedules "
                                           "(default 2)", short="--virtual-stages")

    def check(self, job: "JobConfig") -> None:
        from ..distributed.pipeline import SCHEDULES   # imports torch: only when a job is checked
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
