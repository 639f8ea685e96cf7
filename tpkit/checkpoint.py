"""Checkpoint helpers: full (unsharded) state dicts <-> TP-sharded models.

Generic over layers: a parameter is sharded iff it carries ``tp_partition_dim`` (tagged
by tpkit.nn layers). If it also carries ``tp_partition_sizes`` (global segment sizes along
that dim, e.g. fused q/k/v ``(H*d, G*d, G*d)``), each segment is sharded on its own and
the local shard is the concatenation of this rank's chunk of every segment, so the full
tensor is ``cat(segment_0, segment_1, ...)`` in the un-interleaved order. Everything else
(replicated params, buffers) is taken as is.
"""
from __future__ import annotations

import torch
from torch import nn

from .collectives import all_gather, group_size
from .param_tags import partition_dim
from .topology import resolve_state

__all__ = ["full_state_dict", "load_full_state_dict", "full_shapes", "gather_param",
           "shard_tensor"]


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


def full_state_dict(model: nn.Module, state=None) -> dict[str, torch.Tensor]:
    """The unsharded state dict, identical on every TP rank (collective over TP: every
    rank must call it). Sharded params are all-gathered; the rest is cloned."""
    state = resolve_state(state)
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        p = params.get(name)
        dim = partition_dim(p) if p is not None else None
        if dim is None:
            out[name] = t.detach().clone()
        else:
            out[name] = gather_param(t, dim, getattr(p, "tp_partition_sizes", None),
                                     state.tp_group)
    return out


def full_shapes(model: nn.Module, state=None) -> dict[str, torch.Size]:
    """The full (unsharded) shape of every state-dict entry, without communication: what
    full_state_dict would return shapes of, e.g. to draw a layout-independent init."""
    n = resolve_state(state).tp_size
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        shape = list(t.shape)
        dim = partition_dim(params.get(name))
        if dim is not None:
            shape[dim] *= n
        out[name] = torch.Size(shape)
    return out


def load_full_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], state=None) -> None:
    """Copy the full state dict ``sd`` into ``model``, taking this rank's shard of every
    ``tp_partition_dim`` param. Keys must match exactly; shapes are checked."""
    state = resolve_state(state)
    n, rank = state.tp_size, state.tp_rank
    params = dict(model.named_parameters(remove_duplicate=False))
    own = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
    if missing or unexpected:
        raise ValueError(f"state dict keys do not match the model: missing {missing}, "
                         f"unexpected {unexpected}")
    with torch.no_grad():
        for name, t in own.items():
            src = sd[name]
            p = params.get(name)
            dim = partition_dim(p) if p is not None else None
            if dim is not None:
                sizes = getattr(p, "tp_partition_sizes", None)
                full_len = src.shape[dim] if src.dim() > dim else -1
                expect = list(t.shape)
                expect[dim] = t.shape[dim] * n
                if list(src.shape) != expect:
                    raise ValueError(f"{name}: full tensor has shape {tuple(src.shape)}, "
                                     f"expected {tuple(expect)} (shard {tuple(t.shape)} x tp={n}"
                                     f" along dim {dim})")
                if sizes is not None and sum(sizes) != full_len:
                    raise ValueError(f"{name}: tp_partition_sizes {sizes} do not sum to "
                                     f"{full_len}")
                src = shard_tensor(src, dim, sizes, rank, n)
            elif src.shape != t.shape:
                raise ValueError(f"{name}: shape {tuple(src.shape)} does not match the "
                                 f"model's {tuple(t.shape)}")
            t.copy_(src)

# Sharded, reshardable checkpoints with torch.distributed.checkpoint (tpkit/_dcp.py).
from ._dcp import PendingSave, async_save, load, read_extras, save, unwrap_module  # noqa: E402

__all__ += ["save", "load", "async_save", "PendingSave", "read_extras", "unwrap_module"]
