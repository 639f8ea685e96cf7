"""Launched by tests/fp8/test_fp8_recipes.py as
``tpkit-launch --nproc-per-node 4 --tp 2 --cp 2 --sequence-parallel fp8_recipes.py OUT``:
every fp8 recipe the way a user runs it, in one process per rank.

A. launch/train.py's ``main`` (Fabric, TPKitPrecision) at tp=2 x cp=2 with SP: float32,
   then ``--precision fp8 --fp8-recipe`` delayed, current, block, mxfp8; every rank's
   curves are written out (the test compares them with the float32 one).
B. tpkit.nn's column -> row pair with SP under ``fp8_autocast(recipe=name)``, one step
   per recipe; rank 0 writes what every rank's layers hold: the per-tensor scales of
   ``fp8_meta`` and, computed here by hand from the all-gathered tensors (the full
   sequence of this CP rank), the scales the full tensors give.
"""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpkit
from tpkit import fp8
from tpkit.fp8 import fp8_autocast
from tpkit.nn import ColumnParallelLinear, RowParallelLinear

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpkit.train import trainer as train

RECIPES = ["delayed", "current", "block", "mxfp8"]
STEPS = int(os.environ.get("FP8_RECIPES_STEPS", 20))
SMALL = ["--steps", str(STEPS), "--hidden", "64", "--layers", "2", "--heads", "4",
         "--gqa-groups", "2", "--ffn", "128", "--seq-len", "32", "--global-batch", "4",
         "--warmup", "5", "--log-every", "100", "--tp", "2", "--cp", "2",
         "--sequence-parallel"]
if os.environ.get("FP8_RECIPES_MODEL") == "default":   # BENCHMARKS.md: train.py's own model
    SMALL = ["--steps", str(STEPS), "--log-every", "100", "--tp", "2", "--cp", "2",
             "--sequence-parallel"]


def curves() -> dict:
    out = {}
    for name in ["fp32"] + RECIPES:
        extra = [] if name == "fp32" else ["--precision", "fp8", "--fp8-recipe", name]
        out[name] = train.main(SMALL + extra)
        tpkit.destroy_parallel()  # the next Fabric builds the layout again
    return out


def _gather(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _scale(fp8_max: float, t: torch.Tensor) -> float:
    """fp8_max / amax, one float32 division (numpy's: torch's ``float / tensor`` is a
    reciprocal and a product, one rounding more)."""
    return float(np.float32(fp8_max) / np.float32(t.detach().abs().max().item()))


def scales() -> dict:
    """Rank by rank: the layers' scales and the full tensors' (448 / amax, E4M3 forward;
    57344 / amax, E5M2 gradients: HYBRID)."""
    state = tpkit.init_parallel()
    assert (state.tp_size, state.cp_size, state.sequence_parallel) == (2, 2, True)
    out = {}
    for name in RECIPES:
        fp8.reset()
        torch.manual_seed(7)
        fc1, fc2 = ColumnParallelLinear(64, 256), RowParallelLinear(256, 64)
        g = torch.Generator().manual_seed(100 + dist.get_rank())  # every rank its own data
        x = (torch.randn(8, 2, 64, generator=g) * (1 + dist.get_rank())).requires_grad_()
        dy = torch.randn(8, 2, 64, generator=g)
        with fp8_autocast(recipe=name):
            y = fc2(F.gelu(fc1(x)))
        y.backward(dy)
        full_x = torch.cat(_gather(x.detach(), state.tp_group))   # what SP gathers for fc1
        full_dy = torch.cat(_gather(dy, state.tp_group))          # ... for fc2's backward
        out[name] = {
            "fc1": fc1.fp8_meta.scale.tolist() if fc1.fp8_meta.recipe.per_tensor else None,
            "fc2": fc2.fp8_meta.scale.tolist() if fc2.fp8_meta.recipe.per_tensor else None,
            "full_x": _scale(448.0, full_x),
            "full_dy": _scale(57344.0, full_dy),
            "fc1_w": _scale(448.0, fc1.weight),
            "local_x": _scale(448.0, x),
            "grads_finite": all(bool(p.grad.isfinite().all()) for p in
                                [*fc1.parameters(), *fc2.parameters(), x]),
        }
    layout = {"tp": state.tp_rank, "cp": state.cp_rank, "dp": state.dp_rank}
    tpkit.destroy_parallel()
    return {"layout": layout, **out}


def main():
    result = {"curves": curves(), "scales": scales()}
    for key in ("curves", "scales"):   # every rank's, not rank 0's only
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, result[key])
        result[key] = everyone
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    print("FP8 RECIPES OK", flush=True)


if __name__ == "__main__":
    main()
