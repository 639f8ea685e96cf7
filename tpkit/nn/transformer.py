"""TransformerLayer: pre-norm GPT block built from the parallel layers.

``x = x + dropout(attn(norm1(x)))``; ``x = x + dropout(mlp(norm2(x)))`` on ``[s, b, h]``,
or ``[s/tp, b, h]`` under sequence parallelism (norms, dropout and residuals then run on
this rank's tokens only). Hidden dropout uses the RNG tracker's model-parallel stream
under SP (each TP rank holds different tokens) and the default stream otherwise (every
TP rank holds the same activations and must draw the same mask).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layout.random import get_rng_tracker
from ._backend import TEBackendMixin
from ._common import ParallelModule, check_input_format, check_sbh, resolve_sp
from .attention import ParallelSelfAttention
from .mlp import ParallelMLP
from .norm import LayerNorm, RMSNorm

__all__ = ["TransformerLayer"]

_NORMS = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}


class TransformerLayer(TEBackendMixin, ParallelModule):
    """One pre-norm transformer block (self-attention + MLP), TE-like arguments. ``bias``
    covers every linear layer; ``qkv_bias`` (None: ``bias``) the fused QKV alone
    (ParallelSelfAttention's; TE has no such option, so backend="te" refuses it).
    ``attn_input_format`` (TE's): ``"sbhd"`` (default: ``[s, b, h]``, SP shards dim 0) or
    ``"bshd"`` (batch-first ``[b, s, h]``, SP shards dim 1)."""
    _te_kind = "transformer_layer"  # backend="te": te.TransformerLayer (tpkit.nn._backend)

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int, *,
                 num_gqa_groups: int | None = None, normalization: str = "LayerNorm",
                 layernorm_epsilon: float = 1e-5, hidden_dropout: float = 0.0,
                 attention_dropout: float = 0.0, attn_mask_type: str = "causal",
                 bias: bool = True, qkv_bias: bool | None = None, activation: str = "gelu",
                 sequence_parallel: bool | None = None, init_method=None,
                 output_layer_init_method=None, attn_input_format: str = "sbhd", state=None,
                 device=None, dtype=None, backend: str = "torch"):
        super().__init__()
        check_input_format(attn_input_format)
        self.attn_input_format = attn_input_format
        if normalization not in _NORMS:
            raise ValueError(f"normalization={normalization!r} is not supported; use one of "
                             f"{tuple(_NORMS)}")
        if not 0.0 <= hidden_dropout < 1.0:
            raise ValueError(f"hidden_dropout={hidden_dropout} must be in [0, 1)")
        self._bind_state(state)
        self.sequence_parallel = resolve_sp(sequence_parallel, self.state)
        self.hidden_size, self.hidden_dropout = hidden_size, hidden_dropout
        common = dict(sequence_parallel=self.sequence_parallel, state=self.state,
                      device=device, dtype=dtype)
        norm = _NORMS[normalization]
        self.input_layernorm = norm(hidden_size, eps=layernorm_epsilon, **common)
        self.self_attention = ParallelSelfAttention(
            hidden_size, num_attention_heads, num_gqa_groups=num_gqa_groups,
            attention_dropout=attention_dropout, attn_mask_type=attn_mask_type, bias=bias,
            qkv_bias=qkv_bias, init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            attn_input_format=attn_input_format, **common)
        self.pre_mlp_layernorm = norm(hidden_size, eps=layernorm_epsilon, **common)
        self.mlp = ParallelMLP(hidden_size, ffn_hidden_size, activation=activation, bias=bias,
                               init_method=init_method,
                               output_layer_init_method=output_layer_init_method,
                               attn_input_format=attn_input_format, **common)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0.0:
            return x
        if self.sequence_parallel and self.state.tp_size > 1:
            with get_rng_tracker().fork():
                return F.dropout(x, self.hidden_dropout, True)
        return F.dropout(x, self.hidden_dropout, True)

    def forward(self, hidden_states: torch.Tensor,
                rotary_pos_emb: torch.Tensor | None = None, attention_mask=None,
                inference_params=None, **packed) -> torch.Tensor:
        """``attention_mask``, ``inference_params`` (TE's KV cache) and ``packed`` (TE's
        ``cu_seqlens_q``, ... of one packed row) go to ``ParallelSelfAttention.forward``."""
        check_sbh(hidden_states, self.hidden_size, type(self).__name__, self.attn_input_format)
        x = hidden_states
        x = x + self._dropout(self.self_attention(self.input_layernorm(x), rotary_pos_emb,
                                                  attention_mask,
                                                  inference_params=inference_params,
                                                  **packed))
        x = x + self._dropout(self.mlp(self.pre_mlp_layernorm(x)))
        return x
