"""``verify(build_model, make_batch, layouts=...)``: the reference in one process, then each
layout on CPU with gloo (one set of processes per layout, started here), compared.

The processes are forked from the caller (they start in milliseconds, and
``build_model`` / ``make_batch`` may be defined anywhere: a script, a notebook, a test);
a process group or layout the caller has is forgotten in them. A platform without fork
is refused (ValueError).
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import re
import time
import traceback
from datetime import timedelta

from ..layout.config import ParallelConfig

__all__ = ["Layout", "parse_layouts", "verify", "Report", "LayoutResult", "DEFAULT_LAYOUTS",
           "PRECISIONS", "verify_all"]

DEFAULT_LAYOUTS = ("2x1x1", "2x2x1+sp", "1x2x2")
PRECISIONS = ("32", "bf16-mixed")
_LAYOUT = re.compile(r"^(\d+)x(\d+)x(\d+)((?:\+\w+)*)$")


@dataclasses.dataclass(frozen=True)
class Layout:
    """``TPxCPxDP[+sp]``: tensor, context and data parallel sizes, ``+sp`` for sequence
    parallelism (needs tp > 1)."""
    tp: int
    cp: int
    dp: int
    sp: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp

    def __str__(self) -> str:
        return f"{self.tp}x{self.cp}x{self.dp}" + ("+sp" if self.sp else "")

    def config(self) -> ParallelConfig:
        return ParallelConfig(tp=self.tp, cp=self.cp, dp=self.dp, sequence_parallel=self.sp)


def parse_layouts(spec, where: str = "layouts") -> list[Layout]:
    """``"2x1x1,2x2x1+sp"`` or a list of such strings -> Layouts (ValueError naming the
    bad one and ``where`` it came from)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for item in items:
        text = str(item).strip()
        m = _LAYOUT.match(text)
        opts = m.group(4).split("+")[1:] if m else []
        bad = [o for o in opts if o != "sp"]
        if not m or bad:
            raise ValueError(f"{where}: {text!r} is not a layout; write TPxCPxDP with an "
                             "optional +sp, e.g. 2x1x1, 2x2x1+sp, 1x2x2 (pipeline and expert "
                             "parallelism are not verified yet)")
        layout = Layout(int(m.group(1)), int(m.group(2)), int(m.group(3)), "sp" in opts)
        if min(layout.tp, layout.cp, layout.dp) < 1:
            raise ValueError(f"{where}: {text!r} has a size below 1")
        if layout.sp and layout.tp == 1:
            raise ValueError(f"{where}: {text!r} asks for sequence parallelism at tp=1; "
                             "use tp >= 2 with +sp")
        layout.config().validate(layout.world)
        out.append(layout)
    if not out:
        raise ValueError(f"{where}: no layout given; e.g. 2x1x1,2x2x1+sp,1x2x2")
    return out


@dataclasses.dataclass
class LayoutResult:
    layout: Layout
    ok: bool
    text: str
    seconds: float
    findings: list


@dataclasses.dataclass
class Report:
    """What ``verify`` found: ``ok`` when every layout agrees with the reference; ``str()``
    is the report (one line per layout when all agree)."""
    results: list
    seconds: float
    tolerance: str

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def __str__(self) -> str:
        lines = [r.text for r in self.results]
        lines.append(f"{'verified' if self.ok else 'FAILED'}: {len(self.results)} layout(s) "
                     f"in {self.seconds:.1f} s ({self.tolerance})")
        return "\n".join(lines)


def _sgd(model):
    import torch
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _forget_parent_groups() -> None:
    """In a forked rank: the caller's process group and layout (a notebook's
    ``init_parallel()``, a launched script's) are copies whose threads did not come along;
    start from none. torch has no public call for this: its world record is replaced (the
    copies are never used nor destroyed: the rank ends with os._exit)."""
    import torch.distributed.distributed_c10d as c10d

    from ..layout.topology import set_parallel_state
    if c10d.is_initialized():
        c10d._world = c10d._World()
    set_parallel_state(None)


def _entry(rank, layout, port, jobs, full_sds, send, fork, go=None):
    """One rank: the default gloo group, the layout, run_rank for every job (a job that
    raises is answered with its traceback); ``send(bytes)`` the results to the parent.
    ``go``: an event the parent sets once every rank is forked; nothing here touches a
    socket before it (see _forked)."""
    if go is not None and not go.wait(timeout=120):
        send(pickle.dumps(("err", f"rank {rank}: the parent did not finish forking the "
                                  "ranks within 120 s")))
        os._exit(0)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(layout.world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(layout.world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    ok = False
    try:
        import torch
        import torch.distributed as dist

        from ..layout.parallel_state import destroy_parallel, init_parallel
        from .record import run_rank
        if fork:
            _forget_parent_groups()
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, layout.world, is_master=False,
                              timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=layout.world,
                                timeout=timedelta(seconds=jobs[0]["timeout"]))
        state = init_parallel(config=layout.config(), backend="gloo", seed=jobs[0]["seed"])
        results = []
        for job, full_sd in zip(jobs, full_sds):
            try:
                results.append(("ok", run_rank(job, state, full_sd)))
            except Exception:  # noqa: BLE001 - reported for this job
                results.append(("err", traceback.format_exc()))
        reply = ("ok", results)
        ok = True
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        reply = ("err", traceback.format_exc())
    try:
        send(pickle.dumps(reply))
    except BaseException:  # noqa: BLE001
        send(pickle.dumps(("err", traceback.format_exc())))
    if ok:
        destroy_parallel()
    if fork:
        os._exit(0)


def _forked(layout, port, jobs, full_sds, deadline):
    """The ranks forked from this process; yields (rank, reply bytes or None).

    Every rank waits on ``go`` until all are forked: a rank that connected at once made
    the parent's TCPStore server thread resolve its address (getnameinfo) while the next
    rank was being forked, and that child inherited glibc's resolver lock held, hanging
    in its own getnameinfo for good (seen: ranks stuck in ``__resolv_context_get``)."""
    ctx = mp.get_context("fork")
    go = ctx.Event()
    procs, waiting = [], {}
    for rank in range(layout.world):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_entry, daemon=True,
                        args=(rank, layout, port, jobs, full_sds, child.send_bytes, True, go))
        p.start()
        child.close()
        procs.append(p)
        waiting[rank] = parent
    go.set()
    try:
        while waiting:
            ready = mp.connection.wait(list(waiting.values()),
                                       timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                yield sorted(waiting), None
                return
            for rank in [r for r, c in waiting.items() if c in ready]:
                try:
                    data = waiting.pop(rank).recv_bytes()
                except EOFError:
                    data = None
                yield rank, data
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _run_layout(layout: Layout, jobs: list, full_sds: list, timeout: float) -> list:
    """[job][rank] -> ("ok", result) or ("err", traceback); RuntimeError when a rank
    failed outside the jobs, TimeoutError naming the ranks that did not answer."""
    import torch.distributed as dist
    if "fork" not in mp.get_all_start_methods():
        raise ValueError("tpkit.verify forks its ranks from this process, and this platform "
                         "cannot fork; run it on Linux")
    store = dist.TCPStore("127.0.0.1", 0, layout.world + 1, is_master=True,
                          wait_for_workers=False, timeout=timedelta(seconds=60))
    results = [None] * layout.world
    ranks = _forked(layout, store.port, jobs, full_sds, time.monotonic() + timeout)
    try:
        for rank, data in ranks:
            if isinstance(rank, list):
                raise TimeoutError(f"ranks {rank} did not finish within {timeout:.0f} s "
                                   "(timeout=)")
            status, value = pickle.loads(data) if data is not None else \
                ("err", f"rank {rank} exited without a result")
            if status == "err":
                raise RuntimeError(f"rank {rank}:\n{value}")
            results[rank] = value
    finally:
        ranks.close()
        del store
    return [[results[r][j] for r in range(layout.world)] for j in range(len(jobs))]


def _failed(layout, replies) -> str | None:
    """The first failing rank's error, as one line, or None."""
    for rank, (status, value) in enumerate(replies):
        if status == "err":
            lines = [ln for ln in value.strip().splitlines() if ln.strip()]
            return f"{layout}: FAILED on rank {rank}: {lines[-1] if lines else value}"
    return None


def _check_fn(fn, name):
    if not callable(fn):
        raise ValueError(f"{name}={fn!r} is not callable; pass a function")


def verify(build_model, make_batch, *, layouts=DEFAULT_LAYOUTS, steps: int = 3, plan=None,
           optimizer=None, precision: str = "32", seed: int = 1234,
           timeout: float = 300.0) -> Report:
    """Prove a model's parallelization: the model built by ``build_model()`` trained for
    ``steps`` steps in one process (the reference) and at every layout (``"TPxCPxDP[+sp]"``),
    on CPU with gloo, from the same full weights; every module's output, the gradients at
    its output and input, every parameter's gradient and its value after each optimizer
    step, compared in forward order. A plain PyTorch model is parallelized with
    ``tpkit.parallelize(model, plan)`` (None: its ready plan); a model built from tpkit's
    layers is built at each layout. ``make_batch(step)`` returns the full batch (the
    model's positional arguments as a tuple, or keyword arguments as a dict; batch-first,
    with the token ids ``[batch, seq]``), the same on every call; ``optimizer(model)``
    builds the optimizer (default SGD, lr 0.1). Returns a Report (``report.ok``,
    ``print(report)``); docs/verify.md."""
    case = dict(build_model=build_model, make_batch=make_batch, plan=plan,
                optimizer=optimizer, precision=precision, steps=steps)
    return verify_all({"model": case}, layouts=layouts, seed=seed, timeout=timeout)["model"]


def _job(name, case: dict, layouts, seed, timeout) -> dict:
    from .record import batch_shape
    unknown = set(case) - {"build_model", "make_batch", "plan", "optimizer", "precision", "steps"}
    if unknown:
        raise ValueError(f"case {name!r}: unknown keys {sorted(unknown)}")
    build_model, make_batch = case.get("build_model"), case.get("make_batch")
    optimizer, precision = case.get("optimizer"), case.get("precision", "32")
    steps = case.get("steps", 3)
    _check_fn(build_model, "build_model")
    _check_fn(make_batch, "make_batch")
    if optimizer is not None:
        _check_fn(optimizer, "optimizer")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {PRECISIONS} (fp8 is not "
                         "verified yet)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be a positive integer")
    rows, seq = batch_shape(make_batch(0))
    for layout in layouts:
        if rows % layout.dp:
            raise ValueError(f"layout {layout}: the batch has {rows} rows, which dp="
                             f"{layout.dp} does not divide; make_batch a multiple of {layout.dp}")
        need = 2 * layout.cp * (layout.tp if layout.sp else 1)
        if layout.cp > 1 and seq % need or layout.sp and seq % layout.tp:
            raise ValueError(f"layout {layout}: the sequence has {seq} tokens; cp={layout.cp}"
                             f"{' with sp' if layout.sp else ''} needs a multiple of {need}")
    return dict(build_model=build_model, make_batch=make_batch, plan=case.get("plan"),
                optimizer=optimizer or _sgd, precision=precision, seed=seed, steps=steps,
                shape=(rows, seq), timeout=timeout)


def verify_all(cases: dict, *, layouts=DEFAULT_LAYOUTS, seed: int = 1234,
               timeout: float = 300.0) -> dict:
    """``verify`` for several models at once, ``{name: {build_model=, make_batch=, plan=,
    optimizer=, precision=, steps=}}`` -> ``{name: Report}``: one set of processes per
    layout runs every case (processes cost more than these models' steps)."""
    from .compare import compare_layout
    from .findings import dropout_findings, tolerance
    layouts = parse_layouts(layouts)
    if not cases:
        raise ValueError("verify_all: no cases")
    names = list(cases)
    jobs = [_job(n, cases[n], layouts, seed, timeout) for n in names]
    start = time.monotonic()
    refs = _run_layout(Layout(1, 1, 1), jobs, [None] * len(jobs), timeout)
    ref_secs = time.monotonic() - start
    per_case = {n: [] for n in names}
    for layout in layouts:
        t0 = time.monotonic()
        ok_refs = [r[0][1] if r[0][0] == "ok" else None for r in refs]
        good = [i for i, r in enumerate(ok_refs) if r is not None]
        try:
            replies = [[("err", "the reference failed")]] * len(jobs)
            if good:
                got = _run_layout(layout, [jobs[i] for i in good],
                                  [ok_refs[i]["full_sd"] for i in good], timeout)
                for i, rep in zip(good, got):
                    replies[i] = rep
        except (RuntimeError, TimeoutError) as e:
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            text = f"{layout}: FAILED, {lines[0]} {lines[-1] if len(lines) > 1 else ''}"
            for n in names:
                per_case[n].append(LayoutResult(layout, False, text.strip(),
                                                time.monotonic() - t0, [e]))
            continue
        secs = time.monotonic() - t0
        for n, job, ref, rep, ref_reply in zip(names, jobs, ok_refs, replies, refs):
            tol = tolerance(job["precision"])
            failed = _failed("reference (1x1x1)", ref_reply) or _failed(layout, rep)
            if failed:
                per_case[n].append(LayoutResult(layout, False, failed, secs, []))
                continue
            ranks = [v for _, v in rep]
            first = compare_layout(ref, ranks, layout, job["shape"][0], job["shape"][1], tol)
            found = ([first] if first else []) + dropout_findings(ranks,
                                                                  ref["steps"][0]["order"])
            kind = "tpkit layers" if ranks[0]["tpkit_model"] else "tpkit.parallelize"
            if not found:
                text = (f"{layout}: OK  {job['steps']} step(s), "
                        f"{len(ref['steps'][0]['order'])} module calls, "
                        f"{len(ref['full_sd'])} tensors agree ({kind}, {secs:.1f} s)")
            else:
                text = "\n".join(f"{layout}: " + f.line(tol) for f in found)
            per_case[n].append(LayoutResult(layout, not found, text, secs, found))
    total = time.monotonic() - start
    return {n: Report(per_case[n], total, tolerance(job["precision"]).why + 
                      f"; reference {ref_secs:.1f} s")
            for n, job in zip(names, jobs)}

