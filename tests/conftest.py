"""Test-session set-up: import tpkit from this checkout, start from a clean environment."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

# Layout variables from a surrounding tpkit-launch must not leak into tests (or workers).
for var in [v for v in os.environ if v.startswith("TPKIT_") and v not in (
        "TPKIT_DIST_TIMEOUT", "TPKIT_DIST_PG_TIMEOUT", "TPKIT_PG_TIMEOUT")]:
    del os.environ[var]
os.environ.setdefault("OMP_NUM_THREADS", "1")
