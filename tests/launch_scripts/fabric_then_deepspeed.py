"""Launched by tests/test_userpath.py (one launch for two tests: a rank's start with
Lightning costs ~5 CPU-s, four of them per launch) as

    tpkit-launch --nproc-per-node 4 --tp 2 --sequence-parallel fabric_then_deepspeed.py \
        CKPT FABRIC_OUT DS_OUT

fabric_layouts.py's three Fabric layouts, then, in the same processes over the default
group the first Fabric created, ds_train.py's two DeepSpeed layouts (skipped, and
DS_OUT not written, where deepspeed is not installed). Each part checks its losses
inside and rank 0 writes its summary; a failing part fails the launch.
"""
import importlib.util
import sys

import torch.distributed as dist

import fabric_layouts

ckpt, fabric_out, ds_out = sys.argv[1:4]
fabric_layouts.main(ckpt, fabric_out)
if importlib.util.find_spec("deepspeed") is not None:
    world = dist.group.WORLD
    import ds_train
    ds_train.main(ds_out)
    assert dist.group.WORLD is world, "DeepSpeed re-created the default process group"
