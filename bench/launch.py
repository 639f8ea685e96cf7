"""Launcher overhead: wall time from start to exit of a 4-process gloo hello world started
by tpkit-launch vs plain torchrun, alternating in the same run; median of the repeats.

    python -m bench.launch [--repeats N]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import ROOT, fmt, table, write_section

HELLO = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.barrier()
dist.destroy_process_group()
"""
NPROC = 4


def _commands(script: str) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "tpkit-launch": [py, "-m", "tpkit.cli.launch", "--nproc-per-node", str(NPROC), script],
        "torchrun": [py, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", str(NPROC), script],
    }


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _time(cmd: list[str], env: dict) -> tuple[float, float]:
    """Wall seconds, and CPU seconds of the launcher and all its workers."""
    c0, t0 = _cpu(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    dt, dc = time.perf_counter() - t0, _cpu() - c0
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return dt, dc


def measure(repeats: int = 5) -> dict[str, list[tuple[float, float]]]:
    """Alternate the two launchers (one untimed warm-up each), ``repeats`` timed runs each."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPKIT_", "SLURM_", "PET_"))}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")  # same threads for both launchers
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "hello.py")
        with open(script, "w") as f:
            f.write(HELLO)
        cmds = _commands(script)
        for cmd in cmds.values():
            _time(cmd, env)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in cmds}
        for i in range(repeats):
            order = list(cmds) if i % 2 == 0 else list(cmds)[::-1]
            for name in order:
                times[name].append(_time(cmds[name], env))
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    times = measure(args.repeats)
    med = {n: [statistics.median(t[i] for t in times[n]) for i in (0, 1)] for n in times}
    rows = []
    for i, kind in enumerate(("wall time", "CPU time (launcher + workers)")):
        ours, peer = med["tpkit-launch"][i], med["torchrun"][i]
        print(f"[bench.launch] {kind}: tpkit-launch {ours:.3f} s, torchrun {peer:.3f} s, "
              f"ratio {ours / peer:.3f}", flush=True)
        rows.append(dict(what=f"{NPROC}-process gloo hello world, start to exit, {kind} "
                              f"(median of {args.repeats}, alternating)",
                         figure=f"tpkit-launch {fmt(ours, 's')}", peer=fmt(peer, "s"),
                         peer_name="torchrun --standalone", ratio=ours / peer,
                         target="<= 1.05" if i == 0 else ""))
    body = table(rows) + (
        "\n\ntpkit-launch runs torchrun's launcher in process; the extra work is the layout "
        "check, the TPKIT_* export and the `@record` worker wrapper (run by file path, so "
        "a script that does not import tpkit does not pay for it). CPU time is the steadier "
        "figure on a shared machine.")
    write_section("launch", "Launcher overhead", body)


if __name__ == "__main__":
    main()
