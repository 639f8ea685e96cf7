"""Mutation testing with cosmic-ray (``pip install cosmic-ray``), one module at a time.

    python tools/mutation.py config [--keep DIR]     # or any other name in MODULES

Copies the tracked files to a scratch directory (cosmic-ray edits the module in place, so
the checkout stays untouched and tests may run meanwhile), runs every mutant of the
module against the test subset of MODULES, and prints cosmic-ray's report: the mutation
score is 100 % minus "surviving mutants". ``--keep DIR`` keeps the session database (and
the scratch copy) there for ``cr-report DIR/session.sqlite --show-output``; the same
command resumes a stopped session, and with ``--survivors`` runs a finished one's
surviving mutants again against the current tests (after tests were added).
docs/testing.md records the scores and the survivors judged equivalent.

The mutants run in forked children of one process that imported torch and pytest once
(``--runner fork``, the default): the parent writes a mutant into the scratch copy on
disk (so processes a test starts see it too), forks, the child runs ``pytest -x`` on the
subset in-process and exits with pytest's status, and the parent puts the file back and
records the outcome in cosmic-ray's session database (``cr-report`` reads it as usual).
Tests that killed earlier mutants run first. ``--runner cosmic-ray`` runs
``cosmic-ray exec`` instead (a fresh interpreter per mutant: slower, same outcomes).
A mutant is killed when pytest fails (or errors, or the run exceeds ``--timeout``).
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# module -> (path, pytest arguments: the tests that exercise it); a subset of single-process
# tests keeps a mutant's run short
MODULES = {
    "config": ("tpkit/layout/config.py", ["tests/layout/test_config.py"]),
    # the single-process tests of every rank (the launched one checks the same seeds)
    "random": ("tpkit/layout/random.py", ["tests/layout/test_random.py", "-k", "not forked_masks"]),
    "cp": ("tpkit/cp/sharding.py", [
        "tests/cp/test_sharding.py", "--deselect",
        "tests/cp/test_sharding.py::test_unshard_roundtrip_and_grad",
        *(f"tests/nn/test_packed.py::test_{t}" for t in (
            "pack_sequences_rows_labels_positions", "per_document_layout", "packing_errors"))]),
    # the exact single-process checks against quantisers written in the tests
    "quantize": ("tpkit/fp8/quantize.py", [
        "tests/fp8/test_fp8_recipes.py", "tests/fp8/test_strength_fp8.py",
        "tests/fp8/test_fp8.py", "-k",
        "current_scale_formula or block_scaling_cast or mxfp8_cast or linear_matches_the_ref"
        " or backward_override or reference_quantiser or second_step_uses_the_delayed"
        " or fp8_linear_matches_manual or te_scales_against or quantize_helpers"]),
    "planning": ("tpkit/layout/planning.py", [
        "tests/layout/test_planning.py", "tests/cli/test_launch.py::test_dry_run_65536_ranks_summarises"]),
    "dcp_verify": ("tpkit/checkpoint/_dcp_verify.py", ["tests/checkpoint/test_dcp_verify.py"]),
    # the last wave's (issue 52): the single-process tests against references in the tests
    "order": ("tpkit/data/order.py", ["tests/data/test_order_epochs.py"]),
    "inference": ("tpkit/nn/inference.py", [
        "tests/nn/test_inference_offset.py",
        "tests/nn/test_inference.py::test_inference_params_refuses_what_does_not_fit"]),
    "flops": ("tpkit/observe/flops.py", [
        "tests/observe/test_observe_peaks.py", "tests/observe/test_observe_flops.py", "-k",
        "not bench_gpu"]),
    "findings": ("tpkit/verifier/findings.py", ["tests/verifier/test_compare_nonfinite.py"]),
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# imported once by the fork runner's parent; never tpkit (the children import the mutant)
PRELOAD = ("torch", "torch.distributed", "torch.nn.functional", "numpy", "pytest", "hypothesis")


def _copy_tree(tree: str) -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout.split()
    for f in files:
        os.makedirs(os.path.dirname(os.path.join(tree, f)) or tree, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(tree, f))


def _pytest_args(tests) -> list[str]:
    # plain asserts: pytest would rewrite (and, without bytecode, re-rewrite) every module
    return ["-x", "-q", "-p", "no:cacheprovider", "--assert=plain", *tests]


class _KillersFirst:
    """pytest plugin: the tests in ``first`` (most useful first) run before the rest; the
    first failing test's id is written to ``report``, and at the end the names of the
    modules imported from outside ``tree`` to ``report + ".modules"``."""

    def __init__(self, first, report, tree):
        self.rank = {nodeid: i for i, nodeid in enumerate(first)}
        self.report, self.tree = report, tree

    def pytest_sessionfinish(self):
        names = [name for name, m in list(sys.modules.items())
                 if not (getattr(m, "__file__", None) or "").startswith(self.tree)
                 and name.partition(".")[0] not in ("tpkit", "tests", "conftest", "__main__")]
        with open(self.report + ".modules", "w") as f:
            f.write("\n".join(names))

    def pytest_collection_modifyitems(self, items):
        items.sort(key=lambda item: self.rank.get(item.nodeid, len(self.rank)))

    def pytest_runtest_logreport(self, report):
        if report.failed and not os.path.exists(self.report):
            with open(self.report, "w") as f:
                f.write(report.nodeid)


def _run_child(tests, killers, report, log, tree) -> None:
    """In the forked child: its own process group, output to ``log``, pytest, exit."""
    code = 3
    try:
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        import pytest
        code = int(pytest.main(_pytest_args(tests), plugins=[_KillersFirst(killers, report, tree)]))
    except BaseException:  # noqa: BLE001 (report anything as a failed run)
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float):
    """The child's exit status, or None after killing its process group at ``timeout``."""
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                pid = None
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        return None
    finally:   # timed out, or the runner was stopped: the child and what it started go
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            os.waitpid(pid, 0)


def fork_exec(session: str, tree: str, tests, timeout: float, survivors: bool = False,
              limit: int | None = None) -> None:
    """Run every pending mutant of ``session`` in a forked child (see the module doc), and
    with ``survivors`` the surviving ones again; ``limit``: at most that many pending
    ones, spread evenly over the module (the rest stay pending for a resumed run)."""
    import importlib

    from cosmic_ray import plugins
    from cosmic_ray.mutating import use_mutation
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    os.chdir(tree)
    sys.path.insert(0, tree)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # put the module back first
    sys.dont_write_bytecode = True   # a mutant may keep the size and mtime second of another
    for name in PRELOAD:
        importlib.import_module(name)
    assert not any(m == "tpkit" or m.startswith("tpkit.") for m in sys.modules), \
        "the fork runner's parent must not import tpkit"
    scratch = tempfile.mkdtemp(prefix="mutant-")
    report, log = os.path.join(scratch, "killer"), os.path.join(scratch, "log")
    killers: list[str] = []   # tests that killed a mutant, the latest first

    def run(killers_now, limit):
        if os.path.exists(report):
            os.remove(report)
        pid = os.fork()
        if pid == 0:
            _run_child(tests, killers_now, report, log, tree)
        t0 = time.monotonic()
        code = _wait(pid, limit)
        with open(log, errors="replace") as f:
            output = f.read()[-20000:]
        killer = open(report).read() if os.path.exists(report) else None
        return code, output, killer, time.monotonic() - t0

    for attempt in ("cold", "warm"):
        # the first run lists the modules the tests import: the parent imports them too
        code, output, _, took = run([], 3600)
        if code != 0:
            raise SystemExit(f"the unmutated tree fails its tests (status {code}):\n{output}")
        print(f"unmutated tests pass in a forked child ({attempt}): {took:.1f} s", flush=True)
        with open(report + ".modules") as f:
            for name in f.read().split():
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 (a module that only imports in context)
                    pass
        assert not any(m.partition(".")[0] == "tpkit" for m in sys.modules)
    if timeout is None:
        timeout = 10 + 5 * took
        gc.freeze()   # the children's gc.collect() (pytest calls it 5 times) skips all that
    with use_db(session, WorkDB.Mode.open) as db:
        pending = sorted(db.pending_work_items, key=lambda w: w.job_id)
        if limit is not None and len(pending) > limit:   # 0: only the survivors again
            step = len(pending) / max(limit, 1)
            pending = [pending[int(i * step)] for i in range(limit)]
        if survivors:
            pending += [w for w, r in db.completed_work_items
                        if r.test_outcome == TestOutcome.SURVIVED]
        t_start = time.monotonic()
        for n, item in enumerate(pending, 1):
            (mutation,) = item.mutations
            operator = plugins.get_operator(mutation.operator_name)(**mutation.operator_args)
            with use_mutation(mutation.module_path, operator, mutation.occurrence) as (
                    before, after):
                if after is None:
                    db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.NO_TEST))
                    continue
                code, output, killer, took = run(killers, timeout)
            if code is None:
                outcome, output = TestOutcome.KILLED, "timeout"
            else:
                outcome = TestOutcome.SURVIVED if code == 0 else TestOutcome.KILLED
            if killer is not None:
                if killer in killers:
                    killers.remove(killer)
                killers.insert(0, killer)
            import difflib
            diff = "\n".join(difflib.unified_diff(
                before.split("\n"), after.split("\n"), str(mutation.module_path),
                str(mutation.module_path), lineterm=""))
            db.set_result(item.job_id, WorkResult(
                worker_outcome=WorkerOutcome.NORMAL, test_outcome=outcome,
                output=output, diff=diff))
            print(f"[{n}/{len(pending)}] {outcome.value:8} {took:5.1f} s "
                  f"{mutation.operator_name} #{mutation.occurrence} line "
                  f"{mutation.start_pos[0]}", flush=True)
        if pending:
            print(f"{len(pending)} mutants in {time.monotonic() - t_start:.0f} s", flush=True)
    shutil.rmtree(scratch)


def _annotation_spans(path: str) -> list[tuple]:
    """((line, col), (end_line, end_col)) of every annotation in the module at ``path``."""
    import ast
    spans = []
    for node in ast.walk(ast.parse(open(path).read())):
        notes = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            notes = [node.returns] + [x.annotation for x in (
                *a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None]
        elif isinstance(node, ast.AnnAssign):
            notes = [node.annotation]
        spans += [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset))
                  for n in notes if n is not None]
    return spans


def skip_annotation_mutants(session: str, path: str) -> int:
    """Mark the mutants of ``|`` inside annotations skipped: ``from __future__ import
    annotations`` keeps annotations as strings, so they are all equivalent. ``|`` in code
    (bit masks, boolean tensors) is mutated like any operator. Returns how many."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult
    spans = _annotation_spans(path)
    n = 0
    with use_db(session, WorkDB.Mode.open) as db:
        for item in db.pending_work_items:
            (m,) = item.mutations
            if m.operator_name.startswith("core/ReplaceBinaryOperator_BitOr_") and any(
                    a <= tuple(m.start_pos) < b for a, b in spans):
                db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
                n += 1
    return n


def score(session: str) -> str:
    """killed / (killed + survived) of the mutants that ran (skipped ones are not)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome
    with use_db(session, WorkDB.Mode.open) as db:
        ran = [r for _, r in db.completed_work_items
               if r.worker_outcome == WorkerOutcome.NORMAL]
        skipped = db.num_work_items - len(ran)
    survived = sum(r.test_outcome == TestOutcome.SURVIVED for r in ran)
    return (f"{len(ran)} mutants ran ({skipped} skipped), {survived} survived: score "
            f"{100 * (len(ran) - survived) / max(len(ran), 1):.1f} %")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("module", choices=sorted(MODULES))
    ap.add_argument("--keep", default=None, help="directory for the session and the copy")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per mutant (default: 10 s + 5 x the unmutated run)")
    ap.add_argument("--runner", choices=("fork", "cosmic-ray"), default="fork")
    ap.add_argument("--survivors", action="store_true",
                    help="with --keep: run a finished session's surviving mutants again, "
                         "against the checkout's current tests (after adding tests)")
    ap.add_argument("--limit", type=int, default=None,
                    help="run at most this many pending mutants, spread evenly over the "
                         "module (a time-boxed sample; resume later for the rest)")
    args = ap.parse_args()
    path, tests = MODULES[args.module]
    work = os.path.abspath(args.keep or tempfile.mkdtemp(prefix="tpkit-mutation-"))
    tree = os.path.join(work, "tree")
    session = os.path.join(work, "session.sqlite")
    fresh = not os.path.exists(session)   # an existing session resumes where it stopped
    if fresh:
        _copy_tree(tree)
    elif open(os.path.join(tree, path)).read() != open(os.path.join(ROOT, path)).read():
        raise SystemExit(f"{tree}/{path} differs from the checkout's: start a new session")
    elif args.survivors:
        _copy_tree(tree)   # the current tests (the module is the same)
    config = os.path.join(work, "cosmic-ray.toml")
    with open(config, "w") as f:
        f.write(f'[cosmic-ray]\nmodule-path = "{path}"\ntimeout = {args.timeout or 600}\n'
                f'excluded-modules = []\ntest-command = "{sys.executable} -m pytest '
                f'{" ".join(_pytest_args(tests))}"\n'
                '[cosmic-ray.distributor]\nname = "local"\n')
    os.environ.update(PYTHONPATH=tree, PYTHONDONTWRITEBYTECODE="1")
    if fresh:
        subprocess.run(["cosmic-ray", "init", config, session], cwd=tree, check=True)
        skip_annotation_mutants(session, os.path.join(tree, path))
    if args.runner == "fork":
        fork_exec(session, tree, tests, args.timeout, args.survivors, args.limit)
    else:
        subprocess.run(["cosmic-ray", "exec", config, session], cwd=tree, check=True)
    report = subprocess.run(["cr-report", session], check=True, capture_output=True, text=True)
    print(report.stdout)
    print(score(session))
    if not args.keep:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
