"""Test-session set-up: start from a clean environment. pyproject.toml's pytest
``pythonpath`` puts this checkout (its tpkit) and tests/ (the shared harness) first on
the path."""
import os

import pytest

# Layout variables from a surrounding tpkit-launch must not leak into tests (or workers);
# the test harness' own settings stay (TPKIT_SEEDS: where test_te_api_table finds TE's
# documentation pages when ../shared/seeds is not beside the checkout).
for var in [v for v in os.environ if v.startswith("TPKIT_") and v not in (
        "TPKIT_DIST_TIMEOUT", "TPKIT_DIST_PG_TIMEOUT", "TPKIT_PG_TIMEOUT", "TPKIT_SEEDS")]:
    del os.environ[var]
os.environ.setdefault("OMP_NUM_THREADS", "1")


# The longest test modules, longest first (wall time in a profiled serial run on the
# 2-core machine, docs/testing.md "What the suite's time is made of"): under pytest-xdist
# they start first, after the modules that read the shared launch (tests/shared.py's
# READERS, one unit of work, first). test_structure checks that each names a test module.
LONG_MODULES = ("test_userpath", "test_docs", "test_recovery", "test_compile",
                "test_gpu_tools", "test_train_data_launched",
                "test_verify", "test_launch_run", "test_models_hf", "test_launch_layout",
                "test_memory")


def pytest_configure(config):
    # pytest-xdist would hand out the modules with the most tests first; keep ours
    if getattr(config.option, "dist", None) == "loadfile":
        config.option.loadscopereorder = False


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with one change: the modules that read a shared launch
    (tests/shared.py's ``READERS``) are one unit of work, so one worker runs the launch
    and every test that reads it, and the other never waits for it."""
    if getattr(config.option, "dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling
    from shared import READERS

    class SharedLaunchScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/shared.py:READERS" if _name(path) in READERS else path
    return SharedLaunchScheduling(config, log)


def _name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def pytest_collection_modifyitems(session, config, items):
    """README's test command runs the suite on two pytest-xdist workers, a module one unit
    of work (``-n 2 --dist loadfile``: a module's shared launch runs once) handed to the
    next free worker in collection order. Reordered so the long modules start first, then
    the other modules with a ``slow`` (process-starting) test, then the rest, each module's
    tests in their order: the many short modules fill the gaps at the end instead of one
    worker finishing a long module alone."""
    def module(item) -> str:
        return getattr(getattr(item, "module", None), "__name__", "")

    slow = {module(item) for item in items if item.get_closest_marker("slow") is not None}

    from shared import READERS

    def rank(item):
        name = module(item)
        if name in READERS:   # one unit of work (see above), the longest: first
            return -1
        if name in LONG_MODULES:
            return LONG_MODULES.index(name)
        return len(LONG_MODULES) + (name not in slow)
    items.sort(key=rank)   # stable: each module's tests keep their order


def pytest_runtest_makereport(item, call):
    """Under CI (``CI=true``, .ci/run) a skip is a failure unless the test is ``-m gpu``:
    the test extra installs every optional package the suite uses (ray, onnx,
    transformers, ...), so a test skipped for a missing one there ran nowhere."""
    if call.excinfo is None or not call.excinfo.errisinstance(pytest.skip.Exception):
        return None
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes") or \
            item.get_closest_marker("gpu") is not None:
        return None
    from _pytest.reports import TestReport
    report = TestReport.from_item_and_call(item, call)
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI, where only -m gpu tests may skip: "
                       f"{call.excinfo.value}")
    return report
