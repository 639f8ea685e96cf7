"""Autograd collectives for tensor, sequence and context parallelism.

Names follow the Megatron paper: ``copy_to_tp_region`` is *f* (identity forward,
all-reduce backward) and ``reduce_from_tp_region`` is *g* (all-reduce forward, identity
backward). Sequence parallelism shards activations along dim 0 (``[s, b, h]``):
``gather_from_sp_region`` all-gathers dim 0 forward and reduce-scatters backward;
``reduce_scatter_to_sp_region`` is its transpose. ``all_to_all`` swaps a scattered dim for
a gathered one (its backward is the reverse all-to-all), for context parallelism.

Every function is the identity when the group has one rank (no collective is issued).
The collectives themselves (and the shared-memory path of TP sums) are tpkit.comm.collectives'.
"""
from __future__ import annotations

import torch

from ..comm.collectives import (all_gather, all_reduce_sum, group_size,
                           reduce_scatter, split)
from ..comm.collectives import all_to_all as _all_to_all
from .export import check_exportable

__all__ = ["copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region",
           "gather_from_tp_region", "gather_from_sp_region", "reduce_scatter_to_sp_region",
           "scatter_to_sp_region", "all_to_all"]


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
        if inplace and x.is_contiguous() and not torch.compiler.is_compiling():
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
        return split(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group, ctx.dim), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return split(g, ctx.group, ctx.dim), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter(g, ctx.group, ctx.dim), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, g):
        s, gd = ctx.dims
        return _all_to_all(g, ctx.group, gd, s), None, None, None


# --- public API -------------------------------------------------------------------------
def _one_rank(group, where: str) -> bool:
    """True for a group of one rank (every function is then the identity); refuses a
    collective inside onnx_export (tpkit.nn.export)."""
    n = group_size(group)
    check_exportable(n, where)
    return n == 1


def copy_to_tp_region(x: torch.Tensor, group, *, inplace_grad: bool = False) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward. ``inplace_grad=True``
    reduces the incoming gradient without a copy: only when ``x``'s sole consumer is a
    matmul, whose input gradient is a fresh tensor (the parallel linear layers)."""
    if _one_rank(group, "copy_to_tp_region"):
        return x
    return _CopyToTP.apply(x, group, inplace_grad)


def reduce_from_tp_region(x: torch.Tensor, group, *, inplace: bool = False) -> torch.Tensor:
    """g: all-reduce forward, identity backward. ``inplace=True`` reduces ``x`` itself
    (for a fresh intermediate such as a matmul output) instead of a copy."""
    if _one_rank(group, "reduce_from_tp_region"):
        return x
    return _ReduceFromTP.apply(x, group, inplace)


def scatter_to_tp_region(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk of ``dim`` (default last); all-gather backward."""
    if _one_rank(group, "scatter_to_tp_region"):
        return x
    return _ScatterToTP.apply(x, dim, group)


def gather_from_tp_region(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """All-gather along ``dim`` (default last); keep this rank's chunk backward."""
    if _one_rank(group, "gather_from_tp_region"):
        return x
    return _GatherFromTP.apply(x, dim, group)


def gather_from_sp_region(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """All-gather of the sequence dim (``dim``; 0 for ``[s, b, h]``) forward, its
    reduce-scatter backward: SP's all-gather, and the CP all-gather of K/V."""
    if _one_rank(group, "gather_from_sp_region"):
        return x
    return _GatherFromSP.apply(x, group, dim % x.dim())


def reduce_scatter_to_sp_region(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """SP reduce-scatter of the sequence dim (``dim``; 0 for ``[s, b, h]``, 1 for
    batch-first activations) forward; its all-gather backward."""
    if _one_rank(group, "reduce_scatter_to_sp_region"):
        return x
    return _ReduceScatterToSP.apply(x, group, dim % x.dim())


def scatter_to_sp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's chunk of dim 0 (entering SP); all-gather backward."""
    if _one_rank(group, "scatter_to_sp_region"):
        return x
    return _ScatterToTP.apply(x, 0, group)


def all_to_all(x: torch.Tensor, group, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``scatter_dim`` over the group and concatenate received chunks along
    ``gather_dim``; the backward is the reverse all-to-all."""
    if _one_rank(group, "all_to_all"):
        return x
    return _AllToAll.apply(x, scatter_dim % x.dim(), gather_dim % x.dim(), group)
