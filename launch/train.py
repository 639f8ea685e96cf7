"""Train the reference GPT with tpkit's trainer: copy this script to start your own.

    tpkit-launch --tp 2 --cp 2 launch/train.py                 # CPU, 4 gloo ranks
    tpkit-launch --nproc-per-node auto --tp 2 launch/train.py --precision bf16-mixed
    tpkit-launch --tp 2 --cp 2 launch/train.py --config job.toml --training.steps 100

Every option is a field of tpkit.train.JobConfig (docs/train.md; ``--help``,
``--print-config``). The layout comes from tpkit-launch (TPKIT_* variables) or from
``--tp``/``--cp`` here. tpkit-launch runs ``tpkit_preflight`` before any worker starts: the
job's checks, the model built on the meta device at the launch's layout, --resume's
checkpoint (docs/launch.md). ``python -m tpkit.train`` and ``tpkit-train`` run the same.

The trainer in your own script, with your own loop around it:

    from tpkit.train import Trainer, parse
    job, _ = parse()                  # defaults < --config FILE < flags, checked
    trainer = Trainer(job)            # Fabric + TPKitStrategy + TPKitPrecision, model, data
    losses = trainer.fit()            # or trainer.step_loss(step) in a loop of yours
"""
from tpkit.train import cli, preflight


def tpkit_preflight(argv, launch):
    return preflight(argv, launch)   # checks; the job's MemoryJob for the memory estimate


if __name__ == "__main__":
    cli(prog="launch/train.py")       # --print-config, one-line errors, teardown
