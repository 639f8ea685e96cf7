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
(``sweep_stale``). A file's name carries its creator's pid, pid namespace and boot id, so
liveness is judged only for files of this boot and pid namespace: containers sharing
/dev/shm never delete each other's live segments (a leftover of another namespace
stays until that namespace's next set-up). Waiting spins (yielding the CPU) for a short while, then sleeps; it
raises after the group's own timeout, naming the ranks that never arrived.
"""
from __future__ import annotations

import collections
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

from .._env import env_flag

__all__ = ["SLOT_BYTES", "ShmAllReduce", "ShmP2P", "bypassed", "get", "get_p2p", "release",
           "setup", "setup_p2p", "shm_allreduce_enabled", "shm_p2p_enabled", "sweep_stale"]

SLOT_BYTES = 1 << 20          # per rank and parity; larger tensors go in chunks
_LINE = 64                    # one cache line per rank flag (no false sharing)
_HEADER = 4096
_TOKEN = 16
_SPIN_YIELDS = 2000           # ~ms of sched_yield spinning before sleeping
_SLEEP_S = 5e-5
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_DIR = "/dev/shm"
# tpkit-<creator pid>-<its pid namespace>-<boot id>-<random hex>
_NAME = re.compile(r"tpkit-(\d+)-(\d+)-([0-9a-f]{8})-[0-9a-f]{12}")

# group_name -> (group, transport), one registry per kind; release() clears. The group
# object is kept and compared so a later group that reuses a destroyed group's name never
# finds a stale transport.
_TRANSPORTS: dict[str, tuple] = {}
_P2P: dict[str, tuple] = {}


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
        _unmap(self)


def _unmap(t) -> None:
    """Drop a transport's views of its segment and unmap it."""
    t._data = None
    t._flags.release()
    try:
        t._mm.close()
    except BufferError:  # a caller still holds a view; the mapping dies with it
        pass


P2P_SLOTS = 4                 # slots per ordered pair of ranks (chunks in flight)
P2P_PAIR_BYTES = 4 << 20      # bytes per ordered pair ...
P2P_SEGMENT_BYTES = 64 << 20  # ... as far as this bound on the whole segment allows
_P2P_SPIN_YIELDS = 200
_P2P_ALIVE_EVERY_S = 0.5      # how often a long wait checks that its peers still run


def _p2p_layout(size: int) -> tuple[int, int, int]:
    """(segment bytes, header bytes, slot bytes) of a ``size``-rank point-to-point segment:
    ``P2P_SLOTS`` slots per ordered pair, each with a sender line (chunk number, tag,
    bytes) and a receiver line (chunk number taken)."""
    pairs = size * (size - 1)
    per_pair = min(P2P_PAIR_BYTES, P2P_SEGMENT_BYTES // pairs)
    slot = max(4096, per_pair // P2P_SLOTS // 4096 * 4096)
    # the slots' lines, then one line per rank with its process id
    header = -(-((pairs * P2P_SLOTS * 2 + size) * _LINE + _TOKEN) // 4096) * 4096
    return header + pairs * P2P_SLOTS * slot, header, slot


class _P2POp:
    """One send or receive of a batch: its bytes, progressed chunk by chunk."""
    __slots__ = ("peer", "flat", "tag", "pos", "chunks", "target")

    def __init__(self, peer: int, flat: torch.Tensor, tag: int, slot: int, target=None):
        self.peer, self.flat, self.tag, self.pos = peer, flat, tag, 0
        self.chunks = max(1, -(-flat.numel() // slot))   # an empty message is one chunk
        self.target = target   # a non-contiguous receive: copy into it when complete


class P2PWork:
    """What ``ShmP2P.start`` returns one of: ``wait()`` progresses the transport until the
    batch has gone out and come in."""

    def __init__(self, transport: "ShmP2P", ops: list):
        self._t, self._ops = transport, ops

    def is_completed(self) -> bool:
        self._t.progress()
        return all(op.chunks == 0 for op in self._ops)

    def wait(self, timeout=None) -> bool:
        self._t.wait_for(self._ops)
        return True


class ShmP2P:
    """Point-to-point messages between the ranks of one group on one host, for the
    context-parallel ring (``tpkit.comm.collectives.start_p2p``). Every ordered pair (src, dst)
    has a mailbox of ``P2P_SLOTS`` slots used round-robin: the sender copies a chunk into a
    slot once the receiver has taken the chunk before it there, then publishes the chunk's
    number, tag and size; the receiver copies it out and publishes that it took it.
    Messages of a pair pair up in the order they are posted (like gloo's, per tag); a
    message larger than a slot goes in several chunks. Nothing runs in the background:
    ``start`` moves what fits and every ``wait`` moves whatever any posted send or receive
    can, so two ranks that post each other more than a mailbox holds still finish. A chunk
    whose tag or size is not what the receiver posted raises (the two ranks' schedules
    differ); a wait raises naming the peer when the peer's process has exited, or after
    the group's timeout."""

    def __init__(self, mm: mmap.mmap, size: int, rank: int, timeout_s: float,
                 ranks: list[int]):
        self.size, self.rank, self.timeout_s, self.ranks = size, rank, timeout_s, ranks
        nbytes, header, self.slot = _p2p_layout(size)
        self._mm = mm
        self._flags = memoryview(mm).cast("q")
        self._data = torch.frombuffer(mm, dtype=torch.uint8, offset=header,
                                      count=nbytes - header)
        self._group_rank = {g: i for i, g in enumerate(ranks)}
        self._fence = threading.Lock()
        self._sent = [0] * size     # chunks sent to each peer
        self._taken = [0] * size    # chunks received from each peer
        self._out: dict[int, collections.deque] = {j: collections.deque() for j in range(size)}
        self._in: dict[int, collections.deque] = {j: collections.deque() for j in range(size)}
        self._pid_at = [(size * (size - 1) * P2P_SLOTS * 2 + j) * (_LINE // 8)
                        for j in range(size)]
        self._flags[self._pid_at[rank]] = os.getpid()   # peers check it while they wait

    def _pair(self, src: int, dst: int) -> int:
        return src * (self.size - 1) + (dst if dst < src else dst - 1)

    def _lines(self, src: int, dst: int, j: int) -> tuple[int, int]:
        """Flag indices (int64 units) of slot j's sender and receiver lines."""
        base = (self._pair(src, dst) * P2P_SLOTS + j) * 2 * (_LINE // 8)
        return base, base + _LINE // 8

    def _slot(self, src: int, dst: int, j: int) -> torch.Tensor:
        at = (self._pair(src, dst) * P2P_SLOTS + j) * self.slot
        return self._data[at:at + self.slot]

    def start(self, sends, recvs, tag: int) -> list[P2PWork]:
        """Post ``sends`` ``[(tensor, global rank)]`` and ``recvs`` ``[(buffer, global
        rank)]`` (CPU tensors) and move what fits now; returns one work for the batch."""
        ops = []
        for t, peer in sends:
            flat = t.detach().contiguous().view(-1).view(torch.uint8)
            op = _P2POp(self._peer(peer), flat, tag, self.slot)
            self._out[op.peer].append(op)
            ops.append(op)
        for t, peer in recvs:
            target = None if t.is_contiguous() else t
            buf = t if target is None else torch.empty(t.shape, dtype=t.dtype)
            op = _P2POp(self._peer(peer), buf.view(-1).view(torch.uint8), tag, self.slot,
                        target)
            self._in[op.peer].append(op)
            ops.append(op)
        if not ops:
            return []
        self.progress()
        return [P2PWork(self, ops)]

    def _peer(self, global_rank: int) -> int:
        j = self._group_rank.get(global_rank)
        if j is None or j == self.rank:
            raise ValueError(f"rank {global_rank} is not a peer in the group of ranks "
                             f"{self.ranks} (this is rank {self.ranks[self.rank]})")
        return j

    def progress(self) -> bool:
        """Move every chunk that can move now; returns whether any did."""
        moved = False
        f = self._flags
        for peer, queue in self._out.items():
            while queue:
                op = queue[0]
                c = self._sent[peer] + 1
                j = (c - 1) % P2P_SLOTS
                line, ack = self._lines(self.rank, peer, j)
                if f[ack] < c - P2P_SLOTS:   # the receiver still has the slot's last chunk
                    break
                n = min(self.slot, op.flat.numel() - op.pos)
                if n:
                    self._slot(self.rank, peer, j)[:n].copy_(op.flat[op.pos:op.pos + n])
                f[line + 1], f[line + 2] = op.tag, n
                with self._fence:   # the data and the tag/size before the chunk number
                    pass
                f[line] = c
                self._sent[peer], op.pos, op.chunks, moved = c, op.pos + n, op.chunks - 1, True
                if op.chunks == 0:
                    queue.popleft()
        for peer, queue in self._in.items():
            while queue:
                op = queue[0]
                c = self._taken[peer] + 1
                j = (c - 1) % P2P_SLOTS
                line, ack = self._lines(peer, self.rank, j)
                if f[line] < c:
                    break
                n = min(self.slot, op.flat.numel() - op.pos)
                if f[line + 1] != op.tag or f[line + 2] != n:
                    raise RuntimeError(
                        f"tpkit shared-memory p2p: rank {self.ranks[peer]} sent rank "
                        f"{self.ranks[self.rank]} a chunk with tag {f[line + 1]} of "
                        f"{f[line + 2]} bytes where tag {op.tag} of {n} bytes was posted: "
                        "the two ranks posted different sends and receives")
                if n:
                    op.flat[op.pos:op.pos + n].copy_(self._slot(peer, self.rank, j)[:n])
                f[ack] = c   # after the copy (x86 keeps loads before a later store)
                self._taken[peer], op.pos, op.chunks, moved = c, op.pos + n, op.chunks - 1, True
                if op.chunks == 0:
                    queue.popleft()
                    if op.target is not None:
                        op.target.copy_(op.flat.view(op.target.dtype).view(op.target.shape))
        return moved

    def wait_for(self, ops) -> None:
        """Progress until every op of ``ops`` is complete: spin (yielding the CPU) for a
        short while, then sleep between tries; raise after the group's timeout, or as soon
        as a peer it waits for has exited (checked every ``_P2P_ALIVE_EVERY_S``)."""
        spins, deadline = 0, None
        while any(op.chunks for op in ops):
            if self.progress():
                spins, deadline = 0, None
                continue
            if spins < _P2P_SPIN_YIELDS:
                spins += 1
                os.sched_yield()
                continue
            now = time.monotonic()
            if deadline is None:
                deadline, alive_at = now + self.timeout_s, now + _P2P_ALIVE_EVERY_S
            elif now > alive_at:
                alive_at = now + _P2P_ALIVE_EVERY_S
                self._check_alive(ops)
            if now > deadline:
                late = sorted({self.ranks[op.peer] for op in ops if op.chunks})
                raise RuntimeError(
                    f"tpkit shared-memory p2p: rank {self.ranks[self.rank]} waited "
                    f"{self.timeout_s:g} s for point-to-point transfers with ranks {late} "
                    "that never completed (did a rank die or skip the exchange?)")
            time.sleep(_SLEEP_S)

    def _check_alive(self, ops) -> None:
        """Raise if a peer we wait for has exited (its process id is gone from this host)."""
        for peer in sorted({op.peer for op in ops if op.chunks}):
            pid = self._flags[self._pid_at[peer]]
            if pid and not _alive(pid):
                raise RuntimeError(
                    f"tpkit shared-memory p2p: rank {self.ranks[peer]} (pid {pid}) exited "
                    f"while rank {self.ranks[self.rank]} waited for its point-to-point "
                    "transfer")

    def close(self) -> None:
        self._out.clear()
        self._in.clear()
        _unmap(self)


def shm_allreduce_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``TPKIT_SHM_ALLREDUCE`` (default on): may TP groups on CPU sum through shared memory?
    Checked by tpkit-launch before workers start and by init_parallel."""
    return env_flag("TPKIT_SHM_ALLREDUCE", env, default=True,
                    fix="use 0 (TP all-reduces through gloo) or 1 (through shared memory "
                        "when every TP rank is on one host)")


def shm_p2p_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``TPKIT_SHM_P2P`` (default on): may context-parallel groups on CPU exchange K/V
    blocks through shared memory? Checked by tpkit-launch and by init_parallel."""
    return env_flag("TPKIT_SHM_P2P", env, default=True,
                    fix="use 0 (CP point-to-point transfers through gloo) or 1 (through "
                        "shared memory when every CP rank is on one host)")


def _local_reason(enabled, var: str) -> str | None:
    """Why this process cannot take part, or None."""
    if not enabled():
        return f"disabled by {var}=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not on x86-64 ({platform.machine()})"
    if not os.path.isdir(_DIR):
        return "no /dev/shm"
    return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _host_key() -> str:
    return f"{socket.gethostname()}/{_boot_id()}"


def _where() -> tuple[str, str]:
    """(pid namespace inode, first 8 hex digits of the boot id): whose pids a name holds."""
    try:
        ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        ns = "0"
    boot = _boot_id().replace("-", "")[:8].lower()
    return ns, boot if re.fullmatch(r"[0-9a-f]{8}", boot) else "0" * 8


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
    job setting up) is never touched, nor one of another pid namespace or boot (whose pid
    says nothing here); files of other users are skipped."""
    removed = []
    here = _where()
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None or (m.group(2), m.group(3)) != here or _alive(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def _create(nbytes: int, header: int, token: bytes) -> tuple[str, mmap.mmap]:
    sweep_stale()
    ns, boot = _where()
    path = f"{_DIR}/tpkit-{os.getpid()}-{ns}-{boot}-{secrets.token_hex(6)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)   # fail now, not with SIGBUS on first touch
        mm = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    mm[header - _TOKEN:header] = token
    return path, mm


def _attach(path: str, nbytes: int, header: int, token: bytes) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    if mm[header - _TOKEN:header] != token:
        mm.close()
        raise OSError(f"{path} is not the segment group rank 0 created (another /dev/shm?)")
    return mm


def _timeout_s(group) -> float:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return float(os.environ.get("TPKIT_PG_TIMEOUT", "600"))


def _agree(group, size, rank, reason, path, mm, token, layout):
    """The collective half of setup(): share rank 0's segment, map it, agree on the result."""
    info: list = [None] * size
    dist.all_gather_object(info, (_host_key(), reason, path, token), group=group)
    hosts = {i[0] for i in info}
    reasons = [i[1] for i in info if i[1] is not None]
    path, token = info[0][2], info[0][3]
    err = None
    if len(hosts) == 1 and not reasons and rank != 0:
        try:
            mm = _attach(path, *layout, token)
        except (OSError, ValueError) as e:
            err = f"rank {dist.get_global_rank(group, rank)} cannot map {path} ({e})"
    ok = torch.tensor([int(len(hosts) == 1 and not reasons and err is None)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return int(ok), mm, reasons, err, hosts


def _setup(group, registry: dict, layout: tuple[int, int], reason: str | None, what: str,
           make):
    """Collective over ``group``: map one shared segment of ``layout`` (bytes, header) on
    every rank, or decide (all ranks alike) to leave the group on its backend. ``make(mm,
    size, rank, timeout_s, ranks)`` builds the transport, kept in ``registry``."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size == 1:
        return None
    existing = _lookup(registry, group)
    if existing is not None:
        return existing
    path, mm = None, None
    token = secrets.token_bytes(_TOKEN)
    if rank == 0 and reason is None:
        try:
            path, mm = _create(*layout, token)
        except OSError as e:
            reason = f"cannot allocate the /dev/shm segment ({e})"
    try:
        ok, mm, reasons, err, hosts = _agree(group, size, rank, reason, path, mm, token,
                                             layout)
    finally:
        if path is not None:
            os.unlink(path)   # every rank has it mapped or gave up (or a peer failed)
    ranks = dist.get_process_group_ranks(group)
    if not ok:
        if mm is not None:
            mm.close()
        why = reasons[0] if reasons else (err or "a peer could not map the segment")
        if len(hosts) == 1 and not why.startswith(("disabled", "not on x86", "no /dev/shm")):
            warnings.warn(f"tpkit: {what} over ranks {ranks} use gloo, not shared "
                          f"memory: {why}", RuntimeWarning, stacklevel=3)
        return None
    t = make(mm, size, rank, _timeout_s(group), ranks)
    registry[group.group_name] = (group, t)
    return t


def setup(group) -> ShmAllReduce | None:
    """Collective over ``group``: map one shared segment on every rank, or decide (all
    ranks alike) to leave the group on its backend. Returns the transport or None. A group
    has at most one transport: states sharing a group (a TP group spanning the world is the
    default group) share it, so a second setup returns the first (no collective: every rank
    made the same earlier calls)."""
    size = dist.get_world_size(group)
    return _setup(group, _TRANSPORTS, (_HEADER + 2 * size * SLOT_BYTES, _HEADER),
                  _local_reason(shm_allreduce_enabled, "TPKIT_SHM_ALLREDUCE"),
                  "TP all-reduces", ShmAllReduce)


def setup_p2p(group) -> ShmP2P | None:
    """``setup`` for the point-to-point transport (``ShmP2P``) of a context-parallel group:
    collective over ``group``; returns the transport or None (the group keeps gloo)."""
    size = dist.get_world_size(group)
    return _setup(group, _P2P, _p2p_layout(size)[:2],
                  _local_reason(shm_p2p_enabled, "TPKIT_SHM_P2P"),
                  "context-parallel point-to-point transfers", ShmP2P)


def _lookup(registry: dict, group):
    if not registry or group is None:
        return None
    entry = registry.get(group.group_name)
    return entry[1] if entry is not None and entry[0] is group else None


def get(group) -> ShmAllReduce | None:
    """The transport of ``group`` if setup() made one (a dict lookup)."""
    return _lookup(_TRANSPORTS, group)


def get_p2p(group) -> ShmP2P | None:
    """The point-to-point transport of ``group`` if setup_p2p() made one."""
    return _lookup(_P2P, group)


def release(group) -> None:
    """Forget and unmap ``group``'s transports (destroy_parallel calls it)."""
    for registry in (_TRANSPORTS, _P2P):
        entry = registry.pop(getattr(group, "group_name", None), None)
        if entry is not None:
            entry[1].close()


@contextlib.contextmanager
def bypassed(group):
    """Within the block ``group``'s SUMs go through its backend instead (to compare the two
    or rule the transport out while debugging). Every rank of the group must enter and
    leave it at the same point of the program, like a collective."""
    name = getattr(group, "group_name", None)
    entries = [(r, r.pop(name, None)) for r in (_TRANSPORTS, _P2P)]
    try:
        yield
    finally:
        for registry, entry in entries:
            if entry is not None:
                registry[name] = entry
