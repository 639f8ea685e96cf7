"""A tiny tensor-parallel MLP block of tpkit.nn layers for the recompute and fp8 tests.

ColumnParallelLinear -> gelu -> dropout (tracker-forked: differs per TP rank) ->
RowParallelLinear -> dropout (default stream: same on every TP rank). The layers' matmuls
go through tpkit.nn.linear.linear_fn, so fp8_autocast applies. Weights are copied from
full matrices drawn from a fixed generator, sliced by TP rank.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tpkit.nn import ColumnParallelLinear, RowParallelLinear
from tpkit.layout.random import get_rng_tracker


class TPBlock(nn.Module):
    def __init__(self, hidden, ffn, state, *, seed=0, p=0.3, sequence_parallel=False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w1 = torch.randn(ffn, hidden, generator=g) / hidden ** 0.5
        b1 = torch.randn(ffn, generator=g) * 0.1
        w2 = torch.randn(hidden, ffn, generator=g) / ffn ** 0.5
        self.fc1 = ColumnParallelLinear(hidden, ffn, state=state,
                                        sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(ffn, hidden, bias=False, state=state,
                                     sequence_parallel=sequence_parallel)
        part, r = ffn // state.tp_size, state.tp_rank
        with torch.no_grad():
            self.fc1.weight.copy_(w1[r * part:(r + 1) * part])
            self.fc1.bias.copy_(b1[r * part:(r + 1) * part])
            self.fc2.weight.copy_(w2[:, r * part:(r + 1) * part])
        self.p = p

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        with get_rng_tracker().fork():
            h = F.dropout(h, self.p)
        return F.dropout(self.fc2(h), self.p / 3)
