"""``--verify`` (issue 43): tpkit-launch's pre-flight of the trainer runs tpkit.verify on
the job's own model at the launch's layout before any worker starts; a difference stops
the launch (ValueError, which tpkit-launch turns into one line and exit 2)."""
import os

import pytest

from tpkit.cli.preflight import LaunchInfo
from tpkit.layout.config import ParallelConfig

SMALL = ["--hidden", "32", "--heads", "4", "--gqa-groups", "2", "--ffn", "64", "--layers", "2",
         "--seq-len", "16", "--global-batch", "4", "--steps", "2", "--verify"]


def _launch(**sizes):
    env = dict(os.environ, **{f"TPKIT_{k.upper()}": str(int(v)) for k, v in sizes.items()})
    sizes = dict(dict(tp=1, cp=1, dp=1, pp=1), **sizes)
    world = sizes["tp"] * sizes["cp"] * sizes["dp"] * sizes["pp"]
    return LaunchInfo(ParallelConfig(**sizes), world, world, 1, env, False)


@pytest.mark.slow
def test_verify_runs_in_the_preflight(capsys):
    from tpkit.train.trainer import preflight
    preflight(SMALL, _launch(tp=2, cp=2, sequence_parallel=True))
    out = capsys.readouterr().out
    assert "2x2x1+sp: OK  2 step(s)" in out and "tpkit layers" in out, out


def test_verify_refuses_a_pipeline_layout():
    from tpkit.train.trainer import preflight
    with pytest.raises(ValueError, match="pp=2, ep=1: pipeline and expert layouts are not "
                                         "verified yet"):
        preflight(SMALL + ["--microbatches", "2"], _launch(tp=1, pp=2))


@pytest.mark.slow
def test_a_difference_stops_the_launch(monkeypatch, capsys):
    """The job's model with the sequence-parallel gradient sum left out (planted in the
    verified ranks): the pre-flight prints the report and refuses the launch."""
    import tpkit.verifier.record as record
    from tpkit.train.trainer import preflight
    monkeypatch.setattr(record, "sync_sequence_parallel_grads", lambda model, state: 0)
    with pytest.raises(ValueError, match="--verify: the model differs from one process at "
                                         "layout 2x1x1\\+sp"):
        preflight(SMALL, _launch(tp=2, sequence_parallel=True))
    out = capsys.readouterr().out
    assert "parameter gradient of module 'layers.0." in out and "not summed" in out, out
