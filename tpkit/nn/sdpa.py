"""The default attention core: F.scaled_dot_product_attention on sbhd tensors.

Contract (the context-parallel DotProductAttention replaces this module):
``core(q, k, v)`` with q ``[s, b, heads_local, d]`` and k, v ``[s, b, gqa_local, d]``
returns ``[s, b, heads_local * d]``. Query head i uses kv group ``i // (heads/gqa)``
(TE/Megatron GQA). Attention dropout draws from the RNG tracker's model-parallel stream,
since every TP rank holds different heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SDPAttention", "ATTN_MASK_TYPES"]

ATTN_MASK_TYPES = ("causal", "no_mask")


class SDPAttention(nn.Module):
    """softmax(q k^T * scale [+ causal mask]) v, with kv heads shared by query groups."""

    def __init__(self, *, attention_dropout: float = 0.0, attn_mask_type: str = "causal",
                 softmax_scale: float | None = None):
        super().__init__()
        if attn_mask_type not in ATTN_MASK_TYPES:
            raise ValueError(f"attn_mask_type={attn_mask_type!r} is not supported by the torch "
                             f"backend; use one of {ATTN_MASK_TYPES}")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"attention_dropout={attention_dropout} must be in [0, 1)")
        self.attention_dropout = attention_dropout
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[:2] != k.shape[:2] \
                or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
            raise ValueError(f"core attention expects q [s, b, heads, d] and k, v [s, b, groups,"
                             f" d] with heads divisible by groups; got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)}")
        s, b, heads, d = q.shape
        qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))      # [b, heads, s, d]
        p = self.attention_dropout if self.training else 0.0
        kw = dict(is_causal=self.attn_mask_type == "causal", dropout_p=p,
                  scale=self.softmax_scale, enable_gqa=heads != k.shape[2])
        if p > 0.0:
            from ..random import get_rng_tracker
            with get_rng_tracker().fork():
                out = F.scaled_dot_product_attention(qb, kb, vb, **kw)
        else:
            out = F.scaled_dot_product_attention(qb, kb, vb, **kw)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)

    def extra_repr(self) -> str:
        return f"attn_mask_type={self.attn_mask_type!r}, attention_dropout={self.attention_dropout}"
