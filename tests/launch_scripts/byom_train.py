"""Launched by tests/plans/test_byom_launch.py: bring-your-own-model under tpkit-launch + Fabric,
public API only.

    byom_train.py WORK_DIR

World 4: nanoGPT's GPT and a transformers LlamaForCausalLM (tests/byom_models.py), each
parallelized by its ready plan (``TPKitStrategy(parallelize_fn=tpkit.parallelize)``),
train 8 steps at (tp, cp, dp) = (2, 2, 1) with SP and (1, 2, 2), saving at step 4 of
the first; a third run at (1, 2, 2) loads that checkpoint and trains steps 4..7.
World 2: the same at (2, 1, 1), then the silent cases of issue 35 (each must end in an
error or warning naming its cause) and, last, ``fabric.save`` called on rank 0 only.
Every rank writes ``WORK_DIR/rank<r>.json``: each run's losses and each case's message;
at world 4, rank 0's holds the reference losses too (the unparallelized model, one
process, computed there, for both launches: the same models, seeds and batches; every
rank's losses are the all-reduced global ones, the same on every rank).
"""
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from lightning.fabric import Fabric

import tpkit
from byom_models import hf_llama, model_loss, nanogpt   # tests/ (PYTHONPATH: tests/paths.py)
from tpkit.fabric import TPKitStrategy

STEPS, SAVE_AT, B, S, LR = 8, 4, 4, 16, 1e-3


def build(kind):
    return nanogpt() if kind == "gpt" else hf_llama()


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (B, S), generator=g), torch.randint(0, 64, (B, S), generator=g)


def reference(kind):
    """The unparallelized model, in this process alone."""
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = model_loss(model, x, y, kind)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def train(kind, world, tp, cp, sp, *, save=None, load=None):
    strategy = TPKitStrategy(tp=tp, cp=cp, sequence_parallel=sp,
                             parallelize_fn=tpkit.parallelize)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    state = strategy.parallel_state
    model = fabric.setup_module(build(kind))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    first = 0
    if load:
        fabric.load(load, {"model": model, "optimizer": opt})
        first = SAVE_AT
    rows = slice(state.dp_rank * B // state.dp_size, (state.dp_rank + 1) * B // state.dp_size)
    losses = []
    for step in range(first, STEPS):
        x, y = batch(step)
        loss = model_loss(model, x[rows], y[rows], kind)
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), group=state.dp_cp_group).item())
        if save and step + 1 == SAVE_AT:
            fabric.save(save, {"model": model, "optimizer": opt})
    strategy.teardown()
    return losses


def error_of(fn):
    try:
        fn()
    except Exception as e:   # the case's error, recorded for the test
        return f"{type(e).__name__}: {e}"
    return None


def warning_of(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return "; ".join(str(w.message) for w in seen) or None


def fabric_at(world, **kw):
    strategy = TPKitStrategy(**kw)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    return fabric, strategy


def silent_cases(world):
    """Issue 35's five silent cases, each the user's way."""
    out = {}
    # 1. the unchanged model at tp=2
    fabric, strategy = fabric_at(world, tp=2)
    out["unsharded"] = warning_of(lambda: fabric.setup_module(nanogpt()))
    strategy.teardown()
    # 2. layers swapped after the optimizer was built (fabric.setup(model, opt))
    fabric, strategy = fabric_at(world, tp=2, parallelize_fn=tpkit.parallelize)
    model = nanogpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out["stale_optimizer"] = error_of(lambda: fabric.setup(model, opt))
    strategy.teardown()
    # 3. a tpkit model at cp=2 fed the full sequence (no shard_sequence)
    fabric, strategy = fabric_at(world, tp=1, cp=2)
    layer = tpkit.nn.TransformerLayer(32, 64, 4)
    out["cp_unsharded"] = warning_of(lambda: layer(torch.randn(16, 2, 32)))
    strategy.teardown()
    # 4. [b, s, h] into ParallelSelfAttention (sequence-first by default)
    fabric, strategy = fabric_at(world, tp=2)
    attn = tpkit.nn.ParallelSelfAttention(32, 4)
    out["batch_first"] = warning_of(lambda: attn(torch.randn(4, 16, 32)))
    strategy.teardown()
    # 5. DTensor weights (torch's parallelize_module) under Fabric
    fabric, strategy = fabric_at(world, tp=2)
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    net = torch.nn.Sequential(torch.nn.Linear(8, 8))
    parallelize_module(net, strategy.parallel_state.tp_mesh, {"0": ColwiseParallel()})
    out["dtensor"] = error_of(lambda: fabric.setup_module(net))
    strategy.teardown()
    return out


def rank0_save(world, work):
    """fabric.save on rank 0 only (a single-GPU habit); the others go on to a barrier."""
    fabric, strategy = fabric_at(world, tp=2, parallelize_fn=tpkit.parallelize)
    model = fabric.setup_module(nanogpt())
    if fabric.global_rank == 0:
        return error_of(lambda: fabric.save(os.path.join(work, "rank0-only"),
                                            {"model": model}))
    return error_of(fabric.barrier)


def main(work):
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    # the reference once, by rank 0 of the 4-rank launch (the 2-rank one's is the same)
    result = {"ref": {k: reference(k) for k in ("gpt", "hf")}
              if rank == 0 and world == 4 else None, "runs": {}}
    for kind in ("gpt", "hf"):
        if world == 2:
            result["runs"][f"{kind}-2,1,1"] = train(kind, 2, 2, 1, False)
        else:
            ckpt = os.path.join(work, f"{kind}-ckpt")
            result["runs"][f"{kind}-2,2,1+sp"] = train(kind, 4, 2, 2, True, save=ckpt)
            result["runs"][f"{kind}-1,2,2"] = train(kind, 4, 1, 2, False)
            result["runs"][f"{kind}-1,2,2-resumed"] = train(kind, 4, 1, 2, False, load=ckpt)
    if world == 2:
        result["cases"] = silent_cases(world)
    path = os.path.join(work, f"rank{rank}.json")
    with open(path, "w") as f:
        json.dump(result, f)
    if world == 2:
        result["rank0_save"] = rank0_save(world, work)   # last: it breaks the group
        with open(path, "w") as f:
            json.dump(result, f)
        os._exit(0)   # the default group is unusable after the timeout; nothing to tear down


if __name__ == "__main__":
    main(sys.argv[1])
