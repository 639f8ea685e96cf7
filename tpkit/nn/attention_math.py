"""Attention math in plain torch, shared by every context-parallel kernel.

Everything is computed in ``compute_dtype(input dtype)``: fp32 for half types and fp32
(softmax statistics accumulate in fp32), float64 for float64 (so gradcheck and float64
references see float64 math); results are returned in the input dtype.

Tensors use a grouped layout so grouped-query attention never materialises repeated K/V:
``q`` is ``[b, g, r, s, d]`` (``g`` KV groups of ``r`` query heads each) and ``k``/``v`` are
``[b, g, 1, s, d]``; broadcasting in the matmuls pairs every query head with its group.
``block_forward`` / ``block_backward`` are FlashAttention's per-block forward (output plus
log-sum-exp) and backward (from the *final* output's LSE), so blocks can be computed one
at a time and merged (``tpkit.cp.ring.merge_into``), which is what ring attention needs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layout.random import get_rng_tracker
from ._common import autocast_off


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention math runs in for inputs of ``dtype``: at least fp32."""
    return torch.promote_types(dtype, torch.float32)


def to_grouped(x: torch.Tensor, groups: int, is_kv: bool) -> torch.Tensor:
    """``[b, h, s, d]`` -> ``[b, g, h/g, s, d]`` (queries) or ``[b, g, 1, s, d]`` (K/V)."""
    b, h, s, d = x.shape
    if is_kv:
        return x.unsqueeze(2)
    return x.reshape(b, groups, h // groups, s, d)


def from_grouped(x: torch.Tensor) -> torch.Tensor:
    b, g, r, s, d = x.shape
    return x.reshape(b, g * r, s, d)


def causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """True where a key must be hidden (top-left aligned upper triangle)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def position_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """True where key position > query position (causal mask for arbitrary layouts)."""
    return k_pos.view(1, -1) > q_pos.view(-1, 1)


def _scores(q, k, scale, causal):
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if causal:
        s.masked_fill_(causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    return s


def _keep_mask(shape, dropout_p: float, gen, like: torch.Tensor):
    """Dropout keep-mask scaled by 1/(1-p) in ``like``'s dtype, drawn from ``gen``
    (replayed in backward)."""
    keep = torch.rand(shape, generator=gen, device=like.device) >= dropout_p
    return keep.to(like.dtype).div_(1.0 - dropout_p)


def block_forward(q, k, v, scale: float, causal: bool, dropout_p: float = 0.0, gen=None):
    """Output ``[b, g, r, sq, d]`` and LSE ``[b, g, r, sq]`` of one block (inputs already
    in the compute dtype).
    Every row sees at least one key (a diagonal or an unmasked block). In-place ops keep
    the memory traffic of the ``sq x sk`` scores low. With ``dropout_p`` the probabilities
    (not the LSE) are dropped with a mask drawn from ``gen``."""
    s = _scores(q, k, scale, causal)
    m = s.amax(dim=-1, keepdim=True)
    p = s.sub_(m).exp_()
    denom = p.sum(dim=-1, keepdim=True)
    if dropout_p > 0.0:
        p = p.mul_(_keep_mask(p.shape, dropout_p, gen, p))
    out = torch.matmul(p, v).div_(denom)
    return out, (m + denom.log()).squeeze(-1)


def block_backward(q, k, v, dout, lse, delta, scale: float, causal: bool,
                   dropout_p: float = 0.0, gen=None):
    """dq, dk, dv of one block given the final LSE and ``delta = sum(dout * out, -1)``;
    with dropout, ``gen`` must be in the state it had for this block's forward."""
    p = _scores(q, k, scale, causal).sub_(lse.unsqueeze(-1)).exp_()
    keep = _keep_mask(p.shape, dropout_p, gen, p) if dropout_p > 0.0 else None
    pd = p if keep is None else p * keep
    dv = torch.matmul(pd.transpose(-1, -2), dout).sum(2, keepdim=True)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    if keep is not None:
        dp.mul_(keep)
    ds = dp.sub_(delta.unsqueeze(-1)).mul_(p)
    dq = torch.matmul(ds, k).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2, keepdim=True).mul_(scale)
    return dq, dk, dv


@autocast_off
def local_attention(q, k, v, scale: float, mask: torch.Tensor | None, dropout_p: float):
    """Differentiable attention of grouped tensors (autograd keeps the probabilities).
    ``mask`` is True where hidden; dropout on the probabilities runs inside the RNG
    tracker's model-parallel stream (distinct per TP and PP coordinate, the same on every
    CP rank of a TP coordinate: tpkit.layout.random), each CP rank drawing for its own queries."""
    dtype, cdt = q.dtype, compute_dtype(q.dtype)
    s = torch.matmul(q.to(cdt), k.to(cdt).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    if dropout_p > 0.0:
        with get_rng_tracker().fork():
            p = F.dropout(p, dropout_p, training=True)
    return torch.matmul(p, v.to(cdt)).to(dtype)
