"""The modules ``tpkit.parallelize`` puts in place of a model's own: built from tpkit.nn's
layers, holding the model's loaded weights (this rank's shard of each full tensor), under
the model's own attribute and parameter names, so that a full state dict of the
parallelized model (tpkit.checkpoint.full_state_dict) has the original model's keys and
shapes.

- ``PlannedAttention``: a model's attention module redone over TP heads and CP: q/k/v
  column-parallel (one fused ``[q; k; v]`` weight or three), the core tpkit's
  DotProductAttention (causal, CP-aware), the output projection row-parallel. With fewer
  key/value heads than TP ranks each rank keeps the kv head its query heads use
  (tpkit.nn.attention.ReplicatedKV: the full kv weight, tagged for a TP gradient sum).
- ``LayoutPositionEmbedding``: a learned position table (nanoGPT's ``wpe``) whose output rows are
  the global positions of this rank's CP shard (and SP chunk).
"""
from __future__ import annotations

import torch
from torch import nn

from ..checkpoint import shard_tensor
from ..comm.collectives import group_rank
from ..cp import cp_positions
from ..nn import mappings
from ..nn._common import local_kv_heads
from ..nn.attention import ReplicatedKV
from ..nn.dot_product_attention import DotProductAttention
from ..nn.linear import ColumnParallelLinear, linear_fn
from ..layout.param_tags import set_tp_attrs

__all__ = ["PlannedAttention", "LayoutPositionEmbedding", "rotate_half", "column",
           "replicated_kv", "fill"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class PlannedAttention(nn.Module):
    """Causal self-attention over this rank's heads (see the module docstring). ``qkv``:
    ``{name: layer}`` of one fused or three (q, k, v) projections, kept under the model's
    names; ``out_name``/``out``: the row-parallel output projection. ``rope="hf"`` applies
    the ``position_embeddings=(cos, sin)`` keyword (Hugging Face's rotate-half layout);
    ``returns="tuple"`` gives ``(out, None)`` as Hugging Face's attention modules do."""

    def __init__(self, *, qkv: dict, out_name: str, out: nn.Module, heads: int,
                 kv_heads: int, head_dim: int, dropout: float, output_dropout: nn.Module | None,
                 rope: str | None, returns: str, batch_first: bool, sequence_parallel: bool,
                 state, window: int | None = None):
        super().__init__()
        self.state = state
        self.window = window
        for name, layer in qkv.items():
            setattr(self, name, layer)
        self._qkv_names = tuple(qkv)
        setattr(self, out_name, out)
        self._out_name = out_name
        self.output_dropout = output_dropout
        self.heads_local = heads // state.tp_size
        self.kv_local = local_kv_heads(kv_heads, state.tp_size)
        self.head_dim = head_dim
        self.rope, self.returns = rope, returns
        self.sequence_dim = 1 if batch_first else 0
        self.sequence_parallel = sequence_parallel
        self.core_attention = DotProductAttention(
            heads, head_dim, num_gqa_groups=kv_heads, attention_dropout=dropout,
            qkv_format="bshd" if batch_first else "sbhd", state=state)

    def _project(self, x):
        d, hl, gl = self.head_dim, self.heads_local, self.kv_local
        outs = []
        for name in self._qkv_names:
            layer = getattr(self, name)
            w, b = layer.local() if isinstance(layer, ReplicatedKV) else (layer.weight,
                                                                        layer.bias)
            outs.append(linear_fn(layer, x, w, b))
        if len(outs) == 1:
            outs = outs[0].split([hl * d, gl * d, gl * d], dim=-1)
        return [t.view(*t.shape[:2], n, d) for t, n in zip(outs, (hl, gl, gl))]

    def forward(self, hidden_states=None, *args, position_embeddings=None, **kwargs):
        x = hidden_states
        group = self.state.tp_group
        if self.sequence_parallel:
            x = mappings.gather_from_sp_region(x, group, self.sequence_dim)
        else:
            x = mappings.copy_to_tp_region(x, group)
        q, k, v = self._project(x)
        full = q.shape[self.sequence_dim] * self.state.cp_size
        if self.window is not None and full > self.window:
            raise ValueError(f"this attention has a sliding window of {self.window} tokens, "
                             "which tpkit's plan does not implement (its attention is causal "
                             f"over the whole row); train on sequences of at most {self.window}"
                             f" tokens (got {full})")
        if self.rope == "hf":
            if position_embeddings is None:
                raise ValueError("this attention's plan applies Hugging Face's rotary "
                                 "embeddings, but no position_embeddings=(cos, sin) came")
            cos, sin = position_embeddings             # [b, s, d]
            cos, sin = (t.unsqueeze(2 if self.sequence_dim == 1 else 1) for t in (cos, sin))
            if self.sequence_dim == 0:
                cos, sin = cos.transpose(0, 1), sin.transpose(0, 1)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        ctx = self.core_attention(q, k, v)
        out = getattr(self, self._out_name)(ctx)
        if self.output_dropout is not None:
            out = self.output_dropout(out)
        return (out, None) if self.returns == "tuple" else out


class LayoutPositionEmbedding(nn.Module):
    """A learned position table (the model's ``nn.Embedding``'s weight, kept) that returns
    the rows of this rank's tokens: the model asks for positions ``0..t-1`` of its local
    length ``t`` (nanoGPT's ``wpe(arange(t))``); under CP these are this rank's
    load-balanced chunks of the full sequence (tpkit.cp.cp_positions), under SP their
    ``1/tp`` slice. The weight is replicated; under SP each TP rank's gradient covers its
    own rows, so it is tagged ``sequence_parallel`` (summed over TP)."""

    def __init__(self, emb: nn.Embedding, *, sequence_parallel: bool, state):
        super().__init__()
        self.weight = emb.weight
        self.state, self.sequence_parallel = state, sequence_parallel
        if sequence_parallel:
            set_tp_attrs(self.weight, None, sequence_parallel=True)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        s = self.state
        t = positions.shape[-1]
        pos = cp_positions(s.cp_rank, s.cp_size, t, device=self.weight.device)
        if self.sequence_parallel and s.tp_size > 1:
            pos = pos.chunk(s.tp_size)[group_rank(s.tp_group)]
        out = nn.functional.embedding(pos, self.weight)
        return out.expand(*positions.shape[:-1], *out.shape) if positions.dim() > 1 else out


def column(linear: nn.Linear, *, gather_output=False, segments=None, sequence_parallel=False,
           sequence_dim=0, state) -> ColumnParallelLinear:
    """``linear`` as a ColumnParallelLinear holding this rank's rows (of every segment)."""
    w = linear.weight
    layer = ColumnParallelLinear(
        linear.in_features, linear.out_features, linear.bias is not None,
        gather_output=gather_output, partition_sizes=segments,
        sequence_parallel=sequence_parallel, sequence_dim=sequence_dim, init_method=keep,
        state=state, device=w.device, dtype=w.dtype)
    fill(layer.weight, w, 0, segments, state)
    if linear.bias is not None:
        fill(layer.bias, linear.bias, 0, segments, state)
    return layer


def replicated_kv(linear: nn.Linear, kv_heads: int, head_dim: int, state) -> ReplicatedKV:
    """``linear`` (a k or v projection of ``kv_heads`` < tp heads) whole on every rank."""
    w = linear.weight
    layer = ReplicatedKV(linear.in_features, kv_heads, head_dim, segments=1,
                         bias=linear.bias is not None, init_method=keep, state=state,
                         device=w.device, dtype=w.dtype)
    fill(layer.weight, w, None, None, state)
    if linear.bias is not None:
        fill(layer.bias, linear.bias, None, None, state)
    return layer


def keep(weight) -> None:
    """init_method that leaves a new shard as allocated: the model's weights fill it."""


def fill(param, full, dim, segments, state) -> None:
    with torch.no_grad():
        part = full if dim is None else shard_tensor(full.detach(), dim, segments,
                                                      state.tp_rank, state.tp_size)
        if tuple(part.shape) != tuple(param.shape):
            raise ValueError(f"the model's tensor of shape {tuple(full.shape)} gives a shard "
                             f"of {tuple(part.shape)}, the tpkit layer holds "
                             f"{tuple(param.shape)}")
        param.copy_(part)
