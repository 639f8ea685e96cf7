"""``python -m tpkit.train`` (and ``tpkit-launch ... -m tpkit.train``): tpkit-train."""
from tpkit.train.trainer import cli, preflight


def tpkit_preflight(argv, launch):
    """tpkit-launch's pre-flight hook (tpkit.cli.preflight): tpkit.train.preflight (its
    MemoryJob feeds tpkit-launch's memory estimate)."""
    return preflight(argv, launch)


if __name__ == "__main__":
    cli(prog="python -m tpkit.train")
