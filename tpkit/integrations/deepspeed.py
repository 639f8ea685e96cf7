"""DeepSpeed integration: an ``mpu`` over a ParallelState, and DeepSpeed's activation
checkpointing on tpkit's RNG tracker.

DeepSpeed finds model parallelism through a duck-typed ``mpu`` object; it probes names
with ``hasattr`` and silently changes behaviour when one is missing. ``DeepSpeedMPU``
answers every family DeepSpeed 0.16-0.19 asks for, read off one ParallelState:

=================================  =================  ===================================
DeepSpeed name                      tpkit group        used by DeepSpeed for
=================================  =================  ===================================
tensor_model_parallel, slice        tp                 bwc_* helpers, activation checkpointing
model_parallel (legacy Megatron)    mp (tp x pp)       ZeRO grad-norm / overflow reduction, ckpt names
data_parallel                       dp                 batch-size arithmetic, dp rank
pipeline_model_parallel, pipe       pp                 pipeline engine, checkpoint metadata
sequence_parallel                   cp                 sequence-parallel gradient scaling
sequence_data_parallel              dp_cp              ZeRO partitioning, gradient all-reduce
=================================  =================  ===================================

Gradient scaling with CP: DeepSpeed all-reduces gradients over ``sequence_data_parallel``
(DP x CP) and divides by ``DP x CP / sequence_parallel_world_size`` = DP, i.e. it
*sums* over CP ranks and averages over DP replicas. That is right when each CP rank's
loss is its *share* of its replica's loss (sum over its tokens / token count of the whole
sequence) — see ``sequence_share``. A per-rank mean loss would give CP-times gradients.

The object deliberately has no ``initialize_sequence_parallel``: DeepSpeed takes that
method as the mark of its own Ulysses mpu and then ignores the data-parallel and
model-parallel groups.
"""
from __future__ import annotations

import warnings

import torch

from ..comm.collectives import all_reduce_sum
from ..layout.param_tags import mark_tensor_model_parallel
from ..layout.random import get_rng_tracker, model_parallel_seed
from ..layout.topology import ParallelState, get_parallel_state, is_initialized

INSTALL_HINT = ("DeepSpeed is not installed; tpkit.integrations.deepspeed needs it: "
                "pip install tpkit[deepspeed]  (or: pip install deepspeed)")


def require_deepspeed():
    """Import and return ``deepspeed``, or raise ImportError naming the extra to install."""
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return deepspeed


# DeepSpeed family name -> ParallelState group name.
FAMILIES = {
    "tensor_model_parallel": "tp",
    "slice_parallel": "tp",            # DeepSpeed's PipelineParallelGrid name for TP
    "model_parallel": "mp",            # legacy Megatron: tp x pp
    "data_parallel": "dp",
    "pipeline_model_parallel": "pp",
    "pipe_parallel": "pp",             # DeepSpeed's PipelineParallelGrid name for PP
    "sequence_parallel": "cp",
    "sequence_data_parallel": "dp_cp",
}


def _family(family: str, group: str):
    """The ``get_<family>_{group,rank,world_size,group_ranks,src_rank}`` methods."""

    def get_group(self):
        return getattr(self.state, f"{group}_group")

    def get_rank(self) -> int:
        return getattr(self.state, f"{group}_mesh").get_local_rank()

    def get_world_size(self) -> int:
        return getattr(self.state, f"{group}_mesh").size()

    def get_group_ranks(self) -> list[int]:
        return self.state.group_ranks(group)

    def get_src_rank(self) -> int:
        return self.state.group_ranks(group)[0]

    out = {}
    for suffix, fn in (("group", get_group), ("rank", get_rank),
                       ("world_size", get_world_size), ("group_ranks", get_group_ranks),
                       ("src_rank", get_src_rank)):
        fn.__name__ = f"get_{family}_{suffix}"
        fn.__doc__ = f"{suffix.replace('_', ' ')} of tpkit's {group!r} group"
        out[fn.__name__] = fn
    return out


class _MPUBase:
    def __init__(self, state: ParallelState | None = None):
        require_deepspeed()
        self._state = state

    @property
    def state(self) -> ParallelState:
        """The wrapped state, or the current one when constructed with ``state=None``."""
        return self._state if self._state is not None else get_parallel_state()


for _name, _group in FAMILIES.items():
    for _k, _fn in _family(_name, _group).items():
        setattr(_MPUBase, _k, _fn)


class DeepSpeedMPU(_MPUBase):
    """DeepSpeed's ``mpu`` over a ParallelState (the current one when ``state`` is None,
    looked up at each call): ``deepspeed.initialize(..., mpu=DeepSpeedMPU())``.

    Methods: ``get_<family>_{group,rank,world_size,group_ranks,src_rank}`` for every
    family in ``FAMILIES``, Megatron's ``with_context_parallel`` keyword on the
    data-parallel getters, and the pipeline first/last-stage helpers.
    """

    # Megatron-Core spells DP x CP as data_parallel(with_context_parallel=True).
    def get_data_parallel_group(self, with_context_parallel: bool = False):
        return self.state.dp_cp_group if with_context_parallel else self.state.dp_group

    def get_data_parallel_rank(self, with_context_parallel: bool = False) -> int:
        s = self.state
        return s.dp_cp_mesh.get_local_rank() if with_context_parallel else s.dp_rank

    def get_data_parallel_world_size(self, with_context_parallel: bool = False) -> int:
        s = self.state
        return s.dp_cp_size if with_context_parallel else s.dp_size

    def get_data_parallel_group_ranks(self, with_context_parallel: bool = False) -> list[int]:
        return self.state.group_ranks("dp_cp" if with_context_parallel else "dp")

    def get_data_parallel_src_rank(self, with_context_parallel: bool = False) -> int:
        return self.get_data_parallel_group_ranks(with_context_parallel)[0]

    def get_pipeline_model_parallel_first_rank(self) -> int:
        return self.state.group_ranks("pp")[0]

    def get_pipeline_model_parallel_last_rank(self) -> int:
        return self.state.group_ranks("pp")[-1]

    def is_pipeline_first_stage(self) -> bool:
        return self.state.pp_rank == 0

    def is_pipeline_last_stage(self) -> bool:
        return self.state.pp_rank == self.state.pp_size - 1

    def model_parallel_is_initialized(self) -> bool:
        return self._state is not None or is_initialized()

    def __repr__(self) -> str:
        s = self.state
        return (f"DeepSpeedMPU(tp={s.tp_size}, cp={s.cp_size}, dp={s.dp_size}, "
                f"pp={s.pp_size}, rank={s.rank})")


def sequence_share(loss_sum: torch.Tensor, num_tokens, state: ParallelState | None = None
                   ) -> torch.Tensor:
    """This CP rank's share of its replica's mean loss: ``loss_sum`` (summed over the
    local tokens) divided by the token count of the whole sequence (``num_tokens`` summed
    over the CP group, without gradient). Shares add up over CP ranks to the replica's
    mean loss, which is what DeepSpeed's gradient scaling (sum over CP) expects."""
    state = state if state is not None else get_parallel_state()
    n = torch.as_tensor(num_tokens, dtype=torch.float64, device=loss_sum.device).detach().clone()
    if state.cp_size > 1:
        n = all_reduce_sum(n, state.cp_group)
    if n.item() <= 0:
        raise ValueError(f"the sequence has {n.item():g} tokens across the CP group; "
                         "num_tokens must be positive on at least one CP rank")
    return loss_sum / n.to(loss_sum.dtype)


def mark_tensor_parallel_params(module: torch.nn.Module) -> int:
    """Set DeepSpeed's ``tensor_model_parallel`` flag on every parameter tpkit shards over
    TP (``tp_partition_dim`` not None); returns how many were marked.

    DeepSpeed's gradient norm (clipping, ZeRO overflow checks) counts an unmarked
    parameter on TP rank 0 only, so unmarked TP shards would leave out the other ranks'
    shards and clip with a wrong norm."""
    return mark_tensor_model_parallel(module.parameters())


# --- activation checkpointing --------------------------------------------------------
_ORIGINALS: dict[str, object] = {}
_PATCHED = ("get_cuda_rng_tracker", "_CUDA_RNG_STATE_TRACKER", "model_parallel_cuda_manual_seed")


def configure_activation_checkpointing(state: ParallelState | None = None, *,
                                       mpu: DeepSpeedMPU | None = None, **kwargs):
    """``deepspeed.checkpointing.configure(DeepSpeedMPU(state), **kwargs)`` with one RNG
    tracker: DeepSpeed's checkpointing is pointed at tpkit's tracker, so dropout forked
    with ``tpkit.layout.random.get_rng_tracker().fork()`` (tpkit.nn layers) or with
    ``deepspeed.checkpointing.get_cuda_rng_tracker().fork()`` (Megatron-DeepSpeed models)
    uses and replays the same stream.

    This monkeypatches three names of ``deepspeed.checkpointing`` (undo with
    ``restore_deepspeed_rng``): ``get_cuda_rng_tracker`` and ``_CUDA_RNG_STATE_TRACKER``
    return tpkit's tracker, and ``model_parallel_cuda_manual_seed(seed)`` runs
    ``tpkit.layout.random.model_parallel_seed(seed, state)`` (the default stream the same on a
    whole PP stage, the model-parallel stream distinct per (tp, pp) coordinate and the
    same across CP and DP ranks; DeepSpeed's own seeds only differ per TP rank).

    ``partition_activations=True`` needs TP >= 2: DeepSpeed 0.19 breaks in backward at
    model-parallel size 1. Returns the mpu."""
    deepspeed = require_deepspeed()
    if state is None:
        state = mpu.state if mpu is not None else get_parallel_state()
    if mpu is None:
        mpu = DeepSpeedMPU(state)
    elif mpu.state is not state:
        raise ValueError("mpu= wraps a different ParallelState than state=; pass one of them")
    if kwargs.get("partition_activations") and state.tp_size < 2:
        raise ValueError(
            f"partition_activations=True needs tensor parallelism (TP >= 2) but TP="
            f"{state.tp_size}: DeepSpeed partitions saved activations over the TP group and "
            "its backward fails at size 1; pass partition_activations=False")
    if not deepspeed.comm.is_initialized():
        # configure() logs through deepspeed.comm; this adopts tpkit's default group.
        deepspeed.init_distributed(dist_backend=state.backend, verbose=False)
    ckpt = deepspeed.checkpointing
    if not _ORIGINALS:
        _ORIGINALS.update({n: getattr(ckpt, n) for n in _PATCHED})

    def model_parallel_cuda_manual_seed(seed: int):
        """tpkit.layout.random.model_parallel_seed on the configured state (patched by tpkit)."""
        model_parallel_seed(seed, state)

    tracker = get_rng_tracker()
    if tracker.device.type != state.device.type:
        warnings.warn(f"tpkit's RNG tracker is on {tracker.device} but the state's device is "
                      f"{state.device}; seed it with tpkit.layout.random.model_parallel_seed first")
    ckpt.get_cuda_rng_tracker = get_rng_tracker
    ckpt._CUDA_RNG_STATE_TRACKER = tracker
    ckpt.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed
    ckpt.configure(mpu, **kwargs)
    return mpu


def restore_deepspeed_rng() -> None:
    """Undo configure_activation_checkpointing's patches of deepspeed.checkpointing."""
    if not _ORIGINALS:
        return
    ckpt = require_deepspeed().checkpointing
    for name, value in _ORIGINALS.items():
        setattr(ckpt, name, value)
    _ORIGINALS.clear()
