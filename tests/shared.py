"""Launches that tests of several modules share (the suite's time, docs/testing.md: a rank
of a trainer job spends ~4.5 CPU-seconds importing before its first step, so a 4-rank
launch costs ~19 CPU-seconds before it trains, while a run of a test model inside an
already started rank costs a fraction of one).

``once(tmp_path_factory, name, build)`` runs ``build(workdir)`` once per test session,
also under pytest-xdist: the first worker to ask runs it under a file lock in the
session's shared temporary directory and writes the (JSON) result there; a worker that
asks later, or while it runs, waits for the lock and reads it. A build that fails is not
run again: every later asker fails with its message.

The trainer launch is one such launch: ``tpkit-launch --nproc-per-node 4
tests/launch_scripts/pp_train.py``, every registered run of launch/train.py's ``main``
(``TRAINER_RUNS``) in registration order (a resume reads what an earlier run saved; runs
name their files under ``{work}``, the launch's directory). A module registers at import
(collection imports every selected module before the first test runs, so the table is
complete, and the same on every worker, before any build) and reads with
``trainer_runs``. What sharing costs: a run happens in a process that ran others before
it (each frees its layout; the tests that a fresh process matters to, exit, kill,
restart and re-init, keep launches of their own); a failure fails every test that reads
the launch, with the launch's output; and a worker that asks while the other runs it
waits (so only short runs join: test scripts joined once made the suite slower).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
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
    done, failed = root / f"shared-{name}.json", root / f"shared-{name}.failed"
    with FileLock(str(root / f"shared-{name}.lock")):
        if done.exists():
            return json.loads(done.read_text())
        if failed.exists():   # once is enough: every later asker fails with its message
            raise AssertionError(f"the shared launch {name!r} failed earlier in this "
                                 f"session:\n{failed.read_text()}")
        work = tempfile.mkdtemp(prefix=f"shared-{name}-", dir=root)
        try:
            result = build(work)
        except (Exception, pytest.fail.Exception) as e:   # finish() fails on a timeout
            failed.write_text(f"{type(e).__name__}: {e}"[-10000:])
            raise
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
    from test_userpath import finish
    env = launch_env()
    env["PYTHONPATH"] = paths.PYTHONPATH
    argv = {k: [a.replace("{work}", work) for a in v] for k, v in runs.items()}
    out = os.path.join(work, f"w{world}")
    os.makedirs(out, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "tpkit.cli.launch", "--nproc-per-node",
                             str(world), os.path.join(paths.SCRIPTS, "pp_train.py"), out,
                             json.dumps(argv)], cwd=paths.ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rc, stdout, stderr = finish(proc, timeout=900)   # a timeout kills the ranks too
    assert rc == 0, stdout[-3000:] + stderr[-5000:]
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
