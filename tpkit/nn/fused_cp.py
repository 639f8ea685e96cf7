"""Context-parallel attention on fused block kernels (``tpkit.nn.attention_ops``).

The same comm types and load-balanced layout as the reference kernels of
``tpkit.nn.context_parallel`` (which the tests hold these to), computed block by block
with a fused op that returns each block's log-sum-exp. Blocks are merged by LSE in
float32 (float64 for float64), and the backward runs the op's fused backward on each
block with the *final* output and LSE, so no score matrix is ever held.

p2p (pairwise exchange, bounded memory). Rank ``r`` of ``n`` computes its own diagonal
block first, then at step ``i = 1..n-1`` the K/V of ``src = r - i`` while sending its own
to ``dst = r + i`` (mod n). Causal masking with the layout of ``tpkit.data.shard_sequence``
(rank r holds chunks r and 2n-1-r) needs only the *first* chunk of a lower rank's K/V
(for all local queries) and all of a higher rank's (for the second local chunk), so only
that much travels. Transfers are cut into pieces (up to ``PIECES_PER_CHUNK`` per chunk,
none smaller than the op's ``min_piece_rows``; forward: ``min_fwd_piece_rows``, which
the CPU op sets to whole chunks, since the forward holds no gradient buffers and its peak
stays under the backward's); the next piece is in flight while the current one is
computed, so two pieces are buffered, whatever the sequence length.
Backward receives the pieces again, computes their dK/dV partials in query tiles of a
few pieces (the op's ``tile_pieces``, up to ``max_tile_rows`` rows: a tile bounds the
kernel's dQ output) and sends each partial straight back to its
owner, which adds it to its own dK/dV before the next piece is computed. Every rank
posts every exchange at the same position of one schedule (``ring_schedule``), so the
batches pair up in order on any backend. As paired units wait on each other, the
backward's units carry equal work on every rank: a first chunk sent alone travels in
half-size pieces (it meets all the receiver's queries, a higher rank's pieces only half).

all_gather: K/V gathered (dK/dV reduce-scattered), then one block per (query chunk, key
chunk) the causal mask needs. a2a / a2a+p2p: the reference's all-to-alls around a single
fused block or the p2p exchange above. Saved for backward: q, k, v, out, lse (p2p: local
sizes only, like the reference ring).
"""
from __future__ import annotations

import dataclasses
import itertools
import weakref

import torch

from ..comm.collectives import group_rank, group_size, start_p2p
from ..cp.ring import RingGroup, States, merge_into, wait
from .attention_math import from_grouped, to_grouped
from .attention_ops import BY_NAME, CAUSAL, FULL
from .context_parallel import a2a_attention
from .mappings import gather_from_sp_region
from ._common import autocast_off

PIECES_PER_CHUNK = 8
_KV_TAG, _DKV_TAG = 2, 3


def _split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``parts`` near-equal ranges (sizes differ by at most one)."""
    q, rem = divmod(hi - lo, parts)
    edges = [lo]
    for i in range(parts):
        edges.append(edges[-1] + q + (i < rem))
    return list(zip(edges[:-1], edges[1:]))


def pieces_per_chunk(chunk_rows: int, min_rows: int) -> int:
    return max(1, min(PIECES_PER_CHUNK, chunk_rows // max(1, min_rows)))


def tile_pieces(op, chunk_rows: int, m: int) -> int:
    """Pieces per backward query tile: the op's ``tile_pieces``, as far as its
    ``max_tile_rows`` allows (a tile's rows bound the kernel's dQ output)."""
    if op.max_tile_rows is None:
        return op.tile_pieces
    return max(1, min(op.tile_pieces, op.max_tile_rows // max(1, chunk_rows // m)))


@dataclasses.dataclass(frozen=True)
class Unit:
    """One position of the p2p schedule: ``send`` (dst, rows) of this rank's K/V, ``recv``
    (src, rows) of src's K/V, and the local query tiles that the received piece meets."""
    step: int
    send: tuple[int, tuple[int, int]] | None
    recv: tuple[int, tuple[int, int]] | None
    q_tiles: tuple[tuple[int, int], ...]


def ring_schedule(rank: int, n: int, causal: bool, s: int, m: int, tile: int = 2,
                  balanced: bool = False, max_tile_rows: int | None = None) -> list[Unit]:
    """The exchanges of group rank ``rank`` after its diagonal block: for each step, ``2m``
    units (pieces of a local shard of ``s`` rows, ``m`` per chunk) on every rank, so that
    position k of one rank's schedule pairs with position k of its peers'. Query tiles
    are ``tile`` pieces long.

    ``balanced`` (causal): a first chunk that travels alone (to a higher rank) is cut into
    ``2m`` half-size pieces instead of ``m``, so that every unit of every rank computes
    the same number of scores: a lower rank's half piece meets all our ``s`` queries, a
    higher rank's piece only our second chunk's ``s/2``. Units that pair up are where the
    ranks wait for each other (each settles its peer's dK/dV partial of the previous
    unit), so with unequal units one rank idles every unit. Those units' query tiles are
    twice as long (as far as ``max_tile_rows`` allows): the same op calls, each with the
    same scores, as the other units'."""
    c = s // 2
    pieces = _split(0, c, m) + _split(c, s, m)
    first = _split(0, c, min(2 * m, c)) if balanced else pieces[:m]  # chunk 0 alone
    mt = max(1, m // tile)
    tiles = _split(0, c, mt) + _split(c, s, mt)
    # half pieces meet all s queries: mt tiles over them, twice the rows of the others
    wide = balanced and (max_tile_rows is None or -(-s // mt) <= max_tile_rows)
    tiles1 = _split(0, s, mt) if wide else tiles
    units = []
    for i in range(1, n):
        dst, src = (rank + i) % n, (rank - i) % n
        sends = first if causal and rank < dst else pieces  # a higher rank needs chunk 0 only
        recvs = first if causal and src < rank else pieces
        # a lower rank's first chunk meets all our queries, a higher rank's our second chunk
        q_tiles = tuple(tiles[mt:] if causal and src > rank else
                        tiles1 if causal and src < rank else tiles)
        for u in range(2 * m):
            units.append(Unit(i, (dst, sends[u]) if u < len(sends) else None,
                              (src, recvs[u]) if u < len(recvs) else None, q_tiles))
    return units


def _schedule(ring, causal: bool, s: int, op, m: int, balanced: bool) -> list[Unit]:
    return ring_schedule(ring.rank, ring.n, causal, s, m, tile_pieces(op, s // 2, m),
                         balanced, op.max_tile_rows)


def _wire(x: torch.Tensor) -> torch.Tensor:
    """Grouped K/V ``[b, g, 1, s, d]`` as ``[s, b, g, d]`` contiguous: row ranges are then
    contiguous buffers (a view for sequence-first inputs)."""
    return x.squeeze(2).permute(2, 0, 1, 3).contiguous()


def _grouped(w: torch.Tensor) -> torch.Tensor:
    return w.permute(1, 2, 0, 3).unsqueeze(2)


def _dtypes(op, dtype):
    cdt = op.compute_dtype(dtype)
    return cdt, torch.promote_types(cdt, torch.float32)


def _post_kv(ring: RingGroup, unit: Unit, kw, vw):
    """Start sending our K/V piece and receiving src's; returns (works, buffers)."""
    sends, recvs, bufs = [], [], None
    if unit.send is not None:
        dst, (a, b) = unit.send
        sends = [(kw[a:b], ring.glob[dst]), (vw[a:b], ring.glob[dst])]
    if unit.recv is not None:
        src, (a, b) = unit.recv
        bufs = kw.new_empty((2, b - a) + kw.shape[1:])
        recvs = [(bufs[0], ring.glob[src]), (bufs[1], ring.glob[src])]
    return start_p2p(sends, recvs, ring.group, _KV_TAG), bufs


def _ring_forward(q, k, v, ring: RingGroup, causal: bool, scale: float, op, dropout_p: float):
    """The p2p forward: (output in the compute dtype, LSE, pieces per chunk, op states)."""
    cdt, mdt = _dtypes(op, q.dtype)
    s = q.shape[-2]
    m = pieces_per_chunk(s // 2, op.min_piece_rows)
    # forward and backward calls pair one to one when the backward needs each call's
    # state: with dropout (its mask is replayed) and with an op whose backward needs the
    # state its forward saved (op.needs_state: CUDA's kernels, even without dropout)
    paired = dropout_p > 0.0 or op.needs_state
    # otherwise the forward, which holds no gradients, can take bigger pieces (fewer
    # calls, merges and messages)
    mf = m if paired else pieces_per_chunk(s // 2, op.min_fwd_piece_rows)
    # the backward's units are balanced (see ring_schedule); the forward's need not be
    # (nothing there waits on a peer's computation, and whole chunks make few calls)
    # unless the calls pair up
    units = _schedule(ring, causal, s, op, mf, paired)
    qc, kc, vc = (t.to(cdt) for t in (q, k, v))
    kw, vw = (_wire(t) for t in (k, v)) if units else (None, None)
    pending = _post_kv(ring, units[0], kw, vw) if units else None
    states = []
    o, lse, st = op.forward(qc, kc, vc, CAUSAL if causal else FULL, scale, dropout_p)
    out, lse = o.to(mdt), lse.to(mdt)
    states.append(st)
    for i, unit in enumerate(units):
        nxt = _post_kv(ring, units[i + 1], kw, vw) if i + 1 < len(units) else None
        wait(pending[0])
        if pending[1] is not None:
            kp, vp = (_grouped(t).to(cdt) for t in pending[1])
            # unpaired, one call for all query rows; backward tiles them
            tiles = unit.q_tiles if paired else (
                (unit.q_tiles[0][0], unit.q_tiles[-1][1]),)
            for a, b in tiles:
                o, l, st = op.forward(qc[..., a:b, :], kp, vp, FULL, scale, dropout_p)
                merge_into(out[..., a:b, :], lse[..., a:b], o, l)
                states.append(st)
                del o, l  # not alive during the next call (peak memory)
        pending = nxt
    return out.to(cdt), lse, m, states


def _ring_backward(dout, q, k, v, out, lse, ring: RingGroup, causal: bool, scale: float, op,
                   dropout_p: float, m: int, states):
    """The p2p backward from the final output and LSE: (dq, dk, dv) in the inputs' dtypes."""
    cdt, mdt = _dtypes(op, q.dtype)
    s = q.shape[-2]
    units = _schedule(ring, causal, s, op, m, True)
    qc, kc, vc, dout = (t.to(cdt) for t in (q, k, v, dout))
    kw, vw = (_wire(t) for t in (k, v)) if units else (None, None)
    pending = _post_kv(ring, units[0], kw, vw) if units else None
    states = States(states, op.name, op.needs_state or dropout_p > 0.0)
    grads = op.backward(dout, qc, kc, vc, out, lse, CAUSAL if causal else FULL, scale,
                        dropout_p, states())
    dq, dk, dv = (g.to(mdt) for g in grads)
    partial = None   # (works, buffer received, our rows) of the last dK/dV exchange
    for i, unit in enumerate(units):
        nxt = _post_kv(ring, units[i + 1], kw, vw) if i + 1 < len(units) else None
        wait(pending[0])
        partial = _settle(partial, dk, dv)
        part = None
        if pending[1] is not None:
            kp, vp = (_grouped(t).to(cdt) for t in pending[1])
            part = torch.zeros((2,) + pending[1].shape[1:], dtype=mdt, device=q.device)
            pk, pv = _grouped(part[0]), _grouped(part[1])
            for a, b in unit.q_tiles:  # query tiles bound the op's dq buffer
                dq_t, dk_t, dv_t = op.backward(
                    dout[..., a:b, :], qc[..., a:b, :], kp, vp, out[..., a:b, :],
                    lse[..., a:b], FULL, scale, dropout_p, states())
                dq[..., a:b, :] += dq_t
                pk += dk_t
                pv += dv_t
                del dq_t, dk_t, dv_t  # not alive during the next tile's call
            del kp, vp
        pending = nxt
        partial = _post_partial(ring, unit, part, kw, mdt)
    _settle(partial, dk, dv)
    states.check_done()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FusedRingAttention(torch.autograd.Function):
    """Grouped q ``[b, g, r, s, d]``, k/v ``[b, g, 1, s, d]`` (this rank's shard) -> output
    like q, by the p2p schedule above with block op ``op``."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal: bool, scale: float, op, dropout_p: float):
        ring = RingGroup(group)
        out, lse, m, states = _ring_forward(q, k, v, ring, causal, scale, op, dropout_p)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, causal, scale, op, dropout_p, m, states)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return _ring_backward(dout, q, k, v, out, lse, *ctx.args) + (None,) * 5


# --- the ring inside torch.compile ------------------------------------------------------
# Point-to-point sends cannot be traced (and the shm transport's spin-waits even less), so
# a compiled region calls the ring as two opaque custom ops, forward and backward: dynamo
# sees one node each (fullgraph holds), and they run eagerly on the group's own transport
# (shm on CPU, else the backend). The group travels by name, the block op by its name
# (attention_ops.BY_NAME). An op's per-call states (op.needs_state: CUDA's kernels) are no
# tensors a custom op can return, so the forward keeps them in ``_SAVED`` under a key and
# returns the key as a one-element tensor; the backward looks them up by it, and they are
# dropped with that tensor (the graph's saved tensors, or the output of a forward without
# grad). compile_blocks refuses attention dropout under CP.
_SAVED: dict[int, list] = {}
_NEXT_KEY = itertools.count(1)


def _resolve_group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


@torch.library.custom_op("tpkit::ring_attention_fwd", mutates_args=())
def _ring_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                 causal: bool, scale: float, op_name: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = BY_NAME[op_name]
    ring = RingGroup(_resolve_group(group_name))
    out, lse, _, states = _ring_forward(q, k, v, ring, causal, scale, op, 0.0)
    key = torch.zeros(1, dtype=torch.int64)
    if op.needs_state:
        key.fill_(next(_NEXT_KEY))
        _SAVED[int(key)] = states
        weakref.finalize(key, _SAVED.pop, int(key), None)
    return out.contiguous(), lse.contiguous(), key   # the strides the fake promises


@_ring_fwd_op.register_fake
def _(q, k, v, group_name, causal, scale, op_name):
    cdt, mdt = _dtypes(BY_NAME[op_name], q.dtype)
    return (q.new_empty(q.shape, dtype=cdt), q.new_empty(q.shape[:-1], dtype=mdt),
            torch.empty(1, dtype=torch.int64))


@torch.library.custom_op("tpkit::ring_attention_bwd", mutates_args=())
def _ring_bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, key: torch.Tensor, group_name: str,
                 causal: bool, scale: float, op_name: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = BY_NAME[op_name]
    ring = RingGroup(_resolve_group(group_name))
    m = pieces_per_chunk(q.shape[-2] // 2, op.min_piece_rows)
    states = _SAVED.get(int(key), ()) if op.needs_state else ()
    grads = _ring_backward(dout, q, k, v, out, lse, ring, causal, scale, op, 0.0, m, states)
    return tuple(g.contiguous() for g in grads)   # the strides the fake promises


@_ring_bwd_op.register_fake
def _(dout, q, k, v, out, lse, key, group_name, causal, scale, op_name):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _ring_setup(ctx, inputs, output):
    q, k, v, group_name, causal, scale, op_name = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = (group_name, causal, scale, op_name)


def _ring_grad(ctx, dout, _dlse, _dkey):
    q, k, v, out, lse, key = ctx.saved_tensors
    return _ring_bwd_op(dout, q, k, v, out, lse, key, *ctx.args) + (None,) * 4


_ring_fwd_op.register_autograd(_ring_grad, setup_context=_ring_setup)


def ring_attention_op(q, k, v, group, causal: bool, scale: float, op, dropout_p: float):
    """The p2p ring: the autograd function eagerly, the custom ops while compiling."""
    if not torch.compiler.is_compiling():
        return FusedRingAttention.apply(q, k, v, group, causal, scale, op, dropout_p)
    assert dropout_p == 0.0, "compile_blocks refuses attention dropout under CP"
    out, _, _ = _ring_fwd_op(q, k, v, group.group_name, causal, scale, op.name)
    return out.to(q.dtype)


def _post_partial(ring: RingGroup, unit: Unit, part, kw, dtype):
    """Send the dK/dV partial of the piece we received back to its owner, and receive the
    partial of the piece we sent (computed by dst) into a fresh buffer."""
    sends, recvs, buf, rows = [], [], None, None
    if part is not None:
        sends = [(part, ring.glob[unit.recv[0]])]
    if unit.send is not None:
        dst, rows = unit.send
        buf = torch.empty((2, rows[1] - rows[0]) + kw.shape[1:], dtype=dtype, device=kw.device)
        recvs = [(buf, ring.glob[dst])]
    return start_p2p(sends, recvs, ring.group, _DKV_TAG), buf, rows, part


def _settle(partial, dk, dv) -> None:
    """Wait for an exchange of partials and add the received one to our dK/dV rows."""
    if partial is None:
        return None
    works, buf, rows, _ = partial
    wait(works)
    if buf is not None:
        a, b = rows
        dk[..., a:b, :] += _grouped(buf[0])
        dv[..., a:b, :] += _grouped(buf[1])
    return None


class BlockAttention(torch.autograd.Function):
    """Attention of local grouped q against local k/v as a list of blocks
    ``((q start, q stop), (k start, k stop), BlockMask)`` merged by LSE (all_gather, a2a)."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, scale: float, op, dropout_p: float):
        cdt, mdt = _dtypes(op, q.dtype)
        qc, kc, vc = (t.to(cdt) for t in (q, k, v))
        out = lse = None
        states = []
        for (qa, qb), (ka, kb), mask in blocks:
            o, l, st = op.forward(qc[..., qa:qb, :], kc[..., ka:kb, :], vc[..., ka:kb, :],
                                  mask, scale, dropout_p)
            states.append(st)
            if out is None and (qa, qb) == (0, q.shape[-2]):  # the first block sets all rows
                out, lse = o.to(mdt), l.to(mdt)
                continue
            if out is None:
                out = torch.zeros(q.shape, dtype=mdt, device=q.device)
                lse = torch.full(q.shape[:-1], float("-inf"), dtype=mdt, device=q.device)
            merge_into(out[..., qa:qb, :], lse[..., qa:qb], o, l)
            del o, l
        ctx.save_for_backward(q, k, v, out.to(cdt), lse)
        ctx.args = (blocks, scale, op, dropout_p, states)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        blocks, scale, op, dropout_p, states = ctx.args
        cdt, mdt = _dtypes(op, q.dtype)
        qc, kc, vc, dout = (t.to(cdt) for t in (q, k, v, dout))
        dq, dk, dv = (torch.zeros(t.shape, dtype=mdt, device=t.device) for t in (q, k, v))
        for ((qa, qb), (ka, kb), mask), st in zip(blocks, states):
            g = op.backward(dout[..., qa:qb, :], qc[..., qa:qb, :], kc[..., ka:kb, :],
                            vc[..., ka:kb, :], out[..., qa:qb, :], lse[..., qa:qb], mask,
                            scale, dropout_p, st)
            dq[..., qa:qb, :] += g[0]
            dk[..., ka:kb, :] += g[1]
            dv[..., ka:kb, :] += g[2]
            del g
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 4


def all_gather_blocks(rank: int, n: int, s: int, causal: bool):
    """Blocks of the all_gather kernel: the local shard's two query chunks against the
    gathered K/V (rank order: rank j's chunks j and 2n-1-j), chunk by chunk."""
    if not causal:
        return [((0, s), (0, n * s), FULL)]
    c = s // 2

    def rows(j):  # global chunk j -> its rows in the gathered K/V
        return (j * s, j * s + c) if j < n else ((2 * n - 1 - j) * s + c, (2 * n - j) * s)
    blocks = []
    for q_rows, chunk in (((0, c), rank), ((c, s), 2 * n - 1 - rank)):
        blocks += [(q_rows, rows(j), FULL) for j in range(chunk)]
        blocks.append((q_rows, rows(chunk), CAUSAL))
    return blocks


@autocast_off
def fused_context_parallel_attention(q, k, v, *, comm_type: str, group, causal: bool,
                                     scale: float, op, dropout_p: float = 0.0):
    """``tpkit.nn.context_parallel.context_parallel_attention`` on block op ``op``:
    q ``[b, h, s, d]``, k/v ``[b, g, s, d]`` of this rank's shard -> ``[b, h, s, d]``."""
    g = k.shape[1]
    qg, kg, vg = to_grouped(q, g, False), to_grouped(k, g, True), to_grouped(v, g, True)

    def local(q_, k_, v_):
        blocks = [((0, q_.shape[-2]), (0, k_.shape[-2]), CAUSAL if causal else FULL)]
        return BlockAttention.apply(q_, k_, v_, blocks, scale, op, dropout_p)

    def ring(q_, k_, v_, grp):
        return ring_attention_op(q_, k_, v_, grp, causal, scale, op, dropout_p)

    if comm_type == "p2p":
        out = ring(qg, kg, vg, group)
    elif comm_type == "all_gather":
        kf, vf = (gather_from_sp_region(t, group, dim=3) for t in (kg, vg))
        blocks = all_gather_blocks(group_rank(group), group_size(group), q.shape[-2], causal)
        out = BlockAttention.apply(qg, kf, vf, blocks, scale, op, dropout_p)
    elif comm_type == "a2a":
        out = a2a_attention(qg, kg, vg, group, None, local, ring)
    else:  # "a2a+p2p" (DotProductAttention validated the comm type)
        out = a2a_attention(qg, kg, vg, group[0], group[1], local, ring)
    return from_grouped(out)
