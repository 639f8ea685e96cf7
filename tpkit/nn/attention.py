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

import warnings

import torch

from ._backend import TEBackendMixin
from torch import nn

from . import mappings
from ._common import (ParallelModule, check_input_format, check_sbh, divide, local_kv_heads,
                      resolve_sp, set_tp_attrs)
from .linear import ColumnParallelLinear, RowParallelLinear, linear_fn
from .rope import apply_rotary_pos_emb
from .dot_product_attention import THD_KWARGS, DotProductAttention
from .inference import check_window

__all__ = ["ParallelSelfAttention", "ReplicatedKV"]


class ReplicatedKV(ParallelModule):
    """Key (and value) projections with fewer kv heads than TP ranks: every rank holds the
    whole ``[segments * kv_heads * d, in]`` weight (replicated: full in checkpoints) and
    computes only the head its query heads use (``local()``: that head's rows of every
    segment). Each rank's gradient then covers its head's rows, and the sum over the TP
    ranks is every head's gradient (the ranks sharing a head add their query heads'
    shares), so the parameters carry the ``sequence_parallel`` tag: TPKitStrategy sums them
    over TP after every backward, plain loops call tpkit.grads.sync_sequence_parallel_grads.
    The input comes in already gathered (the attention's job, as for its fused QKV)."""

    def __init__(self, in_features: int, kv_heads: int, head_dim: int, *, segments: int = 2,
                 bias: bool = False, init_method=None, state=None, device=None, dtype=None):
        super().__init__()
        state = self._bind_state(state)
        local_kv_heads(kv_heads, state.tp_size)
        self.in_features, self.kv_heads, self.head_dim = in_features, kv_heads, head_dim
        self.segments = segments
        out = segments * kv_heads * head_dim
        kw = {"device": state.device if device is None else device,
              "dtype": dtype or torch.get_default_dtype()}
        self.weight = set_tp_attrs(nn.Parameter(torch.empty(out, in_features, **kw)), None,
                                   sequence_parallel=True)
        with torch.no_grad():   # the default stream: the same on every TP rank (replicated)
            (init_method or (lambda w: nn.init.uniform_(w, -in_features ** -0.5,
                                                        in_features ** -0.5)))(self.weight)
        self.bias = set_tp_attrs(nn.Parameter(torch.zeros(out, **kw)), None,
                                 sequence_parallel=True) if bias else None
        head = state.tp_rank // (state.tp_size // kv_heads) if kv_heads < state.tp_size \
            else state.tp_rank
        seg = kv_heads * head_dim
        # plain ints, no tensor: under ``with torch.device("meta")`` (the pre-flight's
        # build) a torch.arange would be a meta tensor with no values to read
        self._rows = [r for i in range(segments)
                      for r in range(i * seg + head * head_dim, i * seg + (head + 1) * head_dim)]

    def local(self):
        """(weight rows, bias rows) of this rank's kv head, every segment in order."""
        rows = self._rows
        w = self.weight[rows[0]:rows[-1] + 1] if self.segments == 1 else self.weight[rows]
        b = None if self.bias is None else (
            self.bias[rows[0]:rows[-1] + 1] if self.segments == 1 else self.bias[rows])
        return w, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.local()
        return linear_fn(self, x, w, b)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}, segments={self.segments}, replicated over TP")


class ParallelSelfAttention(TEBackendMixin, ParallelModule):
    """Multi-head / grouped-query self-attention on ``[s, b, h]`` (``[s/tp, b, h]`` under
    SP). ``num_gqa_groups`` is TE's: the number of kv heads (None = num_attention_heads).
    ``bias`` covers QKV and the projection; ``qkv_bias`` (None: ``bias``) overrides it for
    QKV alone (Qwen2 and Megatron's ``add_qkv_bias``: biased q/k/v, unbiased projection).
    ``attn_input_format`` (TE's name): ``"sbhd"`` (default, ``[s, b, h]``) or ``"bshd"``
    (batch-first ``[b, s, h]``, nanoGPT's and Hugging Face's; SP then shards dim 1). An
    "sbhd" input with fewer positions than batch rows is warned about once: a batch-first
    tensor read as sequence-first attends across the batch."""
    _te_kind = "self_attention"  # backend="te" refuses (no TE counterpart), "auto" = torch

    def __init__(self, hidden_size: int, num_attention_heads: int, *,
                 num_gqa_groups: int | None = None, attention_dropout: float = 0.0,
                 attn_mask_type: str = "causal", bias: bool = True,
                 qkv_bias: bool | None = None, sequence_parallel: bool | None = None,
                 init_method=None, output_layer_init_method=None,
                 attn_input_format: str = "sbhd", state=None, device=None,
                 dtype=None, backend: str = "torch"):
        super().__init__()
        self._bind_state(state)
        self.sequence_dim = check_input_format(attn_input_format)
        self.attn_input_format = attn_input_format
        tp = self.state.tp_size
        self.sequence_parallel = resolve_sp(sequence_parallel, self.state)
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        divide(hidden_size, 1, "hidden_size")
        self.heads_local = divide(num_attention_heads, tp, "num_attention_heads")
        self.groups_local = local_kv_heads(groups, tp)
        divide(num_attention_heads, groups, "num_attention_heads", by="num_gqa_groups")
        divide(hidden_size, num_attention_heads, "hidden_size", by="num_attention_heads")
        self.hidden_size = hidden_size
        self.num_attention_heads, self.num_gqa_groups = num_attention_heads, groups
        d = self.kv_channels = hidden_size // num_attention_heads
        kw = dict(sequence_parallel=self.sequence_parallel, state=self.state, device=device,
                  dtype=dtype, sequence_dim=self.sequence_dim)
        sizes = (num_attention_heads * d, groups * d, groups * d)
        qkv_bias = bias if qkv_bias is None else qkv_bias
        # fewer kv heads than TP ranks: linear_qkv holds the queries, linear_kv the whole
        # k/v projection on every rank (ReplicatedKV)
        self.replicated_kv = groups < tp
        if self.replicated_kv:
            sizes = sizes[:1]
            self.linear_kv = ReplicatedKV(hidden_size, groups, d, bias=qkv_bias,
                                          init_method=init_method, state=self.state,
                                          device=device, dtype=dtype)
        self.linear_qkv = ColumnParallelLinear(hidden_size, sum(sizes), qkv_bias,
                                               init_method=init_method, partition_sizes=sizes,
                                               **kw)
        self.core_attention = DotProductAttention(
            num_attention_heads, d, num_gqa_groups=groups, attention_dropout=attention_dropout,
            attn_mask_type=attn_mask_type, qkv_format=attn_input_format, state=self.state)
        self.linear_proj = RowParallelLinear(num_attention_heads * d, hidden_size, bias,
                                             input_is_parallel=True,
                                             init_method=output_layer_init_method or init_method,
                                             **kw)

    def forward(self, hidden_states: torch.Tensor,
                rotary_pos_emb: torch.Tensor | None = None, attention_mask=None,
                inference_params=None, **packed) -> torch.Tensor:
        """``attention_mask``: TE's padding mask ``[b, 1, 1, s]`` (the core's mask type must
        be a padding one). ``packed``: TE's THD arguments (``cu_seqlens_q``, ...,
        ``PackedBatch.attention_kwargs()``) for one packed row, ``hidden_states``
        ``[t, 1, h]``; the core then runs ``qkv_format="thd"`` with the padding form of
        this layer's mask type, and ``rotary_pos_emb`` holds the angles of the row's
        per-document positions (``RotaryEmbedding(batch.position_ids)``).
        ``inference_params`` (TE's KV cache, tpkit.nn.inference): as TE's
        MultiheadAttention, ``rotary_pos_emb`` then holds the angles of every position
        from 0 (``[>= offset + s, 1 or b, 1, d]``) and the call takes rows ``offset ..
        offset + s - 1``; an ``attention_mask`` covers every key so far (the core runs the
        padding form of its mask type)."""
        check_sbh(hidden_states, self.hidden_size, type(self).__name__, self.attn_input_format)
        unknown = sorted(set(packed) - set(THD_KWARGS))
        if unknown:
            raise TypeError(f"{type(self).__name__}.forward got unexpected arguments {unknown};"
                            f" packed sequences take {list(THD_KWARGS)}")
        fmt = self.attn_input_format
        if self.replicated_kv:   # one gather (or f) of the input for both projections
            x = mappings.gather_from_sp_region(hidden_states, self.group, self.sequence_dim) \
                if self.sequence_parallel else mappings.copy_to_tp_region(hidden_states,
                                                                          self.group)
            lq = self.linear_qkv
            qkv = torch.cat([linear_fn(lq, x, lq.weight, lq.bias), self.linear_kv(x)], -1)
        else:
            qkv = self.linear_qkv(hidden_states)               # [s, b, (hl + 2 gl) * d]
        n0, n1, _ = qkv.shape
        s, b = (n0, n1) if fmt == "sbhd" else (n1, n0)
        if fmt == "sbhd" and s < b and inference_params is None \
                and not getattr(self, "_format_warned", False):
            self._format_warned = True
            warnings.warn(f"{type(self).__name__} read an input of {s} positions x {b} batch "
                          "rows as sequence-first [s, b, h]; if it is batch-first [b, s, h] "
                          "(nanoGPT's, Hugging Face's layout), attention runs over the batch: "
                          "pass attn_input_format='bshd'", stacklevel=2)
        d, hl, gl = self.kv_channels, self.heads_local, self.groups_local
        q, k, v = qkv.split([hl * d, gl * d, gl * d], dim=-1)
        q, k, v = q.view(n0, n1, hl, d), k.view(n0, n1, gl, d), v.view(n0, n1, gl, d)
        if rotary_pos_emb is not None and inference_params is not None:
            off = check_window(inference_params, s, b, type(self).__name__)[0]
            if rotary_pos_emb.shape[0] < off + s:
                raise ValueError(f"{type(self).__name__}: with inference_params, "
                                 f"rotary_pos_emb holds the angles of every position from 0 "
                                 f"(TE's rule); it has {rotary_pos_emb.shape[0]}, the call "
                                 f"needs {off + s} (sequence_len_offset={off} + {s})")
            rotary_pos_emb = rotary_pos_emb[off:off + s]
        if rotary_pos_emb is not None:
            q = apply_rotary_pos_emb(q, rotary_pos_emb, fmt)
            k = apply_rotary_pos_emb(k, rotary_pos_emb, fmt)
        if inference_params is not None:
            if packed:
                raise ValueError(f"{type(self).__name__}: inference_params with packed "
                                 "sequences (cu_seqlens) is not supported; pass [s, b, h] "
                                 "rows (left-padded, with a padding mask)")
            mask_type = getattr(self.core_attention, "attn_mask_type", "causal")
            if attention_mask is not None and not mask_type.startswith("padding"):
                mask_type = "padding_" + mask_type if mask_type == "causal" else "padding"
            ctx = self.core_attention(q, k, v, attention_mask, attn_mask_type=mask_type,
                                      inference_params=inference_params)
        elif packed.get("cu_seqlens_q") is None:
            args = () if attention_mask is None else (attention_mask,)
            ctx = self.core_attention(q, k, v, *args)           # [s, b, hl * d]
        elif b != 1:
            raise ValueError(f"packed sequences are one row: hidden_states [t, 1, h], got batch "
                             f"{b}; pack more documents into the row instead")
        else:
            causal = "causal" in getattr(self.core_attention, "attn_mask_type", "causal")
            row = 1 - self.sequence_dim     # the batch dim, of size 1
            ctx = self.core_attention(q.select(row, 0), k.select(row, 0), v.select(row, 0),
                                      qkv_format="thd",
                                      attn_mask_type="padding_causal" if causal else "padding",
                                      **packed).unsqueeze(row)
        return self.linear_proj(ctx)
