"""Run tpkit's test suite against chosen dependency versions, each set in a throw-away venv.

This is how the floors in pyproject.toml were found (README, "Supported versions").
From the repository root::

    nice -n 19 python tools/floors.py "torch==2.10.0 lightning==2.4.0 deepspeed==0.16.0" \\
        "torch==2.9.1" [-- PYTEST_ARGS]
    python tools/floors.py --te 2.1.0 2.2.0

Each positional argument is one candidate set: requirements separated by spaces or commas.
For each set, one at a time, the script

1. creates a venv in a new temporary directory (deleted afterwards unless ``--keep``);
2. pip-installs the set together with tpkit's own dependencies that the set does not name
   (as pyproject.toml declares them) and the ``test`` extra; optional packages such as
   ``deepspeed`` are installed only when the set names them (their tests skip otherwise);
3. installs this checkout in editable mode with ``--no-deps``, so that a set below the
   declared floors can be tried;
4. runs ``python -m pytest`` (the whole suite, or PYTEST_ARGS given after ``--``) from the
   repository root with the venv first on PATH and PYTHONPATH unset, so the launched
   ``tpkit-launch`` processes use the venv too;

then prints a table: the set, the versions pip installed, pytest's summary line, the time
and PASS/FAIL. The exit status is 1 when any set failed.

``--te VERSION ...`` runs tests/te/test_te_contract.py once per Transformer Engine release with
``TE_CONTRACT_VERSION`` set (in this interpreter, no venv: TE's wheel is only parsed, since
TE does not run on CPU): what tpkit passes to TE is checked against that release's sources.

Notes: PyPI's Linux torch wheels are CUDA builds; their nvidia-* dependencies (several GB
per venv, shared through pip's cache) make them import and run on a CPU-only machine. A pip
configuration that caps versions (a constraint file) applies inside the venvs too;
``PIP_CONFIG_FILE=/dev/null`` ignores it. Transformer Engine does not run on CPU: its floor
is checked against its sources instead (``--te``).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHOWN = ("torch", "lightning", "deepspeed", "pytest")


def _name(req: str) -> str:
    """The distribution name of a requirement string, normalised."""
    return re.split(r"[<>=!~\[; ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def requirements(candidate: list[str]) -> list[str]:
    """The candidate set plus tpkit's dependencies and test extra it does not name."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    named = {_name(r) for r in candidate}
    rest = project["dependencies"] + project["optional-dependencies"]["test"]
    return candidate + [r for r in rest if _name(r) not in named]


def _run(cmd: list[str], log: str, **kw) -> int:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, **kw).returncode


def try_set(candidate: list[str], pytest_args: list[str], keep: bool, python: str) -> dict:
    tmp = tempfile.mkdtemp(prefix="tpkit-floors-")
    venv, log = os.path.join(tmp, "venv"), os.path.join(tmp, "log.txt")
    py = os.path.join(venv, "bin", "python")
    row = {"set": " ".join(candidate), "installed": "", "summary": "", "seconds": 0.0,
           "ok": False, "dir": tmp}
    try:
        steps = [[python, "-m", "venv", venv],
                 [py, "-m", "pip", "install", "-q", *requirements(candidate)],
                 [py, "-m", "pip", "install", "-q", "--no-deps", "-e", ROOT]]
        for cmd in steps:
            if _run(cmd, log) != 0:
                row["summary"] = f"install failed: {' '.join(cmd[3:])[:60]}"
                with open(log) as f:
                    print(f.read()[-3000:])
                return row
        probe = ("import importlib.metadata as m\nfor n in %r:\n    try: print(n, m.version(n))"
                 "\n    except m.PackageNotFoundError: pass" % (SHOWN,))
        row["installed"] = ", ".join(
            line.replace(" ", "=") for line in subprocess.run(
                [py, "-c", probe], capture_output=True, text=True).stdout.split("\n") if line)
        print(f"[floors] {row['set']}: installed {row['installed']}; running pytest", flush=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env.get("PATH", "")
        env["VIRTUAL_ENV"] = venv
        t0 = time.perf_counter()
        proc = subprocess.Popen([py, "-m", "pytest", *pytest_args], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        summary = ""
        for line in proc.stdout:
            sys.stdout.write(line)
            if re.search(r"\d+ (passed|failed|error)", line):
                summary = line.strip().strip("=").strip()
        rc = proc.wait()
        row.update(seconds=time.perf_counter() - t0, summary=summary or f"pytest exit {rc}",
                   ok=rc == 0)
        return row
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def try_te(version: str) -> dict:
    env = dict(os.environ, TE_CONTRACT_VERSION=version)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/te/test_te_contract.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    failures = [line[2:].strip() for line in proc.stdout.splitlines() if line.startswith("E   ")]
    lines = proc.stdout.strip().splitlines()
    return {"set": f"transformer-engine=={version} (sources)", "installed": "",
            "summary": (lines[-1].strip("= ") if lines else "no output")
            + (f": {failures[0]}" if failures else ""),
            "seconds": time.perf_counter() - t0, "ok": proc.returncode == 0, "dir": ""}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pytest_args = ["-q", "-p", "no:cacheprovider"]
    if "--" in argv:
        i = argv.index("--")
        argv, pytest_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sets", nargs="*", help='candidate sets, e.g. "torch==2.10.0 lightning==2.4.0"')
    p.add_argument("--te", nargs="+", default=[], metavar="VERSION",
                   help="Transformer Engine releases to check tests/te/test_te_contract.py against")
    p.add_argument("--keep", action="store_true", help="keep each venv and its install log")
    p.add_argument("--python", default=sys.executable, help="interpreter the venvs are made from")
    args = p.parse_args(argv)
    if not args.sets and not args.te:
        p.error("give at least one candidate set or --te VERSION")
    rows = [try_set(s.replace(",", " ").split(), pytest_args, args.keep, args.python)
            for s in args.sets] + [try_te(v) for v in args.te]
    print("\n| set | installed | pytest | s | result |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['set']} | {r['installed']} | {r['summary']} | {r['seconds']:.0f} | "
              f"{'PASS' if r['ok'] else 'FAIL'} |" + (f" (kept in {r['dir']})" if args.keep and r["dir"] else ""))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
