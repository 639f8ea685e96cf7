"""``python -m tpkit.train`` (and ``tpkit-launch ... -m tpkit.train``): tpkit-train."""
from tpkit.train.trainer import cli, preflight


def tpkit_preflight(argv, launch) -> None:
    """tpkit-launch's pre-flight hook (tpkit.cli.preflight): tpkit.train.preflight."""
    preflight(argv, launch)


if __name__ == "__main__":
    cli(prog="python -m tpkit.train")
