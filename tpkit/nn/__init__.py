"""Tensor- and sequence-parallel layers (torch backend), Megatron-Core / TE semantics.

Global sizes in constructors, ``[s, b, h]`` activations, sequence parallelism on dim 0.
The layers bound to a layout take ``state=None`` (the current
tpkit.get_parallel_state()); those that shard activations along the sequence also take
``sequence_parallel=None`` (the state's setting): the linears, embedding, norms, MLP,
self-attention and TransformerLayer. DotProductAttention takes ``state`` only (its
inputs are per-head, SP does not reach it); RotaryEmbedding takes neither (it holds no
shard). Most constructors also take ``backend="torch"|"te"|"auto"`` (tpkit.nn._backend).
"""
from .attention import ParallelSelfAttention
from .compile import compile_blocks
from .dot_product_attention import DotProductAttention
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear
from .loss import vocab_parallel_cross_entropy
from .mlp import ParallelMLP
from .moe import MoE
from ..grads import sync_sequence_parallel_grads
from .norm import LayerNorm, RMSNorm
from .rope import RotaryEmbedding, apply_rotary_pos_emb
from .transformer import TransformerLayer

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "LayerNorm", "RMSNorm",
           "sync_sequence_parallel_grads", "ParallelMLP", "ParallelSelfAttention",
           "TransformerLayer", "RotaryEmbedding", "apply_rotary_pos_emb",
           "DotProductAttention", "MoE", "compile_blocks"]
