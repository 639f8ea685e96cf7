"""A tiny tensor-parallel MLP block for the recompute and fp8 tests.

column-parallel linear -> gelu -> dropout (tracker-forked: differs per TP rank) ->
row-parallel linear -> all-reduce -> dropout (default stream: same on every TP rank).
Its matmuls go through ``tpkit.fp8.linear(layer, x, weight, bias)``, the signature of
tpkit.nn's linear function, so fp8_autocast applies to it. Weights come from full
matrices drawn from a fixed generator and are sliced by TP rank.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tpkit import fp8
from tpkit.random import get_rng_tracker


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        if dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class Linear(nn.Module):
    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.bias = None if bias is None else nn.Parameter(bias.clone())

    def forward(self, x):
        return fp8.linear(self, x, self.weight, self.bias)


class TPBlock(nn.Module):
    def __init__(self, hidden, ffn, state, *, seed=0, p=0.3, tp_group=None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w1 = torch.randn(ffn, hidden, generator=g) / hidden ** 0.5
        b1 = torch.randn(ffn, generator=g) * 0.1
        w2 = torch.randn(hidden, ffn, generator=g) / ffn ** 0.5
        self.group = state.tp_group if tp_group is None else tp_group
        tp, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        part = ffn // tp
        self.fc1 = Linear(w1[r * part:(r + 1) * part], b1[r * part:(r + 1) * part])
        self.fc2 = Linear(w2[:, r * part:(r + 1) * part])
        self.p = p

    def forward(self, x):
        h = self.fc1(_CopyToTP.apply(x, self.group))
        h = F.gelu(h)
        with get_rng_tracker().fork():
            h = F.dropout(h, self.p)
        y = _ReduceFromTP.apply(self.fc2(h), self.group)
        return F.dropout(y, self.p / 3)
