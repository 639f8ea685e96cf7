"""Shared benchmark helpers: timing with medians, machine naming, BENCHMARKS.md sections.

Every benchmark writes rows of (what, figure, peer or limit measured in the same run,
ratio) into its own marked section of BENCHMARKS.md, so benchmarks can be rerun one at
a time (``python -m bench.<name>``) or all together (``python -m bench``).
"""
from __future__ import annotations

import os
import platform
import re
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS_MD = os.path.join(ROOT, "BENCHMARKS.md")


def machine() -> str:
    """A short description of this machine: CPU model and cores, or the GPU."""
    try:
        import torch
        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
        tv = f", torch {torch.__version__}"
    except ImportError:  # pragma: no cover
        tv = ""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores{tv}"


def median_time(fn, *, warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of ``fn()`` in seconds after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fmt(x: float, unit: str = "") -> str:
    if unit == "ms":
        return f"{x * 1e3:.2f} ms"
    if unit == "s":
        return f"{x:.2f} s"
    if unit == "MiB":
        return f"{x / 2**20:.1f} MiB"
    return f"{x:.4g}{(' ' + unit) if unit else ''}"


def table(rows: list[dict]) -> str:
    """Markdown table of rows with keys: what, figure, peer, peer_name, ratio, target."""
    out = ["| what | figure | peer / limit (same run) | ratio | target |",
           "| --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['what']} | {r['figure']} | {r['peer_name']}: {r['peer']} | "
                   f"{r['ratio']:.3f} | {r.get('target', '')} |")
    return "\n".join(out)


def write_section(name: str, title: str, body: str) -> None:
    """Replace (or append) the section ``name`` of BENCHMARKS.md with ``title`` + ``body``."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n## {title}\n\n{body.strip()}\n\n_machine: {machine()}; " \
            f"written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}_\n{end}"
    text = ""
    if os.path.exists(BENCHMARKS_MD):
        with open(BENCHMARKS_MD) as f:
            text = f.read()
    if not text:
        text = "# Benchmarks\n\nEach row compares a figure with a peer or limit measured in " \
               "the same run; `python -m bench` writes the CPU sections.\n"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(BENCHMARKS_MD, "w") as f:
        f.write(text)


def _tp2_rank(rank: int, port: int, queue, fn, args) -> None:
    # spawn gives this process the parent's sys.path (ROOT: python -m bench.NAME)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    import tpkit
    tpkit.init_parallel(tp=2, backend="gloo", seed=1234)
    try:
        res = fn(*args)
    finally:
        tpkit.destroy_parallel()
    if rank == 0:
        queue.put(res)


def run_tp2(fn, *args):
    """``fn(*args)`` on 2 spawned gloo processes (1 thread each) at tp=2; rank 0's result.
    ``fn`` must be a module-level function (it is pickled)."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_tp2_rank, args=(port, queue, fn, args), nprocs=2,
                       start_method="spawn")
    return queue.get()


def gloo_rank(rank: int, world: int, port: int) -> None:
    """In a spawned benchmark rank: one thread, the default gloo group on localhost."""
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def token_batch(state, batch: int, seq: int, vocab: int = 256, seed: int = 1):
    """This data-parallel rank's contiguous share of a random ``[batch, seq]`` token batch
    and its next-token targets (the same global batch at every layout)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    rows = slice(state.dp_rank * batch // state.dp_size,
                 (state.dp_rank + 1) * batch // state.dp_size)
    return x[rows, :-1].contiguous(), x[rows, 1:].contiguous()


def spawn(worker, world: int, *args):
    """``worker(rank, world, port, *args, queue)`` on ``world`` spawned processes; the one
    value rank 0 puts on the queue."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = mp.get_context("spawn").Queue()
    mp.start_processes(worker, args=(world, port, *args, q), nprocs=world,
                       start_method="spawn")
    return q.get()


def median_step(step, warmup: int, iters: int) -> float:
    """Median wall time of ``step()`` over ``iters`` calls after ``warmup``, every rank
    starting and ending each call together (barriers, outside the timed region's ends)."""
    import torch.distributed as dist
    times = []
    for _ in range(warmup + iters):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return sorted(times[warmup:])[iters // 2]


def interleaved_rounds(steps: dict, warmup: int, rounds: int) -> dict[str, list[float]]:
    """Wall times of every step in ``steps`` (name -> callable), run in turn once per
    round for ``warmup + rounds`` rounds, so all of them see the same load at the same
    moment; every rank starts and ends each call together (barriers outside the timed
    region). Returns name -> the times of every round, the warmup rounds first (a
    compile's first step is among them); ``round_medians`` reads them."""
    import torch.distributed as dist
    times = {name: [] for name in steps}
    for _ in range(warmup + rounds):
        for name, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    return times


def round_medians(times: dict[str, list[float]], warmup: int, peer: str | None = None):
    """(name -> median time after ``warmup`` rounds, name -> median of the per-round
    ratios to ``peer``'s time in the same round). A ratio taken round by round, like for
    like, is steadier under a shared machine's load than the ratio of two medians."""
    med = {k: statistics.median(v[warmup:]) for k, v in times.items()}
    ratios = {}
    if peer is not None:
        for k, v in times.items():
            ratios[k] = statistics.median(a / b for a, b in zip(v[warmup:], times[peer][warmup:]))
    return med, ratios
