"""Parameter tags: the attributes that say how a parameter is laid out over TP.

tpkit's layers tag their parameters when they create them (``set_tp_attrs``); everything
generic reads the tags instead of knowing the layers: full and sharded checkpoints,
sequence-parallel gradient sums, the TP-aware gradient norm, FSDP wrapping, deepcopy,
DeepSpeed's ``tensor_model_parallel`` marking.

======================  ==============================================================
tag                     meaning
======================  ==============================================================
``tp_partition_dim``    sharded over the TP group along this dim
``tp_partition_sizes``  the full dim is several segments (global sizes), each sharded on
                        its own: fused q/k/v, gate/up
``sequence_parallel``   replicated over TP but fed sequence-sharded activations: each TP
                        rank holds its own tokens' share of the gradient (a TP sum is due)
``tensor_model_parallel``, ``partition_dim``, ``partition_stride``
                        Transformer Engine / Megatron / DeepSpeed's names for a TP shard
``expert_parallel``     an expert weight (tpkit.nn.MoE): dim 0 holds this ep rank's
                        experts of ``num_experts``; its gradient is summed over the
                        expert-data-parallel group, not dp x cp
``etp_partition_dim``, ``etp_partition_sizes``
                        like the tp_* tags, over the expert-tensor-parallel group
``num_experts``         the global expert count of an expert weight
======================  ==============================================================

No torch import: the tags are plain attributes.
"""
from __future__ import annotations

from typing import Iterable

TP_PARAM_ATTRS = ("tp_partition_dim", "tp_partition_sizes", "sequence_parallel")
EXPERT_ATTRS = ("expert_parallel", "num_experts", "etp_partition_dim", "etp_partition_sizes")
FOREIGN_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride")
ALL_TAGS = TP_PARAM_ATTRS + FOREIGN_ATTRS + EXPERT_ATTRS

__all__ = ["TP_PARAM_ATTRS", "FOREIGN_ATTRS", "ALL_TAGS", "set_tp_attrs", "tp_spec",
           "partition_dim", "is_sequence_parallel", "tags_of",
           "set_tags", "mark_tensor_model_parallel", "EXPERT_ATTRS", "set_expert_attrs",
           "is_expert"]


def set_tp_attrs(param, partition_dim: int | None,
                 partition_sizes: tuple[int, ...] | None = None,
                 sequence_parallel: bool = False):
    """Tag ``param`` (see the module docstring) and return it."""
    if partition_dim is not None:
        param.tp_partition_dim = partition_dim
        if partition_sizes is not None:
            param.tp_partition_sizes = tuple(partition_sizes)
    if sequence_parallel:
        param.sequence_parallel = True
    return param


def partition_dim(t) -> int | None:
    """tpkit's own ``tp_partition_dim`` of ``t`` (None: not sharded by a tpkit layer)."""
    return getattr(t, "tp_partition_dim", None)


def tp_spec(t) -> tuple[int, tuple[int, ...] | None] | None:
    """(partition dim, segment sizes or None) of a TP-sharded tensor, tagged by tpkit or
    by Transformer Engine (``tensor_model_parallel`` + ``partition_dim``), else None."""
    dim = partition_dim(t)
    if dim is None and getattr(t, "tensor_model_parallel", False):
        dim = getattr(t, "partition_dim", None)
        if dim is not None and dim < 0:
            dim = None
    if dim is None:
        return None
    return int(dim), getattr(t, "tp_partition_sizes", None)


def is_sequence_parallel(p) -> bool:
    return bool(getattr(p, "sequence_parallel", False))


def tags_of(p) -> dict:
    """Every tag ``p`` carries (tpkit's and the foreign ones), by name."""
    return {t: getattr(p, t) for t in ALL_TAGS if hasattr(p, t)}


def set_tags(p, tags: dict) -> None:
    """Put back tags read with ``tags_of`` (on a copy or an FSDP DTensor parameter, whose
    creation drops Python attributes)."""
    for name, value in tags.items():
        setattr(p, name, value)


def mark_tensor_model_parallel(params: Iterable) -> int:
    """Set the foreign ``tensor_model_parallel`` flag on every tpkit-sharded parameter (as
    DeepSpeed's gradient norm expects); returns how many were marked."""
    n = 0
    for p in params:
        if partition_dim(p) is not None:
            p.tensor_model_parallel = True
            n += 1
    return n


def set_expert_attrs(param, *, num_experts: int, etp_partition_dim: int | None = None,
                     etp_partition_sizes: tuple[int, ...] | None = None):
    """Tag an expert weight (dim 0: this ep rank's experts) and return it."""
    param.expert_parallel = True
    param.num_experts = int(num_experts)
    if etp_partition_dim is not None:
        param.etp_partition_dim = etp_partition_dim
        if etp_partition_sizes is not None:
            param.etp_partition_sizes = tuple(etp_partition_sizes)
    return param


def is_expert(p) -> bool:
    return bool(getattr(p, "expert_parallel", False))
