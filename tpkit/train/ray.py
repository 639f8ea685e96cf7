"""tpkit-train on Ray Train: ``ray.train.torch.TorchTrainer`` starts the workers and the
default process group; tpkit adopts them (docs/clusters.md).

    from tpkit.train.ray import ray_trainer
    result = ray_trainer(["--tp", "2", "--steps", "100", "--save-every", "20"],
                         num_workers=4, storage_path="s3://bucket/runs", name="gpt",
                         max_failures=3).fit()

- **Layout**: the job's (its flags, ``--config`` TOML), checked against the world Ray
  gives before any worker starts (``ray_trainer``: ``num_workers``) and again in every
  worker (``ray.train.get_context().get_world_size()`` against the process group), with
  the messages of ``tpkit-launch`` (``tpkit.layout.config.ParallelConfig.validate``).
- **Ranks**: Ray's, through ``tpkit.fabric.environment.RayEnvironment`` (``TPKitStrategy``
  picks it inside a Ray Train worker); ``tpkit.init_parallel`` builds the layout over
  the group Ray made and never destroys it.
- **Checkpoints** go to the Ray run's storage, ``<storage_path>/<name>/tpkit/stepNNNNNN``
  (a local directory, or an fsspec URL for ``s3://``... through ``tpkit.checkpoint._dcp_fs``),
  unless ``--save`` names another place; every save is reported to Ray
  (``ray.train.report(..., checkpoint=...)``, not copied: ``NO_UPLOAD``), and saves are
  synchronous so that each report names a complete checkpoint.
- **Metrics**: every step, ``ray.train.report({"step", "loss", "lr", ...})``.
- **Restarts**: Ray restarts the worker group (``FailureConfig(max_failures=N)``); the new
  workers auto-resume from the newest complete checkpoint in the run's storage onto the
  same loss curve (tpkit.recovery).
"""
from __future__ import annotations

import os
import posixpath

from .config import parse
from .trainer import Trainer

SUBDIR = "tpkit"   # under the Ray run's directory


def check_world(job, world: int, where: str):
    """The job's layout checked against ``world`` processes (tpkit-launch's messages,
    ``where`` saying whose world it is); the ParallelConfig, dp resolved."""
    try:
        return job.layout().validate(world)
    except ValueError as e:
        raise ValueError(f"{e} [world = {where}]") from None


def _run_dir() -> str:
    """This Ray run's directory, a local path or an fsspec URL."""
    import ray.train
    storage = ray.train.get_context().get_storage()
    fs_dir = posixpath.join(storage.experiment_fs_path, SUBDIR)
    kind = storage.storage_filesystem.type_name   # pyarrow's
    if kind == "local":
        return fs_dir
    if kind in _SCHEMES:
        return f"{_SCHEMES[kind]}://{fs_dir}"
    raise ValueError(f"the Ray run's storage is a {kind!r} file system, which tpkit cannot "
                     "name as an fsspec URL; pass --save URL (e.g. s3://bucket/run)")


_SCHEMES = {"s3": "s3", "gcs": "gs", "hdfs": "hdfs", "abfs": "abfs"}   # pyarrow -> fsspec


class RayTrainer(Trainer):
    """``tpkit.train.Trainer`` reporting to Ray Train: per-step metrics, every save as a
    checkpoint of the run."""

    save_signals = ()   # Ray stops and restarts the workers; the loop runs off the main thread

    def __init__(self, job):
        import ray.train
        ctx = ray.train.get_context()
        check_world(job, ctx.get_world_size(),
                    f"{ctx.get_world_size()} Ray Train workers")
        super().__init__(job)
        self._saved: list[tuple[int, str]] = []
        save = self.recovery.save

        def save_and_note(step, state, *, wait=False):
            save(step, state, wait=True)   # synchronous: the report names a complete one
            self._saved.append((step, self.recovery.save_dir))
        self.recovery.save = save_and_note

    def metrics_logger(self):
        log = super().metrics_logger()
        step_fn = log.step

        def step(step, *, tokens=None, **scalars):
            out = step_fn(step, tokens=tokens, **scalars)
            self.report(step, {k: v for k, v in scalars.items()
                               if isinstance(v, (int, float))})
            return out
        log.step = step
        return log

    def report(self, step: int, metrics: dict) -> None:
        """``ray.train.report`` on every worker (Ray's barrier); rank 0 names the checkpoint
        saved after this step, if any."""
        import ray.train
        checkpoint = None
        if self._saved and self._saved[-1][0] == step and self.state.rank == 0:
            from tpkit.recovery.checkpoints import checkpoint_path
            checkpoint = _ray_checkpoint(checkpoint_path(self._saved[-1][1], step + 1))
        ray.train.report({"step": step, **metrics}, checkpoint=checkpoint,
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)


def _ray_checkpoint(path: str):
    """A Ray Checkpoint for a tpkit checkpoint already in the run's storage."""
    import ray.train
    storage = ray.train.get_context().get_storage()
    fs_path = path.split("://", 1)[1] if "://" in path else path
    return ray.train.Checkpoint(path=fs_path, filesystem=storage.storage_filesystem)


def train_loop(config: dict) -> None:
    """The ``train_loop_per_worker`` of ``ray.train.torch.TorchTrainer``:
    ``config = {"argv": [tpkit-train flags], "trainer_cls": optional Trainer subclass}``.
    Trains in the process group Ray made; checkpoints and auto-resume in the run's
    storage unless ``--save`` is given."""
    import tpkit
    job, _ = parse(list(config.get("argv", ())), prog="tpkit-train (Ray)",
                   defaults={"checkpoint.save": (_run_dir(), "the Ray run's storage")})
    if not job.checkpoint.resume:
        job.recovery.auto_resume = True          # a restarted Ray run resumes
    job.checkpoint.async_save = False
    trainer = (config.get("trainer_cls") or RayTrainer)(job)
    try:
        trainer.fit()
    finally:
        tpkit.destroy_parallel()                 # the default group is Ray's to destroy


def ray_trainer(argv, *, num_workers: int, resources_per_worker: dict | None = None,
                use_gpu: bool = False, storage_path: str | None = None,
                name: str | None = None, max_failures: int = 0, trainer_cls=None,
                backend: str | None = None):
    """A ``ray.train.torch.TorchTrainer`` running tpkit-train with ``argv`` on
    ``num_workers`` workers; the job and its layout are checked here, before Ray starts
    anything (ValueError with tpkit-launch's messages). ``backend``: the process group's
    (default nccl with GPUs, else gloo)."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer
    job, _ = parse(list(argv), prog="tpkit-train (Ray)", defaults={
        "checkpoint.save": (os.path.join(storage_path or "~/ray_results", name or "run", SUBDIR),
                            "the Ray run's storage")})
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers={num_workers!r} must be a positive integer (the Ray "
                         "Train workers, one per rank)")
    check_world(job, num_workers, f"num_workers={num_workers} Ray Train workers")
    return TorchTrainer(
        train_loop, train_loop_config={"argv": list(argv), "trainer_cls": trainer_cls},
        torch_config=TorchConfig(backend=backend or ("nccl" if use_gpu else "gloo")),
        scaling_config=ray.train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                               resources_per_worker=resources_per_worker),
        run_config=ray.train.RunConfig(
            name=name, storage_path=storage_path,
            failure_config=ray.train.FailureConfig(max_failures=max_failures)))
