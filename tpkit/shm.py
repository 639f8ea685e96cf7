"""Shared-memory all-reduce for CPU process groups whose ranks share one host.

gloo moves every collective through TCP loopback and several thread hand-offs: on the
2-core VMs tpkit is tested on, one 128 KiB all-reduce costs ~0.3 ms of wall time and
about as much CPU per rank, whatever else the ranks do. The tensor-parallel f/g
all-reduces of ``tpkit.nn.mappings`` are small and frequent, so on CPU tpkit sums them
through a shared-memory segment instead (as DeepSpeed's and vLLM's CPU backends do):
each rank copies its tensor into its slot, publishes a sequence number, waits until
every rank has published it, and adds the slots in rank order 0..n-1 (every rank runs the
same additions, so results are identical across ranks; for two ranks they are bitwise
those of gloo). Slots are double-buffered by sequence parity: a rank can only write slot
set ``p`` again after every rank has arrived one round later, i.e. finished reading it.

Setup (``setup(group)``) is collective over the group and is done by ``build_state`` for
the TP group on the gloo backend. The transport is used only when every rank of the group
is on the same host and can map the segment (checked collectively, so all ranks decide
alike), on x86-64 (total store order: with one locked instruction between them, "data,
then flag" becomes visible in that order), unless ``TPKIT_SHM_ALLREDUCE=0``. Otherwise
the group keeps using gloo, with a warning when the host looked able but the segment
failed. The segment's file exists in /dev/shm only while the group sets up: group rank 0
creates it and unlinks it as soon as every rank has mapped it (the memory then lives
until the last rank unmaps it or exits, whatever way it exits). A rank 0 killed inside
that window (SIGKILL between the creation and the unlink) leaves the file behind; the
next set-up on the host removes the files whose creating process is gone
(``sweep_stale``). Waiting spins (yielding the CPU) for a short while, then sleeps; it
raises after the group's own timeout, naming the ranks that never arrived.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import platform
import re
import secrets
import socket
import threading
import time
import warnings
from typing import Mapping

import torch
import torch.distributed as dist

from .config import env_flag

__all__ = ["SLOT_BYTES", "ShmAllReduce", "bypassed", "get", "release", "setup",
           "shm_allreduce_enabled", "sweep_stale"]

SLOT_BYTES = 1 << 20          # per rank and parity; larger tensors go in chunks
_LINE = 64                    # one cache line per rank flag (no false sharing)
_HEADER = 4096
_TOKEN = 16
_SPIN_YIELDS = 2000           # ~ms of sched_yield spinning before sleeping
_SLEEP_S = 5e-5
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_DIR = "/dev/shm"
_NAME = re.compile(r"tpkit-(\d+)-[0-9a-f]{12}")   # tpkit-<creator pid>-<random hex>

# group_name -> (group, transport); release() clears. The group object is kept and compared
# so a later group that reuses a destroyed group's name never finds a stale transport.
_TRANSPORTS: dict[str, tuple] = {}


class ShmAllReduce:
    """In-place SUM all-reduce of CPU floating tensors over a mapped segment."""

    def __init__(self, mm: mmap.mmap, size: int, rank: int, timeout_s: float,
                 ranks: list[int]):
        self.size, self.rank, self.timeout_s, self.ranks = size, rank, timeout_s, ranks
        self._mm = mm
        self._flags = memoryview(mm).cast("q")
        self._flag_at = [j * (_LINE // 8) for j in range(size)]   # rank j's flag index
        self._data = torch.frombuffer(mm, dtype=torch.uint8, offset=_HEADER,
                                      count=2 * size * SLOT_BYTES)
        self._views: dict[torch.dtype, torch.Tensor] = {}
        # Taking an uncontended lock is a LOCK-prefixed instruction: it drains the store
        # buffer, including non-temporal / fast-string stores a large memcpy may use, which
        # x86 does not otherwise order before the flag store.
        self._fence = threading.Lock()
        self.seq = 0

    def supports(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in _DTYPES

    def _slots(self, dtype: torch.dtype) -> torch.Tensor:
        v = self._views.get(dtype)
        if v is None:
            v = self._data.view(dtype).view(2, self.size, SLOT_BYTES // dtype.itemsize)
            self._views[dtype] = v
        return v

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (contiguous) over the group, in place; returns ``x``."""
        assert x.is_contiguous() and self.supports(x)
        with torch.no_grad():
            self._reduce(x.view(-1))
        return x

    def _reduce(self, flat: torch.Tensor) -> None:
        slots = self._slots(flat.dtype)
        per = slots.shape[-1]
        for start in range(0, flat.numel(), per):
            part = flat[start:start + per]
            k = part.numel()
            self.seq += 1
            cur = slots[self.seq & 1]
            cur[self.rank, :k].copy_(part)
            with self._fence:
                pass
            self._flags[self._flag_at[self.rank]] = self.seq   # publish after the data
            self._wait(self.seq)
            torch.add(cur[0, :k], cur[1, :k], out=part)
            for j in range(2, self.size):
                part.add_(cur[j, :k])

    def _arrived(self, seq: int) -> bool:
        f = self._flags
        return all(f[i] >= seq for i in self._flag_at)

    def _wait(self, seq: int) -> None:
        if self._arrived(seq):
            return
        for _ in range(_SPIN_YIELDS):
            os.sched_yield()
            if self._arrived(seq):
                return
        deadline = time.monotonic() + self.timeout_s
        while not self._arrived(seq):
            if time.monotonic() > deadline:
                late = [self.ranks[j] for j, i in enumerate(self._flag_at)
                        if self._flags[i] < seq]
                raise RuntimeError(
                    f"tpkit shared-memory all-reduce over ranks {self.ranks} timed out after "
                    f"{self.timeout_s:g} s at round {seq}: ranks {late} never arrived (did a "
                    "rank die or skip a collective the others issued?)")
            time.sleep(_SLEEP_S)

    def close(self) -> None:
        self._views.clear()
        self._data = None
        self._flags.release()
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view; the mapping dies with it
            pass


def shm_allreduce_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``TPKIT_SHM_ALLREDUCE`` (default on): may TP groups on CPU sum through shared memory?
    Checked by tpkit-launch before workers start and by init_parallel."""
    return env_flag("TPKIT_SHM_ALLREDUCE", env, default=True,
                    fix="use 0 (TP all-reduces through gloo) or 1 (through shared memory "
                        "when every TP rank is on one host)")


def _local_reason() -> str | None:
    """Why this process cannot take part, or None."""
    if not shm_allreduce_enabled():
        return "disabled by TPKIT_SHM_ALLREDUCE=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not on x86-64 ({platform.machine()})"
    if not os.path.isdir(_DIR):
        return "no /dev/shm"
    return None


def _host_key() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    return True


def sweep_stale(directory: str = _DIR) -> list[str]:
    """Remove the segment files in ``directory`` whose creating process is gone (left by a
    rank 0 killed during set-up); returns their names. A file of a live process (another
    job setting up) is never touched; files of other users are skipped."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def _create(size: int, token: bytes) -> tuple[str, mmap.mmap]:
    nbytes = _HEADER + 2 * size * SLOT_BYTES
    sweep_stale()
    path = f"{_DIR}/tpkit-{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)   # fail now, not with SIGBUS on first touch
        mm = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    mm[_HEADER - _TOKEN:_HEADER] = token
    return path, mm


def _attach(path: str, size: int, token: bytes) -> mmap.mmap:
    nbytes = _HEADER + 2 * size * SLOT_BYTES
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    if mm[_HEADER - _TOKEN:_HEADER] != token:
        mm.close()
        raise OSError(f"{path} is not the segment group rank 0 created (another /dev/shm?)")
    return mm


def _timeout_s(group) -> float:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return float(os.environ.get("TPKIT_PG_TIMEOUT", "600"))


def _agree(group, size, rank, reason, path, mm, token):
    """The collective half of setup(): share rank 0's segment, map it, agree on the result."""
    info: list = [None] * size
    dist.all_gather_object(info, (_host_key(), reason, path, token), group=group)
    hosts = {i[0] for i in info}
    reasons = [i[1] for i in info if i[1] is not None]
    path, token = info[0][2], info[0][3]
    err = None
    if len(hosts) == 1 and not reasons and rank != 0:
        try:
            mm = _attach(path, size, token)
        except (OSError, ValueError) as e:
            err = f"rank {dist.get_global_rank(group, rank)} cannot map {path} ({e})"
    ok = torch.tensor([int(len(hosts) == 1 and not reasons and err is None)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return int(ok), mm, reasons, err, hosts


def setup(group) -> ShmAllReduce | None:
    """Collective over ``group``: map one shared segment on every rank, or decide (all
    ranks alike) to leave the group on its backend. Returns the transport or None. A group
    has at most one transport: states sharing a group (a TP group spanning the world is the
    default group) share it, so a second setup returns the first (no collective: every rank
    made the same earlier calls)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size == 1:
        return None
    existing = get(group)
    if existing is not None:
        return existing
    reason, path, mm = _local_reason(), None, None
    token = secrets.token_bytes(_TOKEN)
    if rank == 0 and reason is None:
        try:
            path, mm = _create(size, token)
        except OSError as e:
            reason = f"cannot allocate the /dev/shm segment ({e})"
    try:
        ok, mm, reasons, err, hosts = _agree(group, size, rank, reason, path, mm, token)
    finally:
        if path is not None:
            os.unlink(path)   # every rank has it mapped or gave up (or a peer failed)
    ranks = dist.get_process_group_ranks(group)
    if not ok:
        if mm is not None:
            mm.close()
        why = reasons[0] if reasons else (err or "a peer could not map the segment")
        if len(hosts) == 1 and not why.startswith(("disabled", "not on x86", "no /dev/shm")):
            warnings.warn(f"tpkit: TP all-reduces over ranks {ranks} use gloo, not shared "
                          f"memory: {why}", RuntimeWarning, stacklevel=2)
        return None
    t = ShmAllReduce(mm, size, rank, _timeout_s(group), ranks)
    _TRANSPORTS[group.group_name] = (group, t)
    return t


def get(group) -> ShmAllReduce | None:
    """The transport of ``group`` if setup() made one (a dict lookup)."""
    if not _TRANSPORTS or group is None:
        return None
    entry = _TRANSPORTS.get(group.group_name)
    return entry[1] if entry is not None and entry[0] is group else None


def release(group) -> None:
    """Forget and unmap ``group``'s transport (destroy_parallel calls it)."""
    entry = _TRANSPORTS.pop(getattr(group, "group_name", None), None)
    if entry is not None:
        entry[1].close()


@contextlib.contextmanager
def bypassed(group):
    """Within the block ``group``'s SUMs go through its backend instead (to compare the two
    or rule the transport out while debugging). Every rank of the group must enter and
    leave it at the same point of the program, like a collective."""
    entry = _TRANSPORTS.pop(getattr(group, "group_name", None), None)
    try:
        yield
    finally:
        if entry is not None:
            _TRANSPORTS[group.group_name] = entry
