"""Vocabulary-parallel embedding: each TP rank holds rows [r*V/tp, (r+1)*V/tp) of the table.

Ids outside this rank's range look up zeros; the partial outputs are summed over TP with
an all-reduce, or under sequence parallelism reduce-scattered along the sequence dim:
pass ids sequence-first (``[s, b]``) to get ``[s/tp, b, h]`` hidden states, or
batch-first ``[b, s]`` with ``sequence_dim=1`` to get ``[b, s/tp, h]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import mappings
from ._common import ParallelModule, divide, init_shard, resolve_sp, set_tp_attrs

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(ParallelModule):
    """nn.Embedding with the vocabulary sharded over TP (weight ``[V/tp, h]``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method=None,
                 sequence_parallel: bool | None = None, sequence_dim: int = 0, state=None,
                 device=None, dtype=None):
        super().__init__()
        self._bind_state(state)
        if sequence_dim not in (0, 1):
            raise ValueError(f"sequence_dim={sequence_dim!r} must be 0 (ids [s, b]) or 1 "
                             "(batch-first ids [b, s])")
        self.sequence_dim = sequence_dim
        self.tp_size = self.state.tp_size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        divide(embedding_dim, 1, "embedding_dim")
        local = divide(num_embeddings, self.tp_size, "num_embeddings (vocab size)")
        self.vocab_start = self.state.tp_rank * local
        self.vocab_end = self.vocab_start + local
        self.sequence_parallel = resolve_sp(sequence_parallel, self.state)
        device = self.state.device if device is None else device
        self.weight = set_tp_attrs(nn.Parameter(torch.empty(
            local, embedding_dim, device=device, dtype=dtype or torch.get_default_dtype())), 0)
        init_shard(self.weight, init_method or (lambda w: nn.init.normal_(w)), embedding_dim,
                   self.tp_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"VocabParallelEmbedding expects integer ids, got {input_ids.dtype}")
        d = self.sequence_dim
        if self.sequence_parallel and (input_ids.dim() < 1 + d or
                                       input_ids.shape[d] % self.tp_size):
            raise ValueError(f"with sequence_parallel=True the ids must be "
                             f"{('[s, b]', '[b, s]')[d]} (sequence_dim={d}) with s divisible "
                             f"by tp={self.tp_size}, got shape {tuple(input_ids.shape)}; pad "
                             "the sequence")
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sp_region(out, self.group, d)
        return mappings.reduce_from_tp_region(out, self.group, inplace=True)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, "
                f"sequence_parallel={self.sequence_parallel}")
