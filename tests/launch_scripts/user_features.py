"""Launched by tests/test_user_features.py as
``tpkit-launch --nproc-per-node 4 user_features.py WORKDIR``: features no other test runs
the user's way, in one process start (public API only).

T. launch/train.py's options, ``train.main(argv)`` one run after another (the layout
   freed with ``tpkit.destroy_parallel()`` between runs):
   - ``--tp 2 --data-parallel fsdp --save D --save-every 3`` (8 steps: step000003,
     step000006, step000008); step000008 is then deleted, as if the job had died before
     its last save, and ``--cp 2 --resume D`` (DDP, another layout) must pick step000006
     and run steps 6-7;
   - ``--precision bf16-mixed``, ``--precision 16-mixed``, ``--precision fp8
     --fp8-compute-dtype bfloat16`` (at tp 2), ``--dropout 0.1`` (cp 2),
     ``--cp-comm-type a2a`` and ``all_gather`` (cp 2).
F. Fabric + TPKitStrategy:
   - ``parallelize_fn``: a plain full-size model handed to ``fabric.setup`` is sharded
     by the function (called once, with the strategy's state) and trains on the
     single-process curve;
   - ``seed=``: what each rank draws from torch's default stream and from the RNG
     tracker's model-parallel stream after ``fabric.launch()``;
   - ``TPKitPrecision("fp8", fallback_compute_dtype=...)``: the dtype of an operation fp8
     does not cover (a matmul) inside ``fabric.autocast()``.
S. launch/smoke.py --tp 2, last (it destroys the default process group), run as
   tpkit-launch's worker runs a script (runpy, as ``__main__``); it checks an all-reduce
   over every group on every rank and prints the rank table on rank 0.
Every rank writes what it saw to WORKDIR/rankN.json; the test compares every rank's with
independent references (single-process runs, the layout's rank formula).
"""
import json
import os
import runpy
import shutil
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric

import tpkit
from fabric_helpers import Block, data, full_model, local_batch, shard_into
from tpkit.fabric import TPKitPrecision, TPKitStrategy
from tpkit.layout.random import get_rng_tracker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpkit.train import trainer as train

TRAIN = ["--steps", "8", "--hidden", "32", "--layers", "1", "--heads", "4",
         "--gqa-groups", "2", "--ffn", "64", "--seq-len", "16", "--global-batch", "4",
         "--warmup", "2", "--log-every", "100"]


def train_runs(workdir: str) -> dict:
    ckpt = os.path.join(workdir, "ckpt")
    runs = {
        "fsdp": ["--tp", "2", "--data-parallel", "fsdp", "--save", ckpt, "--save-every", "3"],
        "resume": ["--cp", "2", "--resume", ckpt],
        "bf16": ["--tp", "2", "--precision", "bf16-mixed"],
        "fp16": ["--tp", "2", "--precision", "16-mixed"],
        "fp8_bf16": ["--tp", "2", "--precision", "fp8", "--fp8-compute-dtype", "bfloat16"],
        "dropout": ["--cp", "2", "--dropout", "0.1"],
        "a2a": ["--cp", "2", "--cp-comm-type", "a2a"],
        "all_gather": ["--cp", "2", "--cp-comm-type", "all_gather"],
    }
    out = {}
    for name, extra in runs.items():
        out[name] = train.main(TRAIN + extra)
        tpkit.destroy_parallel()
        if name == "fsdp":
            out["saved"] = sorted(os.listdir(ckpt))
            dist.barrier()
            if dist.get_rank() == 0:   # the job "died" before its last save
                shutil.rmtree(os.path.join(ckpt, "step000008"))
            dist.barrier()
    return out


LR = 0.05


def parallelize_run() -> dict:
    calls, made = [], []

    def parallelize(module, state):
        calls.append(state)
        made.append(shard_into(Block(state), module, state))
        return made[-1]

    strategy = TPKitStrategy(tp=2, parallelize_fn=parallelize)
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    state = strategy.parallel_state
    full = full_model()
    model = fabric.setup_module(full)
    start = made[0].fc1.weight.detach().clone()
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=LR))
    losses = []
    for x, y in data(3):
        x, y = local_batch(x, y, state)
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), group=state.dp_cp_group).item())
    out = {"calls": len(calls), "same_state": all(s is state for s in calls),
           "fc1_shape": list(made[0].fc1.weight.shape), "losses": losses,
           # the module the function returned is what trained (Fabric's ``model.module``
           # stays the one passed in, as with Lightning's ModelParallelStrategy)
           "trained": not torch.equal(made[0].fc1.weight, start),
           "full_untouched": torch.equal(full.fc1.weight, full_model().fc1.weight)}
    strategy.teardown()
    return out


def seed_draws() -> dict:
    out = {}
    for seed in (None, 1234, 7):
        strategy = TPKitStrategy(tp=2, seed=seed)
        fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
        fabric.launch()
        fabric.setup_module(torch.nn.Linear(2, 2))
        default = torch.rand(4).tolist()
        with get_rng_tracker().fork():
            tracker = torch.rand(4).tolist()
        out[str(seed)] = {"default": default, "tracker": tracker,
                          "tp_rank": strategy.parallel_state.tp_rank}
        strategy.teardown()
    return out


def fallback_dtypes() -> dict:
    out = {}
    for fallback in (None, torch.bfloat16, torch.float16):
        strategy = TPKitStrategy(tp=2)
        fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy,
                        plugins=[TPKitPrecision("fp8", fallback_compute_dtype=fallback)])
        fabric.launch()
        fabric.setup_module(torch.nn.Linear(2, 2))
        a = torch.ones(4, 4)
        with fabric.autocast():
            out[str(fallback)] = str((a @ a).dtype)
        strategy.teardown()
    return out


def main() -> None:
    workdir = sys.argv[1]
    result = {"train": train_runs(workdir), "parallelize": parallelize_run(),
              "seed": seed_draws(), "fallback": fallback_dtypes()}
    with open(os.path.join(workdir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    # launch/smoke.py last (it destroys the default group), run as tpkit-launch's worker
    # runs a script: runpy as __main__ with its own argv
    sys.argv = [os.path.join(ROOT, "launch", "smoke.py"), "--tp", "2"]
    runpy.run_path(sys.argv[0], run_name="__main__")
    assert not dist.is_initialized()


if __name__ == "__main__":
    main()
