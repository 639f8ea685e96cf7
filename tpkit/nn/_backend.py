"""Which implementation a tpkit.nn constructor builds: tpkit's torch layers or TE's.

``backend="torch"`` always builds tpkit's own layers; ``"te"`` builds the Transformer
Engine module and fails loudly when TE or CUDA is missing; ``"auto"`` picks TE only when
TE imports *and* CUDA is available, so one model file runs on CPU and on GPUs.
tpkit.te imports ``transformer_engine`` only when a TE module is asked for: nothing here
touches it for "torch".
"""
from __future__ import annotations

import inspect

from .. import te
from ..layout.topology import resolve_state

BACKENDS = ("auto", "torch", "te")


def resolve_backend(backend: str = "auto") -> str:
    """``"torch"`` or ``"te"`` for a requested backend (see the module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; use one of {BACKENDS}")
    if backend == "torch":
        return "torch"
    if backend == "te":
        te.require_te()  # raises with what to install / that CUDA is needed
        return "te"
    return "te" if te.te_available() else "torch"


def build_te(kind: str, state=None, **te_kwargs):
    """The TE module for ``kind`` (a key of tpkit.te.KINDS) built for ``state``."""
    return te.make(kind, state, **te_kwargs)


# --- the hook used by tpkit.nn constructors ------------------------------------------------
def _translate_linear(a: dict, kind: str) -> dict:
    if kind == "column" and a.get("gather_output"):
        raise ValueError("gather_output=True is not available with backend='te' (TE's "
                         "column-parallel Linear keeps its output sharded); gather with "
                         "tpkit.nn.mappings.gather_from_tp_region or use backend='torch'")
    if kind == "column" and a.get("partition_sizes") is not None:
        raise ValueError(f"partition_sizes={a['partition_sizes']!r} is not available with "
                         "backend='te'; use separate layers or backend='torch'")
    if kind == "row" and not a.get("input_is_parallel", True):
        raise ValueError("input_is_parallel=False is not available with backend='te' (TE's "
                         "row-parallel Linear takes the sharded input); scatter it first")
    kw = {"in_features": a["in_features"], "out_features": a["out_features"],
          "bias": bool(a.get("bias", True)), "init_method": a.get("init_method"),
          "return_bias": bool(a.get("skip_bias_add") or a.get("return_bias")),
          "params_dtype": a.get("dtype")}
    return kw


def _translate_norm(a: dict, kind: str) -> dict:
    if kind == "layernorm" and not a.get("bias", True):
        raise ValueError("bias=False is not available for TE's LayerNorm; use RMSNorm or "
                         "backend='torch'")
    return {"normalized_shape": a["hidden_size"], "eps": a.get("eps", 1e-5),
            "params_dtype": a.get("dtype")}


def _translate_attention(a: dict, kind: str) -> dict:
    comm = a.get("cp_comm_type")
    if comm is not None:
        state = resolve_state(a.get("state"))
        if comm != state.cp_comm_type:
            raise ValueError(f"cp_comm_type={comm!r} differs from the state's "
                             f"{state.cp_comm_type!r}; with backend='te' tpkit wires the "
                             "state's CP groups, so build the state with that comm type")
    return {k: a.get(k) for k in ("num_attention_heads", "kv_channels", "num_gqa_groups",
                                  "attn_mask_type", "attention_dropout", "qkv_format",
                                  "softmax_scale")}


def _translate_transformer_layer(a: dict, kind: str) -> dict:
    kw = {k: a.get(k) for k in ("hidden_size", "ffn_hidden_size", "num_attention_heads",
                                "num_gqa_groups", "normalization", "layernorm_epsilon",
                                "hidden_dropout", "attention_dropout", "bias", "activation",
                                "init_method", "output_layer_init_method")}
    kw["self_attn_mask_type"] = a.get("attn_mask_type", "causal")
    kw["params_dtype"] = a.get("dtype")
    kw["attn_input_format"] = a.get("attn_input_format") or "sbhd"  # TE's name and values
    return kw


def _no_te(reason: str):
    def translate(a: dict, kind: str) -> dict:
        raise ValueError(reason)
    return translate


# tpkit argument names each translator consumes (beyond state/device/sequence_parallel)
_HANDLED = {
    "column": ({"in_features", "out_features", "bias", "gather_output", "partition_sizes",
                "init_method", "skip_bias_add", "return_bias", "dtype"}, _translate_linear),
    "row": ({"in_features", "out_features", "bias", "input_is_parallel", "init_method",
             "skip_bias_add", "return_bias", "dtype"}, _translate_linear),
    "layernorm": ({"hidden_size", "eps", "bias", "dtype"}, _translate_norm),
    "rmsnorm": ({"hidden_size", "eps", "dtype"}, _translate_norm),
    "attention": ({"num_attention_heads", "kv_channels", "num_gqa_groups", "attn_mask_type",
                   "attention_dropout", "qkv_format", "cp_comm_type", "softmax_scale"},
                  _translate_attention),
    "transformer_layer": ({"hidden_size", "ffn_hidden_size", "num_attention_heads",
                           "num_gqa_groups", "normalization", "layernorm_epsilon",
                           "hidden_dropout", "attention_dropout", "attn_mask_type", "bias",
                           "activation", "init_method", "output_layer_init_method", "dtype",
                           "attn_input_format"},
                          _translate_transformer_layer),
    "mlp": (set(), _no_te(
        "ParallelMLP has no Transformer Engine counterpart without its norm (TE fuses them "
        "in LayerNormMLP); use TransformerLayer(backend='te'), "
        "tpkit.te.make('layernorm_mlp', ...), or backend='torch'")),
    "self_attention": (set(), _no_te(
        "ParallelSelfAttention has no Transformer Engine counterpart in tpkit yet; use "
        "TransformerLayer(backend='te') or DotProductAttention(backend='te') as the core")),
}


def _te_from_constructor(cls, args: tuple, kwargs: dict):
    kind = cls._te_kind
    if kind not in _HANDLED:
        raise ValueError(f"{cls.__name__} has no Transformer Engine counterpart in tpkit; "
                         "use backend='torch'")
    sig = inspect.signature(cls.__init__)
    bound = sig.bind(None, *args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    a.pop(next(iter(sig.parameters)))  # self
    a.pop("backend", None)
    handled, translate = _HANDLED[kind]
    if not handled:
        translate(a, kind)  # kinds without a TE counterpart raise their reason
    handled = handled | {"state", "device", "sequence_parallel"}
    for name, value in a.items():
        default = sig.parameters[name].default
        if name not in handled and value is not default and value != default:
            raise ValueError(f"{cls.__name__}({name}={value!r}) is not available with "
                             "backend='te'; drop it or use backend='torch'")
    te_kwargs = {k: v for k, v in translate(a, kind).items() if v is not None}
    if a.get("sequence_parallel") is not None:
        te_kwargs["sequence_parallel"] = a["sequence_parallel"]
    if a.get("device") is not None:
        te_kwargs["device"] = a["device"]
    return build_te(kind, a.get("state"), **te_kwargs)


class TEBackendMixin:
    """Gives a tpkit.nn layer a ``backend=`` keyword: for "te" (or "auto" resolving to TE)
    the constructor returns TE's module for ``_te_kind`` instead of the torch layer, built
    from the same arguments (options TE lacks are refused with a ValueError). Layers with
    no TE counterpart (ParallelMLP, ParallelSelfAttention) refuse "te"; "auto" builds them
    with torch, so a model written with backend="auto" runs everywhere."""

    _te_kind: str = ""

    def __new__(cls, *args, backend: str = "torch", **kwargs):
        if backend == "auto" and not _HANDLED.get(cls._te_kind, ((),))[0]:
            return super().__new__(cls)  # no TE counterpart: "auto" means torch here
        if resolve_backend(backend) == "te":
            return _te_from_constructor(cls, args, kwargs)
        return super().__new__(cls)
