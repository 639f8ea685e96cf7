"""Test-session set-up: start from a clean environment. pyproject.toml's pytest
``pythonpath`` puts this checkout (its tpkit) and tests/ (the shared harness) first on
the path."""
import os

# Layout variables from a surrounding tpkit-launch must not leak into tests (or workers).
for var in [v for v in os.environ if v.startswith("TPKIT_") and v not in (
        "TPKIT_DIST_TIMEOUT", "TPKIT_DIST_PG_TIMEOUT", "TPKIT_PG_TIMEOUT")]:
    del os.environ[var]
os.environ.setdefault("OMP_NUM_THREADS", "1")
