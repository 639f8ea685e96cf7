"""The script's own checks, run by tpkit-launch once, before any worker starts.

A script opts in by defining, at module level::

    def tpkit_preflight(argv: list[str], launch) -> None:
        ...   # raise ValueError (or exit through argparse) to refuse the launch

tpkit-launch finds the function by parsing the script's source (``ast``; nothing runs for
scripts without it), imports the script under another name than ``__main__`` (so its
``if __name__ == "__main__":`` block does not run) and calls it with the script's
arguments and a :class:`LaunchInfo`: the layout ``init_parallel()`` will build with no
arguments (dp resolved), the world, and the workers' environment. A ValueError, or
argparse's ``error()``, becomes ``tpkit-launch: error: SCRIPT: ...`` and exit 2 with no
worker started; argparse's ``--help`` prints once and exits 0. Elastic launches call it
once per node count ``--nnodes MIN:MAX`` allows. It may return the layout its workers will
build (a ``tpkit.layout.config.Layout``, e.g. from the script's own ``--tp``: tpkit-launch then
launches, prints and exports that one, so the dry run describes the job that runs) and a
``tpkit.memory.MemoryJob`` (the model and batch it will train: tpkit-launch then estimates
every rank's memory, tpkit.cli.memory), either or both (a tuple). See docs/launch.md
"Pre-flight checks" and "Memory".
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import io
import os
import sys
from typing import Mapping

HOOK = "tpkit_preflight"
ARGPARSE_OWN = ("argument ", "unrecognized arguments", "the following arguments are required",
                "ambiguous option", "expected ")


class PreflightError(ValueError):
    """The script refused the launch, or cannot run at all; tpkit-launch exits 2."""


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """What a launch will be, as a script's pre-flight sees it."""

    config: object              # tpkit.ParallelConfig, dp resolved: init_parallel()'s layout
    world_size: int
    nproc_per_node: int
    nnodes: int
    env: Mapping[str, str]      # the workers' environment: this one plus the TPKIT_* exports
    dry_run: bool               # --dry-run: files the job would find may not exist yet


def _module_source(name: str) -> str | None:
    """The source file ``python -m name`` would run, found without running any code
    (parent packages are not imported); PreflightError when there is none."""
    parts = name.split(".")
    cwd = os.getcwd()
    sys.path.insert(0, cwd)   # the workers run -m from the current directory
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path.remove(cwd)
    for i, part in enumerate(parts[1:], 1):
        if spec is None or spec.submodule_search_locations is None:
            break
        spec = importlib.machinery.PathFinder.find_spec(part, spec.submodule_search_locations)
        if spec is None:
            name_missing = ".".join(parts[:i + 1])
            raise PreflightError(
                f"-m {name}: no module named {name_missing!r}; check the name (the workers "
                f"run it from {cwd}, with PYTHONPATH)")
    if spec is None:
        raise PreflightError(
            f"-m {name}: no module named {parts[0]!r} on the workers' path (the current "
            f"directory {cwd}, PYTHONPATH, site-packages); check the name, run tpkit-launch "
            "from the directory that holds it, or add that directory to PYTHONPATH")
    if spec.submodule_search_locations is not None:   # a package runs its __main__
        main = importlib.machinery.PathFinder.find_spec("__main__",
                                                        spec.submodule_search_locations)
        if main is None:
            raise PreflightError(f"-m {name}: {name!r} is a package without __main__.py, so "
                                 "it cannot be run; pass the module inside it to run")
        spec = main
    origin = spec.origin
    return origin if origin and origin.endswith(".py") and os.path.isfile(origin) else None


def script_source(script: str) -> str:
    """The file ``python script`` runs (a directory runs its ``__main__.py``), or
    PreflightError naming what is wrong with ``script``."""
    if os.path.isdir(script):
        main = os.path.join(script, "__main__.py")
        if not os.path.isfile(main):
            raise PreflightError(f"training script {script!r} is a directory without "
                                 "__main__.py; pass the .py file inside it to run")
        return main
    if not os.path.isfile(script):
        raise PreflightError(f"training script {script!r} does not exist (looked in "
                             f"{os.getcwd()}); pass the path of a .py file")
    return script


def find_hook(args) -> str | None:
    """The source file of the script or module tpkit-launch was given, if it defines
    ``tpkit_preflight`` at module level; PreflightError for a missing script or module,
    or a syntax error (every worker would fail on it)."""
    source = _module_source(args.training_script) if args.module \
        else script_source(args.training_script)
    if source is None:
        return None
    try:
        with open(source, "rb") as f:
            tree = ast.parse(f.read(), source)
    except SyntaxError as e:
        raise PreflightError(f"{source} line {e.lineno}: SyntaxError: {e.msg}; fix the "
                             "script") from None
    except (OSError, ValueError):
        return None   # not Python source we can read (a binary, a zip): the workers decide
    return source if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and n.name == HOOK for n in tree.body) else None


def _load(args, source: str):
    if args.module:   # a package runs its __main__, which holds the hook (find_hook)
        main = os.path.basename(source) == "__main__.py"
        return importlib.import_module(args.training_script + (".__main__" if main else ""))
    spec = importlib.util.spec_from_file_location("__tpkit_preflight__", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_hook(args, source: str, infos: list[LaunchInfo], jobs: list | None = None,
             layouts: list | None = None) -> str | None:
    """Import the script and call its hook for every ``LaunchInfo``. Returns None when it
    accepts the launch, or the text to print when it answered instead (``--help``);
    PreflightError when it refuses. What the hook returns for each is appended: a
    ``tpkit.memory.MemoryJob`` (the model and batch the launch trains, for the memory
    estimate) to ``jobs``, a ``tpkit.layout.config.Layout`` (the layout its workers build) to
    ``layouts``."""
    name = args.training_script
    argv = list(args.training_script_args)
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [source, *argv]
    sys.path.insert(0, os.getcwd() if args.module else os.path.dirname(os.path.abspath(source)))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            hook = getattr(_load(args, source), HOOK)
            for info in infos:
                _collect(hook(argv, info), info, jobs, layouts)
    except SystemExit as e:
        if e.code in (0, None):
            return out.getvalue() + err.getvalue()
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        why = lines[-1].split(": error: ", 1)[-1] if lines else f"exit code {e.code}"
        if why.startswith(ARGPARSE_OWN):   # argparse's words name the value, not the fix
            why += f"; see {name} --help"
        raise PreflightError(f"{name}: {why}") from None
    except ValueError as e:
        raise PreflightError(f"{name}: {e}") from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    sys.stdout.write(out.getvalue())
    sys.stderr.write(err.getvalue())
    return None


def _collect(answer, info: LaunchInfo, jobs: list | None, layouts: list | None) -> None:
    """Sort what one hook call returned into ``jobs`` and ``layouts``."""
    from tpkit.layout.config import Layout
    from tpkit.memory import MemoryJob
    for item in answer if isinstance(answer, tuple) else (answer,):
        if item is None:
            continue
        if isinstance(item, MemoryJob):
            if jobs is not None:
                jobs.append(item)
        elif isinstance(item, Layout):
            if item.world_size != info.world_size:
                raise PreflightError(
                    f"{HOOK} returned a layout of {item.world_size} ranks ({item.sizes()}) "
                    f"for a launch of {info.world_size}; return launch.config's world")
            if layouts is not None:
                layouts.append(item)
        else:
            raise PreflightError(
                f"{HOOK} returned {type(item).__name__}; it returns None, a tpkit.layout.config."
                "Layout (the layout its workers build), a tpkit.memory.MemoryJob (the model "
                "for the memory estimate) or a tuple of both")
