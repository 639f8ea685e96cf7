"""Runs what tests/test_docs.py extracted from the Markdown, in a process of its own.

    python tests/doc_runner.py blocks BLOCKS.json RESULT.json   # single-process blocks
    tpkit-launch ... tests/doc_runner.py blocks BLOCKS.json -   # launched blocks, every rank
    python tests/doc_runner.py commands COMMANDS.json RESULT.json

``blocks``: each Python block runs as ``__main__`` in a fresh namespace (with its
``env``, when it has one, in the environment: the ``TPKIT_*`` its launch command exports,
where one launch runs the blocks of several), then ``tpkit.destroy_parallel()`` if the
block left a layout. Single-process runs record every
failure in RESULT; launched runs (RESULT ``-``) raise at the first one, naming the block,
so tpkit-launch stops every rank and prints it. ``commands``: tpkit-launch invocations
that start no worker (``--dry-run``, or a bad invocation exiting 2) run through
``tpkit.cli.launch.main``, the console script's function; for a dry run the script's own
``parse_args(argv)``, when it has one, checks the script arguments too.
"""
import contextlib
import importlib.util
import io
import json
import os
import sys
import traceback


class DocBlockError(RuntimeError):
    """A documentation block failed; the message names its file and line."""


def _prepare(code: str) -> None:
    if "import deepspeed" in code:
        # DeepSpeed JIT-compiles a CPU shared-memory op that training never uses; skip
        # the build as tests/integrations/test_deepspeed.py does (TPKIT_TEST_DS_SHM=1 keeps it).
        from test_deepspeed import _quiet_deepspeed
        _quiet_deepspeed()


def _cleanup() -> None:
    import tpkit
    if tpkit.is_initialized():
        tpkit.destroy_parallel()


def run_blocks(blocks: list[dict], result_path: str) -> int:
    failures = []
    launched_env = dict(os.environ)
    for block in blocks:
        try:
            _prepare(block["code"])
            # a launch shared by several launch commands: this block's command's TPKIT_*
            os.environ.update(block.get("env", {}))
            exec(compile(block["code"], block["where"], "exec"), {"__name__": "__main__"})
            _cleanup()
        except BaseException as e:  # noqa: BLE001 (SystemExit from a block is a failure too)
            if result_path == "-":
                raise DocBlockError(f"{block['where']}: {type(e).__name__}: {e}") from e
            failures.append({"where": block["where"], "error": traceback.format_exc()})
            with contextlib.suppress(Exception):
                _cleanup()
        finally:
            os.environ.clear()
            os.environ.update(launched_env)
    if result_path != "-":
        with open(result_path, "w") as f:
            json.dump({"ran": len(blocks), "failures": failures}, f)
    return 1 if failures else 0


def _script_parser_error(argv: list[str]) -> str | None:
    """The script's own parse_args(script_args) on a dry run; None when it accepts them."""
    from tpkit.cli.launch import build_parser
    args = build_parser().parse_args(argv)
    script = args.training_script
    if args.module or not script.endswith(".py"):
        return None
    spec = importlib.util.spec_from_file_location("_doc_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "parse_args"):
        return None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            module.parse_args(list(args.training_script_args))
    except SystemExit as e:
        return f"{script} rejects {args.training_script_args} (exit {e.code}): {err.getvalue()}"
    return None


def run_commands(commands: list[dict], result_path: str) -> int:
    from tpkit.cli.launch import main
    results = []
    for cmd in commands:
        saved = dict(os.environ)
        os.environ.update(cmd["env"])
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = main(cmd["argv"])
            script_error = _script_parser_error(cmd["argv"]) \
                if rc == 0 and "--dry-run" in cmd["argv"] else None
        except BaseException:  # noqa: BLE001
            rc, script_error = None, traceback.format_exc()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        results.append({"where": cmd["where"], "rc": rc, "stdout": out.getvalue(),
                        "stderr": err.getvalue(), "script_error": script_error})
    with open(result_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    kind, items_path, result = sys.argv[1:4]
    with open(items_path) as f:
        items = json.load(f)
    runner = {"blocks": run_blocks, "commands": run_commands}[kind]
    sys.exit(runner(items, result))
