"""Worker script for tests/cli/test_launch_run.py and tests/cli/test_slurm.py: checks that
tpkit.init_parallel() with no arguments builds the layout tpkit-launch exported.

    check_layout.py TP CP [--fail-rank R] [--wait-signal DIR]

Every rank checks its tp/cp/dp groups against the rank formula of docs/design.md
("Layout and rank order") and that an all-reduce over each group sums the group's ranks,
then prints one ``OK`` line.
``--fail-rank R`` makes rank R raise after the checks; ``--wait-signal DIR`` skips the
process group, writes DIR/ready.<rank> (its rank variables, the layout tpkit-launch
exported, its arguments) and sleeps until a signal (TERM, INT, HUP or QUIT), writing
DIR/<SIGNAL>.<rank> when it arrives.
"""
import argparse
import os
import signal
import sys
import time


def wait_for_signal(directory: str) -> None:
    rank = os.environ["RANK"]

    def handler(signum, frame):
        with open(os.path.join(directory, f"{signal.Signals(signum).name}.{rank}"), "w") as f:
            f.write(str(os.getpid()))
        sys.exit(0)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, handler)
    ready = os.path.join(directory, f"ready.{rank}")
    with open(ready + ".tmp", "w") as f:   # what the rank was given
        f.write(" ".join(f"{k}={os.environ.get(k)}" for k in
                         ("RANK", "WORLD_SIZE", "TPKIT_TP", "TPKIT_CP", "TPKIT_BACKEND")) +
                f" argv={sys.argv[1:]}")
    os.replace(ready + ".tmp", ready)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit("no signal arrived within 120 s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tp", type=int)
    ap.add_argument("cp", type=int)
    ap.add_argument("--fail-rank", type=int, default=None)
    ap.add_argument("--wait-signal", default=None)
    args, _ = ap.parse_known_args()  # other arguments are only echoed back
    if args.wait_signal:
        return wait_for_signal(args.wait_signal)

    import torch
    import torch.distributed as dist
    import tpkit

    state = tpkit.init_parallel()  # everything from TPKIT_* (and TPKIT_BACKEND)
    r, w, tp, cp = state.rank, state.world_size, args.tp, args.cp
    dp = w // (tp * cp)
    assert (state.tp_size, state.cp_size, state.dp_size, state.pp_size) == (tp, cp, dp, 1), \
        (state.tp_size, state.cp_size, state.dp_size, state.pp_size)
    assert state.backend == os.environ["TPKIT_BACKEND"] == "gloo"
    t_, c_, d_ = r % tp, (r // tp) % cp, r // (tp * cp)
    expect = {
        "tp": [i + tp * (c_ + cp * d_) for i in range(tp)],
        "cp": [t_ + tp * (i + cp * d_) for i in range(cp)],
        "dp": [t_ + tp * (c_ + cp * i) for i in range(dp)],
    }
    for name, ranks in expect.items():
        assert state.group_ranks(name) == ranks, (name, state.group_ranks(name), ranks)
        t = torch.tensor([float(r)])
        dist.all_reduce(t, group=getattr(state, f"{name}_group"))
        assert t.item() == sum(ranks), (name, t.item(), ranks)
    # One write per line: with `python -u` print() writes the text and the newline
    # separately, and the ranks share one pipe.
    sys.stdout.write(f"OK rank={r} world={w} local_rank={os.environ['LOCAL_RANK']} "
                     f"tp={state.tp_rank} cp={state.cp_rank} dp={state.dp_rank} "
                     f"omp={os.environ.get('OMP_NUM_THREADS')} "
                     f"run_id={os.environ['TORCHELASTIC_RUN_ID']} args={sys.argv[1:]}\n")
    sys.stdout.flush()
    if args.fail_rank == r:
        raise RuntimeError(f"boom on rank {r}")
    # Without this barrier a rank that tears its gloo groups down while a peer is still
    # finishing the last collective sometimes aborts at exit ("terminate called without
    # an active exception"; seen with plain torchrun too, about 1 run in 6 here).
    dist.barrier()
    tpkit.destroy_parallel()


if __name__ == "__main__":
    main()
