"""Llama-family decoder (Llama 2/3, Qwen2, Mistral without sliding window) from tpkit layers.

Pre-norm blocks of RMSNorm, grouped-query attention with rotary embeddings (rotate-half
layout, ``rope_theta``, linear or Llama-3 frequency scaling), SwiGLU MLP; optional q/k/v
biases (Qwen2) or biases on every linear layer; tied or untied embeddings. Sequence-first
activations, TP / SP / CP / DP and recompute exactly as tpkit/models/gpt.py: the blocks are
``tpkit.nn.TransformerLayer`` (``backend="torch"``, or TE's TransformerLayer with
``backend="te"``), so nothing here computes attention or shards a weight itself.

Hugging Face checkpoints are read and written by the adapter tpkit.models.hf
(``hf.from_hf(dir)``, ``hf.save_hf(model, dir)``), which this module never imports;
``hf_names()`` is the one table between tpkit's parameters and
Hugging Face's tensor names.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..cp import shard_position_ids, shard_sequence
from ..nn import (ColumnParallelLinear, RMSNorm, RotaryEmbedding, TransformerLayer,
                  VocabParallelEmbedding, vocab_parallel_cross_entropy)
from ..recompute import checkpoint
from ..te import is_te_module
from ..layout.topology import resolve_state
from .decoder import DecoderPipelineMixin
from .generate import GenerationMixin
from .vocab import padded_vocab_size

__all__ = ["LlamaConfig", "Llama", "ARCHITECTURES", "ROPE_TYPES", "rope_inv_freq"]

ARCHITECTURES = ("llama", "qwen2", "mistral")  # Hugging Face model_type values read/written
ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


@dataclasses.dataclass
class LlamaConfig:
    """Sizes and options, with tpkit's names (GPTConfig's, TE's ``num_gqa_groups``);
    docs/models.md maps them to config.json's. ``rope_scaling`` is Hugging Face's dict
    (``{"rope_type": "linear" | "llama3", "factor": ..., ...}``) or None. ``bias`` puts a
    bias on every linear layer (Llama's ``attention_bias`` with ``mlp_bias``);
    ``qkv_bias`` (None: ``bias``) on q/k/v alone (Qwen2)."""
    vocab_size: int = 32000
    hidden_size: int = 4096
    ffn_hidden_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_gqa_groups: int | None = None    # key/value heads; None: num_heads (no GQA)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    qkv_bias: bool | None = None
    bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    architecture: str = "llama"          # config.json's model_type when written
    initializer_range: float = 0.02      # std of the normal init of a fresh model
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    recompute: bool = False
    backend: str = "torch"               # the blocks': "torch", "te" or "auto" (tpkit.nn)
    # embedding/output rows padded to a multiple of this (tpkit.models.vocab: the padded
    # logits are masked out; config.json and an export keep the real vocab_size)
    vocab_multiple: int = 1

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_gqa_groups is None else self.num_gqa_groups

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.vocab_size, self.vocab_multiple)

    @property
    def has_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else bool(self.qkv_bias)

    def validate(self) -> "LlamaConfig":
        """Raise ValueError naming the first field that tpkit cannot build; return self."""
        for name in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_heads",
                     "kv_heads", "max_position_embeddings", "vocab_multiple"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"LlamaConfig.{name}={v!r} must be a positive integer")
        if self.hidden_size % self.num_heads or self.head_dim % 2:
            raise ValueError(f"hidden_size={self.hidden_size} must be num_heads="
                             f"{self.num_heads} times an even head size")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_gqa_groups="
                             f"{self.kv_heads} (key/value heads)")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r} is not supported; use one "
                             f"of {ARCHITECTURES}")
        want = {"qwen2": (True, False), "mistral": (False, False)}.get(self.architecture)
        got = (self.has_qkv_bias, self.bias)
        if (want is not None and got != want) or (want is None and got[0] != got[1]):
            raise ValueError(
                f"qkv_bias={self.has_qkv_bias}, bias={self.bias} cannot be written as "
                f"architecture={self.architecture!r}: Llama biases all linear layers or none, "
                "Qwen2 exactly q/k/v, Mistral none")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} and rope_theta="
                             f"{self.rope_theta} must be positive")
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope scaling type {kind!r} is not supported; use one of "
                             f"{ROPE_TYPES} (or rope_scaling=None)")
        need = {"linear": ("factor",), "llama3": _LLAMA3_KEYS}.get(kind, ())
        missing = [k for k in need if k not in scaling]
        if missing:
            raise ValueError(f"rope_scaling of type {kind!r} lacks {missing}")
        return self

    def check_tp(self, tp: int) -> "LlamaConfig":
        """Raise ValueError naming the size (tpkit's and config.json's name) that tp does
        not divide; return self."""
        # fewer kv heads than TP ranks (tp a multiple of them) are replicated: each rank keeps
        # the kv head its query heads use (tpkit.nn.attention.ReplicatedKV)
        kv_shared = self.kv_heads < tp and tp % self.kv_heads == 0
        for what, n in (("num_heads (num_attention_heads)", self.num_heads),
                        ("num_gqa_groups (num_key_value_heads)",
                         tp if kv_shared else self.kv_heads),
                        ("ffn_hidden_size (intermediate_size)", self.ffn_hidden_size),
                        ("vocab_size", self.padded_vocab_size)):
            if n % tp and what == "vocab_size" and self.vocab_multiple > 1:
                raise ValueError(f"vocab_size={self.vocab_size} padded to a multiple of "
                                 f"vocab_multiple={self.vocab_multiple} is "
                                 f"{self.padded_vocab_size}, which the tensor-parallel size "
                                 f"tp={tp} does not divide; use vocab_multiple="
                                 f"{math.lcm(self.vocab_multiple, tp)}")
            if n % tp:
                raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size "
                                 f"tp={tp}; choose a tp that divides it")
        return self


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """The rotary inverse frequencies ``[head_dim / 2]`` (float32) of ``cfg``: ``theta **
    (-2i/d)``, divided by ``factor`` for "linear"; for "llama3", divided by ``factor`` at
    wavelengths above ``original_max_position_embeddings / low_freq_factor``, kept below
    ``.../ high_freq_factor``, and interpolated smoothly in between (Llama 3.1's rule)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor, low, high, old = (float(scaling[k]) for k in _LLAMA3_KEYS)
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        middle = (wavelen >= old / high) & (wavelen <= old / low)
        inv = torch.where(middle, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv.float()


def _no_init(weight: torch.Tensor) -> None:
    """init_method that leaves weights as allocated: from_hf overwrites every one."""


# tpkit block parameter -> Hugging Face names under model.layers.<i>. (segments in order)
_TORCH_BLOCK = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight"),
    "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                       "self_attn.v_proj.bias"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "self_attention.linear_proj.bias": ("self_attn.o_proj.bias",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc1.bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
    "mlp.linear_fc2.bias": ("mlp.down_proj.bias",),
}
# fewer kv heads than TP ranks: linear_qkv holds q alone, linear_kv [k; v] whole on each rank
_REPLICATED_KV = {
    "self_attention.linear_qkv.weight": ("self_attn.q_proj.weight",),
    "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias",),
    "self_attention.linear_kv.weight": ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attention.linear_kv.bias": ("self_attn.k_proj.bias", "self_attn.v_proj.bias"),
}
# Transformer Engine's TransformerLayer (fuse_qkv_params=False: q, k, v are separate
# parameters, each sharded on its own; fc1 is [gate; up] per rank, as tpkit's)
_TE_BLOCK = {
    "self_attention.layernorm_qkv.layer_norm_weight": ("input_layernorm.weight",),
    **{f"self_attention.layernorm_qkv.{x}_{w}": (f"self_attn.{x[0]}_proj.{w}",)
       for x in ("query", "key", "value") for w in ("weight", "bias")},
    "self_attention.proj.weight": ("self_attn.o_proj.weight",),
    "self_attention.proj.bias": ("self_attn.o_proj.bias",),
    "layernorm_mlp.layer_norm_weight": ("post_attention_layernorm.weight",),
    "layernorm_mlp.fc1_weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "layernorm_mlp.fc1_bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
    "layernorm_mlp.fc2_weight": ("mlp.down_proj.weight",),
    "layernorm_mlp.fc2_bias": ("mlp.down_proj.bias",),
}


class Llama(DecoderPipelineMixin, GenerationMixin, nn.Module):
    """The decoder on this rank's shard of ``state``'s layout (None: the current one).
    ``init_method`` (default: normal with ``cfg.initializer_range``) initialises every
    weight shard on the RNG tracker's model-parallel stream."""

    def __init__(self, cfg: LlamaConfig, state=None, *, dtype: torch.dtype | None = None,
                 init_method=None):
        super().__init__()
        self.state = state = resolve_state(state)
        self.cfg = cfg.validate().check_tp(state.tp_size)
        self.hf_config: dict | None = None   # config.json read by from_hf, kept for save_hf
        std = cfg.initializer_range
        init = init_method or (lambda w: nn.init.normal_(w, 0.0, std))
        kw = dict(state=state, dtype=dtype)
        self.embedding = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size,
                                                init_method=init, **kw)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device=state.device)
        with torch.no_grad():
            self.rope.inv_freq.copy_(rope_inv_freq(cfg))
        qkv_bias = None if cfg.has_qkv_bias == cfg.bias else cfg.has_qkv_bias
        self.layers = nn.ModuleList(
            TransformerLayer(cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_heads,
                             num_gqa_groups=cfg.kv_heads, normalization="RMSNorm",
                             layernorm_epsilon=cfg.rms_norm_eps, activation="swiglu",
                             hidden_dropout=cfg.hidden_dropout,
                             attention_dropout=cfg.attention_dropout, bias=cfg.bias,
                             qkv_bias=qkv_bias, init_method=init,
                             output_layer_init_method=init, backend=cfg.backend, **kw)
            for _ in range(cfg.num_layers))
        # TE's TransformerLayer takes the full sequence's RoPE angles and picks this CP
        # rank's chunks itself; tpkit's takes the angles of this rank's positions.
        self._te_blocks = any(is_te_module(m) for m in self.layers)
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **kw)
        self.output = ColumnParallelLinear(cfg.hidden_size, cfg.padded_vocab_size, bias=False,
                                           gather_output=False,
                                           init_method=_no_init if cfg.tie_word_embeddings
                                           else init, **kw)
        if cfg.tie_word_embeddings:   # same [V/tp, h] rows on both sides: share the shard
            self.output.weight = self.embedding.weight

    # --- pipeline protocol (tpkit.distributed.pipeline): stem and loss; blocks and head
    # from DecoderPipelineMixin ---------------------------------------------------------
    def pp_stem(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` tokens of the full sequence -> ``[s_cp(/tp under SP), b, h]``."""
        if self.cfg.tie_word_embeddings and self.state.pp_size > 1:
            raise ValueError("Llama with tie_word_embeddings=True cannot be split into "
                             f"pipeline stages (pp={self.state.pp_size}): the embedding and "
                             "the head share one weight; untie them or use pp=1")
        ids = shard_sequence(tokens, 1, self.state).t().contiguous()   # [s_cp, b]
        return self.embedding(ids)

    def pp_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = shard_sequence(targets, 1, self.state).t().contiguous()
        return vocab_parallel_cross_entropy(logits, targets, group=self.state.tp_group).mean()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        """``tokens`` (and ``targets``): ``[b, s]``, the full sequence of this DP slice; the
        CP shard is taken here. Returns the mean loss over this rank's tokens, or without
        targets the vocab-parallel logits ``[s/cp, b, V/tp]`` of this rank's shard (the
        load-balanced CP order of tpkit.data.shard_sequence)."""
        s = self.state
        seq = tokens.shape[1]
        ids = shard_sequence(tokens, 1, s).t().contiguous()        # [s_cp, b]
        freqs = self.rope(seq if self._te_blocks else
                          shard_position_ids(seq, s, device=ids.device))
        x = self.embedding(ids)                                    # [s_cp(/tp under SP), b, h]
        for layer in self.layers:
            if self.cfg.recompute and self.training:
                x = checkpoint(layer, x, rotary_pos_emb=freqs)
            else:
                x = layer(x, rotary_pos_emb=freqs)
        logits = self.pp_head(x)
        if targets is None:
            return logits
        return self.pp_loss(logits, targets)

    def hf_names(self) -> dict[str, tuple[str, ...]]:
        """Every parameter of this module (tied ones once) -> the Hugging Face tensors it
        holds, in order: several names are segments concatenated along the parameter's
        partition dim (q/k/v, gate/up), each sharded over TP on its own."""
        block = _TE_BLOCK if self._te_blocks else _TORCH_BLOCK
        if not self._te_blocks and self.cfg.kv_heads < self.state.tp_size:
            block = {**block, **_REPLICATED_KV}
        table = {"embedding.weight": ("model.embed_tokens.weight",),
                 "final_norm.weight": ("model.norm.weight",),
                 "output.weight": ("lm_head.weight",)}
        for i in range(len(self.layers)):
            table.update({f"layers.{i}.{k}": tuple(f"model.layers.{i}.{n}" for n in v)
                          for k, v in block.items()})
        names = [n for n, _ in self.named_parameters()]
        unknown = [n for n in names if n not in table]
        assert not unknown, f"parameters without a Hugging Face name: {unknown}"
        return {n: table[n] for n in names}
