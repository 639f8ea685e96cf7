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
name their files under ``{work}``, the launch's directory), then every registered test
script (``register_trainer_script``; cuda_rules_matrix.py last), each run as
tpkit-launch's worker runs a script (``-m MODULE`` as ``python -m``), with the
``TPKIT_*`` variables tpkit-launch's own ``resolve`` exports for the layout flags the
script is written for (``--tp 2 --cp 2``: what the script's own launch would have given
it). A module registers at import (collection imports every selected module before the
first test runs, so the table is complete, and the same on every worker, before any
build) and reads with ``trainer_runs`` / ``script_dir`` / ``script_output``; it must be
one of ``READERS``, which tests/conftest.py's scheduler runs on one worker, the launch
inside that unit of work, so no worker waits for it.

What sharing costs: a script runs in a process that ran others before it (each frees
its layout; the tests that a fresh process matters to, exit, kill, restart and re-init,
keep launches of their own; after a script that destroys the default group at its end,
as launch/smoke.py and ``python -m tpkit.train`` do, pp_train.py makes the next one a
new default group on a key prefix of the launch's store of its own: created again on the
old keys, it finds the old group's peers and hangs, as test_train_observe's run once
hung cuda_rules_matrix.py), a script whose ranks must
agree on a collective must decide it alike on every rank (cuda_rules_matrix.py's
``hf_base`` once hung here: its ranks decided by a file rank 0 had just written), and a
failure fails every test that reads the launch, with the launch's output.
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

# The modules that read a shared launch. README's ``-n 2 --dist loadfile`` hands them to
# one pytest-xdist worker as one unit of work (tests/conftest.py's scheduler), so the
# launch runs inside that unit and no worker ever waits for the other's launch;
# registering from a module not named here is an error.
READERS = ("test_compose", "test_pipeline", "test_moe_checkpoint", "test_byom_launch",
           "test_cuda_rules_matrix", "test_fp8_recipes", "test_moe", "test_packed",
           "test_observe_launch", "test_train_observe", "test_user_features",
           "test_fabric_conformance", "test_ray")

TRAINER_RUNS: dict[str, list[str]] = {}
TRAINER_SCRIPTS: list[dict] = []    # {name, script, args, flags, env}, after the runs
_LAST: list[dict] = []              # scripts that must run last (process-wide changes)


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


def _reader(depth: int = 2) -> None:
    module = sys._getframe(depth).f_globals.get("__name__", "?")
    if module not in READERS:
        raise ValueError(f"{module} registers a shared launch but is not in tests/shared.py's "
                         f"READERS: add it there, so that its tests run on the worker that "
                         f"runs the launch")


def register_trainer_runs(runs: dict[str, list[str]]) -> None:
    """Adds ``runs`` ({name: launch/train.py argv}) to the shared trainer launch."""
    _reader()
    for name in runs:
        if name in TRAINER_RUNS:
            raise ValueError(f"trainer run {name!r} registered twice")
    TRAINER_RUNS.update(runs)


def register_trainer_script(name: str, script: str, *args: str, flags: tuple = (),
                            env: dict | None = None, last: bool = False) -> None:
    """Adds ``script`` to the shared trainer launch, run after the train.py runs as
    tpkit-launch runs a script (``-m MODULE`` as ``python -m``; ``{dir}`` in ``args``: a
    directory of its own, see ``script_dir``). ``flags``: tpkit-launch's layout flags the
    script is written for (``--tp 2 --cp 2``): it runs with the ``TPKIT_*`` variables
    tpkit-launch's own ``resolve`` exports for them at 4 ranks, in place of the launch's;
    ``env``: more variables of its own launch's environment (set while it runs). ``last``:
    after every other script (it changes the process for good, as CUDA's autocast rules
    do)."""
    _reader()
    if any(entry["name"] == name for entry in TRAINER_SCRIPTS + _LAST):
        raise ValueError(f"trainer script {name!r} registered twice")
    (_LAST if last else TRAINER_SCRIPTS).append(
        {"name": name, "script": script, "args": list(args), "flags": list(flags),
         "env": dict(env or {})})


def launch_plan(argv: list[str], env: dict):
    """tpkit-launch's own plan (tpkit.cli.launch's resolve: its world and what it exports
    to its workers) for ``tpkit-launch ARGV``, from ``env``."""
    from tpkit.cli.launch import build_parser, resolve
    return resolve(build_parser().parse_args(argv), env)


def launch_exports(flags: list[str], world: int, env: dict) -> dict[str, str]:
    """What ``tpkit-launch --nproc-per-node WORLD FLAGS script`` exports to its workers."""
    return dict(launch_plan(["--nproc-per-node", str(world), *flags, "script.py"], env).exports)


def launch_trainer_runs(world: int, runs: dict[str, list[str]], work: str,
                        scripts: list[dict] = ()) -> dict:
    """``tpkit-launch --nproc-per-node WORLD tests/launch_scripts/pp_train.py``: every run
    of ``runs`` ({name: argv}, ``{work}`` replaced by ``work``) in one launch; {name:
    losses} (every rank reported the same, checked)."""
    from test_launch_run import launch_env
    from test_userpath import finish
    env = launch_env()
    env["PYTHONPATH"] = paths.PYTHONPATH
    scripts = [dict(entry, exports={**launch_exports(entry["flags"], world, env),
                                    **entry["env"]})
               for entry in scripts]
    argv = {k: [a.replace("{work}", work) for a in v] for k, v in runs.items()}
    out = os.path.join(work, f"w{world}")
    os.makedirs(out, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "tpkit.cli.launch", "--nproc-per-node",
                             str(world), os.path.join(paths.SCRIPTS, "pp_train.py"), out,
                             json.dumps(argv), json.dumps(list(scripts))], cwd=paths.ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
        "work": work, "losses": launch_trainer_runs(4, TRAINER_RUNS, work,
                                                    TRAINER_SCRIPTS + _LAST)})


def trainer_runs(tmp_path_factory) -> dict[str, list[float]]:
    """{name: losses} of every registered run (one launch of 4 ranks per session)."""
    return _trainer_launch(tmp_path_factory)["losses"]


def trainer_work(tmp_path_factory) -> str:
    """The trainer launch's directory (``{work}`` in the runs' arguments)."""
    return _trainer_launch(tmp_path_factory)["work"]


def script_dir(tmp_path_factory, name: str) -> str:
    """The directory of the shared launch's script ``name`` (``{dir}`` in its arguments;
    ``stdout.rank<r>`` holds what rank r printed), after the launch."""
    return os.path.join(trainer_work(tmp_path_factory), "w4", name)


def script_output(tmp_path_factory, name: str) -> str:
    """What the shared launch's script ``name`` printed, every rank's in rank order."""
    where = script_dir(tmp_path_factory, name)
    return "".join(open(os.path.join(where, f"stdout.rank{r}")).read() for r in range(4))
