"""Test-session set-up: start from a clean environment. pyproject.toml's pytest
``pythonpath`` puts this checkout (its tpkit) and tests/ (the shared harness) first on
the path."""
import os

import pytest

# Layout variables from a surrounding tpkit-launch must not leak into tests (or workers).
for var in [v for v in os.environ if v.startswith("TPKIT_") and v not in (
        "TPKIT_DIST_TIMEOUT", "TPKIT_DIST_PG_TIMEOUT", "TPKIT_PG_TIMEOUT")]:
    del os.environ[var]
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(session, config, items):
    """Modules with a ``slow`` (process-starting) test first, each module's tests in their
    order, then the rest: under pytest-xdist (``-n 2 --dist loadfile``, pyproject.toml)
    a module is one unit of work handed to the next free worker in this order, so the long
    launched modules start early and the many short ones fill the gaps at the end instead of
    one worker finishing a long module alone."""
    slow = {item.module.__name__ for item in items
            if item.get_closest_marker("slow") is not None and hasattr(item, "module")}
    items.sort(key=lambda item: getattr(item, "module", None) is None
               or item.module.__name__ not in slow)   # stable: keeps the order within


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
