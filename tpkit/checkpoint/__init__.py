"""Checkpoint helpers: full (unsharded) state dicts <-> TP-sharded models.

Generic over layers: a parameter is sharded iff it carries ``tp_partition_dim`` (tagged
by tpkit.nn layers; the loaders also read TE's ``tensor_model_parallel`` +
``partition_dim``, and take FSDP2 parameters' dp(x cp) pieces). If it also carries ``tp_partition_sizes`` (global segment sizes along
that dim, e.g. fused q/k/v ``(H*d, G*d, G*d)``), each segment is sharded on its own and
the local shard is the concatenation of this rank's chunk of every segment, so the full
tensor is ``cat(segment_0, segment_1, ...)`` in the un-interleaved order. Everything else
(replicated params, buffers) is taken as is.

Expert weights (tagged ``expert_parallel`` by tpkit.nn.MoE) hold this ep rank's slice of
dim 0 (``num_experts / ep`` experts, in global expert order) and, along
``etp_partition_dim``, their etp shard: their full tensor has every expert, so a full
state dict loads at any (ep, etp).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ._dcp import (MissingKeyError, _param_names, fsdp_local, missing_key_error,
                   unwrap_module)
from ..comm.collectives import all_gather, group_size
from ..layout.param_tags import is_expert, partition_dim, tp_spec
from ..layout.topology import resolve_state

__all__ = ["full_state_dict", "user_module", "load_full_state_dict", "load_full_optimizer_state_dict",
           "load_full", "full_shapes", "gather_param", "shard_tensor"]


def gather_param(p: torch.Tensor, dim: int, sizes, group) -> torch.Tensor:
    """The full tensor of the shard ``p`` (sharded along ``dim``, optionally in segments)."""
    n = group_size(group)
    local = p.detach().movedim(dim, 0).contiguous()
    if n == 1:
        return local.movedim(0, dim).clone()
    out = all_gather(local, group)
    per_rank = out.chunk(n, 0)
    if sizes is not None:
        seg_local = [s // n for s in sizes]
        pieces = [r.split(seg_local, 0) for r in per_rank]          # [rank][segment]
        out = torch.cat([pieces[r][s] for s in range(len(sizes)) for r in range(n)], 0)
    return out.movedim(0, dim).contiguous()


def shard_tensor(full: torch.Tensor, dim: int, sizes, rank: int, n: int) -> torch.Tensor:
    """This rank's shard of ``full`` (inverse of gather_param)."""
    t = full.movedim(dim, 0)
    segments = t.split(list(sizes), 0) if sizes is not None else [t]
    out = torch.cat([seg.chunk(n, 0)[rank] for seg in segments], 0)
    return out.movedim(0, dim)


def user_module(model: nn.Module) -> nn.Module:
    """The user's module inside the wrappers that rename its parameters: Lightning
    Fabric's ``_FabricModule`` (``fabric.setup_module``), DDP, ``torch.compile``. Their
    state dicts carry the inner names, their ``named_parameters`` a prefix: read through
    one of them the names would not match, and shards would pass for full tensors."""
    while True:
        inner = getattr(model, "_original_module", None)   # lightning's _FabricModule
        if not isinstance(inner, nn.Module):
            inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) \
                else getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def full_state_dict(model: nn.Module, state=None) -> dict[str, torch.Tensor]:
    """The unsharded state dict, identical on every rank (collective over TP, and over
    dp x cp for FSDP2 parameters: every rank must call it). Sharded params are
    all-gathered; the rest is cloned. ``model`` may be wrapped (``user_module``)."""
    state = resolve_state(state)
    model = user_module(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, DTensor):   # FSDP2: its dp(x cp) pieces -> the TP-local tensor
            with torch.no_grad():
                t = t.full_tensor()
        p = params.get(name)
        dim = partition_dim(p) if p is not None else None
        if p is not None and is_expert(p):
            out[name] = _gather_expert(t, p, state)
        elif dim is None:
            out[name] = t.detach().clone()
        else:
            out[name] = gather_param(t, dim, getattr(p, "tp_partition_sizes", None),
                                     state.tp_group)
    return out


def full_shapes(model: nn.Module, state=None) -> dict[str, torch.Size]:
    """The full (unsharded) shape of every state-dict entry, without communication: what
    full_state_dict would return shapes of, e.g. to draw a layout-independent init."""
    n = resolve_state(state).tp_size
    model = user_module(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        shape = list(t.shape)
        dim = partition_dim(params.get(name))
        if dim is not None:
            shape[dim] *= n
        out[name] = torch.Size(shape)
        if params.get(name) is not None and is_expert(params[name]):
            out[name] = torch.Size(_expert_full_shape(t, resolve_state(state)))
    return out


# --- expert weights (ep slice of dim 0, etp shard) --------------------------------------
def _expert_full_shape(t, state) -> tuple:
    shape = list(t.shape)
    shape[0] *= state.ep_size
    dim = getattr(t, "etp_partition_dim", None)
    if dim is not None:
        shape[dim] *= state.etp_size
    return tuple(shape)


def _gather_expert(t, p, state) -> torch.Tensor:
    dim = getattr(p, "etp_partition_dim", None)
    full = t.detach()
    if dim is not None:
        full = gather_param(full, dim, getattr(p, "etp_partition_sizes", None), state.etp_group)
    return all_gather(full.contiguous(), state.ep_group) if state.ep_size > 1 else full.clone()


def _expert_local(full: torch.Tensor, t, state) -> torch.Tensor:
    n = full.shape[0] // state.ep_size
    local = full.narrow(0, state.ep_rank * n, n)
    dim = getattr(t, "etp_partition_dim", None)
    if dim is not None:
        local = shard_tensor(local, dim, getattr(t, "etp_partition_sizes", None),
                             state.etp_rank, state.etp_size)
    return local


def _full_shape(t: torch.Tensor, spec, n: int) -> tuple:
    shape = list(t.shape)   # an FSDP2 DTensor's shape: its TP-local whole
    if spec is not None:
        shape[spec[0]] *= n
    return tuple(shape)


def _to_local(full: torch.Tensor, live: torch.Tensor, spec, state) -> torch.Tensor:
    """This rank's part of the full tensor ``full`` for ``live``: its TP shard (``spec``),
    then, for an FSDP2 DTensor, its dp(x cp) piece."""
    if spec is not None:
        full = shard_tensor(full, spec[0], spec[1], state.tp_rank, state.tp_size)
    return fsdp_local(live, full) if isinstance(live, DTensor) else full


def load_full_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], state=None, *,
                         strict: bool = True) -> None:
    """Copy the full (unsharded) state dict ``sd`` into ``model``, taking this rank's shard
    of every TP-sharded tensor (tpkit's or TE's tags; FSDP2 parameters too). ``strict``:
    the keys must match exactly, else MissingKeyError (a KeyError, as Fabric's, and a
    ValueError); shapes are always checked (ValueError). TE's ``_extra_state`` is left
    alone."""
    state = resolve_state(state)
    n = state.tp_size
    model = user_module(model)
    own = {k: v for k, v in model.state_dict(keep_vars=True).items()
           if isinstance(v, torch.Tensor)}
    missing, unexpected = sorted(set(own) - set(sd)), sorted(
        k for k in set(sd) - set(own) if not k.endswith("_extra_state"))
    if strict and (missing or unexpected):
        raise MissingKeyError(f"state dict keys do not match the model: missing {missing}, "
                              f"unexpected {unexpected}; pass strict=False to load the common keys")
    with torch.no_grad():
        for name, t in own.items():
            if name not in sd:
                continue
            src, spec = sd[name], tp_spec(t)
            if is_expert(t):
                expect = _expert_full_shape(t, state)
                if tuple(src.shape) != expect:
                    raise ValueError(f"{name}: full tensor has shape {tuple(src.shape)}, "
                                     f"expected {expect} (all experts; ep={state.ep_size}, "
                                     f"etp={state.etp_size})")
                t.copy_(_expert_local(src.to(t.device), t, state))
                continue
            expect = _full_shape(t, spec, n)
            if tuple(src.shape) != expect:
                how = (f" (shard {tuple(t.shape)} x tp={n} along dim {spec[0]})"
                       if spec is not None else "")
                raise ValueError(f"{name}: full tensor has shape {tuple(src.shape)}, expected "
                                 f"{expect}{how}")
            if spec is not None and spec[1] is not None and sum(spec[1]) != expect[spec[0]]:
                raise ValueError(f"{name}: tp_partition_sizes {spec[1]} do not sum to "
                                 f"{expect[spec[0]]}")
            local = _to_local(src.to(t.device), t, spec, state)
            (t.to_local() if isinstance(t, DTensor) else t).copy_(local)


def load_full_optimizer_state_dict(optimizer: torch.optim.Optimizer, osd: dict,
                                   model, state=None) -> None:
    """Load the full (unsharded) optimizer state dict ``osd`` into ``optimizer`` over the
    sharded ``model`` (a module or a list of them: they name the parameters): each state
    tensor shaped like its full parameter becomes this rank's shard. ``osd`` is keyed by
    parameter index (``torch.optim.Optimizer.state_dict()`` of the unsharded model, matched
    by position as torch does) or by parameter name (``read``; names are checked).
    ValueError when groups or shapes do not match."""
    state = resolve_state(state)
    names = {i: n for i, (n, _) in _param_names(
        [model] if isinstance(model, nn.Module) else model).items()}
    groups, saved_groups = optimizer.param_groups, osd["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in saved_groups]:
        raise ValueError(f"the optimizer state has groups of "
                         f"{[len(g['params']) for g in saved_groups]} parameters but the "
                         f"optimizer has {[len(g['params']) for g in groups]}")
    local_state, index = {}, 0
    local_groups = []
    for g, sg in zip(groups, saved_groups):
        local_groups.append({**{k: v for k, v in sg.items() if k != "params"},
                             "params": list(range(index, index + len(g["params"])))})
        for p, key in zip(g["params"], sg["params"]):
            name = names.get(id(p), f"<parameter {index}>")
            if isinstance(key, str) and key != name:
                raise ValueError(f"optimizer state for {key!r} is at the position of "
                                 f"parameter {name!r}; build the optimizer over the same "
                                 "parameters in the same order")
            entry, spec = osd["state"].get(key), tp_spec(p)
            if entry is not None:
                local_state[index] = {k: _optimizer_value(v, p, spec, state, f"{name}.{k}")
                                      for k, v in entry.items()}
            index += 1
    optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})


def load_full(full: dict, state_dict: dict, state=None, *, strict: bool = True) -> dict:
    """Load a full (unsharded) checkpoint dict, e.g. one process's ``torch.save({"model":
    model.state_dict(), "optimizer": opt.state_dict(), "step": 3})``, into ``state_dict``
    (modules, optimizers, objects with ``load_state_dict``, plain values) at the current
    layout, as ``load`` does for checkpoint directories. Returns the entries of ``full``
    not in ``state_dict``; ``strict``: a key of ``state_dict`` not in ``full`` (or a
    module key mismatch) is a MissingKeyError (KeyError and ValueError)."""
    absent = [k for k in state_dict if k not in full]
    if absent and strict:
        raise missing_key_error(absent[0])
    rest = dict(full)
    modules = [m for m in state_dict.values() if isinstance(m, nn.Module)]
    for key, obj in state_dict.items():
        if key not in rest:
            continue
        value = rest.pop(key)
        if isinstance(obj, nn.Module):
            load_full_state_dict(unwrap_module(obj), value, state, strict=strict)
        elif isinstance(obj, torch.optim.Optimizer):
            load_full_optimizer_state_dict(obj, value, modules, state)
        elif hasattr(obj, "load_state_dict"):
            obj.load_state_dict(value)
        else:
            state_dict[key] = value
    return rest


def _optimizer_value(v, p, spec, state, what: str):
    if not isinstance(v, torch.Tensor) or v.dim() == 0:
        return v   # step counters, hyper-parameters
    expert = is_expert(p)
    expect = _expert_full_shape(p, state) if expert else _full_shape(p, spec, state.tp_size)
    if tuple(v.shape) != expect:
        raise ValueError(f"optimizer state {what} has shape {tuple(v.shape)} but its "
                         f"parameter's full shape is {expect}")
    local = (_expert_local(v.to(p.device), p, state) if expert else
             _to_local(v.to(p.device), p, spec, state)).clone()   # never alias ``osd``
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return local


# Sharded, reshardable checkpoints with torch.distributed.checkpoint (tpkit/checkpoint/_dcp.py).
from ._dcp import PendingSave, async_save, load, read, read_extras, save, verify  # noqa: E402

__all__ += ["save", "load", "async_save", "PendingSave", "verify", "read", "read_extras",
            "unwrap_module", "MissingKeyError"]
