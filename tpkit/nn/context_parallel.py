"""Context-parallel attention kernels in plain torch (run on CPU/gloo as well as GPUs).

Inputs are this rank's shard in the load-balanced layout of ``tpkit.data.shard_sequence``
(CP rank r holds chunks r and 2n-1-r of 2n: tpkit.cp.cp_chunk_ids), as ``[b, h, s, d]``
tensors. These are the reference kernels: ``tpkit.nn.fused_cp`` runs the same comm types
on fused per-device block ops (``tpkit.nn.attention_ops``), and DotProductAttention
chooses between them (docs/design.md).

=============  ==========================================================================
comm type      what travels
=============  ==========================================================================
p2p            K/V blocks around the CP ring (``ring_attention``); O(S/cp) memory
all_gather     K/V all-gathered once; dK/dV reduce-scattered in backward
a2a            Ulysses: all-to-all scatters heads and gathers the sequence, then attention
               over the full sequence for heads/cp heads, and all-to-all back
a2a+p2p        a2a inside the inner CP level, then ring attention over the outer level
=============  ==========================================================================
"""
from __future__ import annotations

import torch

from ..comm.collectives import group_rank, group_size
from ..layout.config import CP_COMM_TYPES
from ..cp import cp_positions
from .attention_math import (causal_mask, from_grouped, local_attention, position_mask,
                             to_grouped)
from .mappings import all_to_all, gather_from_sp_region
from .ring_attention import ring_attention
from ._common import autocast_off


def _lb_from_a2a(x: torch.Tensor, a: int, dim: int) -> torch.Tensor:
    """The shards of ``a`` consecutive CP ranks, concatenated in rank order, -> one shard of
    the outer level's load-balanced layout: first chunks in rank order, then second chunks
    in reverse rank order (natural order when the outer level has one rank)."""
    chunks = x.chunk(2 * a, dim=dim)
    return torch.cat(chunks[0::2] + chunks[1::2][::-1], dim=dim)


def _a2a_from_lb(x: torch.Tensor, a: int, dim: int) -> torch.Tensor:
    chunks = x.chunk(2 * a, dim=dim)
    firsts, seconds = chunks[:a], chunks[a:][::-1]
    return torch.cat([c for pair in zip(firsts, seconds) for c in pair], dim=dim)


# --- kernels (grouped tensors [b, g, r, s, d] / [b, g, 1, s, d]) -----------------------------
def _p2p(q, k, v, group, causal, scale, dropout_p):
    return ring_attention(q, k, v, group, causal=causal, scale=scale, dropout_p=dropout_p)


def _all_gather(q, k, v, group, causal, scale, dropout_p):
    n, rank = group_size(group), group_rank(group)
    kf = gather_from_sp_region(k, group, dim=3)   # all-gather the sequence, reduce-scatter dK
    vf = gather_from_sp_region(v, group, dim=3)
    mask = None
    if causal:
        sl = q.shape[-2]
        q_pos = cp_positions(rank, n, sl, q.device)
        k_pos = torch.cat([cp_positions(r, n, sl, q.device) for r in range(n)])
        mask = position_mask(q_pos, k_pos)
    return local_attention(q, kf, vf, scale, mask, dropout_p)


def a2a_attention(q, k, v, a2a_group, p2p_group, local, ring):
    """Ulysses over ``a2a_group`` (heads scattered, sequence gathered), then attention over
    the gathered sequence: ``local(q, k, v)`` (``p2p_group`` None) or ``ring(q, k, v,
    p2p_group)`` over the outer level. Shared by the reference and the fused kernels."""
    a = group_size(a2a_group)
    b, g, r, s, d = q.shape
    q4 = from_grouped(q)
    k4, v4 = k.squeeze(2), v.squeeze(2)
    # [b, h, s, d] -> [b, h/a, a*s, d], then into the outer level's load-balanced layout
    qa, ka, va = (_lb_from_a2a(all_to_all(t, a2a_group, scatter_dim=1, gather_dim=2), a, 2)
                  for t in (q4, k4, v4))
    qg, kg, vg = to_grouped(qa, g // a, False), to_grouped(ka, g // a, True), \
        to_grouped(va, g // a, True)
    out = local(qg, kg, vg) if p2p_group is None else ring(qg, kg, vg, p2p_group)
    out = all_to_all(_a2a_from_lb(from_grouped(out), a, 2), a2a_group, scatter_dim=2,
                     gather_dim=1)
    return to_grouped(out, g, False)


def _a2a(q, k, v, a2a_group, p2p_group, causal, scale, dropout_p):
    def local(qg, kg, vg):
        mask = causal_mask(qg.shape[-2], kg.shape[-2], q.device) if causal else None
        return local_attention(qg, kg, vg, scale, mask, dropout_p)

    def ring(qg, kg, vg, group):
        return ring_attention(qg, kg, vg, group, causal=causal, scale=scale,
                              dropout_p=dropout_p)
    return a2a_attention(q, k, v, a2a_group, p2p_group, local, ring)


@autocast_off
def context_parallel_attention(q, k, v, *, comm_type: str, group, causal: bool, scale: float,
                               dropout_p: float = 0.0):
    """Attention of this rank's load-balanced shard; q ``[b, h, s, d]``, k/v ``[b, g, s, d]``.
    ``group`` is the CP group, or ``[a2a_group, p2p_group]`` for ``a2a+p2p``. Returns
    ``[b, h, s, d]``. Callers validate arguments (DotProductAttention does)."""
    g = k.shape[1]
    qg, kg, vg = to_grouped(q, g, False), to_grouped(k, g, True), to_grouped(v, g, True)
    if comm_type == "p2p":
        out = _p2p(qg, kg, vg, group, causal, scale, dropout_p)
    elif comm_type == "all_gather":
        out = _all_gather(qg, kg, vg, group, causal, scale, dropout_p)
    elif comm_type == "a2a":
        out = _a2a(qg, kg, vg, group, None, causal, scale, dropout_p)
    elif comm_type == "a2a+p2p":
        out = _a2a(qg, kg, vg, group[0], group[1], causal, scale, dropout_p)
    else:
        raise ValueError(f"cp_comm_type={comm_type!r} is unknown; use one of {CP_COMM_TYPES}")
    return from_grouped(out)
