"""What a memory estimate reads and returns: ``MemoryJob`` (the model's shape and how it is trained)
and ``MemoryEstimate`` (one rank's bytes, term by term, and the peak)."""
from __future__ import annotations

import dataclasses

from ..models.shape import ModelShape


GiB = 1024 ** 3
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "fp8")
OPTIMIZERS = ("adamw", "adam", "sgd", "none")
# bytes per element of (the residual stream, what the matmuls and attention produce):
# autocast keeps the residual stream in the float32 of the parameters
_ACT = {"32-true": (4, 4), "bf16-mixed": (4, 2), "16-mixed": (4, 2), "bf16-true": (2, 2),
        "fp8": (4, 4)}
AUTOCAST = ("bf16-mixed", "16-mixed")


@dataclasses.dataclass(frozen=True)
class MemoryJob:
    """A training job as the estimator needs it: the model, the batch each rank computes at
    once, and how it is trained. ``micro_batch`` is the sequences of one micro-batch per
    data-parallel rank (the local batch / ``microbatches``)."""

    model: ModelShape
    micro_batch: int = 1
    seq_len: int = 2048
    microbatches: int = 1            # per step and dp rank (pp > 1: the schedule's)
    precision: str = "32-true"       # PRECISIONS; parameters stay float32 except bf16-true
    recompute: bool = False          # whole blocks recomputed in backward
    optimizer: str = "adamw"
    data_parallel: str = "ddp"       # or "fsdp" (FSDP2 over dp x cp)
    pp_schedule: str = "1F1B"
    virtual_stages: int | None = None
    packed: bool = False             # one packed row of documents (THD attention)
    dropout: float = 0.0             # hidden dropout (keeps a 1-byte mask per element)
    attention_dropout: float = 0.0
    async_save: bool = False         # a host staging copy of the rank's checkpoint shard
    fp8_recipe: str = "delayed"
    amax_history: int = 1024         # delayed scaling's history length
    # whose kernels run: "cpu" (the decompositions tests/memory/test_memory.py measures) or
    # "cuda": the fused RMSNorm saves its input and rstd only, fp32 attention with GQA
    # falls back to SDPA's math kernel (it keeps the probabilities and the repeated K/V),
    # and torch's default foreach AdamW allocates one float32 temporary of every
    # parameter in its step (CPU's single-tensor loop: one parameter at a time)
    device: str = "cpu"

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"MemoryJob.precision={self.precision!r} is unknown; use one of "
                             f"{PRECISIONS}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"MemoryJob.optimizer={self.optimizer!r} is unknown; use one of "
                             f"{OPTIMIZERS}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"MemoryJob.device={self.device!r} must be 'cpu' or 'cuda'")
        if self.data_parallel not in ("ddp", "fsdp"):
            raise ValueError(f"MemoryJob.data_parallel={self.data_parallel!r} must be 'ddp' "
                             "or 'fsdp'")
        for name in ("micro_batch", "seq_len", "microbatches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MemoryJob.{name}={v!r} must be an integer >= 1")

    # --- constructors ----------------------------------------------------------------
    @classmethod
    def from_job(cls, job, model: ModelShape | None, *, dp: int = 1, pp: int = 1,
                 device: str = "cpu") -> "MemoryJob | None":
        """From the trainer's ``tpkit.train.JobConfig`` training ``model`` (the shape of
        the model it builds: tpkit.train.trainer.model_shape, vocabulary included), at
        ``dp`` data-parallel ranks (the micro-batch is global batch / dp / micro-batches)
        and ``pp`` stages (the job's micro-batch count there), on ``device``'s kernels. None without a model (a
        dry run may plan the download of ``model.init_from_hf``: nothing to estimate)."""
        if model is None:
            return None
        m, t = job.model, job.training
        mb = job.microbatches(pp)
        return cls(model=model, micro_batch=max(1, t.global_batch // dp // mb),
                   seq_len=t.seq_len, microbatches=mb, precision=job.precision.mode,
                   recompute=bool(t.recompute), optimizer="adamw",
                   data_parallel=job.parallelism.data_parallel,
                   pp_schedule=job.pipeline.schedule,
                   virtual_stages=job.pipeline.virtual_stages, packed=bool(job.data.pack),
                   dropout=m.dropout, attention_dropout=m.dropout,
                   async_save=bool(job.checkpoint.async_save),
                   fp8_recipe=job.precision.fp8_recipe or "delayed", device=device)

    def at_dp(self, global_batch: int, dp: int) -> "MemoryJob":
        """This job with the micro-batch of ``global_batch`` sequences split over ``dp``."""
        return dataclasses.replace(self, micro_batch=max(1, global_batch // dp // self.microbatches))


@dataclasses.dataclass
class MemoryEstimate:
    """One rank's estimate: ``terms`` (name -> bytes, each at its largest), ``peak`` bytes
    (the most alive together) and ``phase`` (when: "forward", "backward" or "optimizer")."""

    role: str
    ranks: str
    terms: dict
    peak: int
    phase: str
    notes: list = dataclasses.field(default_factory=list)
    # bytes alive at each moment of a step ("forward", "backward", "end of backward",
    # "optimizer"; ``peak`` is their maximum), and the first step's peak: the optimizer
    # states do not exist before its optimizer step creates them
    phases: dict = dataclasses.field(default_factory=dict)
    first_step: int = 0

    @property
    def biggest(self) -> tuple[str, int]:
        """The largest term in bytes (the in-flight count is not bytes)."""
        return max(((k, v) for k, v in self.terms.items()
                    if k != "pipeline in-flight micro-batches"), key=lambda kv: kv[1])

    def gib(self) -> float:
        return self.peak / GiB
