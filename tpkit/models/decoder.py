"""The pipeline protocol (tpkit.distributed.pipeline) that tpkit's decoder models share: the
block and head steps of an embedding -> RoPE blocks -> final norm -> vocab-parallel output
stack. Each model keeps its own ``pp_stem`` and ``pp_loss``."""
from __future__ import annotations

import torch
from torch import nn

from ..cp import shard_position_ids
from ..recompute import checkpoint
from .vocab import mask_padding


class DecoderPipelineMixin:
    """For a model with ``state``, ``cfg`` (``recompute``, ``vocab_size``), ``rope``,
    ``_te_blocks``, ``layers``, ``embedding``, ``final_norm`` and ``output``."""
    pp_blocks = "layers"
    pp_stem_modules = ("embedding",)
    pp_head_modules = ("final_norm", "output")

    @property
    def pp_recompute(self) -> bool:
        return self.cfg.recompute

    def pp_block(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        s = self.state
        seq = x.shape[0] * s.cp_size * (s.tp_size if s.sequence_parallel else 1)
        freqs = self.rope(seq if self._te_blocks else
                          shard_position_ids(seq, s, device=x.device))
        if self.cfg.recompute and self.training:
            # Non-reentrant: pipeline schedules take gradients with torch.autograd.grad.
            return checkpoint(layer, x, rotary_pos_emb=freqs, use_reentrant=False)
        return layer(x, rotary_pos_emb=freqs)

    def pp_head(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.final_norm(x))                     # [s_cp, b, V/tp]
        return mask_padding(logits, self.cfg.vocab_size, self.state.tp_rank)
