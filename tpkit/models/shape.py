"""ModelShape: a decoder-only transformer's sizes, the one description of a model from
which its FLOPs (tpkit.observe's MFU) and its memory plan (tpkit.memory) are derived.

No torch here: tpkit-launch's dry run reads it (tpkit.models' families are imported only
to recognise their configs).
"""
from __future__ import annotations

import dataclasses
import json
import os

__all__ = ["ModelShape", "transformer_flops_per_token"]

_GATED = ("swiglu", "geglu")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes (tpkit's GPT and Llama blocks): the one
    description of a model that its FLOPs (``flops_per_token``) and tpkit.memory's plan
    are derived from; ``of`` reads it off a tpkit model or its config."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int | None = None      # None: = heads (no grouped-query attention)
    vocab: int = 256
    activation: str = "gelu"         # gelu/relu/silu, or swiglu/geglu (fc1 2*ffn wide)
    norm: str = "RMSNorm"            # or LayerNorm (weight and bias)
    bias: bool = False               # biases of every linear
    qkv_bias: bool | None = None     # None: bias
    tied_embeddings: bool = False
    experts: int = 0                 # MoE experts per MoE layer (0: dense)
    topk: int = 2
    moe_every: int = 1               # every k-th block is MoE
    capacity_factor: float | None = None

    def __post_init__(self):
        for name in ("layers", "hidden", "ffn", "heads", "vocab", "topk", "moe_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelShape.{name}={v!r} must be an integer >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"ModelShape: hidden={self.hidden} is not divisible by "
                             f"heads={self.heads}")
        if self.heads % self.groups:
            raise ValueError(f"ModelShape: heads={self.heads} is not divisible by "
                             f"kv_heads={self.groups}")
        if self.experts < 0:
            raise ValueError(f"ModelShape.experts={self.experts} must be >= 0 (0: dense)")

    @property
    def groups(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def gated(self) -> bool:
        return self.activation in _GATED

    def is_moe(self, block: int) -> bool:
        return self.experts > 0 and (block + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        return sum(map(self.is_moe, range(self.layers)))

    def flops_per_token(self, seq_len: int, *, causal: bool = False) -> float:
        """Model FLOPs per token of one training step (forward + backward) at the global
        sequence length ``seq_len``: tpkit.observe.flops' convention (attention over the
        full ``S x S`` square, as MFU counts it); ``causal=True`` counts the half a causal
        kernel computes (tpkit.memory.step_cost's idealised step time)."""
        return transformer_flops_per_token(
            causal=causal,
            hidden_size=self.hidden, num_layers=self.layers, num_heads=self.heads,
            kv_heads=self.groups, head_dim=self.head_dim, seq_len=seq_len,
            vocab_size=self.vocab, ffn_hidden_size=self.ffn, gated=self.gated,
            moe_experts=self.experts, moe_topk=self.topk, moe_layers=self.moe_layers)

    # --- constructors ----------------------------------------------------------------
    @classmethod
    def of(cls, model) -> "ModelShape":
        """The shape of a tpkit model or its config: ``tpkit.models.GPT``/``GPTConfig``,
        ``Llama``/``LlamaConfig``, or a ModelShape; ValueError for anything else."""
        cfg = getattr(model, "cfg", model)
        if isinstance(cfg, ModelShape):
            return cfg
        from .gpt import GPTConfig
        from .llama import LlamaConfig
        if isinstance(cfg, LlamaConfig):
            return cls.from_llama_config(cfg)
        if isinstance(cfg, GPTConfig):
            return cls.from_gpt_config(cfg)
        raise ValueError(f"ModelShape.of does not know {type(cfg).__name__}: pass a tpkit "
                         "Llama/GPT (or its config), or count another model with "
                         "transformer_flops_per_token(hidden_size=..., ...)")

    @classmethod
    def from_gpt_config(cls, cfg) -> "ModelShape":
        """From a tpkit.models.GPTConfig (GELU MLPs, RMSNorm, no biases; every
        ``moe_every``-th MLP a top-k MoE when ``moe_experts``); the vocabulary as built:
        padded to ``vocab_multiple`` (its rows are allocated and multiplied, as Megatron's
        FLOPs count ``padded_vocab_size``)."""
        return cls(layers=cfg.num_layers, hidden=cfg.hidden_size, ffn=cfg.ffn_hidden_size,
                   heads=cfg.num_heads, kv_heads=cfg.num_gqa_groups,
                   vocab=cfg.padded_vocab_size,
                   activation="gelu", norm="RMSNorm", bias=False, experts=cfg.moe_experts,
                   topk=cfg.moe_topk, moe_every=cfg.moe_every,
                   capacity_factor=cfg.moe_capacity_factor)

    @classmethod
    def from_llama_config(cls, cfg) -> "ModelShape":
        """From a tpkit.models.LlamaConfig (SwiGLU MLPs, RMSNorm), the vocabulary padded
        to ``vocab_multiple`` as built."""
        return cls(layers=cfg.num_layers, hidden=cfg.hidden_size, ffn=cfg.ffn_hidden_size,
                   heads=cfg.num_heads, kv_heads=cfg.kv_heads,
                   vocab=cfg.padded_vocab_size, activation="swiglu", norm="RMSNorm",
                   bias=bool(cfg.bias), qkv_bias=cfg.qkv_bias,
                   tied_embeddings=bool(cfg.tie_word_embeddings))

    @classmethod
    def from_hf_config(cls, source) -> "ModelShape":
        """From a Hugging Face ``config.json`` (a path, a directory holding one, or the
        parsed dict): what tpkit.models reads (Llama, Mistral, Qwen2: through
        ``tpkit.models.hf.config_from_hf``), or a Mixtral-style MoE (``num_local_experts``,
        ``num_experts_per_tok``), whose sizes are read here. ValueError naming the file."""
        where = "the config dict"
        if not isinstance(source, dict):
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            where = path
            try:
                with open(path) as f:
                    source = json.load(f)
            except OSError as e:
                raise ValueError(f"model config {path!r} cannot be read ({e.strerror}); pass "
                                 "a Hugging Face config.json or the directory holding it") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"model config {path!r} is not JSON (line {e.lineno}: "
                                 f"{e.msg}); pass a Hugging Face config.json") from None
        if not isinstance(source, dict):
            raise ValueError(f"model config {where} holds {type(source).__name__}, not a "
                             "JSON object; pass a Hugging Face config.json")
        experts = int(source.get("num_local_experts") or source.get("num_experts") or 0)
        if not experts:
            from .hf import config_from_hf
            try:
                return cls.from_llama_config(config_from_hf(source))
            except ValueError as e:
                raise ValueError(f"model config {where}: {e}") from None
        need = ("num_hidden_layers", "hidden_size", "intermediate_size",
                "num_attention_heads", "vocab_size")
        missing = [k for k in need if k not in source]
        if missing:
            raise ValueError(f"model config {where} lacks {', '.join(missing)}; pass the "
                             "config.json of a Mixtral-style MoE or a Llama-family model")
        try:
            return cls(layers=int(source["num_hidden_layers"]),
                       hidden=int(source["hidden_size"]),
                       ffn=int(source.get("moe_intermediate_size")
                               or source["intermediate_size"]),
                       heads=int(source["num_attention_heads"]),
                       kv_heads=int(source.get("num_key_value_heads")
                                    or source["num_attention_heads"]),
                       vocab=int(source["vocab_size"]), activation="swiglu",
                       tied_embeddings=bool(source.get("tie_word_embeddings", False)),
                       experts=experts, topk=int(source.get("num_experts_per_tok") or 2))
        except ValueError as e:
            raise ValueError(f"model config {where}: {e}") from None


def transformer_flops_per_token(*, hidden_size: int, num_layers: int, num_heads: int,
                                seq_len: int, vocab_size: int, ffn_hidden_size: int,
                                kv_heads: int | None = None, head_dim: int | None = None,
                                gated: bool = False, moe_experts: int = 0, moe_topk: int = 1,
                                moe_layers: int = 0, causal: bool = False) -> float:
    """Model FLOPs per token of one training step (forward + backward) of a decoder with
    these sizes (the module docstring's convention). ``moe_layers`` of the ``num_layers``
    have a routed MLP of ``moe_experts`` experts (each ``ffn_hidden_size`` wide, ``moe_topk``
    per token) instead of the dense MLP. ``causal=True``: attention's matmuls over the half
    of the square a causal kernel computes, not the full square MFU counts."""
    for name, v in (("hidden_size", hidden_size), ("num_layers", num_layers),
                    ("num_heads", num_heads), ("seq_len", seq_len),
                    ("vocab_size", vocab_size), ("ffn_hidden_size", ffn_hidden_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if not 0 <= moe_layers <= num_layers or (moe_layers and not 1 <= moe_topk <= moe_experts):
        raise ValueError(f"moe_layers={moe_layers}, moe_experts={moe_experts}, moe_topk="
                         f"{moe_topk}: need 0 <= moe_layers <= num_layers={num_layers} and "
                         "1 <= moe_topk <= moe_experts")
    kv = num_heads if kv_heads is None else kv_heads
    d = hidden_size // num_heads if head_dim is None else head_dim
    q_dim, kv_dim = num_heads * d, kv * d
    attn = hidden_size * (q_dim + 2 * kv_dim) + q_dim * hidden_size
    mlp = hidden_size * ffn_hidden_size * (2 if gated else 1) + ffn_hidden_size * hidden_size
    moe = moe_topk * mlp + hidden_size * moe_experts            # the experts a token visits
    matmul = (num_layers * attn + (num_layers - moe_layers) * mlp + moe_layers * moe
              + hidden_size * vocab_size)
    return 6.0 * matmul + (6.0 if causal else 12.0) * num_layers * num_heads * d * seq_len
