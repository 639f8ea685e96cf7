"""Sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``) for tpkit's
layouts: one unit per transformer block, HSDP, a mixed-precision policy.

``shard_model(model, state)`` shards every parameter over the data ranks (dp x cp; the
TP shards of tpkit's layers are what FSDP2 shards further) in units, so that forward
holds one unit's parameters unsharded at a time (docs/train.md, "Sharded data
parallelism"):

- each transformer block is its own unit (``model.pp_blocks`` of the pp protocol, else
  every outermost ``tpkit.nn.TransformerLayer``: the blocks ``tpkit.compile_blocks``
  compiles; a ``tpkit.parallelize``d model's blocks are TransformerLayers or its
  ``pp_blocks``);
  else the longest ``nn.ModuleList`` of one class (Hugging Face's ``model.layers``); a
  model with none of these is the root unit alone;
- the stem (``pp_stem_modules``: the embedding) its own unit, the head
  (``pp_head_modules``: final norm and output layer) one unit, and the root the rest
  (for a model without the pp protocol, or whose head is tied to its embedding: one
  parameter in two units would be two parameters, so both stay in the root unit);
- ``reshard_after_forward`` per unit (``RESHARD``): True for the stem and every block
  (their parameters are gathered again in backward: the memory FSDP exists to save; the
  last block too, which torchtitan keeps gathered to save one all-gather, so that forward
  never holds two units unsharded at once), False for the head (backward starts there:
  a reshard would be gathered again at once) and the root (FSDP2's own choice for it);
- prefetching: in forward each block gathers the next one as it starts
  (``set_modules_to_forward_prefetch``), in backward the one before
  (``set_modules_to_backward_prefetch``), so the all-gathers overlap compute on devices
  with a communication stream; a prefetched block's gathered bytes sit in FSDP2's
  all-gather buffer until its own forward starts, not in its parameters;
- ``units="model"``: the whole model as one unit (the old behaviour; the bench's peer);
- ``replicate`` > 1 is HSDP: the dp x cp ranks form a (replicate, shard) mesh, the
  parameters sharded over the inner ``shard`` ranks (consecutive in dp x cp order, so
  within a node whenever tp x shard ranks fit one) and replicated over the outer ones
  (gradients reduce-scattered within, all-reduced across);
- ``mixed_precision="bf16"``: FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32): the gathered parameters and the compute in bfloat16, the
  gradients reduced and the sharded parameters (and the optimizer) in float32;
- expert weights (tagged ``expert_parallel``, tpkit.nn.MoE) are sharded over the ranks
  that hold the same experts (``state.edp_mesh``, the expert-data-parallel group: EP
  borrows its ranks from dp x cp, as torchtitan's dp_mod_ep), the dense weights over dp
  x cp: the dense units ignore the expert weights and each module owning some becomes
  its own unit over edp afterwards (its other weights stay in the dense unit around it).
  Their gradients are reduce-scattered over edp as a *sum* divided by dp x cp
  (``set_gradient_divide_factor``): the expert-gradient scaling of docs/moe.md, which
  DDP's runs do with tpkit.grads.reduce_expert_grads. With edp = 1 (ep = dp x cp) there
  is no one to shard with: the expert weights stay plain and that sum handles them;
- ``pipelined=True`` (a stage module of tpkit.distributed.pipeline, whose
  ``fsdp_parts`` name its stem, blocks and head): every unit keeps its parameters
  gathered after forward (torchtitan's choice with pipeline stages): the schedule
  keeps them gathered across the micro-batches' backwards anyway
  (``set_reshard_after_backward(False)``), and a reshard after each micro-batch's
  forward would gather them again for the next. The schedule also turns the gradient
  reduction off until the last micro-batch (``set_requires_gradient_sync(False)``) and
  runs it once per step (torch.distributed.pipelining's ``perform_reduce_grad``).

tpkit's parameter tags (tp_partition_dim, sequence_parallel, ...) are carried over to the
DTensor parameters FSDP2 creates, so checkpoints, clipping and the SP gradient sum treat
them as before.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..layout.param_tags import is_expert, set_tags, tags_of

__all__ = ["UNITS", "MIXED_PRECISION", "RESHARD", "fsdp_units", "fsdp_mesh", "shard_model",
           "expert_owners"]

UNITS = ("blocks", "model")
MIXED_PRECISION = (None, "bf16")
# reshard_after_forward of each kind of unit (shard_model's docstring says why)
RESHARD = {"stem": True, "block": True, "head": False, "root": False}


def _blocks(model: nn.Module) -> list[nn.Module]:
    """``model.pp_blocks``, else its outermost TransformerLayers (tpkit.compile_blocks'
    rule), else its longest ``nn.ModuleList`` of modules of one class (Hugging Face's
    ``model.layers``, nanoGPT's ``transformer.h``: a ``tpkit.parallelize``d model's
    decoder layers), else none."""
    from ..nn.compile import _blocks as blocks   # one definition of "the blocks"
    found = [b for b in blocks(model) if b is not model]
    if found:
        return found
    lists = [list(m) for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1
             and len({type(c) for c in m}) == 1]
    return max(lists, key=len) if lists else []


def _parts(model: nn.Module):
    """(stem modules, blocks, head modules): a pipeline stage's ``fsdp_parts()``, else the
    pp protocol's names and ``_blocks``."""
    if callable(getattr(model, "fsdp_parts", None)):
        return model.fsdp_parts()
    cls = type(model)
    stem = [getattr(model, n) for n in getattr(cls, "pp_stem_modules", ())
            if isinstance(getattr(model, n, None), nn.Module)]
    head = [getattr(model, n) for n in getattr(cls, "pp_head_modules", ())
            if isinstance(getattr(model, n, None), nn.Module)]
    return stem, _blocks(model), head


def fsdp_units(model: nn.Module, units: str = "blocks",
               pipelined: bool = False) -> list[tuple[str, list, bool]]:
    """The units ``shard_model`` makes, in forward order: (kind, modules,
    reshard_after_forward); the root (the model itself) is last. ``pipelined``: no unit
    reshards after forward (the module docstring)."""
    if units not in UNITS:
        raise ValueError(f"units={units!r} is unknown; use one of {list(UNITS)}")
    out = []
    if units == "blocks":
        stem, blocks, head = _parts(model)   # no blocks: the root alone
        stem = [m for m in stem if any(True for _ in m.parameters())]
        head = [m for m in head if any(True for _ in m.parameters())]
        stem_params = {id(p) for m in stem for p in m.parameters()}
        if any(id(p) in stem_params for m in head for p in m.parameters()):
            stem, head = [], []   # a tied embedding and head: one parameter, the root's unit
        if stem:
            out.append(("stem", stem, RESHARD["stem"]))
        out += [("block", [b], RESHARD["block"]) for b in blocks]
        if head:
            out.append(("head", head, RESHARD["head"]))
    out.append(("root", [model], RESHARD["root"]))
    if pipelined:
        out = [(kind, mods, False) for kind, mods, _ in out]
    return out


def fsdp_mesh(state, replicate: int = 1):
    """The DeviceMesh FSDP2 shards over: the dp x cp ranks (1-D), or with ``replicate`` >
    1 those ranks as (replicate, shard), shard the inner (consecutive) dimension."""
    n = state.dp_cp_size
    if replicate < 1 or n % replicate:
        raise ValueError(f"HSDP replicate={replicate} does not divide the data ranks dp x cp"
                         f" = {state.dp_size} x {state.cp_size} = {n}; use a divisor of {n}")
    if replicate == 1:
        return state.dp_cp_mesh
    return state.dp_cp_mesh._unflatten(0, (replicate, n // replicate),
                                       ("dp_replicate", "dp_shard"))


def expert_owners(model: nn.Module) -> list[nn.Module]:
    """The modules owning expert weights themselves (tpkit.nn.MoE), in module order."""
    return [m for m in model.modules()
            if any(is_expert(p) for p in m.parameters(recurse=False))]


def shard_model(model: nn.Module, state, *, units: str = "blocks", replicate: int = 1,
                mixed_precision: str | None = None, mesh=None,
                pipelined: bool = False) -> nn.Module:
    """Shard ``model`` (in place) with FSDP2 over ``state``'s data ranks in ``units``,
    its expert weights over the expert-data-parallel ranks (the module docstring);
    returns ``model``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision={mixed_precision!r} is unknown; use one of "
                         f"{list(MIXED_PRECISION)}")
    mesh = fsdp_mesh(state, replicate) if mesh is None else mesh
    mp = MixedPrecisionPolicy() if mixed_precision is None else MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    saved = {n: tags_of(p) for n, p in model.named_parameters()}
    plan = fsdp_units(model, units, pipelined)
    owners = expert_owners(model) if getattr(state, "edp_size", 1) > 1 else []
    experts = {p for m in owners for p in m.parameters(recurse=False) if is_expert(p)}
    for kind, mods, reshard in plan:
        fully_shard(mods if len(mods) > 1 else mods[0], mesh=mesh,
                    reshard_after_forward=reshard, mp_policy=mp,
                    ignored_params=experts or None)
    # each expert owner its own unit over edp, inside the dense unit that holds its other
    # weights (the router): outer first, so that the dense unit manages those
    if owners:   # tpkit.nn.MoE returns a reshaped (view) output, which tpkit's blocks add
        # out of place; FSDP2 warns about views at every forward of the expert unit
        warnings.filterwarnings("ignore", category=UserWarning, message=r"FSDP2-wrapped "
                                r"module \(FSDPMoE\) returned a view tensor")
    block_of: dict = {}   # the innermost unit's reshard_after_forward (the root is last)
    for _, mods, r in plan:
        for m in (m for b in mods for m in b.modules()):
            block_of.setdefault(id(m), r)
    for owner in owners:
        others = {p for p in owner.parameters() if p not in experts}
        fully_shard(owner, mesh=state.edp_mesh, mp_policy=mp, ignored_params=others,
                    reshard_after_forward=block_of.get(id(owner), True))
        # sum over edp, divided by dp x cp: the expert-gradient scaling (docs/moe.md)
        owner.set_gradient_divide_factor(float(state.dp_cp_size))
        if dist.get_backend(state.edp_group) != "nccl":   # gloo has no PREMUL_SUM: a sum,
            owner.set_force_sum_reduction_for_comms(True)   # then the division
    blocks = [mods[0] for kind, mods, _ in plan if kind == "block"]
    for prev, nxt in zip(blocks, blocks[1:]):
        prev.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([prev])
    for n, p in model.named_parameters():
        set_tags(p, saved.get(n, {}))
    return model
