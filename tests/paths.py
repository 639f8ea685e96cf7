"""Where the suite's files are: the checkout, tests/ (the shared harness: this folder's
modules, launch_scripts/, fake_te/) and the test folders that mirror tpkit/'s packages.
``PYTHONPATH`` is what a launched worker needs to import all of them by name, as pytest
does (pyproject.toml's ``pythonpath`` lists the same folders)."""
import os

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
SCRIPTS = os.path.join(TESTS, "launch_scripts")
SUBDIRS = ("checkpoint", "cli", "comm", "cp", "data", "distributed", "fabric", "fp8",
           "integrations", "layout", "memory", "models", "nn", "observe", "plans", "recovery",
           "te", "train", "verifier")
PYTHONPATH = os.pathsep.join([ROOT, TESTS] + [os.path.join(TESTS, d) for d in SUBDIRS])
