"""Transformer Engine's PyTorch API (``transformer_engine.pytorch``) on tpkit's layers.

``import tpkit.te_api as te`` runs a model written against TE's documented classes and
functions (``te.Linear(..., parallel_mode="column")``, ``te.LayerNormMLP``,
``te.TransformerLayer``, ``te.fp8_autocast``, ``te.checkpoint``, ...) on tpkit's torch
backend, CPU or GPU. Every class here is a thin layer over tpkit's Megatron-named layers
(``ColumnParallelLinear``, ``ParallelMLP``, ``ParallelSelfAttention``, ``nn.TransformerLayer``)
and computes exactly what they compute; the names, signatures and defaults are TE's
(docs/te_api.md holds the table of every documented item and its status).

TE's semantics kept here: ``tp_group`` is the tensor-parallel group (None: no tensor
parallelism), ``sequence_parallel`` defaults to False, ``init_method`` defaults to
``normal(0, 0.023)``, dropout defaults are TE's (0.1). tpkit's layers bind to a
``ParallelState``, so ``tp_group`` must be the current state's TP group (or None at
tp=1); anything tpkit cannot do yet raises a ValueError saying why and what to use.
Each class takes tpkit's ``backend=`` ("torch" default; "te" returns TE's own class of
the same name built from the same arguments; "auto": TE where it runs).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import nn as tnn
from . import te as _te
from .fp8 import fp8_autocast as _fp8_autocast
from .fp8 import fp8_model_init, register_gemm_layer
from .fp8 import is_active as _fp8_active
from .nn._backend import resolve_backend
from .nn._common import SharedRef
from .nn.export import export_mode as _export_mode
from .nn.inference import InferenceParams
from .nn.linear import linear_fn
from .te.offload import get_cpu_offload_context
from .layout.random import RNGStatesTracker
from .recompute import checkpoint
from .layout.topology import resolve_state

__all__ = ["Linear", "LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP",
           "DotProductAttention", "MultiheadAttention", "TransformerLayer", "InferenceParams",
           "CudaRNGStatesTracker", "fp8_autocast", "fp8_model_init", "checkpoint",
           "onnx_export", "get_cpu_offload_context"]

# TE's class for its RNG tracker is tpkit's tracker (same methods: add, fork, get_states,
# set_states, reset), exported under TE's documented name.
CudaRNGStatesTracker = RNGStatesTracker


def _default_init(weight: torch.Tensor) -> torch.Tensor:
    """TE's default ``init_method``: normal(mean=0, std=0.023)."""
    return nn.init.normal_(weight, mean=0.0, std=0.023)


def _not_yet(what: str, instead: str):
    raise ValueError(f"{what} is not yet supported by tpkit's torch backend; {instead}")


def _state(tp_group, tp_size: int, who: str):
    """The ParallelState a TE-API module binds to: ``tp_group`` must be its TP group."""
    state = resolve_state(None)
    if tp_group is None:
        if tp_size != 1:
            _not_yet(f"{who}(tp_size={tp_size}) without tp_group (a group set later by "
                     "set_tensor_parallel_group)",
                     "pass tp_group=tpkit.get_parallel_state().tp_group at construction")
        if state.tp_size != 1:
            raise ValueError(f"{who}(tp_group=None) means no tensor parallelism in TE's API, "
                             f"but the current layout has tp={state.tp_size}; pass "
                             "tp_group=tpkit.get_parallel_state().tp_group")
    elif tp_group is not state.tp_group:
        raise ValueError(f"{who}(tp_group=...) is not the current layout's TP group; tpkit's "
                         "layers run on the current ParallelState's groups: pass "
                         "tp_group=tpkit.get_parallel_state().tp_group")
    return state


def _check_parallel_group(module: nn.Module, tp_group) -> None:
    """``set_tensor_parallel_group``: the module's layers were built on their state's TP
    group, the only one they can use."""
    state = module._te_state.obj
    if tp_group is not state.tp_group:
        _not_yet(f"{type(module).__name__}.set_tensor_parallel_group with another group than "
                 "the one it was built on",
                 "build the module with tp_group=<that group> inside its layout")


def _refuse(who: str, **flags) -> None:
    """ValueError for each TE option tpkit cannot honour yet (value != TE's default)."""
    for name, (value, default, instead) in flags.items():
        if value is not default and (isinstance(value, torch.Tensor) or value != default):
            _not_yet(f"{who}({name}={value!r})", instead)


_MODES = (None, "column", "row")


def _mode(parallel_mode) -> str | None:
    mode = parallel_mode.lower() if isinstance(parallel_mode, str) else parallel_mode
    if mode not in _MODES:
        raise ValueError(f"parallel_mode={parallel_mode!r} is not one of TE's modes; use "
                         "None, 'column' or 'row'")
    return mode


class _HandOff:
    """``backend=``: "torch" (the default) builds tpkit's layer; "te" (or "auto" with TE
    and CUDA) returns Transformer Engine's class of the same name built from the same
    arguments, which are TE's already (``device=None`` becomes TE's default)."""

    def __new__(cls, *args, backend: str = "torch", **kwargs):
        if resolve_backend(backend) == "te":
            name = next(c.__name__ for c in cls.__mro__
                        if c.__module__ == __name__ and not c.__name__.startswith("_"))
            te_cls = getattr(_te.require_te(), name)
            if "device" in kwargs and kwargs["device"] is None:
                kwargs.pop("device")
            return te_cls(*args, **kwargs)
        return super().__new__(cls)


# --- Linear ------------------------------------------------------------------------------
class Linear(_HandOff, nn.Module):
    """TE's ``Linear``: ``parallel_mode="column"`` is tpkit's ColumnParallelLinear,
    ``"row"`` its RowParallelLinear (the input is this rank's shard), None a plain linear
    with the full weight and no communication. ``te.Linear(...)`` returns an instance of
    the subclass for its mode (``isinstance(layer, te.Linear)`` holds)."""

    def __new__(cls, *args, backend: str = "torch", **kwargs):
        if cls is Linear:
            cls = _LINEARS[_mode(kwargs.get("parallel_mode"))]
        return super().__new__(cls, *args, backend=backend, **kwargs)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 init_method=None, parameters_split=None, device=None,
                 sequence_parallel: bool = False, tp_group=None, tp_size: int = 1,
                 parallel_mode: str | None = None, fuse_wgrad_accumulation: bool = False,
                 return_bias: bool = False, params_dtype: torch.dtype | None = None,
                 backend: str = "torch"):
        _refuse("Linear", parameters_split=(
                    parameters_split, None, "use one Linear per split, or tpkit.nn."
                    "ColumnParallelLinear(partition_sizes=...) for a fused sharded weight"),
                fuse_wgrad_accumulation=(
                    fuse_wgrad_accumulation, False, "gradients accumulate into .grad; pass "
                    "fuse_wgrad_accumulation=False"))
        state = _state(tp_group, tp_size, "Linear")
        self._build(in_features, out_features, bias, state=state,
                    sequence_parallel=bool(sequence_parallel),
                    init_method=init_method or _default_init, return_bias=return_bias,
                    device=device, dtype=params_dtype)
        self._te_state = SharedRef(state)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        """``is_first_microbatch`` is TE's fp8 weight-caching hint; the result is the same
        without it, so it is accepted and not needed."""
        return super().forward(inp)

    def set_tensor_parallel_group(self, tp_group) -> None:
        _check_parallel_group(self, tp_group)


class _ColumnLinear(Linear, tnn.ColumnParallelLinear):
    def _build(self, in_features, out_features, bias, **kw):
        tnn.ColumnParallelLinear.__init__(self, in_features, out_features, bias, **kw)


class _RowLinear(Linear, tnn.RowParallelLinear):
    def _build(self, in_features, out_features, bias, **kw):
        tnn.RowParallelLinear.__init__(self, in_features, out_features, bias,
                                       input_is_parallel=True, **kw)


class _LocalLinear(Linear):
    def _build(self, in_features, out_features, bias, *, state, sequence_parallel,
               init_method, return_bias, device, dtype):
        nn.Module.__init__(self)
        kw = {"device": state.device if device is None else device,
              "dtype": dtype or torch.get_default_dtype()}
        self.in_features, self.out_features = in_features, out_features
        self.return_bias = bool(return_bias)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
        with torch.no_grad():   # replicated on every rank: the default stream, not the TP one
            init_method(self.weight)
        self.bias = nn.Parameter(torch.zeros(out_features, **kw)) if bias else None

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        out = linear_fn(self, inp, self.weight, None if self.return_bias else self.bias)
        return (out, self.bias) if self.return_bias else out


register_gemm_layer(_LocalLinear)   # its weight goes fp8 under fp8_model_init too
_LINEARS = {"column": _ColumnLinear, "row": _RowLinear, None: _LocalLinear}


# --- norms -------------------------------------------------------------------------------
class _TENorm:
    """TE's norm keywords over tpkit.nn's norms, and ``zero_centered_gamma``: gamma starts
    at 0 and the norm multiplies by 1 + gamma."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *,
                 sequence_parallel: bool | None = None, params_dtype=None,
                 zero_centered_gamma: bool = False, device=None, backend: str = "torch"):
        super().__init__(hidden_size, eps, sequence_parallel=bool(sequence_parallel),
                         device=device, dtype=params_dtype)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        if self.zero_centered_gamma:
            with torch.no_grad():
                self.weight.zero_()

    def _gamma(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered_gamma else self.weight


class LayerNorm(_HandOff, _TENorm, tnn.LayerNorm):
    """TE's ``LayerNorm`` (tpkit.nn.LayerNorm with TE's keywords and zero_centered_gamma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        return nn.functional.layer_norm(x, (self.hidden_size,), self._gamma(), self.bias,
                                        self.eps)


class RMSNorm(_HandOff, _TENorm, tnn.RMSNorm):
    """TE's ``RMSNorm`` (tpkit.nn.RMSNorm with TE's keywords and zero_centered_gamma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        return nn.functional.rms_norm(x, (self.hidden_size,), self._gamma(), self.eps)


_NORMS = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}


def _norm(normalization: str, hidden_size: int, eps: float, **kw) -> nn.Module:
    if normalization not in _NORMS:
        raise ValueError(f"normalization={normalization!r} is not one of TE's; use "
                         f"{tuple(_NORMS)}")
    return _NORMS[normalization](hidden_size, eps, **kw)


def _check_ln_output(who: str, return_layernorm_output_gathered: bool) -> None:
    _refuse(who, return_layernorm_output_gathered=(
        return_layernorm_output_gathered, False,
        "gather the returned norm output with tpkit.nn.mappings.gather_from_sp_region"))


# --- LayerNormLinear / LayerNormMLP ------------------------------------------------------
class LayerNormLinear(_HandOff, nn.Module):
    """TE's ``LayerNormLinear``: ``layer_norm`` (LayerNorm/RMSNorm) then ``linear``
    (``te_api.Linear`` with ``parallel_mode``). Under SP with "column" the norm runs on
    this rank's tokens and the linear gathers its output, as TE's fused module does."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5,
                 bias: bool = True, *, normalization: str = "LayerNorm", init_method=None,
                 return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False, parameters_split=None,
                 zero_centered_gamma: bool = False, device=None,
                 sequence_parallel: bool = False, tp_group=None, tp_size: int = 1,
                 parallel_mode: str | None = None, fuse_wgrad_accumulation: bool = False,
                 return_bias: bool = False, params_dtype=None, backend: str = "torch"):
        super().__init__()
        _check_ln_output("LayerNormLinear", return_layernorm_output_gathered)
        self.linear = Linear(in_features, out_features, bias, init_method=init_method,
                             parameters_split=parameters_split, device=device,
                             sequence_parallel=sequence_parallel, tp_group=tp_group,
                             tp_size=tp_size, parallel_mode=parallel_mode,
                             fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                             return_bias=return_bias, params_dtype=params_dtype)
        self.layer_norm = _norm(normalization, in_features, eps,
                                sequence_parallel=sequence_parallel, params_dtype=params_dtype,
                                zero_centered_gamma=zero_centered_gamma, device=device)
        self.return_layernorm_output = bool(return_layernorm_output)
        self._te_state = self.linear._te_state

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        ln = self.layer_norm(inp)
        out = self.linear(ln)
        if not self.return_layernorm_output:
            return out
        return (*out, ln) if isinstance(out, tuple) else (out, ln)

    def set_tensor_parallel_group(self, tp_group) -> None:
        _check_parallel_group(self, tp_group)


class LayerNormMLP(_HandOff, nn.Module):
    """TE's ``LayerNormMLP``: ``layer_norm`` then tpkit's ``ParallelMLP`` (fc1 column-,
    fc2 row-parallel; ``set_parallel_mode=True`` is TE's switch for that sharding)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5,
                 bias: bool = True, *, normalization: str = "LayerNorm",
                 activation: str = "gelu", init_method=None, output_layer_init_method=None,
                 return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False,
                 zero_centered_gamma: bool = False, device=None,
                 set_parallel_mode: bool = False, sequence_parallel: bool = False,
                 tp_group=None, tp_size: int = 1, fuse_wgrad_accumulation: bool = False,
                 return_bias: bool = False, params_dtype=None, seq_length=None,
                 micro_batch_size=None, backend: str = "torch"):
        super().__init__()
        _check_ln_output("LayerNormMLP", return_layernorm_output_gathered)
        _refuse("LayerNormMLP", fuse_wgrad_accumulation=(
                    fuse_wgrad_accumulation, False, "pass fuse_wgrad_accumulation=False"),
                return_bias=(return_bias, False, "pass return_bias=False (fc2's bias is "
                             "added inside)"))
        state = _state(tp_group, tp_size, "LayerNormMLP")
        if state.tp_size > 1 and not set_parallel_mode:
            _not_yet("LayerNormMLP(set_parallel_mode=False) with a TP group of size "
                     f"{state.tp_size} (TE then leaves fc1/fc2 unsharded)",
                     "pass set_parallel_mode=True")
        self.layer_norm = _norm(normalization, hidden_size, eps,
                                sequence_parallel=sequence_parallel, params_dtype=params_dtype,
                                zero_centered_gamma=zero_centered_gamma, device=device)
        self.mlp = tnn.ParallelMLP(hidden_size, ffn_hidden_size, activation=activation,
                                   bias=bias, sequence_parallel=bool(sequence_parallel),
                                   init_method=init_method or _default_init,
                                   output_layer_init_method=output_layer_init_method
                                   or init_method or _default_init,
                                   state=state, device=device, dtype=params_dtype)
        self.return_layernorm_output = bool(return_layernorm_output)
        self._te_state = SharedRef(state)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        ln = self.layer_norm(inp)
        out = self.mlp(ln)
        return (out, ln) if self.return_layernorm_output else out

    def set_tensor_parallel_group(self, tp_group) -> None:
        _check_parallel_group(self, tp_group)


# --- attention ---------------------------------------------------------------------------
class DotProductAttention(_HandOff, tnn.DotProductAttention):
    """TE's ``DotProductAttention``: tpkit.nn.DotProductAttention (TE's call contract
    already) with TE's constructor keywords (``tp_group``, ``cp_group``, ...) and forward
    arguments; the CP group is the layout's unless ``cp_group`` says otherwise."""

    def __init__(self, num_attention_heads: int, kv_channels: int, num_gqa_groups=None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd",
                 attn_mask_type: str = "causal", window_size=None,
                 sequence_parallel: bool = False, tp_size: int = 1,
                 get_rng_state_tracker=None, tp_group=None, layer_number=None,
                 attention_type: str = "self", cp_group=None, cp_global_ranks=None,
                 cp_stream=None, cp_comm_type: str = "p2p", softmax_scale=None,
                 backend: str = "torch"):
        state = _state(tp_group, tp_size, "DotProductAttention")
        _refuse("DotProductAttention",
                window_size=(window_size, None, "sliding windows need the TE backend"),
                attention_type=(attention_type, "self", "self-attention only"))
        super().__init__(num_attention_heads, kv_channels, num_gqa_groups=num_gqa_groups,
                         attn_mask_type=attn_mask_type, attention_dropout=attention_dropout,
                         qkv_format=qkv_format, softmax_scale=softmax_scale, state=state)
        self.layer_number = layer_number     # the key of its KV cache (InferenceParams)
        if cp_group is not None:
            self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None,
                qkv_format=None, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None,
                max_seqlen_kv=None, attn_mask_type=None, window_size=None,
                checkpoint_core_attention: bool = False,
                core_attention_bias_type: str = "no_bias", core_attention_bias=None,
                alibi_slopes=None, fast_zero_fill: bool = True, inference_params=None,
                **padded):
        """TE's forward; ``padded``: ``cu_seqlens_q_padded``/``cu_seqlens_kv_padded``."""
        _check_attention_forward("DotProductAttention.forward", None, window_size,
                                 checkpoint_core_attention, core_attention_bias_type,
                                 core_attention_bias, alibi_slopes)
        return super().forward(query_layer, key_layer, value_layer, attention_mask, qkv_format,
                               cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
                               max_seqlen_kv=max_seqlen_kv, attn_mask_type=attn_mask_type,
                               inference_params=inference_params, **padded)


def _check_attention_forward(who: str, encoder_output=None, window_size=None,
                             checkpoint_core_attention=False,
                             core_attention_bias_type="no_bias", core_attention_bias=None,
                             alibi_slopes=None, enc_dec_attn_mask=None) -> None:
    _refuse(who,
            encoder_output=(encoder_output, None, "self-attention only"),
            enc_dec_attn_mask=(enc_dec_attn_mask, None, "self-attention only"),
            window_size=(window_size, None, "sliding windows need the TE backend"),
            checkpoint_core_attention=(checkpoint_core_attention, False,
                                       "wrap the layer in te_api.checkpoint"),
            core_attention_bias_type=(core_attention_bias_type, "no_bias",
                                      "attention biases need the TE backend"),
            core_attention_bias=(core_attention_bias, None,
                                 "attention biases need the TE backend"),
            alibi_slopes=(alibi_slopes, None, "ALiBi needs the TE backend"))


def _check_attention_init(who: str, hidden_size, num_attention_heads, kv_channels,
                          window_size, attention_type, fuse_wgrad_accumulation,
                          state, set_parallel_mode) -> None:
    if kv_channels is not None and kv_channels * num_attention_heads != hidden_size:
        _not_yet(f"{who}(kv_channels={kv_channels}) with kv_channels * num_attention_heads "
                 f"!= hidden_size={hidden_size}", "use kv_channels=None (hidden_size / heads)")
    _refuse(who, window_size=(window_size, None, "sliding windows need the TE backend"),
            attention_type=(attention_type, "self", "self-attention only"),
            fuse_wgrad_accumulation=(fuse_wgrad_accumulation, False,
                                     "pass fuse_wgrad_accumulation=False"))
    if state.tp_size > 1 and not set_parallel_mode:
        _not_yet(f"{who}(set_parallel_mode=False) with a TP group of size {state.tp_size}",
                 "pass set_parallel_mode=True (QKV/FC1 column-, PROJ/FC2 row-parallel)")


class MultiheadAttention(_HandOff, nn.Module):
    """TE's ``MultiheadAttention`` (self-attention): an optional ``layernorm``
    (``input_layernorm=True``) then tpkit's ``ParallelSelfAttention`` (fused QKV whatever
    ``fuse_qkv_params`` says: the math is the same; the parameter layout is tpkit's)."""

    def __init__(self, hidden_size: int, num_attention_heads: int, kv_channels=None,
                 attention_dropout: float = 0.1, layernorm_epsilon: float = 1e-5,
                 init_method=None, output_layer_init_method=None, layer_number=None,
                 attn_mask_type: str = "causal", window_size=None, num_gqa_groups=None,
                 return_layernorm_output: bool = False, input_layernorm: bool = False,
                 attention_type: str = "self", zero_centered_gamma: bool = False,
                 normalization: str = "LayerNorm", qkv_weight_interleaved: bool = True,
                 bias: bool = True, device=None, qkv_format: str = "sbhd",
                 set_parallel_mode: bool = False, sequence_parallel: bool = False,
                 tp_group=None, tp_size: int = 1, fuse_wgrad_accumulation: bool = False,
                 params_dtype=None, return_bias: bool = False, fuse_qkv_params: bool = False,
                 backend: str = "torch"):
        super().__init__()
        state = _state(tp_group, tp_size, "MultiheadAttention")
        _check_attention_init("MultiheadAttention", hidden_size, num_attention_heads,
                              kv_channels, window_size, attention_type,
                              fuse_wgrad_accumulation, state, set_parallel_mode)
        _refuse("MultiheadAttention", return_bias=(
            return_bias, False, "pass return_bias=False (the projection adds its bias)"))
        if return_layernorm_output and not input_layernorm:
            raise ValueError("return_layernorm_output=True needs input_layernorm=True")
        self.layernorm = (_norm(normalization, hidden_size, layernorm_epsilon,
                                sequence_parallel=sequence_parallel, params_dtype=params_dtype,
                                zero_centered_gamma=zero_centered_gamma, device=device)
                          if input_layernorm else None)
        self.attention = tnn.ParallelSelfAttention(
            hidden_size, num_attention_heads, num_gqa_groups=num_gqa_groups,
            attention_dropout=attention_dropout, attn_mask_type=attn_mask_type, bias=bias,
            sequence_parallel=bool(sequence_parallel),
            init_method=init_method or _default_init,
            output_layer_init_method=output_layer_init_method or init_method or _default_init,
            attn_input_format=qkv_format, state=state, device=device, dtype=params_dtype)
        self.attention.core_attention.layer_number = layer_number   # its KV cache's key
        self.attn_mask_type = attn_mask_type
        self.return_layernorm_output = bool(return_layernorm_output)
        self._te_state = SharedRef(state)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, encoder_output=None,
                attn_mask_type=None, window_size=None, is_first_microbatch=None,
                checkpoint_core_attention: bool = False, inference_params=None,
                rotary_pos_emb=None, core_attention_bias_type: str = "no_bias",
                core_attention_bias=None, alibi_slopes=None, fast_zero_fill: bool = True):
        _check_attention_forward("MultiheadAttention.forward", encoder_output, window_size,
                                 checkpoint_core_attention, core_attention_bias_type,
                                 core_attention_bias, alibi_slopes)
        _check_mask_type("MultiheadAttention.forward", attn_mask_type, self.attn_mask_type)
        x = hidden_states if self.layernorm is None else self.layernorm(hidden_states)
        out = self.attention(x, rotary_pos_emb, attention_mask,
                             inference_params=inference_params)
        return (out, x) if self.return_layernorm_output else out

    def set_tensor_parallel_group(self, tp_group) -> None:
        _check_parallel_group(self, tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream) -> None:
        self.attention.core_attention.set_context_parallel_group(cp_group, cp_global_ranks,
                                                                 cp_stream)


def _check_mask_type(who: str, given, built: str) -> None:
    if given is not None and given != built:
        _not_yet(f"{who}(mask type {given!r}) differing from the constructor's {built!r}",
                 "build the layer with that mask type")


# --- TransformerLayer --------------------------------------------------------------------
class TransformerLayer(_HandOff, tnn.TransformerLayer):
    """TE's ``TransformerLayer`` (a pre-norm encoder block) as tpkit.nn.TransformerLayer,
    with TE's argument names and defaults (dropouts 0.1, ``self_attn_mask_type``,
    ``params_dtype``, ``tp_group``) and TE's forward argument order."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_gqa_groups=None, layernorm_epsilon: float = 1e-5,
                 hidden_dropout: float = 0.1, attention_dropout: float = 0.1,
                 init_method=None, output_layer_init_method=None, layer_number=None,
                 kv_channels=None, self_attn_mask_type: str = "causal", window_size=None,
                 tp_group=None, tp_size: int = 1, params_dtype=None,
                 fuse_wgrad_accumulation: bool = False, seq_length=None,
                 micro_batch_size=None, sequence_parallel: bool = False,
                 apply_residual_connection_post_layernorm: bool = False,
                 output_layernorm: bool = False, parallel_attention_mlp: bool = False,
                 layer_type: str = "encoder", drop_path_rate: float = 0.0,
                 set_parallel_mode: bool = False, fuse_qkv_params: bool = False,
                 zero_centered_gamma: bool = False, qkv_weight_interleaved: bool = True,
                 bias: bool = True, activation: str = "gelu",
                 normalization: str = "LayerNorm", device=None,
                 attn_input_format: str = "sbhd", backend: str = "torch"):
        state = _state(tp_group, tp_size, "TransformerLayer")
        _check_attention_init("TransformerLayer", hidden_size, num_attention_heads,
                              kv_channels, window_size, "self",
                              fuse_wgrad_accumulation, state, set_parallel_mode)
        keep = "the pre-norm encoder block"
        _refuse("TransformerLayer",
                apply_residual_connection_post_layernorm=(
                    apply_residual_connection_post_layernorm, False, keep),
                output_layernorm=(output_layernorm, False, keep),
                parallel_attention_mlp=(parallel_attention_mlp, False, keep),
                layer_type=(layer_type, "encoder", keep + " (no cross-attention yet)"),
                drop_path_rate=(drop_path_rate, 0.0, "pass drop_path_rate=0"),
                zero_centered_gamma=(zero_centered_gamma, False,
                                     "build the block from te_api.MultiheadAttention and "
                                     "LayerNormMLP, which take it"))
        super().__init__(hidden_size, ffn_hidden_size, num_attention_heads,
                         num_gqa_groups=num_gqa_groups, normalization=normalization,
                         layernorm_epsilon=layernorm_epsilon, hidden_dropout=hidden_dropout,
                         attention_dropout=attention_dropout,
                         attn_mask_type=self_attn_mask_type, bias=bias, activation=activation,
                         sequence_parallel=bool(sequence_parallel),
                         init_method=init_method or _default_init,
                         output_layer_init_method=output_layer_init_method
                         or init_method or _default_init,
                         attn_input_format=attn_input_format,
                         state=state, device=device, dtype=params_dtype)
        self.self_attn_mask_type = self_attn_mask_type
        self.self_attention.core_attention.layer_number = layer_number   # its KV cache's key

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                self_attn_mask_type=None, window_size=None, encoder_output=None,
                enc_dec_attn_mask=None, is_first_microbatch=None,
                checkpoint_core_attention: bool = False, inference_params=None,
                rotary_pos_emb=None, core_attention_bias_type: str = "no_bias",
                core_attention_bias=None, alibi_slopes=None, fast_zero_fill: bool = True):
        _check_attention_forward("TransformerLayer.forward", encoder_output, window_size,
                                 checkpoint_core_attention, core_attention_bias_type,
                                 core_attention_bias, alibi_slopes, enc_dec_attn_mask)
        _check_mask_type("TransformerLayer.forward", self_attn_mask_type,
                         self.self_attn_mask_type)
        return super().forward(hidden_states, rotary_pos_emb, attention_mask,
                               inference_params=inference_params)

    def set_tensor_parallel_group(self, tp_group) -> None:
        _check_parallel_group(self, tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream) -> None:
        self.self_attention.core_attention.set_context_parallel_group(
            cp_group, cp_global_ranks, cp_stream)

    @property
    def _te_state(self):
        return SharedRef(self.state)


# --- functions ---------------------------------------------------------------------------
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None,
                 fp8_group=None):
    """TE's ``fp8_autocast`` on tpkit's emulated fp8 (tpkit.fp8.fp8_autocast: every tpkit
    linear inside runs in fp8 with ``fp8_recipe``, amaxes reduced over ``fp8_group``;
    ``calibrating=True`` with ``enabled=False``: high-precision compute that records the
    amaxes and scales)."""
    return _fp8_autocast(enabled, recipe=fp8_recipe, fp8_group=fp8_group,
                         calibrating=calibrating)


@contextlib.contextmanager
def onnx_export(enabled: bool = False):
    """TE's ONNX export mode: ``torch.onnx.export(model, ...)`` inside it exports a tpkit
    model built at tp=cp=pp=ep=1 (torch's default exporter, ``dynamo=True``), each layer
    on a path ONNX can express (tpkit.nn.export); a model-parallel layout, or tpkit's
    emulated fp8 (active here or entered inside), is refused with a ValueError.
    ``enabled=False`` changes nothing, as TE's."""
    if enabled is True and _fp8_active():
        raise ValueError("onnx_export(enabled=True) inside fp8_autocast: tpkit's emulated fp8 "
                         "is not exported (neither as fp8 nor as quantize/dequantize pairs: "
                         "its scales are training state); export outside fp8_autocast, in "
                         "the parameters' precision")
    with _export_mode(enabled):
        yield

