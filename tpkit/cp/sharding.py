"""The context-parallel layout: TE/Megatron's load-balanced sharding, written once.

With causal attention, token ``t`` attends to ``t + 1`` keys, so cutting the sequence into
``cp`` contiguous pieces would give the last CP rank ``2*cp - 1`` times the work of the
first. Instead the sequence is cut into ``2*cp`` equal chunks and CP rank ``r`` keeps
chunks ``r`` and ``2*cp - 1 - r`` (concatenated in that order, ``cp_chunk_ids``): every
rank then holds one "early" and one "late" chunk and does the same amount of attention
work.

Divisibility rule (checked, ``ValueError`` otherwise): with ``cp > 1`` the sequence length
must be divisible by ``2*cp``; with sequence parallelism on as well it must be divisible
by ``2*cp*tp`` (each of the two chunks of a CP shard then splits evenly over the TP
ranks). With ``cp == 1`` nothing is cut (under SP the length must still divide by tp).

Packed rows (THD, ``tpkit.data.pack_sequences``): every *document* is cut into ``2*cp``
chunks and rank ``r`` keeps chunks ``r`` and ``2*cp-1-r`` of every document, documents in
order (TE's per-document DUAL_CHUNK_SWAP): ``packed_cp_indices`` is the formula,
``shard_packed`` / ``unshard_packed`` move between the row and a rank's shard.

Sharding a sequence over CP records its full length in the layout's declared field
``ParallelState.last_sharded_len``: DotProductAttention refuses that length as its local
one (a full sequence reaching CP attention would attend to all of it on every rank,
silently wrong).
"""
from __future__ import annotations

import torch

from ..comm.collectives import all_gather
from ..layout.topology import resolve_state


def check_sequence_length(seq_len: int, state=None) -> None:
    """Raise ValueError if ``seq_len`` cannot be sharded under ``state`` (see module doc)."""
    state = resolve_state(state)
    cp, tp, sp = state.cp_size, state.tp_size, state.sequence_parallel
    div = sequence_multiple(state)
    if seq_len % div != 0:
        rule = (f"2*cp*tp = 2*{cp}*{tp} = {div} (context parallelism cuts the sequence into "
                f"2*cp chunks and sequence parallelism splits each over tp)" if sp and cp > 1
                else f"2*cp = {div} (context parallelism cuts the sequence into 2*cp "
                     "load-balanced chunks)" if cp > 1
                else f"tp = {div} (sequence parallelism)")
        raise ValueError(f"sequence length {seq_len} is not divisible by {rule}; pad the "
                         f"sequence to a multiple of {div}")


def sequence_multiple(state=None) -> int:
    """What a sequence length (and, packed, every document's padded length) must divide
    by under ``state``: ``2*cp`` with CP, times ``tp`` with sequence parallelism."""
    state = resolve_state(state)
    cp = state.cp_size
    return (2 * cp if cp > 1 else 1) * (state.tp_size if state.sequence_parallel else 1)


def cp_chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two global chunk indices (of ``2*cp_size``) that ``cp_rank`` holds, in order:
    the one place the load-balanced layout is written down."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_positions(cp_rank: int, cp_size: int, local_len: int, device=None) -> torch.Tensor:
    """Global positions of the ``local_len`` tokens CP rank ``cp_rank`` holds (the causal
    masks of the CP attention kernels need them for any rank, not only this one)."""
    if cp_size == 1:
        return torch.arange(local_len, device=device)
    c = local_len // 2
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                      for i in cp_chunk_ids(cp_rank, cp_size)])


def shard_sequence(tensor: torch.Tensor, seq_dim: int, state=None) -> torch.Tensor:
    """This CP rank's load-balanced shard of a full-sequence tensor (no communication):
    chunks ``r`` and ``2*cp-1-r`` of ``2*cp`` along ``seq_dim``, concatenated."""
    state = resolve_state(state)
    check_sequence_length(tensor.shape[seq_dim], state)
    cp = state.cp_size
    if cp == 1:
        return tensor
    state.last_sharded_len = int(tensor.shape[seq_dim])
    chunks = tensor.chunk(2 * cp, dim=seq_dim)
    first, second = cp_chunk_ids(state.cp_rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=seq_dim)


def shard_position_ids(seq_len: int, state=None, *, device=None) -> torch.Tensor:
    """Position ids (int64, shape ``[seq_len / cp]``) of the tokens this CP rank holds, in
    the layout of :func:`shard_sequence`; feed them to RoPE so rotations match the
    unsharded sequence."""
    state = resolve_state(state)
    check_sequence_length(seq_len, state)
    if state.cp_size > 1:
        state.last_sharded_len = int(seq_len)
    return cp_positions(state.cp_rank, state.cp_size, seq_len // state.cp_size, device)


def _reorder_gathered(parts: list[torch.Tensor], seq_dim: int) -> torch.Tensor:
    """Natural order from the shards of every CP rank (rank order)."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        a, b = part.chunk(2, dim=seq_dim)
        i, j = cp_chunk_ids(r, cp)
        chunks[i], chunks[j] = a, b
    return torch.cat(chunks, dim=seq_dim)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seq_dim, group, cp_rank, cp_size):
        ctx.seq_dim, ctx.cp_rank, ctx.cp_size = seq_dim, cp_rank, cp_size
        return _reorder_gathered(all_gather(x, group, seq_dim).chunk(cp_size, seq_dim),
                                 seq_dim)

    @staticmethod
    def backward(ctx, grad):
        chunks = grad.chunk(2 * ctx.cp_size, dim=ctx.seq_dim)
        i, j = cp_chunk_ids(ctx.cp_rank, ctx.cp_size)
        return torch.cat([chunks[i], chunks[j]], dim=ctx.seq_dim), None, None, None, None


def unshard_sequence(tensor: torch.Tensor, seq_dim: int, state=None) -> torch.Tensor:
    """The full sequence from every CP rank's load-balanced shard: all-gather over the CP
    group, then restore natural order. Differentiable: backward keeps this rank's chunks of
    the gradient, i.e. it assumes every CP rank computes the same loss from the full
    tensor (as when the result feeds a replicated computation)."""
    state = resolve_state(state)
    cp = state.cp_size
    if cp == 1:
        return tensor
    if tensor.shape[seq_dim] % 2 != 0:
        raise ValueError(f"a CP shard has two equal chunks, but its length along dim "
                         f"{seq_dim} is {tensor.shape[seq_dim]} (odd); pass the tensor "
                         "shard_sequence produced and the same seq_dim")
    seq_dim = seq_dim % tensor.dim()
    return _Unshard.apply(tensor, seq_dim, state.cp_group, state.cp_rank, cp)


# --- packed rows (THD): the per-document layout ---------------------------------------------
def _bounds(cu_seqlens_padded) -> list[int]:
    if isinstance(cu_seqlens_padded, (list, tuple)):   # already on the host
        return [int(x) for x in cu_seqlens_padded]
    return [int(x) for x in torch.as_tensor(cu_seqlens_padded).tolist()]


def packed_cp_indices(cu_seqlens_padded, cp_rank: int, cp_size: int,
                      device=None) -> torch.Tensor:
    """Row indices (int64) of the tokens CP rank ``cp_rank`` holds, in its order: for every
    document, its chunks ``cp_chunk_ids(cp_rank, cp_size)`` of ``2*cp_size``."""
    b = _bounds(cu_seqlens_padded)
    if cp_size == 1:
        return torch.arange(b[-1], device=device)
    parts = []
    for i, (lo, hi) in enumerate(zip(b[:-1], b[1:])):
        if (hi - lo) % (2 * cp_size):
            raise ValueError(f"document {i} has padded length {hi - lo}, not a multiple of "
                             f"2*cp = {2 * cp_size}; pad every document with "
                             "tpkit.data.pack_sequences (cu_seqlens_padded)")
        c = (hi - lo) // (2 * cp_size)
        parts += [torch.arange(lo + j * c, lo + (j + 1) * c, device=device)
                  for j in cp_chunk_ids(cp_rank, cp_size)]
    return torch.cat(parts)


def _check_rows(tensor, seq_dim, want, what):
    if tensor.shape[seq_dim] != want:
        raise ValueError(f"{what} has {tensor.shape[seq_dim]} tokens along dim {seq_dim}, but "
                         f"cu_seqlens_padded says {want}; pass the tensor and cu_seqlens_padded"
                         " of the same packed row (PackedBatch)")


def shard_packed(tensor: torch.Tensor, cu_seqlens_padded, seq_dim: int = 0,
                 state=None) -> torch.Tensor:
    """This CP rank's shard of a packed row (no communication; differentiable)."""
    state = resolve_state(state)
    _check_rows(tensor, seq_dim, _bounds(cu_seqlens_padded)[-1], "the packed tensor")
    if state.cp_size == 1:
        return tensor
    idx = packed_cp_indices(cu_seqlens_padded, state.cp_rank, state.cp_size, tensor.device)
    return tensor.index_select(seq_dim, idx)


class _UnshardPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seq_dim, group, order, mine):
        ctx.seq_dim, ctx.mine = seq_dim, mine
        gathered = all_gather(x, group, seq_dim)
        return torch.empty_like(gathered).index_copy_(seq_dim, order, gathered)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(ctx.seq_dim, ctx.mine), None, None, None, None


def unshard_packed(tensor: torch.Tensor, cu_seqlens_padded, seq_dim: int = 0,
                   state=None) -> torch.Tensor:
    """The whole packed row from every CP rank's shard (all-gather over CP, then natural
    order). Differentiable like :func:`unshard_sequence`: backward keeps this rank's
    tokens of the gradient."""
    state = resolve_state(state)
    cp = state.cp_size
    seq_dim = seq_dim % tensor.dim()
    _check_rows(tensor, seq_dim, _bounds(cu_seqlens_padded)[-1] // cp, "the shard")
    if cp == 1:
        return tensor
    order = torch.cat([packed_cp_indices(cu_seqlens_padded, r, cp, tensor.device)
                       for r in range(cp)])
    return _UnshardPacked.apply(tensor, seq_dim, state.cp_group, order,
                                order.view(cp, -1)[state.cp_rank])
