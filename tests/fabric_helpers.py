"""A tiny TP/SP/CP-shardable model for the Fabric and checkpoint tests.

Plain nn modules tagged by hand (so the generic tag handling is tested apart from
tpkit.nn's layers), with tpkit.nn.mappings' collectives: a pre-norm gated MLP block with
a fused gate/up column-parallel projection (``tp_partition_sizes``), a row-parallel
output projection, and, under sequence parallelism, norm weights and the row bias tagged
``sequence_parallel``. Per-token, so CP just splits the sequence. ``full_model`` is the
single-process reference; ``shard_into`` copies full weights into a TP model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.nn import mappings as m


def launch_fabric(*, precision=None, **strategy_kwargs):
    """Fabric over this worker's gloo ranks with ``TPKitStrategy(**strategy_kwargs)``,
    launched; returns ``(fabric, state)`` (the strategy is ``fabric.strategy``)."""
    import torch.distributed as dist
    from lightning.fabric import Fabric

    from tpkit.fabric import TPKitStrategy
    strategy = TPKitStrategy(**strategy_kwargs)
    kwargs = {} if precision is None else {"precision": precision}
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy,
                    **kwargs)
    fabric.launch()
    return fabric, strategy.parallel_state

H, S, B = 8, 8, 4  # hidden, global sequence, global batch


# --- the model ------------------------------------------------------------------------------
class Block(nn.Module):
    """x + W2 (silu(gate) * up), gate/up = W1 norm(x); input/output [s, b, H]."""

    def __init__(self, state=None, *, sp: bool = False):
        super().__init__()
        self.state, self.sp = state, sp
        tp = 1 if state is None else state.tp_size
        self.norm = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, 4 * H // tp)       # [gate; up] each sharded on its own
        self.fc2 = nn.Linear(2 * H // tp, H)
        self.head = nn.Linear(H, H, bias=False)    # replicated, no SP tag (plain DDP param)
        if tp > 1 or state is not None:
            for p in (self.fc1.weight, self.fc1.bias):
                p.tp_partition_dim, p.tp_partition_sizes = 0, (2 * H, 2 * H)
            self.fc2.weight.tp_partition_dim = 1
        if sp:
            for p in (self.norm.weight, self.norm.bias, self.fc2.bias):
                p.sequence_parallel = True

    def forward(self, x):
        s = self.state
        tp = s is not None and s.tp_size > 1
        if tp and self.sp:
            x = m.scatter_to_sp_region(x, s.tp_group)
        h = self.norm(x)
        if tp:
            h = (m.gather_from_sp_region(h, s.tp_group) if self.sp
                 else m.copy_to_tp_region(h, s.tp_group))
        gate, up = self.fc1(h).chunk(2, -1)
        y = F.linear(F.silu(gate) * up, self.fc2.weight)
        if tp:
            y = (m.reduce_scatter_to_sp_region(y, s.tp_group) if self.sp
                 else m.reduce_from_tp_region(y, s.tp_group))
        y = x + y + self.fc2.bias
        if tp and self.sp:
            y = m.gather_from_tp_region(y, s.tp_group, dim=0)
        return self.head(y)


def full_model(seed: int = 0) -> Block:
    torch.manual_seed(seed)
    return Block()


def shard_into(model: Block, full: Block, state) -> Block:
    """Copy ``full``'s weights into the TP model ``model`` (this rank's shards)."""
    tp, r = state.tp_size, state.tp_rank
    fsd = full.state_dict()
    with torch.no_grad():
        for k, v in model.state_dict(keep_vars=True).items():
            src = fsd[k]
            if k.startswith("fc1."):
                src = torch.cat([seg.chunk(tp, 0)[r] for seg in src.chunk(2, 0)], 0)
            elif k == "fc2.weight":
                src = src.chunk(tp, 1)[r]
            v.copy_(src)
    return model


def data(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g))
            for _ in range(steps)]


def local_batch(x, y, state):
    """This rank's part of a global batch: DP splits the batch dim, CP the sequence."""
    x = x.chunk(state.dp_size, 1)[state.dp_rank].chunk(state.cp_size, 0)[state.cp_rank]
    y = y.chunk(state.dp_size, 1)[state.dp_rank].chunk(state.cp_size, 0)[state.cp_rank]
    return x, y


def reference_losses(steps: int, lr: float = 0.1, clip: float | None = None):
    """Single-process losses (mean over all tokens of the global batch) and grad norms."""
    model = full_model()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses, norms = [], []
    for x, y in data(steps):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms
