"""Attention over packed sequences (THD) and padding masks, in plain torch, with CP.

Every token of a packed row gets a *segment* (its document's index; a padding token gets
a segment of its own, ``-1 - row index``) and a *position* (its offset in its document).
A query sees a key when both have the same segment and, causally, the key's position is
not after the query's. So documents never see each other, a padding token sees only
itself (its output is then zeroed, as TE zeroes THD padding), and every query row sees at
least one key: the row-wise softmax never divides by zero.

Under CP the row is laid out per document (``tpkit.cp.packed_cp_indices``), and every
rank can compute the segments and positions of any rank's shard from the global
``cu_seqlens``, so masks need no communication. The comm types move K/V as their
``tpkit.nn.context_parallel`` counterparts do (TE 2.x supports THD on all four):

=============  ==========================================================================
p2p            K/V around ``tpkit.cp.ring``'s ring (``PackedBlocks``: each step's mask)
all_gather     K/V all-gathered (dK/dV reduce-scattered), one masked block per rank
a2a            heads scattered, sequence gathered, one masked block over the whole row
a2a+p2p        a2a inside the inner level, then the ring over the outer level
=============  ==========================================================================

The math is dense per block (``[sq, sk]`` scores) in the compute dtype of
``attention_math`` (float64 stays float64); the fused per-device block ops of
``attention_ops`` do not take THD masks yet.
"""
from __future__ import annotations

import torch

from ..comm.collectives import group_size
from ..cp.ring import Ring, RingBlocks, RingGroup
from ..cp.sharding import _bounds, packed_cp_indices
from .attention_math import compute_dtype, from_grouped, local_attention, to_grouped
from .mappings import all_to_all, gather_from_sp_region
from ._common import autocast_off

# --- segments and masks ----------------------------------------------------------------------
def row_segments(cu_seqlens, cu_seqlens_padded, device=None):
    """(segment, position, real) of every token of a packed row, in row order."""
    total = _bounds(cu_seqlens_padded)[-1]   # from the host copy: no device sync
    cu = torch.as_tensor(cu_seqlens, device=device).long()
    cup = torch.as_tensor(cu_seqlens_padded, device=device).long()
    idx = torch.arange(total, device=device)
    doc = torch.searchsorted(cup[1:], idx, right=True)
    pos = idx - cup[doc]
    real = pos < (cu[1:] - cu[:-1])[doc]
    return torch.where(real, doc, -1 - idx), pos, real


def rank_segments(cu_seqlens, cu_seqlens_padded, cp_size: int, device=None):
    """``[(segment, position, real)]`` of every CP rank's shard (rank order)."""
    seg, pos, real = row_segments(cu_seqlens, cu_seqlens_padded, device)
    out = []
    for r in range(cp_size):
        idx = packed_cp_indices(cu_seqlens_padded, r, cp_size, device)
        out.append((seg[idx], pos[idx], real[idx]))
    return out


def padding_segments(attention_mask: torch.Tensor):
    """(segment, position, real) ``[b, s]`` of a bshd/sbhd batch from TE's padding mask
    ``[b, 1, 1, s]`` (True: a padding token)."""
    pad = attention_mask.reshape(attention_mask.shape[0], attention_mask.shape[-1]).bool()
    s = pad.shape[-1]
    idx = torch.arange(s, device=pad.device).expand_as(pad)
    return torch.where(pad, -1 - idx, torch.zeros_like(idx)), idx, ~pad


def hidden_mask(q_meta, k_meta, causal: bool) -> torch.Tensor:
    """True where a query (rows) must not see a key (columns); ``[..., sq, sk]``."""
    (qs, qp), (ks, kp) = q_meta[:2], k_meta[:2]
    hide = qs.unsqueeze(-1) != ks.unsqueeze(-2)
    if causal:
        hide |= kp.unsqueeze(-2) > qp.unsqueeze(-1)
    return hide


def _cat(metas):
    return tuple(torch.cat(parts, dim=-1) for parts in zip(*metas))


# --- the ring (p2p) --------------------------------------------------------------------------
def _block_forward(q, k, v, hide, scale):
    """Output and LSE of one block; rows with every key hidden give 0 and -inf."""
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).masked_fill_(hide, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = s.sub_(m).exp_()
    denom = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v).div_(denom.clamp_min(torch.finfo(p.dtype).tiny))
    return out, (m + denom.log()).squeeze(-1)


def _block_backward(q, k, v, dout, lse, delta, hide, scale):
    p = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).masked_fill_(hide, float("-inf"))
    p = p.sub_(lse.unsqueeze(-1)).exp_()
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(2, keepdim=True)
    ds = torch.matmul(dout, v.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(p)
    dq = torch.matmul(ds, k).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2, keepdim=True).mul_(scale)
    return dq, dk, dv


_ALL = slice(None)


class PackedBlocks(RingBlocks):
    """The packed kernel's block of every ring step: this rank's queries against ``src``'s
    K/V, masked with both ranks' (segment, position) from ``metas``; nothing where every
    pair is hidden."""
    name = "packed_attention"

    def __init__(self, rank: int, metas, causal: bool, scale: float):
        self.rank, self.metas, self.causal, self.scale = rank, metas, causal, scale

    def _hide(self, src):
        hide = hidden_mask(self.metas[self.rank], self.metas[src], self.causal)
        return None if bool(hide.all()) else hide

    def forward(self, src, q, k, v):
        hide = self._hide(src)
        return None if hide is None else (_ALL, *_block_forward(q, k, v, hide, self.scale),
                                          None)

    def backward(self, src, q, k, v, dout, lse, delta, states):
        hide = self._hide(src)
        return None if hide is None else (_ALL, _ALL, *_block_backward(
            q, k, v, dout, lse, delta, hide, self.scale))


def packed_ring(q, k, v, group, metas, causal: bool, scale: float):
    """The p2p ring of grouped q ``[b, g, r, s, d]``, k/v ``[b, g, 1, s, d]`` of this ring
    rank; ``metas`` the (segment, position) of every ring rank's tokens."""
    ring = RingGroup(group)
    return Ring.apply(q, k, v, ring, PackedBlocks(ring.rank, metas, causal, scale))


# --- the comm types --------------------------------------------------------------------------
def _masked(q, k, v, q_meta, k_meta, causal, scale):
    """Dense attention of grouped tensors with the segment mask (autograd keeps scores)."""
    hide = hidden_mask(q_meta, k_meta, causal)
    while hide.dim() < q.dim():   # [b, sq, sk] (padding) or [sq, sk] (THD) -> grouped
        hide = hide.unsqueeze(-3)
    return local_attention(q, k, v, scale, hide, 0.0)


def _a2a(q, k, v, a2a_group, metas, local):
    """Ulysses over ``a2a_group``: heads scattered, the shards of the group's ranks
    gathered in rank order; ``local(q, k, v, metas_of_gathered)``; then back."""
    a = group_size(a2a_group)
    g = k.shape[1]
    q4, k4, v4 = from_grouped(q), k.squeeze(2), v.squeeze(2)
    qa, ka, va = (all_to_all(t, a2a_group, scatter_dim=1, gather_dim=2) for t in (q4, k4, v4))
    out = local(to_grouped(qa, g // a, False), to_grouped(ka, g // a, True),
                to_grouped(va, g // a, True))
    return to_grouped(all_to_all(from_grouped(out), a2a_group, scatter_dim=2, gather_dim=1),
                      g, False)


@autocast_off
def packed_attention(q, k, v, *, cu_seqlens, cu_seqlens_padded, comm_type: str, group,
                     cp_size: int, cp_rank: int, causal: bool, scale: float) -> torch.Tensor:
    """THD attention of this CP rank's shard. q ``[1, h, t, d]``, k/v ``[1, g, t, d]``
    (the row as a batch of one) -> ``[1, h, t, d]``, padding rows zero."""
    g = k.shape[1]
    qg, kg, vg = to_grouped(q, g, False), to_grouped(k, g, True), to_grouped(v, g, True)
    metas = rank_segments(cu_seqlens, cu_seqlens_padded, cp_size, q.device)
    mine = metas[cp_rank]
    if cp_size == 1:
        out = _masked(qg, kg, vg, mine, mine, causal, scale)
    elif comm_type == "p2p":
        out = packed_ring(qg, kg, vg, group, metas, causal, scale)
    elif comm_type == "all_gather":
        kf, vf = (gather_from_sp_region(t, group, dim=3) for t in (kg, vg))
        out = _masked(qg, kf, vf, mine, _cat(metas), causal, scale)
    elif comm_type == "a2a":
        every = _cat(metas)
        out = _a2a(qg, kg, vg, group, metas,
                   lambda q_, k_, v_: _masked(q_, k_, v_, every, every, causal, scale))
    else:  # "a2a+p2p": cp rank = p2p rank * a + a2a rank (topology's split of the cp dim)
        a = group_size(group[0])
        outer = [_cat(metas[j * a:(j + 1) * a]) for j in range(cp_size // a)]
        out = _a2a(qg, kg, vg, group[0], metas,
                   lambda q_, k_, v_: packed_ring(q_, k_, v_, group[1], outer, causal, scale))
    return from_grouped(out) * mine[2].to(q.dtype).view(1, 1, -1, 1)


@autocast_off
def padded_attention(q, k, v, attention_mask, *, causal: bool, scale: float) -> torch.Tensor:
    """bshd/sbhd attention with TE's padding mask ``[b, 1, 1, s]`` (True: padding), no CP.
    q ``[b, h, s, d]``, k/v ``[b, g, s, d]`` -> ``[b, h, s, d]``, padding rows zero."""
    g = k.shape[1]
    meta = padding_segments(attention_mask)
    out = _masked(to_grouped(q, g, False), to_grouped(k, g, True), to_grouped(v, g, True),
                  meta, meta, causal, scale)
    return from_grouped(out) * meta[2].to(q.dtype)[:, None, :, None]
