"""Launches that tests of several modules share (the suite's time, docs/testing.md: a rank
of a trainer job spends ~4.5 CPU-seconds importing before its first step, so a 4-rank
launch costs ~19 CPU-seconds before it trains, while a run of a test model inside an
already started rank costs a fraction of one).

``once(tmp_path_factory, name, build)`` runs ``build(workdir)`` once per test session,
also under pytest-xdist: the first worker to ask runs it under a file lock in the
session's shared temporary directory and writes the (JSON) result there; a worker that
asks later, or while it runs, waits for the lock and reads it. A build that fails leaves
no result, so the next asker runs it again (and fails the same way, in its own test).

``TRAINER_RUNS`` is one such launch: ``tpkit-launch --nproc-per-node 4
tests/launch_scripts/pp_train.py``, every registered run of launch/train.py's ``main``
in one launch, in registration order (a resume reads what an earlier run saved; runs
name their files under ``{work}``, the launch's directory). A module registers its runs
at import (collection imports every selected module before the first test runs, so the
table is complete, and the same on every worker, before any build) and reads them with
``trainer_runs(tmp_path_factory)``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from filelock import FileLock

import paths

TRAINER_RUNS: dict[str, list[str]] = {}


def _shared_dir(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    # under xdist each worker's base is <session dir>/popen-gwN; the session dir is shared
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once(tmp_path_factory, name: str, build):
    """``build(workdir)``'s JSON-able result, computed once per session (see above)."""
    root = _shared_dir(tmp_path_factory)
    done = root / f"shared-{name}.json"
    with FileLock(str(root / f"shared-{name}.lock")):
        if done.exists():
            return json.loads(done.read_text())
        work = tempfile.mkdtemp(prefix=f"shared-{name}-", dir=root)
        result = build(work)
        done.write_text(json.dumps(result))
        return result


def register_trainer_runs(runs: dict[str, list[str]]) -> None:
    """Adds ``runs`` ({name: launch/train.py argv}) to the shared trainer launch."""
    for name in runs:
        if name in TRAINER_RUNS:
            raise ValueError(f"trainer run {name!r} registered twice")
    TRAINER_RUNS.update(runs)


def launch_trainer_runs(world: int, runs: dict[str, list[str]], work: str) -> dict:
    """``tpkit-launch --nproc-per-node WORLD tests/launch_scripts/pp_train.py``: every run
    of ``runs`` ({name: argv}, ``{work}`` replaced by ``work``) in one launch; {name:
    losses} (every rank reported the same, checked)."""
    from test_launch_run import launch_env
    env = launch_env()
    env["PYTHONPATH"] = paths.PYTHONPATH
    argv = {k: [a.replace("{work}", work) for a in v] for k, v in runs.items()}
    out = os.path.join(work, f"w{world}")
    os.makedirs(out, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "tpkit.cli.launch", "--nproc-per-node",
                           str(world), os.path.join(paths.SCRIPTS, "pp_train.py"), out,
                           json.dumps(argv)], cwd=paths.ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    for r in ranks[1:]:
        assert r == ranks[0]      # every rank reports the same global loss
    return ranks[0]


def _trainer_launch(tmp_path_factory) -> dict:
    return once(tmp_path_factory, "trainer-runs", lambda work: {
        "work": work, "losses": launch_trainer_runs(4, TRAINER_RUNS, work)})


def trainer_runs(tmp_path_factory) -> dict[str, list[float]]:
    """{name: losses} of every registered run (one launch of 4 ranks per session)."""
    return _trainer_launch(tmp_path_factory)["losses"]


def trainer_work(tmp_path_factory) -> str:
    """The trainer launch's directory (``{work}`` in the runs' arguments)."""
    return _trainer_launch(tmp_path_factory)["work"]
