"""launch/train.py with faults injected on one rank, for tests/recovery/test_recovery.py:

    tpkit-launch ... recovery_faults.py [--slow-rank R --slow-s S] [--hang-rank R
        --hang-after N] [--hold-writes PATH] [--pause-at N --pause-file PATH]
        -- ARGS OF launch/train.py

--slow-rank: that rank's optimizer step takes S seconds longer (a straggler).
--hang-rank: after N optimizer steps that rank sleeps forever inside its next
all-reduce (the loss report), so the others wait for it in the collective.
--hold-writes: while the file PATH exists, every rank's checkpoint writes wait (storage
that stalls), so that a test can kill or signal a job while a save is in flight, for as
long as it needs and no longer; if PATH holds a text, only the writes of a save whose
directory's path contains it (e.g. step000020), so that a test can stall a save long
before it starts.
--pause-at: inside its N-th optimizer step (counted from 1; step N - 1 of the recovery
messages) every rank waits while the file PATH of --pause-file exists, so that a test can
signal the job at a known step, however slow the machine (a signal still reaches the
waiting rank).
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpkit.train import trainer as train

ap = argparse.ArgumentParser()
ap.add_argument("--slow-rank", type=int, default=None)
ap.add_argument("--slow-s", type=float, default=0.0)
ap.add_argument("--hang-rank", type=int, default=None)
ap.add_argument("--hang-after", type=int, default=0)
ap.add_argument("--hold-writes", default=None)
ap.add_argument("--pause-at", type=int, default=None)
ap.add_argument("--pause-file", default=None)
ours, _, theirs = " ".join(sys.argv[1:]).partition(" -- ")
args = ap.parse_args(ours.split())
rank = int(os.environ["RANK"])
steps = [0]
step_fn, all_reduce = torch.optim.AdamW.step, dist.all_reduce


def slow_step(self, *a, **k):
    steps[0] += 1
    if steps[0] == args.pause_at and os.path.exists(args.pause_file):
        # one write (print's text and newline are two, which another rank's may split)
        os.write(1, f"rank {rank}: paused in optimizer step {steps[0]}\n".encode())
        while os.path.exists(args.pause_file):
            time.sleep(0.02)
    if rank == args.slow_rank:
        time.sleep(args.slow_s)
    return step_fn(self, *a, **k)


def stuck_all_reduce(*a, **k):
    if rank == args.hang_rank and steps[0] >= args.hang_after:
        print(f"rank {rank}: sleeping forever in all_reduce", flush=True)
        while True:
            time.sleep(1000)  # HANG HERE
    return all_reduce(*a, **k)


def held(path: str) -> bool:
    """--hold-writes: the file exists, and is empty or names a part of ``path``."""
    try:
        with open(args.hold_writes) as f:
            only = f.read().strip()
    except FileNotFoundError:
        return False
    return not only or only in path


def held_write(self, *a, **k):
    while held(str(self.path)):
        time.sleep(0.02)
    return write_data(self, *a, **k)


torch.optim.AdamW.step = slow_step
dist.all_reduce = stuck_all_reduce
if args.hold_writes:
    from torch.distributed.checkpoint import FileSystemWriter
    write_data = FileSystemWriter.write_data
    FileSystemWriter.write_data = held_write
train.main(theirs.split())
