"""Run by test_fabric_launch (under tpkit-launch, or plain python so Fabric's own launcher
starts the ranks): Fabric(strategy="tpkit") takes the layout from TPKIT_*; rank 0 writes the
losses and the layout as JSON to argv[1]. FABRIC_DEVICES: processes per node (default 4)."""
import json
import os
import sys

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

import tpkit.fabric  # noqa: F401  (registers "tpkit")
from fabric_helpers import Block, data, full_model, local_batch, shard_into

fabric = Fabric(strategy="tpkit", accelerator="cpu",
                devices=int(os.environ.get("FABRIC_DEVICES", 4)))
fabric.launch()
state = fabric.strategy.parallel_state
model = shard_into(Block(state, sp=state.sequence_parallel), full_model(), state)
model, opt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.05))
losses = []
for x, y in data(3):
    x, y = local_batch(x, y, state)
    loss = F.mse_loss(model(x), y)
    fabric.backward(loss)
    fabric.clip_gradients(model, opt, max_norm=0.5)
    opt.step()
    opt.zero_grad()
    losses.append(fabric.all_reduce(loss.detach(), group=state.dp_cp_group).item())
if fabric.global_rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"losses": losses, "layout": [state.tp_size, state.cp_size, state.dp_size,
                                                state.sequence_parallel]}, f)
fabric.strategy.teardown()
torch.distributed.destroy_process_group()
