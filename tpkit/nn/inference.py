"""KV-cache inference: TE's ``InferenceParams`` and the cached attention of one call.

``InferenceParams(max_batch_size, max_sequence_length)`` has TE's documented meaning and
fields: ``key_value_memory_dict`` maps each attention layer (its ``layer_number``, or the
core module itself when it has none) to its ``(key_memory, value_memory)`` of shape
``[max_sequence_length, max_batch_size, kv_heads/tp, head_dim]`` (sbhd, allocated on the
first call), ``sequence_len_offset`` is where the tokens of the next forward go (the
caller adds their count after a *complete* forward pass through every layer, TE's rule),
``batch_size_offset`` the first cached batch row the call's batch occupies, and
``swap_key_value_dict(batch_indices)`` reorders the cached rows (beam search).

``cached_attention`` writes the call's keys and values at ``[offset:offset+s,
b0:b0+b]`` and attends the call's queries (absolute positions ``offset..offset+s-1``)
to every cached key up to ``offset+s``: causal by absolute position, and a key padding
mask (True: padding) of the keys so far, ``[b, 1, 1, offset+s]``.
"""
from __future__ import annotations

import torch

__all__ = ["InferenceParams", "cached_attention"]


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"InferenceParams({name}={v!r}): must be a positive integer")
    return v


class InferenceParams:
    """TE's KV-cache parameters (``transformer_engine.pytorch.InferenceParams``)."""

    def __init__(self, max_batch_size: int, max_sequence_length: int):
        self.max_batch_size = _positive_int("max_batch_size", max_batch_size)
        self.max_sequence_length = _positive_int("max_sequence_length", max_sequence_length)
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.key_value_memory_dict: dict = {}

    def swap_key_value_dict(self, batch_indices) -> None:
        """Reorder every layer's cached batch rows by ``batch_indices`` (one index per
        cached row), TE's beam-search step."""
        if not self.key_value_memory_dict:
            raise ValueError("InferenceParams.swap_key_value_dict: the cache is empty; run a "
                             "forward with inference_params first")
        idx = torch.as_tensor(batch_indices, dtype=torch.long)
        for key, (k, v) in self.key_value_memory_dict.items():
            if idx.dim() != 1 or len(idx) != k.shape[1]:
                raise ValueError(f"swap_key_value_dict(batch_indices of length {len(idx)}): "
                                 f"the cache holds {k.shape[1]} batch rows; pass one index "
                                 "per row")
            i = idx.to(k.device)
            self.key_value_memory_dict[key] = (k[:, i], v[:, i])

    def __repr__(self) -> str:
        return (f"InferenceParams(max_batch_size={self.max_batch_size}, max_sequence_length="
                f"{self.max_sequence_length}, sequence_len_offset={self.sequence_len_offset})")


def check_window(params: InferenceParams, s: int, b: int, who: str) -> tuple[int, int]:
    """(offset, batch offset) of a call of ``s`` tokens x ``b`` rows, or ValueError when it
    does not fit the cache's sizes."""
    if not isinstance(params, InferenceParams):
        raise ValueError(f"{who}: inference_params={params!r} is not a tpkit InferenceParams "
                         "(tpkit.te_api.InferenceParams / tpkit.nn.inference.InferenceParams)")
    off, b0 = int(params.sequence_len_offset), int(params.batch_size_offset)
    if off < 0 or off + s > params.max_sequence_length:
        raise ValueError(f"{who}: sequence_len_offset={off} + {s} new tokens exceeds "
                         f"InferenceParams(max_sequence_length={params.max_sequence_length}); "
                         "build it with a max_sequence_length of at least prompt + new tokens")
    if b0 < 0 or b0 + b > params.max_batch_size:
        raise ValueError(f"{who}: batch_size_offset={b0} + batch {b} exceeds "
                         f"InferenceParams(max_batch_size={params.max_batch_size}); build it "
                         "with a max_batch_size of at least the batch")
    return off, b0


def cached_attention(core, params: InferenceParams, q, k, v, fmt: str, causal: bool,
                     kv_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The attention of ``q, k, v`` (``fmt`` "sbhd"/"bshd", this rank's heads) with the
    cache of ``core``: ``[b, heads, s, d]`` out."""
    if fmt == "bshd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))         # -> [s, b, h, d]
    s, b = q.shape[0], q.shape[1]
    off, b0 = check_window(params, s, b, type(core).__name__)
    key = getattr(core, "layer_number", None)
    key = core if key is None else key
    mem = params.key_value_memory_dict.get(key)
    shape = (params.max_sequence_length, params.max_batch_size, k.shape[2], k.shape[3])
    if mem is None or mem[0].shape != shape or mem[0].dtype != k.dtype:
        if off != 0:
            have = "no cache" if mem is None else \
                f"a cache of {tuple(mem[0].shape)} {mem[0].dtype}, not {shape} {k.dtype}"
            raise ValueError(f"{type(core).__name__}: sequence_len_offset={off} but this layer "
                             f"has {have}; the first call (the prompt) runs at offset 0 with "
                             "the same InferenceParams, heads and dtype")
        mem = tuple(torch.zeros(shape, dtype=k.dtype, device=k.device) for _ in range(2))
        params.key_value_memory_dict[key] = mem
    km, vm = mem
    end = off + s
    km[off:end, b0:b0 + b] = k.detach()
    vm[off:end, b0:b0 + b] = v.detach()
    keys, values = km[:end, b0:b0 + b], vm[:end, b0:b0 + b]    # [S, b, g, d]
    qb = q.permute(1, 2, 0, 3)                                  # [b, h, s, d]
    kb, vb = keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3)
    rep = qb.shape[1] // kb.shape[1]
    if rep > 1:
        kb, vb = kb.repeat_interleave(rep, 1), vb.repeat_interleave(rep, 1)
    scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale     # [b, h, s, S]
    allowed = torch.ones(s, end, dtype=torch.bool, device=q.device)
    if causal:
        qpos = torch.arange(off, end, device=q.device)[:, None]
        allowed = torch.arange(end, device=q.device)[None, :] <= qpos
    allowed = allowed[None, None]
    if kv_mask is not None:
        allowed = allowed & ~kv_mask.to(q.device)
        # a query that sees no key (a left-padding position) attends to itself only: its
        # output is never used, and this keeps it finite
        none = ~allowed.any(-1, keepdim=True)
        diag = torch.arange(end, device=q.device)[None, :] == torch.arange(
            off, end, device=q.device)[:, None]
        allowed = allowed | (none & diag)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(scores.softmax(-1), vb)                 # [b, h, s, d]


def kv_padding_mask(attention_mask, b: int, s_kv: int, who: str) -> torch.Tensor:
    """The key padding mask ``[b, 1, 1, s_kv]`` (True: padding) of a cached call from TE's
    forms: one tensor over the keys so far, or a ``(q_mask, kv_mask)`` pair."""
    mask = attention_mask[1] if isinstance(attention_mask, (tuple, list)) else attention_mask
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool \
            or tuple(mask.shape) != (b, 1, 1, s_kv):
        got = (tuple(mask.shape), mask.dtype) if isinstance(mask, torch.Tensor) else mask
        raise ValueError(f"{who}: with inference_params the padding mask covers every key so "
                         f"far (cached + new): expected a bool [{b}, 1, 1, {s_kv}] (True: "
                         f"padding), or a (q_mask, kv_mask) pair with that kv_mask; got {got}")
    return mask
