"""``tpkit-launch --nproc-per-node 4 --tp 2 --sequence-parallel fabric_layouts.py CKPT OUT``
(tests/test_userpath.py runs its main() then ds_train.py's in one launch:
tests/launch_scripts/fabric_then_deepspeed.py):
Lightning Fabric with TPKitStrategy, three layouts one after another in one process.

A. ``Fabric(strategy="tpkit")``: the layout from TPKIT_* (tp=2 + SP, dp=2), DDP; 3 steps;
   ``fabric.save(CKPT)``; ``strategy.teardown()``.
B. ``TPKitStrategy(tp=1, cp=2, sequence_parallel=False)`` (dp=2): ``fabric.load(CKPT)``
   written at layout A, 3 more steps.
C. ``TPKitStrategy(sequence_parallel=True, data_parallel="fsdp")`` (tp=2 from TPKIT_TP,
   dp=2): FSDP2 from scratch, 3 steps.

Losses (and clipped gradient norms) must equal the single-process reference of
fabric_helpers (Adam, lr 0.05, clip 0.5) to 1e-5: A and C its steps 0-2, B its steps
3-5. Every Fabric reuses the default process group the first one created. Rank 0 writes
a JSON summary to OUT.
"""
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric

import tpkit
from fabric_helpers import Block, data, full_model, local_batch, reference_losses, shard_into
from tpkit.fabric import TPKitStrategy

LR, CLIP = 0.05, 0.5


def run(strategy, steps, *, load=None, save=None, fsdp=False):
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=4)
    fabric.launch()
    state = fabric.strategy.parallel_state
    model = shard_into(Block(state, sp=state.sequence_parallel), full_model(), state)
    if fsdp:
        model = fabric.setup_module(model)
        opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=LR))
    else:
        model, opt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=LR))
    if load:
        fabric.load(load, {"model": model, "optimizer": opt})
    losses, norms = [], []
    for x, y in steps:
        x, y = local_batch(x, y, state)
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        norms.append(fabric.clip_gradients(model, opt, max_norm=CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), group=state.dp_cp_group).item())
    if save:
        fabric.save(save, {"model": model, "optimizer": opt})
    layout = (state.tp_size, state.cp_size, state.dp_size, state.sequence_parallel)
    fabric.strategy.teardown()
    assert not tpkit.is_initialized() and dist.is_initialized()
    return layout, losses, norms


def main(ckpt, out_path):
    ref, ref_norms = reference_losses(6, lr=LR, clip=CLIP)
    batches = data(6)
    results = {}
    results["A"] = run("tpkit", batches[:3], save=ckpt)
    world = dist.group.WORLD
    results["B"] = run(TPKitStrategy(tp=1, cp=2, sequence_parallel=False), batches[3:],
                       load=ckpt)
    results["C"] = run(TPKitStrategy(sequence_parallel=True, data_parallel="fsdp"),
                       batches[:3], fsdp=True)
    assert dist.group.WORLD is world, "a Fabric re-created the default process group"
    expect = {"A": ((2, 1, 2, True), slice(0, 3)), "B": ((1, 2, 2, False), slice(3, 6)),
              "C": ((2, 1, 2, True), slice(0, 3))}
    for name, (layout, losses, norms) in results.items():
        want_layout, steps = expect[name]
        assert layout == want_layout, (name, layout)
        torch.testing.assert_close(losses, ref[steps], rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(norms, ref_norms[steps], rtol=1e-5, atol=1e-7, msg=name)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({k: {"layout": v[0], "losses": v[1]} for k, v in results.items()}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
