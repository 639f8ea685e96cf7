"""Mutation testing with cosmic-ray (``pip install cosmic-ray``), one module at a time.

    python tools/mutation.py config [--keep DIR]     # or: random, data, quantize, planning

Copies the tracked files to a scratch directory (cosmic-ray edits the module in place, so
the checkout stays untouched and tests may run meanwhile), runs every mutant of the
module against the test subset of MODULES, and prints cosmic-ray's report: the mutation
score is 100 % minus "surviving mutants". ``--keep DIR`` keeps the session database (and
the scratch copy) there for ``cr-report DIR/session.sqlite --show-output``.
docs/testing.md records the scores and the survivors judged equivalent.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

# module -> (path, the tests that exercise it); a subset keeps a mutant's run short
MODULES = {
    "config": ("tpkit/config.py", ["tests/test_config.py"]),
    "random": ("tpkit/random.py", ["tests/test_random.py"]),
    "data": ("tpkit/data.py", ["tests/test_data.py"]),
    "quantize": ("tpkit/fp8/quantize.py", ["tests/test_fp8.py", "tests/test_strength_fp8.py"]),
    "planning": ("tpkit/planning.py", ["tests/test_launch.py", "tests/test_topology.py"]),
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("module", choices=sorted(MODULES))
    ap.add_argument("--keep", default=None, help="directory for the session and the copy")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant")
    args = ap.parse_args()
    path, tests = MODULES[args.module]
    work = args.keep or tempfile.mkdtemp(prefix="tpkit-mutation-")
    tree = os.path.join(work, "tree")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout.split()
    for f in files:
        os.makedirs(os.path.dirname(os.path.join(tree, f)) or tree, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(tree, f))
    config = os.path.join(work, "cosmic-ray.toml")
    with open(config, "w") as f:
        f.write(f'[cosmic-ray]\nmodule-path = "{path}"\ntimeout = {args.timeout}\n'
                f'excluded-modules = []\ntest-command = "{sys.executable} -m pytest -x -q '
                f'-p no:cacheprovider {" ".join(tests)}"\n'
                '[cosmic-ray.distributor]\nname = "local"\n'
                # `|` appears only in annotations, which `from __future__ import
                # annotations` leaves as strings: every mutant of it is equivalent
                '[cosmic-ray.filters.operators-filter]\n'
                'exclude-operators = ["core/ReplaceBinaryOperator_BitOr_.*"]\n')
    session = os.path.join(work, "session.sqlite")
    env = dict(os.environ, PYTHONPATH=tree)
    for cmd in (["cosmic-ray", "init", config, session],
                ["cr-filter-operators", session, config],
                ["cosmic-ray", "exec", config, session]):
        subprocess.run(cmd, cwd=tree, env=env, check=True)
    report = subprocess.run(["cr-report", session], check=True, capture_output=True, text=True)
    print(report.stdout)
    if not args.keep:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
