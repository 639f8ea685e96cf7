"""The program tpkit-launch starts on every rank: runs the user's script (or ``-m`` module)
as ``__main__`` the way torchrun's ``@record`` decorator does (its documented equivalent:
fault handler on, uncaught exceptions written to torchrun's per-rank error file through
``get_error_handler()``), so the launcher can name the failing rank and its error. A plain ``ValueError`` (a user
error by tpkit's convention) is recorded but not printed: the launcher prints one line
for the job (``TPKIT_TRACEBACK=1`` prints every rank's traceback as well).

Torch is imported only when an exception has to be recorded, and tpkit-launch runs this
file by path (``python -u .../tpkit/cli/_worker.py script.py ARGS`` or
``... _worker.py -m package.module ARGS``) rather than ``-m tpkit.cli._worker``: a worker
pays nothing for the wrapper beyond what its own script imports.

When the script is done (returned or raised SystemExit), the wrapper destroys and frees
the process groups the script left (tpkit.layout.parallel_state.release_default_group): a gloo
worker thread still holding the last collective's tensors when the interpreter finalizes
aborts the process ("terminate called without an active exception") after a successful
run. When a group cannot be freed (the script's globals hold it), the process ends after
the atexit handlers without finalizing the interpreter (``os._exit``).

Once tpkit.recovery's hang watchdog has fired (``TPKIT_HANG_REPORTED``), an exception of
the main thread is a consequence of the hang (a peer left a collective): the wrapper does
not record it over the watchdog's report, which ends the process within seconds.
"""
import faulthandler
import os
import runpy
import sys


def main() -> None:
    faulthandler.enable(all_threads=True)  # what ErrorHandler.initialize() does
    # Only this process's own watchdog may set it: one inherited from the environment
    # would turn every error into a 60 s sleep with nothing recorded.
    os.environ.pop("TPKIT_HANG_REPORTED", None)
    argv = sys.argv[1:]
    exit_code = None
    try:
        try:
            if argv[:1] == ["-m"]:
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as e:
            exit_code = e.code   # leaving the block drops the script's frames with it
        if not _release_process_group():
            _exit_now(exit_code)
        if exit_code is not None:
            sys.exit(exit_code)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:   # torch's CheckpointException is a BaseException
        if os.environ.get("TPKIT_HANG_REPORTED"):
            # tpkit.recovery's hang watchdog fired and records the hang itself; this is a
            # consequence (a peer exited under a collective). Let it finish and exit.
            import time
            time.sleep(60)
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler
        get_error_handler().record_exception(e)
        if type(e) is ValueError and os.environ.get("TPKIT_TRACEBACK", "0").strip().lower() \
                in ("0", "false", "no", "off", ""):
            # A user error (tpkit's convention: ValueError naming the value and the fix):
            # the launcher prints the first failing rank's message as one line instead of
            # a traceback per rank; the traceback stays in the error file.
            sys.exit(1)
        raise


def _release_process_group() -> bool:
    """The script is done: free the process groups it left, if any (torch is not imported
    here when the script did not import torch.distributed). False when a group is still
    held (by the script's own globals, say) and its threads live on."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return True
    from tpkit.layout.parallel_state import release_default_group
    return release_default_group()


def _exit_now(code) -> None:
    """End the process as the interpreter would (atexit handlers, flushed streams, the
    exit code of ``sys.exit(code)``) but without finalizing it: a gloo group still alive
    then could abort the process (tpkit.layout.parallel_state.release_default_group)."""
    import atexit
    atexit._run_exitfuncs()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status & 0xFF)


if __name__ == "__main__":
    # sys.path[0] is this folder; make it what `python script.py` / `python -m` gives.
    sys.path[0] = os.getcwd() if sys.argv[1:2] == ["-m"] else \
        os.path.dirname(os.path.abspath(sys.argv[1]))
    main()
