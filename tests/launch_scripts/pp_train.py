"""Launched by tests/shared.py (``tpkit-launch --nproc-per-node N``): several runs of
launch/train.py's ``main`` in one process, the layout of each from its own arguments
(train.py's public options: --pp, --tp, --cp, --pp-schedule, ...), then several test
scripts, each run as tpkit-launch's worker runs a script (runpy, as ``__main__``, with
its own argv).

    pp_train.py OUT_DIR RUNS_JSON [SCRIPTS_JSON]

``RUNS_JSON`` maps a run's name to train.py's argument list; runs go in order (a resume
may read a checkpoint an earlier run wrote) and the layout is destroyed after each.
Every rank writes ``OUT_DIR/rank<r>.json``: {name: the losses train.py reported}.
``SCRIPTS_JSON`` is a list of ``[name, script, arg, ...]``: each script runs after the
runs, in order, with ``{dir}`` in its arguments replaced by ``OUT_DIR/<name>`` (created
for it); what it prints goes to ``OUT_DIR/<name>/stdout.rank<r>``.
"""
import contextlib
import json
import os
import runpy
import sys

import torch.distributed as dist

import tpkit
from tpkit.train import trainer as train

out_dir, runs = sys.argv[1], json.loads(sys.argv[2])
scripts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else []
rank = int(os.environ["RANK"])
losses = {}
for name, argv in runs.items():
    losses[name] = train.main(argv)
    tpkit.destroy_parallel()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(losses, f)
for name, script, *args in scripts:
    print(f"pp_train.py: {name}: {script}", flush=True)
    where = os.path.join(out_dir, name)
    os.makedirs(where, exist_ok=True)
    sys.argv = [script, *(a.replace("{dir}", where) for a in args)]
    with open(os.path.join(where, f"stdout.rank{rank}"), "w") as f, \
            contextlib.redirect_stdout(f):
        runpy.run_path(script, run_name="__main__")
    tpkit.destroy_parallel()
if dist.is_initialized():
    dist.destroy_process_group()
