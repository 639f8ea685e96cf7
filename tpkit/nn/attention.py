"""ParallelSelfAttention: QKV column-parallel (GQA), heads split over TP, proj row-parallel.

The fused QKV weight's full layout is ``[Q (heads*d); K (groups*d); V (groups*d)]`` along
dim 0; it is sharded per segment (``tp_partition_sizes``), so each rank holds its heads'
q rows and its groups' k and v rows, and one matmul + one collective serves all three.
The attention core is the swappable submodule ``self.core_attention``: tpkit's
DotProductAttention (TE's DotProductAttention call contract: ``core(q, k, v)`` with
``[s, b, heads/tp, d]`` tensors, returning ``[s, b, heads/tp * d]``), so with CP the local
(load-balanced) sequence shard attends to the whole sequence with the state's
cp_comm_type.
"""
from __future__ import annotations

import torch

from ._backend import TEBackendMixin
from ._common import ParallelModule, check_sbh, divide, resolve_sp
from .linear import ColumnParallelLinear, RowParallelLinear
from .rope import apply_rotary_pos_emb
from .dot_product_attention import THD_KWARGS, DotProductAttention

__all__ = ["ParallelSelfAttention"]


class ParallelSelfAttention(TEBackendMixin, ParallelModule):
    """Multi-head / grouped-query self-attention on ``[s, b, h]`` (``[s/tp, b, h]`` under
    SP). ``num_gqa_groups`` is TE's: the number of kv heads (None = num_attention_heads).
    ``bias`` covers QKV and the projection; ``qkv_bias`` (None: ``bias``) overrides it for
    QKV alone (Qwen2 and Megatron's ``add_qkv_bias``: biased q/k/v, unbiased projection)."""
    _te_kind = "self_attention"  # backend="te" refuses (no TE counterpart), "auto" = torch

    def __init__(self, hidden_size: int, num_attention_heads: int, *,
                 num_gqa_groups: int | None = None, attention_dropout: float = 0.0,
                 attn_mask_type: str = "causal", bias: bool = True,
                 qkv_bias: bool | None = None, sequence_parallel: bool | None = None,
                 init_method=None, output_layer_init_method=None, state=None, device=None,
                 dtype=None, backend: str = "torch"):
        super().__init__()
        self._bind_state(state)
        tp = self.state.tp_size
        self.sequence_parallel = resolve_sp(sequence_parallel, self.state)
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        divide(hidden_size, 1, "hidden_size")
        self.heads_local = divide(num_attention_heads, tp, "num_attention_heads")
        self.groups_local = divide(groups, tp, "num_gqa_groups")
        divide(num_attention_heads, groups, "num_attention_heads", by="num_gqa_groups")
        divide(hidden_size, num_attention_heads, "hidden_size", by="num_attention_heads")
        self.hidden_size = hidden_size
        self.num_attention_heads, self.num_gqa_groups = num_attention_heads, groups
        d = self.kv_channels = hidden_size // num_attention_heads
        kw = dict(sequence_parallel=self.sequence_parallel, state=self.state, device=device,
                  dtype=dtype)
        sizes = (num_attention_heads * d, groups * d, groups * d)
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self.linear_qkv = ColumnParallelLinear(hidden_size, sum(sizes), qkv_bias,
                                               init_method=init_method, partition_sizes=sizes,
                                               **kw)
        self.core_attention = DotProductAttention(
            num_attention_heads, d, num_gqa_groups=groups, attention_dropout=attention_dropout,
            attn_mask_type=attn_mask_type, state=self.state)
        self.linear_proj = RowParallelLinear(num_attention_heads * d, hidden_size, bias,
                                             input_is_parallel=True,
                                             init_method=output_layer_init_method or init_method,
                                             **kw)

    def forward(self, hidden_states: torch.Tensor,
                rotary_pos_emb: torch.Tensor | None = None, attention_mask=None,
                **packed) -> torch.Tensor:
        """``attention_mask``: TE's padding mask ``[b, 1, 1, s]`` (the core's mask type must
        be a padding one). ``packed``: TE's THD arguments (``cu_seqlens_q``, ...,
        ``PackedBatch.attention_kwargs()``) for one packed row, ``hidden_states``
        ``[t, 1, h]``; the core then runs ``qkv_format="thd"`` with the padding form of
        this layer's mask type, and ``rotary_pos_emb`` holds the angles of the row's
        per-document positions (``RotaryEmbedding(batch.position_ids)``)."""
        check_sbh(hidden_states, self.hidden_size, type(self).__name__)
        unknown = sorted(set(packed) - set(THD_KWARGS))
        if unknown:
            raise TypeError(f"{type(self).__name__}.forward got unexpected arguments {unknown};"
                            f" packed sequences take {list(THD_KWARGS)}")
        qkv = self.linear_qkv(hidden_states)                   # [s, b, (hl + 2 gl) * d]
        s, b, _ = qkv.shape
        d, hl, gl = self.kv_channels, self.heads_local, self.groups_local
        q, k, v = qkv.split([hl * d, gl * d, gl * d], dim=-1)
        q, k, v = q.view(s, b, hl, d), k.view(s, b, gl, d), v.view(s, b, gl, d)
        if rotary_pos_emb is not None:
            q = apply_rotary_pos_emb(q, rotary_pos_emb)
            k = apply_rotary_pos_emb(k, rotary_pos_emb)
        if packed.get("cu_seqlens_q") is None:
            args = () if attention_mask is None else (attention_mask,)
            ctx = self.core_attention(q, k, v, *args)           # [s, b, hl * d]
        elif b != 1:
            raise ValueError(f"packed sequences are one row: hidden_states [t, 1, h], got batch "
                             f"{b}; pack more documents into the row instead")
        else:
            causal = "causal" in getattr(self.core_attention, "attn_mask_type", "causal")
            ctx = self.core_attention(q[:, 0], k[:, 0], v[:, 0], qkv_format="thd",
                                      attn_mask_type="padding_causal" if causal else "padding",
                                      **packed).unsqueeze(1)
        return self.linear_proj(ctx)
