"""Launched by tests/shared.py (``tpkit-launch --nproc-per-node N``): several runs of
launch/train.py's ``main`` in one process, the layout of each from its own arguments
(train.py's public options: --pp, --tp, --cp, --pp-schedule, ...), then several test
scripts, each run as tpkit-launch's worker runs a script (runpy, as ``__main__``, with
its own argv).

    pp_train.py OUT_DIR RUNS_JSON [SCRIPTS_JSON]

``RUNS_JSON`` maps a run's name to train.py's argument list; runs go in order (a resume
may read a checkpoint an earlier run wrote) and the layout is destroyed after each.
Every rank writes ``OUT_DIR/rank<r>.json``: {name: the losses train.py reported}.
``SCRIPTS_JSON`` is a list of ``{name, script, args, flags, exports}``: each script runs
after the runs, in order, with ``{dir}`` in its arguments replaced by ``OUT_DIR/<name>``
(created for it) and ``exports`` (what tpkit-launch exports for the script's layout
``flags``, and the script's own ``env``) in its environment; what it prints goes to
``OUT_DIR/<name>/stdout.rank<r>``.
A script ``-m MODULE`` runs the module as ``python -m`` does. A script that destroys the
default group at its end (launch/smoke.py, ``python -m tpkit.train``) leaves the next one
a new default group on a key prefix of the launch's store of its own.
"""
import contextlib
import json
import os
import runpy
import sys
from datetime import timedelta

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


def restore_default_group(after: str) -> None:
    """A default group for the next script, on a key prefix of the launch's store of its
    own: a group made again on the old one's keys finds the old group's peers and hangs."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"pp_train/after-{after}", store),
                            rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=120))


launched_env = dict(os.environ)
for entry in scripts:
    name, script = entry["name"], entry["script"]
    print(f"pp_train.py: {name}: {script} {' '.join(entry['flags'])}", flush=True)
    where = os.path.join(out_dir, name)
    os.makedirs(where, exist_ok=True)
    sys.argv = [script, *(a.replace("{dir}", where) for a in entry["args"])]
    # the TPKIT_* a launch with the script's flags would have exported, in place of ours
    os.environ.update(entry["exports"])
    with open(os.path.join(where, f"stdout.rank{rank}"), "w") as f, \
            contextlib.redirect_stdout(f):
        if script.startswith("-m "):      # tpkit-launch -m MODULE
            runpy.run_module(script[3:], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    tpkit.destroy_parallel()
    os.environ.clear()
    os.environ.update(launched_env)
    if not dist.is_initialized():   # the script destroyed the default group (smoke.py does)
        restore_default_group(name)
if dist.is_initialized():
    dist.destroy_process_group()
