"""A small GPT built only from tpkit.nn layers (the reference model of tpkit.train).

Inputs are this rank's tokens: the DP slice of the global batch, and under CP the
load-balanced sequence shard (tpkit.data.shard_sequence) with matching RoPE positions.
``forward`` returns the mean next-token loss over this rank's tokens; every rank holds
the same number of tokens, so averaging gradients over the dp×cp group (what
TPKitStrategy's DDP does) gives exactly the gradient of the global mean loss.

Packed documents (``tpkit-train --data.pack``): ``forward(tokens, labels, position_ids,
**cu_seqlens...)`` takes this rank's shard of one packed row (``tpkit.data.PackedBatch``)
and returns the *sum* of its token losses (padding and document ends carry
``ignore_index``); the caller divides by the global batch's count of labelled tokens.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..cp import shard_sequence
from ..nn import (ColumnParallelLinear, RMSNorm, RotaryEmbedding, TransformerLayer,
                  VocabParallelEmbedding, vocab_parallel_cross_entropy)
from ..te.offload import get_cpu_offload_context
from ..recompute import checkpoint
from ..layout.topology import get_parallel_state
from .decoder import DecoderPipelineMixin
from .generate import GenerationMixin
from .vocab import padded_vocab_size


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 8
    num_gqa_groups: int | None = 4
    ffn_hidden_size: int = 512
    dropout: float = 0.0
    recompute: bool = False
    backend: str = "torch"   # the blocks' backend: "torch", "te" or "auto" (tpkit.nn)
    # Mixture of experts (docs/moe.md): 0 experts = dense MLPs everywhere; else every
    # moe_every-th block's MLP is a tpkit.nn.MoE of moe_experts experts of width ffn, its
    # load-balancing loss over the global batch (the same curve at every layout).
    moe_experts: int = 0
    moe_topk: int = 2
    moe_every: int = 1
    moe_aux_coeff: float = 1e-2
    moe_capacity_factor: float | None = None
    # Activation offload (tpkit.te.offload, TE's get_cpu_offload_context): the activations of
    # the first cpu_offload_layers blocks wait for the backward off the compute device.
    cpu_offload_layers: int = 0
    # Vocabulary padding (Megatron's make-vocab-size-divisible-by): the embedding and the
    # output layer hold padded_vocab_size rows, so that any tp dividing it shards them; the
    # padded logits are masked out of the loss and of generation (ids < vocab_size only).
    vocab_multiple: int = 1

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.vocab_size, self.vocab_multiple)


class GPT(DecoderPipelineMixin, GenerationMixin, nn.Module):
    def __init__(self, cfg: GPTConfig, state=None):
        super().__init__()
        self.cfg = cfg
        self.state = state or get_parallel_state()
        n = cfg.cpu_offload_layers
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < cfg.num_layers:
            raise ValueError(f"GPTConfig(cpu_offload_layers={n!r}) must be an int from 0 to "
                             f"num_layers - 1 = {cfg.num_layers - 1} (the last block's "
                             "activations are needed first in backward)")
        kw = dict(state=self.state)
        self.embedding = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size, **kw)
        self.rope = RotaryEmbedding(cfg.hidden_size // cfg.num_heads)
        self.layers = nn.ModuleList(
            TransformerLayer(cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_heads,
                             num_gqa_groups=cfg.num_gqa_groups, normalization="RMSNorm",
                             hidden_dropout=cfg.dropout, attention_dropout=cfg.dropout,
                             bias=False, backend=cfg.backend, **kw)
            for _ in range(cfg.num_layers))
        if cfg.moe_experts:
            from ..nn import MoE
            for i, layer in enumerate(self.layers):
                if (i + 1) % cfg.moe_every == 0:
                    layer.mlp = MoE(cfg.hidden_size, cfg.ffn_hidden_size, cfg.moe_experts,
                                    cfg.moe_topk, aux_loss_coeff=cfg.moe_aux_coeff,
                                    capacity_factor=cfg.moe_capacity_factor,
                                    aux_loss_scope="global", **kw)
        from ..te import is_te_module
        # TE's TransformerLayer takes the full sequence's RoPE angles and picks this CP
        # rank's chunks itself; tpkit's takes the angles of this rank's positions.
        self._te_blocks = any(is_te_module(m) for m in self.layers)
        self.final_norm = RMSNorm(cfg.hidden_size, **kw)
        self.output = ColumnParallelLinear(cfg.hidden_size, cfg.padded_vocab_size, bias=False,
                                           gather_output=False, **kw)

    # --- pipeline protocol (tpkit.distributed.pipeline): stem and loss; blocks and head
    # from DecoderPipelineMixin ---------------------------------------------------------
    def pp_stem(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` tokens of the full sequence -> ``[s_cp(/tp under SP), b, h]``."""
        tokens = shard_sequence(tokens, 1, self.state).t().contiguous()   # [s_cp, b]
        return self.embedding(tokens)

    def pp_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = shard_sequence(targets, 1, self.state).t().contiguous()
        return vocab_parallel_cross_entropy(logits, targets).mean()

    def pp_aux_loss(self, layer: nn.Module) -> torch.Tensor | None:
        """The router losses of ``layer``'s last forward (this rank's share, docs/moe.md),
        None for a dense layer: forward adds them to the loss; a pipeline stage attaches
        their gradient to its activations (tpkit.distributed.pipeline)."""
        from ..nn import MoE
        aux = [m.aux_loss for m in layer.modules() if isinstance(m, MoE)]
        return sum(aux) if aux else None

    def moe_layers(self) -> list:
        """The MoE layers of this model (their ``aux_loss``/``last_routing`` after a
        forward)."""
        from ..nn import MoE
        return [m for m in self.modules() if isinstance(m, MoE)]   # a pipeline stage's own

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor,
                position_ids: torch.Tensor | None = None, **packed) -> torch.Tensor:
        """``tokens``/``targets``: ``[b, s]`` over the full sequence of this DP slice; the
        CP shard is taken here. Returns the mean loss over this rank's tokens. With
        ``packed`` (TE's cu_seqlens arguments): see the module docstring."""
        if packed:
            return self._packed_loss(tokens, targets, position_ids, packed)
        x = self.pp_stem(tokens)
        offload, sync = self._offload()
        for layer in self.layers:
            with offload:
                x = self.pp_block(layer, x)
            x = sync(x)
        loss = self.pp_loss(self.pp_head(x), targets)
        for layer in self.layers:
            aux = self.pp_aux_loss(layer)
            if aux is not None:
                loss = loss + aux
        return loss

    def _offload(self):
        """This forward's offload context and synchronizer (TE's pair; disabled: a null
        context and an identity)."""
        n = self.cfg.cpu_offload_layers
        return get_cpu_offload_context(bool(n) and self.training, n, len(self.layers),
                                       offload_weights=False)

    def _packed_loss(self, tokens, labels, position_ids, packed) -> torch.Tensor:
        if self._te_blocks:
            raise ValueError("packed documents need tpkit's torch blocks (backend='torch'); "
                             "TE's TransformerLayer would need attn_input_format='thd'")
        x = self.embedding(tokens[:, None])                      # [t(/tp under SP), 1, h]
        freqs = self.rope(position_ids)                          # restart per document
        offload, sync = self._offload()
        for layer in self.layers:
            with offload:
                if self.cfg.recompute and self.training:
                    x = checkpoint(layer, x, rotary_pos_emb=freqs, use_reentrant=False,
                                   **packed)
                else:
                    x = layer(x, rotary_pos_emb=freqs, **packed)
            x = sync(x)
        return vocab_parallel_cross_entropy(self.pp_head(x), labels[:, None]).sum()
