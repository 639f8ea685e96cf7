"""Launched by tests/shared.py (``tpkit-launch --nproc-per-node N``): several runs of
launch/train.py's ``main`` in one process, the layout of each from its own arguments
(train.py's public options: --pp, --tp, --cp, --pp-schedule, ...).

    pp_train.py OUT_DIR RUNS_JSON

``RUNS_JSON`` maps a run's name to train.py's argument list; runs go in order (a resume
may read a checkpoint an earlier run wrote) and the layout is destroyed after each.
Every rank writes ``OUT_DIR/rank<r>.json``: {name: the losses train.py reported}.
"""
import json
import os
import sys

import torch.distributed as dist

import tpkit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpkit.train import trainer as train

out_dir, runs = sys.argv[1], json.loads(sys.argv[2])
losses = {}
for name, argv in runs.items():
    losses[name] = train.main(argv)
    tpkit.destroy_parallel()
with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(losses, f)
dist.destroy_process_group()
