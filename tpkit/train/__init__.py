"""The trainer: a typed job config (TOML file + flags) and one Trainer (docs/train.md).

    from tpkit.train import Trainer, parse
    job, _ = parse(["--config", "job.toml", "--training.steps", "100"])
    losses = Trainer(job).fit()

``JobConfig`` and ``parse`` import no torch (``--help`` stays fast); ``Trainer`` and the
entry points (``main``, ``cli``: the console script ``tpkit-train`` and ``python -m
tpkit.train``; ``preflight``: tpkit-launch's pre-flight hook) load on first use.
"""
from .config import SECTIONS, JobConfig, parse

__all__ = ["JobConfig", "SECTIONS", "parse", "Trainer", "main", "cli", "preflight"]


def __getattr__(name):
    if name in ("Trainer", "main", "cli", "preflight"):
        from . import trainer
        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
