"""Autograd collectives for tensor, sequence and context parallelism.

Names follow the Megatron paper: ``copy_to_tp_region`` is *f* (identity forward,
all-reduce backward) and ``reduce_from_tp_region`` is *g* (all-reduce forward, identity
backward). Sequence parallelism shards activations along dim 0 (``[s, b, h]``):
``gather_from_sp_region`` all-gathers dim 0 forward and reduce-scatters backward;
``reduce_scatter_to_sp_region`` is its transpose. ``all_to_all`` swaps a scattered dim for
a gathered one (its backward is the reverse all-to-all), for context parallelism.

Every function is the identity when the group has one rank (no collective is issued).
Collectives are called as ``dist.xxx(..., group=group)`` so tests/commcount.py sees them;
SUM all-reduces of a TP group on CPU go through its shared-memory transport when it has one
(tpkit.shm, set up by build_state), which commcount counts too.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .. import shm

# torch 2.13 deprecates the *_tensor names in favour of *_single; the old names are the
# ones every supported torch has (and the ones tests/commcount.py counts).
warnings.filterwarnings("ignore", category=FutureWarning,
                        message=r"`torch\.distributed\.(all_gather_into_tensor|"
                                r"reduce_scatter_tensor)` is deprecated")

__all__ = ["copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region",
           "gather_from_tp_region", "gather_from_sp_region", "reduce_scatter_to_sp_region",
           "scatter_to_sp_region", "all_to_all", "all_reduce_sum", "group_size", "group_rank"]


def group_size(group) -> int:
    return dist.get_world_size(group=group)


def group_rank(group) -> int:
    return dist.get_rank(group=group)


# --- raw collectives (no autograd) ------------------------------------------------------
def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """SUM over ``group``, in place when ``x`` is contiguous (returns the reduced tensor),
    through the group's shared-memory transport when build_state set one up (CPU, one
    host: tpkit.shm), else the group's backend. No autograd; every TP SUM goes here."""
    x = x.contiguous()
    t = shm.get(group)
    if t is not None and t.supports(x):
        return t.all_reduce_(x)
    dist.all_reduce(x, group=group)
    return x


def _all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    x = x.contiguous()
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if x.shape[0] % n:
        raise ValueError(f"dim 0 of size {x.shape[0]} cannot be reduce-scattered over {n} "
                         f"ranks; make the sequence length a multiple of {n}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def _split_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} cannot be split over {n} ranks; "
                         f"make it a multiple of {n}")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def _gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    dim = dim % x.dim()
    if dim == 0:
        return _all_gather_dim0(x, group)
    # gathering x.movedim(dim, 0) along dim 0 is the gather along dim, moved to the front
    return _all_gather_dim0(x.movedim(dim, 0), group).movedim(0, dim).contiguous()


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if x.shape[scatter_dim] % n:
        raise ValueError(f"scatter dim {scatter_dim} of size {x.shape[scatter_dim]} is not "
                         f"divisible by the group size {n}")
    chunks = [c.contiguous() for c in x.chunk(n, dim=scatter_dim)]
    inp = torch.stack(chunks, 0)
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=group)
    return torch.cat(out.unbind(0), dim=gather_dim)


# --- autograd functions -----------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inplace):
        ctx.group, ctx.inplace = group, inplace
        return x

    @staticmethod
    def backward(ctx, g):
        # The incoming gradient may alias other tensors (a user's grad, a fan-out), so it
        # is reduced in place only when the caller guarantees it is a fresh matmul result.
        return all_reduce_sum(g if ctx.inplace else g.clone(), ctx.group), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inplace):
        if inplace and x.is_contiguous():
            ctx.mark_dirty(x)   # reduce the (fresh) matmul output without a copy
            return all_reduce_sum(x, group)
        return all_reduce_sum(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split_dim(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_dim(g, ctx.dim, ctx.group), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _split_dim(g, ctx.dim, ctx.group), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_dim0(g, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_dim0(g, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, g):
        s, gd = ctx.dims
        return _all_to_all(g, gd, s, ctx.group), None, None, None


# --- public API -------------------------------------------------------------------------
def copy_to_tp_region(x: torch.Tensor, group, *, inplace_grad: bool = False) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward. ``inplace_grad=True``
    reduces the incoming gradient without a copy: only when ``x``'s sole consumer is a
    matmul, whose input gradient is a fresh tensor (the parallel linear layers)."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group, inplace_grad)


def reduce_from_tp_region(x: torch.Tensor, group, *, inplace: bool = False) -> torch.Tensor:
    """g: all-reduce forward, identity backward. ``inplace=True`` reduces ``x`` itself
    (for a fresh intermediate such as a matmul output) instead of a copy."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group, inplace)


def scatter_to_tp_region(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk of ``dim`` (default last); all-gather backward."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, dim, group)


def gather_from_tp_region(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """All-gather along ``dim`` (default last); keep this rank's chunk backward."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, dim, group)


def gather_from_sp_region(x: torch.Tensor, group) -> torch.Tensor:
    """SP all-gather of dim 0 forward; reduce-scatter of dim 0 backward."""
    return x if group_size(group) == 1 else _GatherFromSP.apply(x, group)


def reduce_scatter_to_sp_region(x: torch.Tensor, group) -> torch.Tensor:
    """SP reduce-scatter of dim 0 forward; all-gather of dim 0 backward."""
    return x if group_size(group) == 1 else _ReduceScatterToSP.apply(x, group)


def scatter_to_sp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's chunk of dim 0 (entering SP); all-gather backward."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, 0, group)


def all_to_all(x: torch.Tensor, group, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``scatter_dim`` over the group and concatenate received chunks along
    ``gather_dim``; the backward is the reverse all-to-all."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, scatter_dim % x.dim(), gather_dim % x.dim(), group)
