"""Ring attention (``cp_comm_type="p2p"``) over the load-balanced CP layout.

The ring itself (K/V around it, the LSE merge, the dK/dV accumulators travelling back,
O(S/cp) saved memory) is ``tpkit.cp.ring``'s driver; this kernel says what each step
computes. At step ``i`` rank ``r`` holds the K/V of ``src = (r - i) mod n``. With causal
masking and the layout of ``tpkit.cp.shard_sequence`` (rank r holds chunks r and
2n-1-r):

- ``src == r`` (step 0): local causal attention (the local positions are increasing);
- ``src < r``: all local queries see the *first* K/V chunk of src and none of its second;
- ``src > r``: only the *second* local query chunk sees src, and it sees all of it.

So every rank computes one diagonal block plus ``n-1`` half blocks: equal work everywhere.

Dropout: the masks come from a generator started at the RNG tracker's model-parallel
stream; each block call's state is the generator's state before it (the driver hands it
to that block's backward, which redraws the same mask), and the tracker's stream is
advanced past what forward drew.
"""
from __future__ import annotations

import torch

from ..cp.ring import Ring, RingBlocks, RingGroup
from ..layout.random import get_device_rng_state, get_rng_tracker, set_device_rng_state
from .attention_math import block_backward, block_forward
from ._common import autocast_off


def _stream_generator(device: torch.device) -> torch.Generator:
    """A generator at the tracker's model-parallel stream (the stream is not advanced)."""
    gen = torch.Generator(device=device)
    with get_rng_tracker().fork():
        gen.set_state(get_device_rng_state(device))
    return gen


def _advance_stream(gen: torch.Generator, device: torch.device) -> None:
    with get_rng_tracker().fork():
        set_device_rng_state(gen.get_state(), device)


def _plan(src: int, rank: int, causal: bool, sq: int, sk: int):
    """(q rows, kv rows, causal) of the block of ``src``'s K/V as slices of the local
    shards."""
    full_q, full_k = slice(0, sq), slice(0, sk)
    if not causal:
        return full_q, full_k, False
    if src == rank:
        return full_q, full_k, True
    if src < rank:
        return full_q, slice(0, sk // 2), False
    return slice(sq // 2, sq), full_k, False


class DenseBlocks(RingBlocks):
    """The dense kernel's block of every ring step (``_plan``), with dropout masks drawn
    from ``gen`` (None: no dropout)."""
    name = "ring_attention"

    def __init__(self, rank: int, causal: bool, scale: float, dropout_p: float, gen):
        self.rank, self.causal, self.scale = rank, causal, scale
        self.dropout_p, self.gen = dropout_p, gen
        self.needs_state = gen is not None   # the generator's state of each block

    def forward(self, src, q, k, v):
        rows, cols, causal = _plan(src, self.rank, self.causal, q.shape[-2], k.shape[-2])
        st = None if self.gen is None else self.gen.get_state()
        o, l = block_forward(q[..., rows, :], k[..., cols, :], v[..., cols, :], self.scale,
                             causal, self.dropout_p, self.gen)
        return rows, o, l, st

    def backward(self, src, q, k, v, dout, lse, delta, states):
        rows, cols, causal = _plan(src, self.rank, self.causal, q.shape[-2], k.shape[-2])
        st, gen = states(), None
        if st is not None:  # replay forward's dropout mask of this block
            gen = torch.Generator(device=q.device)
            gen.set_state(st)
        return (rows, cols) + block_backward(
            q[..., rows, :], k[..., cols, :], v[..., cols, :], dout[..., rows, :],
            lse[..., rows], delta[..., rows], self.scale, causal, self.dropout_p, gen)


@autocast_off
def ring_attention(q, k, v, group, *, causal: bool, scale: float, dropout_p: float = 0.0):
    """Ring attention of grouped q ``[b, g, r, s, d]`` and k/v ``[b, g, 1, s, d]`` (this
    rank's shard) over ``group`` (None: no CP, just this rank) -> output like q."""
    ring = RingGroup(group)
    gen = _stream_generator(q.device) if dropout_p > 0.0 else None
    out = Ring.apply(q, k, v, ring, DenseBlocks(ring.rank, causal, scale, dropout_p, gen))
    if gen is not None:
        _advance_stream(gen, q.device)
    return out
