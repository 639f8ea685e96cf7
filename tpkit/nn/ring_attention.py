"""Ring attention (``cp_comm_type="p2p"``) over the load-balanced CP layout.

Each rank starts with its own K/V and passes them to the next rank of the ring while it
computes with the block it holds (isend/irecv overlap the block's compute). At step ``i``
rank ``r`` holds the K/V of ``src = (r - i) mod n``. With causal masking and the layout of
``tpkit.data.shard_sequence`` (rank r holds chunks r and 2n-1-r):

- step 0 (``src == r``): local causal attention (the local positions are increasing);
- ``src < r``: all local queries see the *first* K/V chunk of src and none of its second;
- ``src > r``: only the *second* local query chunk sees src, and it sees all of it.

So every rank computes one diagonal block plus ``n-1`` half blocks: equal work everywhere.
Partial outputs are merged with their log-sum-exps. Backward passes K/V around the ring
again and sends each block's dK/dV accumulator along with it, so after ``n`` hops every
rank holds the full gradient of its own K/V; only local-sized tensors (q, k, v, out, lse)
are saved for backward — O(S/cp) memory per rank.

Dropout: the masks come from a generator started at the RNG tracker's model-parallel
stream; backward restarts it from the same state and redraws the masks in the same block
order, and the tracker's stream is advanced past what forward drew.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import exchange as _exchange
from ..layout.random import get_device_rng_state, get_rng_tracker, set_device_rng_state
from .attention_math import block_backward, block_forward, compute_dtype, merge_into
from ._common import autocast_off

_KV_TAG, _DKV_TAG = 0, 1


def _wait(works) -> None:
    for w in works or ():
        w.wait()


def _stream_generator(device: torch.device) -> torch.Generator:
    """A generator at the tracker's model-parallel stream (the stream is not advanced)."""
    gen = torch.Generator(device=device)
    with get_rng_tracker().fork():
        gen.set_state(get_device_rng_state(device))
    return gen


def _advance_stream(gen: torch.Generator, device: torch.device) -> None:
    with get_rng_tracker().fork():
        set_device_rng_state(gen.get_state(), device)


def _plan(step: int, rank: int, n: int, causal: bool, sq: int, sk: int):
    """(q rows, kv rows, causal) of the block at ``step`` as slices of the local shards."""
    full_q, full_k = slice(0, sq), slice(0, sk)
    if not causal:
        return full_q, full_k, False
    if step == 0:
        return full_q, full_k, True
    src = (rank - step) % n
    if src < rank:
        return full_q, slice(0, sk // 2), False
    return slice(sq // 2, sq), full_k, False


class RingAttention(torch.autograd.Function):
    """Grouped q ``[b, g, r, s, d]`` and k/v ``[b, g, 1, s, d]`` (this rank's shard) ->
    output like q. ``group`` is the ring (None: no CP, just this rank)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal: bool, scale: float, dropout_p: float):
        if group is None:  # no CP: one step, no communication (memory-efficient attention)
            n, rank, nxt, prv = 1, 0, None, None
        else:
            n, rank = dist.get_world_size(group), dist.get_rank(group)
            nxt = dist.get_global_rank(group, (rank + 1) % n)
            prv = dist.get_global_rank(group, (rank - 1) % n)
        cdt = compute_dtype(q.dtype)  # fp32 for half types, float64 stays float64
        qf = q.to(cdt)
        sq, sk = q.shape[-2], k.shape[-2]
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=cdt, device=q.device)
        kv = torch.stack([k, v]).to(cdt).contiguous()
        gen = _stream_generator(q.device) if dropout_p > 0.0 else None
        ctx.rng_state = None if gen is None else gen.get_state()
        for step in range(n):
            works, nxt_kv = None, None
            if step < n - 1:
                nxt_kv = torch.empty_like(kv)
                works = _exchange(kv, nxt_kv, group, nxt, prv, _KV_TAG)
            rows, cols, blk_causal = _plan(step, rank, n, causal, sq, sk)
            o, l = block_forward(qf[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                 scale, blk_causal, dropout_p, gen)
            merge_into(out[..., rows, :], lse[..., rows], o, l)
            _wait(works)
            kv = nxt_kv
        if gen is not None:
            _advance_stream(gen, q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.ranks = group, causal, scale, (rank, n, nxt, prv)
        ctx.dropout_p = dropout_p
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        rank, n, nxt, prv = ctx.ranks
        group, scale = ctx.group, ctx.scale
        cdt = out.dtype  # forward's compute dtype
        qf, dout = q.to(cdt), dout.to(cdt)
        sq, sk = q.shape[-2], k.shape[-2]
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v]).to(cdt).contiguous()
        dkv = torch.zeros_like(kv)  # gradient of the K/V block held now, travelling with it
        dkv_works, gen = None, None
        if ctx.rng_state is not None:  # replay forward's dropout masks, block by block
            gen = torch.Generator(device=q.device)
            gen.set_state(ctx.rng_state)
        for step in range(n):
            kv_works, nxt_kv = None, None
            if step < n - 1:
                nxt_kv = torch.empty_like(kv)
                kv_works = _exchange(kv, nxt_kv, group, nxt, prv, _KV_TAG)
            rows, cols, blk_causal = _plan(step, rank, n, ctx.causal, sq, sk)
            dq_b, dk_b, dv_b = block_backward(
                qf[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                dout[..., rows, :], lse[..., rows], delta[..., rows], scale, blk_causal,
                ctx.dropout_p, gen)
            _wait(dkv_works)  # the accumulator of this block arrived from the previous rank
            dq[..., rows, :] += dq_b
            dkv[0][..., cols, :] += dk_b
            dkv[1][..., cols, :] += dv_b
            if n > 1:
                recv = torch.empty_like(dkv)
                dkv_works = _exchange(dkv, recv, group, nxt, prv, _DKV_TAG)
                dkv = recv
            _wait(kv_works)
            kv = nxt_kv
        _wait(dkv_works)  # after n hops the accumulator of our own K/V is back
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None)


@autocast_off
def ring_attention(q, k, v, group, *, causal: bool, scale: float, dropout_p: float = 0.0):
    """Ring attention of grouped tensors over ``group`` (see the module docstring)."""
    return RingAttention.apply(q, k, v, group, causal, scale, dropout_p)
