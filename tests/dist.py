"""Multi-rank test harness: run a function on N gloo ranks with a reused worker pool.

``run(fn, world_size, *args, **kwargs)`` calls ``fn(*args, **kwargs)`` on every rank of
a pool of ``world_size`` worker processes whose default gloo process group is already
initialised (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` are set too),
and returns the list of the ranks' return values, ordered by rank. If any rank raises,
the first failing rank's traceback is raised here as ``RankError``. If the ranks do not
all finish within ``timeout`` seconds (default ``TPKIT_DIST_TIMEOUT`` or 120), the
pool is killed and ``TimeoutError`` names the ranks still running — a hang fails the
test instead of hanging CI. Pools are started once per world size and reused across the
session (workers are forked from a fork server that imported torch, Lightning and tpkit
once: see ``_context``); a pool is rebuilt after a failure.
After each call every rank runs ``tpkit.destroy_parallel()`` so tests start clean.

Where the pool is easier than a user's job, and what covers the real road (issue 14):

(a) The pool creates the default gloo group itself, so tpkit never creates, keeps or
    destroys it here; init_parallel/destroy_parallel cycles over a tpkit-created group
    run launched in test_userpath (tpkit-launch at 4 and 8 ranks, torchrun, plain python)
    and test_slurm (srun + tpkit-launch).
(b) No TPKIT_* (conftest removes them) and no TORCHELASTIC_* variables: layouts are passed
    explicitly. TPKIT_* as defaults under explicit overrides, and TPKIT_BACKEND, are used
    by the launched scripts (tests/launch_scripts/*, test_fabric_conformance, test_launch_run).
(c) Processes are reused and never exit between calls: exit-time teardown (the default
    group destroyed at exit) and a checkpoint read by fresh processes after the writers
    were killed are checked launched (reinit.py's at-exit hook; train.py save -> SIGKILL ->
    resume in test_userpath). Reuse is otherwise harder than a fresh process: state must
    be clean after destroy_parallel, which every call relies on.
(d) Functions run inside the harness, not as ``__main__`` under tpkit-launch's wrapper:
    exit codes, error files and signals are test_launch_run's.
For the layer, attention, checkpoint, fp8, RNG and recompute math the pool is equivalent:
those results depend only on the layout's groups, which init_parallel builds the same way
over any default group (test_userpath's reinit.py re-checks groups, a TP MLP and float64
CP attention on the launched road at every layout).

``fn`` must be picklable by reference (a module-level function); arguments and results
are pickled by value (tensors included). Example::

    from tests.dist import run   # or: from dist import run (tests/ is on sys.path)

    def _allreduce_rank():
        import torch, torch.distributed as dist
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_allreduce():
        assert run(_allreduce_rank, 4) == [6.0] * 4
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import time
import traceback
from datetime import timedelta

WORLD_SIZES = (1, 2, 4, 8)
_POOLS: dict[int, "_Pool"] = {}
_GRACE_S = 5.0


class RankError(RuntimeError):
    """A rank raised; the message holds that rank's traceback."""


def _worker_main(rank: int, world: int, port: int, conn, pg_timeout: float) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=pg_timeout))
    conn.send_bytes(b"ready")
    while True:
        try:
            msg = conn.recv_bytes()
        except EOFError:
            return
        if msg == b"stop":
            break
        try:
            fn, args, kwargs = pickle.loads(msg)
            reply = ("ok", fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - everything goes back to the test
            reply = ("err", f"rank {rank}:\n{traceback.format_exc()}")
        finally:
            try:
                import tpkit
                tpkit.destroy_parallel()
            except BaseException:  # noqa: BLE001
                reply = ("err", f"rank {rank} (cleanup):\n{traceback.format_exc()}")
        try:
            payload = pickle.dumps(reply)
        except BaseException:  # noqa: BLE001
            payload = pickle.dumps(("err", f"rank {rank}: result not picklable:\n"
                                           f"{traceback.format_exc()}"))
        conn.send_bytes(payload)
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world: int):
        import torch.distributed as dist
        self.world = world
        self.store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True,
                                   wait_for_workers=False, timeout=timedelta(seconds=60))
        ctx = _context()
        pg_timeout = float(os.environ.get("TPKIT_DIST_PG_TIMEOUT", 90))
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, daemon=True,
                            args=(rank, world, self.store.port, child, pg_timeout))
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        deadline = time.monotonic() + 120
        for rank, c in enumerate(self.conns):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                self.kill()
                raise TimeoutError(f"worker {rank} of a {world}-rank pool did not start")
            assert c.recv_bytes() == b"ready"

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
        for c in self.conns:
            c.close()

    def stop(self) -> None:
        for c in self.conns:
            try:
                c.send_bytes(b"stop")
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
        self.kill()

    def call(self, fn, args, kwargs, timeout: float) -> list:
        msg = pickle.dumps((fn, args, kwargs))
        for c in self.conns:
            c.send_bytes(msg)
        results: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        first_error_at = None
        while len(results) < self.world:
            now = time.monotonic()
            if first_error_at is not None and now > first_error_at + _GRACE_S:
                break
            if now > deadline:
                break
            for rank, c in enumerate(self.conns):
                if rank in results:
                    continue
                if c.poll(0.02):
                    try:
                        results[rank] = pickle.loads(c.recv_bytes())
                    except EOFError:
                        results[rank] = ("err", f"rank {rank}: worker process died "
                                                f"(exit code {self.procs[rank].exitcode})")
                    if results[rank][0] == "err" and first_error_at is None:
                        first_error_at = time.monotonic()
        errors = sorted((r, v) for r, (k, v) in results.items() if k == "err")
        if errors or len(results) < self.world:
            _POOLS.pop(self.world, None)
            self.kill()
        if errors:
            raise RankError(errors[0][1])
        if len(results) < self.world:
            missing = sorted(set(range(self.world)) - set(results))
            raise TimeoutError(f"ranks {missing} of {self.world} did not finish "
                               f"{getattr(fn, '__name__', fn)} within {timeout:.0f} s")
        return [results[r][1] for r in range(self.world)]


# What every pool worker imports before it runs anything, loaded once per session into
# the fork server the workers are forked from (a worker then starts in ~0.05 s instead of
# importing torch and Lightning for ~5 CPU-seconds).
PRELOAD = ["torch", "torch.distributed", "lightning.fabric", "tpkit", "tpkit.train.trainer"]


def _context():
    """The ``forkserver`` context: workers are forked from a server process started
    fresh (it never runs a test: no test's patches or state reach a worker) that has
    imported ``PRELOAD``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run(fn, world_size: int, *args, timeout: float | None = None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; see the module docstring."""
    if world_size not in WORLD_SIZES:
        raise ValueError(f"world_size={world_size} is not supported; use one of {WORLD_SIZES}")
    if timeout is None:
        timeout = float(os.environ.get("TPKIT_DIST_TIMEOUT", 120))
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _POOLS[world_size] = _Pool(world_size)
    return pool.call(fn, args, kwargs, timeout)


@atexit.register
def shutdown() -> None:
    """Stop every pool (registered at exit; tests may call it too)."""
    for pool in list(_POOLS.values()):
        pool.stop()
    _POOLS.clear()

