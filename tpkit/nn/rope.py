"""Rotary position embeddings in TE's convention (non-interleaved halves, sbhd).

``RotaryEmbedding(kv_channels)(seq_len or position_ids)`` returns angles ``[s, 1, 1, d]``
(the frequencies repeated over both halves; ``[s, b, 1, d]`` for ``[s, b]`` position ids), and ``apply_rotary_pos_emb(t, freqs)``
rotates the first ``d`` channels of ``t [s, b, heads, head_dim]``:
``t * cos + rotate_half(t) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "apply_rotary_pos_emb"]


class RotaryEmbedding(nn.Module):
    """Angles ``pos * base**(-2i/d)`` for i < d/2, laid out as ``[s, 1, 1, d]``."""

    def __init__(self, kv_channels: int, base: float = 10000.0, *, device=None):
        super().__init__()
        if isinstance(kv_channels, bool) or not isinstance(kv_channels, int) \
                or kv_channels <= 0 or kv_channels % 2:
            raise ValueError(f"kv_channels={kv_channels!r} must be a positive even integer")
        if base <= 0:
            raise ValueError(f"base={base} must be positive")
        self.kv_channels, self.base = kv_channels, float(base)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, kv_channels, 2, dtype=torch.float64,
                                                     device=device) / kv_channels))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, position_ids: torch.Tensor | int) -> torch.Tensor:
        if isinstance(position_ids, int):
            pos = torch.arange(position_ids, device=self.inv_freq.device, dtype=torch.float32)
        else:
            if position_ids.dim() not in (1, 2):
                raise ValueError("position_ids must be 1-D [s] (positions shared by the batch) "
                                 "or 2-D [s, b] (one position per row, e.g. left-padded "
                                 f"prompts), got shape {tuple(position_ids.shape)}")
            pos = position_ids.to(device=self.inv_freq.device, dtype=torch.float32)
        freqs = pos[..., None] * self.inv_freq                  # [s, (b,) d/2]
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs[:, None, None, :] if freqs.dim() == 2 else freqs[:, :, None, :]

    def extra_repr(self) -> str:
        return f"kv_channels={self.kv_channels}, base={self.base}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor,
                         tensor_format: str = "sbhd") -> torch.Tensor:
    """Rotate ``t [s, b, h, d_head]`` (TE's ``tensor_format="sbhd"``; ``"bshd"``: ``[b, s,
    h, d_head]``) by ``freqs [>= s, 1, 1, d]`` (d <= d_head; extra channels pass through;
    longer freqs are cut to ``s`` like TE)."""
    if tensor_format not in ("sbhd", "bshd"):
        raise ValueError(f"tensor_format={tensor_format!r} is not supported; use 'sbhd' or "
                         "'bshd'")
    if t.dim() != 4 or freqs.dim() != 4:
        raise ValueError(f"apply_rotary_pos_emb expects t [s, b, h, d] and freqs [s, 1, 1, d], "
                         f"got {tuple(t.shape)} and {tuple(freqs.shape)}")
    s, d = t.shape[0 if tensor_format == "sbhd" else 1], freqs.shape[-1]
    if freqs.shape[0] < s or d > t.shape[-1]:
        raise ValueError(f"freqs {tuple(freqs.shape)} do not cover t {tuple(t.shape)} "
                         f"({tensor_format}): need at least {s} positions and at most "
                         f"{t.shape[-1]} channels")
    freqs = freqs[:s].to(t.device)
    if tensor_format == "bshd":
        freqs = freqs.transpose(0, 1)                          # [1, s, 1, d]
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    rot, rest = t[..., :d], t[..., d:]
    out = rot * cos + _rotate_half(rot) * sin
    return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)
