"""Worker script of tests/train/test_ray.py: one tpkit-train job under tpkit-launch and
under Ray Train, each writing its loss curve.

    tpkit-launch --tp 2 --dp 2 ray_train.py launch OUT.json TRAIN-FLAGS...
    python ray_train.py ray OUTDIR KILL_STEP TRAIN-FLAGS...

``launch``: tpkit.train.main, rank 0 writes the losses (a JSON list, exact floats).
``ray``: a local Ray cluster (4 CPUs, 4 workers of 0.5 CPU each) runs the job through
tpkit.train.ray.ray_trainer with FailureConfig(max_failures=1); on its first attempt the
worker of rank 1 kills itself (SIGKILL) at step KILL_STEP (-1: never), after that step's
save would have happened, before reporting it. Rank 0 appends ``pid step loss`` per
reported step to OUTDIR/losses.txt; the result's checkpoint path goes to OUTDIR/result.txt.
"""
import json
import os
import signal
import sys


def launch(out, argv):
    from tpkit.train import main
    losses = main(argv)
    if int(os.environ.get("RANK", 0)) == 0:
        with open(out, "w") as f:
            json.dump(losses, f)


def ray_run(outdir, kill_step, argv):
    import ray
    from tpkit.train.ray import RayTrainer, ray_trainer

    class KillOnce(RayTrainer):
        def report(self, step, metrics):
            marker = os.path.join(outdir, "killed")
            if step == kill_step and self.state.rank == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            super().report(step, metrics)
            if self.state.rank == 0:
                with open(os.path.join(outdir, "losses.txt"), "a") as f:
                    f.write(f"{os.getpid()} {step} {metrics['loss']!r}\n")

    # a shared test machine's memory is other processes': Ray's memory monitor would kill
    # workers for it; the job itself needs little (object store: 100 MB)
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 * 1024 ** 2,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TPKIT_BACKEND": "gloo"}})
    try:
        result = ray_trainer(argv, num_workers=4, resources_per_worker={"CPU": 0.5},
                             storage_path=os.path.join(outdir, "storage"), name="run",
                             max_failures=1, trainer_cls=KillOnce).fit()
        with open(os.path.join(outdir, "result.txt"), "w") as f:
            f.write(str(result.checkpoint.path if result.checkpoint else None))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "launch":
        launch(out, sys.argv[3:])
    else:
        ray_run(out, int(sys.argv[3]), sys.argv[4:])
