"""The program tpkit-launch starts on every rank: runs the user's script (or ``-m`` module)
as ``__main__`` inside torchrun's ``@record``, so an exception in any rank is written to
torchrun's per-rank error file and the launcher can name the rank and the error.

Usage (done by tpkit-launch, not by users): ``python -m tpkit.cli._worker script.py ARGS``
or ``python -m tpkit.cli._worker -m package.module ARGS``.
"""
import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["-m"]:
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        sys.path[0] = os.getcwd()  # as `python -m module` does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = argv[0], argv[1:]
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` does
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
