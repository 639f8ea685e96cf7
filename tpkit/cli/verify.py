"""``tpkit-verify MODULE:FUNCTION --layouts 2x1x1,2x2x1+sp,1x2x2``: prove a model's
parallelization on CPU before it runs on GPUs (tpkit.verify; docs/verify.md).

``FUNCTION()`` builds the model; the batch comes from ``--batch MODULE:FUNCTION`` (default:
the same module's ``make_batch``), the plan from ``--plan MODULE:NAME`` (a Plan, or a
function returning one; default: the model's ready plan, or none for a model built from
tpkit's layers), the optimizer from ``--optimizer MODULE:FUNCTION`` (``f(model)``; default
SGD). MODULE is an importable module (the current directory is on the path) or a ``.py``
file. Exit 0 when every layout agrees with the reference (one line per layout), 1 when
one does not (the first module that differs, with a hint), 2 for a bad argument.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

PROG = "tpkit-verify"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODULE:FUNCTION", help="builds the model (no arguments)")
    p.add_argument("--batch", metavar="MODULE:FUNCTION",
                   help="make_batch(step) -> the full batch (default: MODULE's make_batch)")
    p.add_argument("--plan", metavar="MODULE:NAME", help="the tpkit.parallelize plan")
    p.add_argument("--optimizer", metavar="MODULE:FUNCTION", help="optimizer(model)")
    p.add_argument("--layouts", default="2x1x1,2x2x1+sp,1x2x2",
                   help="TPxCPxDP[+sp], comma-separated (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (default: 3)")
    p.add_argument("--precision", default="32", choices=("32", "bf16-mixed"))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds each layout's processes may take (default: 300)")
    return p


def _load(ref: str, flag: str):
    """``module:attr`` -> the attribute (ValueError naming the flag and the fix)."""
    module, sep, attr = ref.rpartition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{flag} {ref!r}: write MODULE:NAME (e.g. mymodel:build)")
    try:
        if module.endswith(".py"):
            if not os.path.isfile(module):
                raise ValueError(f"{flag} {ref!r}: no file {module!r}")
            spec = importlib.util.spec_from_file_location(
                os.path.splitext(os.path.basename(module))[0], module)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{flag} {ref!r}: cannot import {module!r} ({e}); run from the "
                         "directory that holds it or give a .py path") from None
    if not hasattr(mod, attr):
        raise ValueError(f"{flag} {ref!r}: {module!r} has no {attr!r}")
    return getattr(mod, attr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from tpkit.plans import Plan
        from tpkit.verifier import parse_layouts, verify
        layouts = parse_layouts(args.layouts, "--layouts")
        build = _load(args.model, "MODULE:FUNCTION")
        module = args.model.rpartition(":")[0]
        batch = _load(args.batch or f"{module}:make_batch",
                      "--batch" if args.batch else "--batch (default: MODULE's make_batch)")
        plan = _load(args.plan, "--plan") if args.plan else None
        if plan is not None and not isinstance(plan, (Plan, dict)) and callable(plan):
            plan = plan()
        opt = _load(args.optimizer, "--optimizer") if args.optimizer else None
        report = verify(build, batch, layouts=layouts, steps=args.steps, plan=plan,
                        optimizer=opt, precision=args.precision, seed=args.seed,
                        timeout=args.timeout)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(report, flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
