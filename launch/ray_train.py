"""tpkit-train on a Ray cluster (Ray Train's TorchTrainer starts the workers and the
process group; tpkit.train.ray adopts them). docs/clusters.md.

    python launch/ray_train.py --workers 4 --storage s3://bucket/runs --name gpt \\
        --max-failures 3 -- --tp 2 --steps 1000 --save-every 100

Everything after ``--`` is tpkit-train's (docs/train.md); the layout is checked against
``--workers`` before Ray starts anything. Checkpoints go to STORAGE/NAME/tpkit and a
restarted run resumes from the newest complete one.
"""
import argparse
import sys

from tpkit.train.ray import ray_trainer


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, train = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    ap = argparse.ArgumentParser(prog="ray_train.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, required=True, help="Ray Train workers (ranks)")
    ap.add_argument("--gpus", action="store_true", help="one GPU per worker (nccl)")
    ap.add_argument("--cpus-per-worker", type=float, default=1.0)
    ap.add_argument("--storage", default=None, help="the run's storage (path or URL)")
    ap.add_argument("--name", default=None, help="the run's name (its directory)")
    ap.add_argument("--max-failures", type=int, default=0, help="Ray's restarts of the run")
    args = ap.parse_args(ours)
    try:
        trainer = ray_trainer(train, num_workers=args.workers, use_gpu=args.gpus,
                              resources_per_worker={"CPU": args.cpus_per_worker},
                              storage_path=args.storage, name=args.name,
                              max_failures=args.max_failures)
    except ValueError as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    result = trainer.fit()
    print(f"done: last checkpoint {result.checkpoint.path if result.checkpoint else None}")


if __name__ == "__main__":
    main()
