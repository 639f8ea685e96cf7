"""Vocabulary padding (Megatron's make-vocab-size-divisible-by), shared by GPT and Llama.

A model's embedding and output layer hold ``padded_vocab_size(vocab_size, multiple)`` rows
(layout-independent, so checkpoints reshard) so that any tp dividing it shards them; the
padded rows' logits are set to the dtype's lowest value by ``mask_padding`` (no
probability in the loss, no gradient, never picked by generation). The config keeps the
real ``vocab_size``: what tokenizers, generation and a Hugging Face export see.
"""
from __future__ import annotations

import torch

__all__ = ["padded_vocab_size", "mask_padding"]


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple``."""
    return -(-vocab_size // multiple) * multiple


def mask_padding(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """``logits [..., V/tp]`` (TP rank ``tp_rank``'s shard of the padded vocabulary) with
    the padded ids' (>= ``vocab_size``) at the dtype's lowest value."""
    n = logits.shape[-1]
    start = tp_rank * n
    if start + n <= vocab_size:
        return logits
    pad = torch.arange(start, start + n, device=logits.device) >= vocab_size
    return logits.masked_fill(pad, torch.finfo(logits.dtype).min)
