"""The collectives tpkit issues on tensors, in one place, without autograd.

``tpkit.nn.mappings`` wraps them in autograd functions (Megatron's f/g and the SP/CP
gathers); checkpoints, gradient finalisation, fp8 amax reduction, the loss and the CP
kernels call them directly.

- SUM all-reduces go through the group's shared-memory transport when it has one (a TP
  group on CPU whose ranks share a host: ``tpkit.comm.shm``, set up by ``build_state``), else
  through the group's backend. Every TP sum in tpkit goes through ``all_reduce_sum``.
- Gathers and reduce-scatters use the single-tensor forms along dim 0 (other dims are
  moved to the front and back), under the name the running torch offers
  (``all_gather_single``/``reduce_scatter_single`` since torch 2.13, ``*_tensor`` before).
- A group of one issues nothing where the result is the input (callers check, since the
  autograd wrappers skip themselves too).
- Inside a ``torch.compile`` region (``torch.compiler.is_compiling()``) a SUM all-reduce
  is torch's functional (traceable) collective over the group's backend, gloo on CPU:
  the shared-memory transport's spin-waits on a mapped buffer cannot be traced.
  Gathers, reduce-scatters and all-to-alls need no change (dynamo rewrites the c10d
  calls into functional collectives itself). Point-to-point never runs in a traced
  region: the CP ring is an opaque custom op (``tpkit.nn.fused_cp``).

Every function here is a collective: every rank of ``group`` calls it, in the same order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from . import shm

__all__ = ["group_size", "group_rank", "all_reduce_sum", "all_reduce_max", "all_reduce_flat",
           "all_gather", "reduce_scatter", "split", "all_to_all", "exchange", "broadcast",
           "start_p2p", "group_device", "any_rank"]


def group_size(group) -> int:
    return dist.get_world_size(group=group)


def group_rank(group) -> int:
    return dist.get_rank(group=group)


def group_device(group) -> torch.device:
    """The device a tensor must be on for a collective over ``group`` (None: the default
    group): the CPU when the group has a CPU backend (gloo, "cpu:gloo,cuda:nccl"), else
    its accelerator (the current CUDA device for nccl). A group without a CPU backend,
    as the nccl-only default group on GPUs, rejects CPU tensors."""
    pg = dist.group.WORLD if group is None else group
    types = [d.type for d in getattr(pg, "_device_types", ())]
    if not types:   # a torch without the attribute: the backend string
        types = ["cpu" if part.split(":")[-1] == "gloo" and ":" not in part
                 else part.split(":")[0] if ":" in part else "cuda"
                 for part in str(dist.get_backend(group)).split(",")]
    if "cpu" in types:
        return torch.device("cpu")
    if types[0] == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(types[0])


def any_rank(flag: bool, group=None) -> bool:
    """True on every rank of ``group`` when ``flag`` is True on any of them (one MAX
    all-reduce of one number, on ``group_device(group)``); ``flag`` on a group of one."""
    if group_size(group) == 1:
        return bool(flag)
    t = torch.full((1,), float(bool(flag)), device=group_device(group))
    all_reduce_max(t, group)
    return bool(t.item())


# --- reductions ------------------------------------------------------------------------
def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """SUM over ``group``, in place when ``x`` is contiguous (returns the reduced tensor),
    through the group's shared-memory transport when it has one, else its backend; out
    of place through the backend while ``torch.compile`` traces (use the result)."""
    x = x.contiguous()
    if torch.compiler.is_compiling():   # traceable; the shm transport is not (gloo/nccl)
        from torch.distributed import _functional_collectives as funcol
        return funcol.all_reduce(x, "sum", group)
    t = shm.get(group)
    if t is not None and t.supports(x):
        return t.all_reduce_(x)
    dist.all_reduce(x, group=group)
    return x


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """MAX over ``group``, in place (``x`` must be contiguous); returns ``x``."""
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def broadcast(x: torch.Tensor, group, src: int) -> torch.Tensor:
    """``x`` of group rank ``src`` on every rank of ``group``, in place (``x`` must be
    contiguous); returns ``x``."""
    if group_size(group) > 1:
        dist.broadcast(x, group=group, group_src=src)
    return x


def all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` over ``group`` in place with one flattened all-reduce per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for bucket in by_dtype.values():
        flat = all_reduce_sum(_flatten_dense_tensors(bucket), group)
        for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(synced)


# --- gathers and scatters ---------------------------------------------------------------
def _all_gather_single(out, x, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def _reduce_scatter_single(out, x, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, group=group)


def all_gather(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in group-rank order (a new tensor)."""
    n = group_size(group)
    dim = dim % x.dim()
    src = (x if dim == 0 else x.movedim(dim, 0)).contiguous()
    out = torch.empty((n * src.shape[0],) + tuple(src.shape[1:]), dtype=src.dtype,
                      device=src.device)
    _all_gather_single(out, src, group)
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """The sum over ``group`` of ``x``, of which this rank keeps its chunk along ``dim``."""
    n = group_size(group)
    dim = dim % x.dim()
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} cannot be reduce-scattered over "
                         f"{n} ranks; make it (the sequence length) a multiple of {n}")
    src = (x if dim == 0 else x.movedim(dim, 0)).contiguous()
    out = torch.empty((src.shape[0] // n,) + tuple(src.shape[1:]), dtype=src.dtype,
                      device=src.device)
    _reduce_scatter_single(out, src, group)
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (no communication; the inverse of
    ``all_gather``)."""
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} cannot be split over {n} ranks; "
                         f"make it a multiple of {n}")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Send chunk ``j`` of ``scatter_dim`` to rank ``j``; concatenate what arrives along
    ``gather_dim`` in rank order."""
    n = group_size(group)
    if x.shape[scatter_dim] % n:
        raise ValueError(f"scatter dim {scatter_dim} of size {x.shape[scatter_dim]} is not "
                         f"divisible by the group size {n}")
    inp = torch.stack([c.contiguous() for c in x.chunk(n, dim=scatter_dim)], 0)
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=group)
    return torch.cat(out.unbind(0), dim=gather_dim)


# --- point to point ---------------------------------------------------------------------
def exchange(send: torch.Tensor, recv: torch.Tensor, group, nxt: int, prv: int, tag: int):
    """Start sending ``send`` to global rank ``nxt`` and receiving ``recv`` from ``prv``
    (one ring hop); returns the works to wait on."""
    return start_p2p([(send, nxt)], [(recv, prv)], group, tag)


def start_p2p(sends, recvs, group, tag: int):
    """Start the sends ``[(tensor, global rank)]`` and receives ``[(buffer, global rank)]``
    as one batch; returns the works to wait on (none when both lists are empty). Every
    rank of a batch's peers must post its matching batch in the same order. A group with
    a shared-memory point-to-point transport (``tpkit.comm.shm.setup_p2p``: CP groups on CPU)
    moves CPU tensors through it."""
    t = shm.get_p2p(group)
    if t is not None and all(x.device.type == "cpu" for x, _ in sends + recvs):
        return t.start(sends, recvs, tag)
    ops = [dist.P2POp(dist.isend, t, peer, group=group, tag=tag) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group=group, tag=tag) for t, peer in recvs]
    return dist.batch_isend_irecv(ops) if ops else []
