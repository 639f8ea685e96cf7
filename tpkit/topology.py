"""ParallelState: the layout turned into a DeviceMesh and every process group.

Rank order (DESIGN.md §3): TP innermost, then CP, DP, PP outermost, i.e.
``rank = tp + TP*(cp + CP*(dp + DP*pp))`` — the mesh ``(pp, dp, cp, tp)`` in row-major
order. Flattened groups (dp_cp, tp_cp, model-parallel, amax) and the two hierarchical CP
levels of ``a2a+p2p`` are built once and kept as attributes. Groups over dimensions of
size 1 alias the size-1 tp/cp/... group instead of creating duplicates; NCCL creates
communicators lazily, so a size-1 group that is never used costs nothing there.

Lifetimes: a layout's groups live from init_parallel() to destroy_parallel(); the default
process group outlives layouts (torch cannot create it twice on one rendezvous store), so
any number of init/destroy cycles run over one default group, destroyed once at exit when
init_parallel created it.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import shm
from .config import ParallelConfig, shm_allreduce_enabled

MESH_DIMS = ("pp", "dp", "cp", "tp")

_CURRENT: "ParallelState | None" = None
# The default process group init_parallel created in this process (None: it created none).
# It outlives every layout and is destroyed once, at interpreter exit (_destroy_default_group).
_DEFAULT_GROUP = None


@dataclasses.dataclass(eq=False)
class ParallelState:
    """Process groups, ranks and sizes of one layout in this process."""

    config: ParallelConfig
    mesh: DeviceMesh
    rank: int
    world_size: int
    backend: str
    device: torch.device
    tp_mesh: DeviceMesh
    cp_mesh: DeviceMesh
    dp_mesh: DeviceMesh
    pp_mesh: DeviceMesh
    dp_cp_mesh: DeviceMesh
    tp_cp_mesh: DeviceMesh
    mp_mesh: DeviceMesh
    amax_mesh: DeviceMesh
    cp_a2a_mesh: DeviceMesh | None = None
    cp_p2p_mesh: DeviceMesh | None = None
    build_seconds: float = 0.0

    # --- groups ----------------------------------------------------------------
    tp_group = property(lambda self: self.tp_mesh.get_group())
    cp_group = property(lambda self: self.cp_mesh.get_group())
    dp_group = property(lambda self: self.dp_mesh.get_group())
    pp_group = property(lambda self: self.pp_mesh.get_group())
    dp_cp_group = property(lambda self: self.dp_cp_mesh.get_group())
    tp_cp_group = property(lambda self: self.tp_cp_mesh.get_group())
    mp_group = property(lambda self: self.mp_mesh.get_group())
    amax_group = property(lambda self: self.amax_mesh.get_group())

    @property
    def cp_a2a_group(self):
        return None if self.cp_a2a_mesh is None else self.cp_a2a_mesh.get_group()

    @property
    def cp_p2p_group(self):
        return None if self.cp_p2p_mesh is None else self.cp_p2p_mesh.get_group()

    # --- ranks and sizes ---------------------------------------------------------
    tp_rank = property(lambda self: self.tp_mesh.get_local_rank())
    cp_rank = property(lambda self: self.cp_mesh.get_local_rank())
    dp_rank = property(lambda self: self.dp_mesh.get_local_rank())
    pp_rank = property(lambda self: self.pp_mesh.get_local_rank())
    dp_cp_rank = property(lambda self: self.dp_cp_mesh.get_local_rank())
    tp_size = property(lambda self: self.config.tp)
    cp_size = property(lambda self: self.config.cp)
    dp_size = property(lambda self: self.config.dp)
    pp_size = property(lambda self: self.config.pp)
    dp_cp_size = property(lambda self: self.config.dp * self.config.cp)
    sequence_parallel = property(lambda self: self.config.sequence_parallel)
    cp_comm_type = property(lambda self: self.config.cp_comm_type)

    @property
    def cp_global_ranks(self) -> list[int]:
        """Global ranks of this rank's CP group, in CP-rank order (TE's cp_global_ranks)."""
        return self.cp_mesh.mesh.tolist()

    def group_ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group ``name`` (tp, cp, dp, pp, dp_cp, tp_cp, mp, amax,
        cp_a2a, cp_p2p), in group-rank order."""
        m = getattr(self, f"{name}_mesh")
        if m is None:
            raise ValueError(f"group {name!r} does not exist for cp_comm_type="
                             f"{self.config.cp_comm_type!r}")
        return m.mesh.flatten().tolist()

    def all_groups(self) -> dict[str, object]:
        names = ["tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "mp", "amax", "cp_a2a", "cp_p2p"]
        return {n: getattr(self, f"{n}_group") for n in names
                if getattr(self, f"{n}_mesh") is not None}

    # --- rank table ----------------------------------------------------------------
    def rank_table(self, nproc_per_node: int | None = None) -> list[dict]:
        """One row per global rank: node, local rank, tp/cp/dp/pp coordinates and the
        tp/cp/dp/pp groups (as ``range`` objects), read off the mesh itself."""
        if nproc_per_node is None:
            nproc_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        full = self.mesh.mesh  # (pp, dp, cp, tp) tensor of global ranks
        columns = {"rank": full.reshape(-1).tolist()}
        for d, name in enumerate(MESH_DIMS):
            size = full.shape[d]
            coord = torch.arange(size).view([-1 if i == d else 1 for i in range(full.dim())])
            columns[name] = coord.expand(full.shape).reshape(-1).tolist()
            first = full.narrow(d, 0, 1).expand(full.shape)
            step = (full.narrow(d, 1, 1) - full.narrow(d, 0, 1)).expand(full.shape) if size > 1 \
                else torch.ones_like(full)
            expect = first + step * coord
            assert torch.equal(expect, full), f"mesh dim {name} is not an arithmetic progression"
            columns[f"{name}_group"] = [range(f, f + s * size, s) for f, s in
                                        zip(first.reshape(-1).tolist(), step.reshape(-1).tolist())]
        rows = []
        for i, r in enumerate(columns["rank"]):
            row = {"rank": r, "node": r // nproc_per_node, "local_rank": r % nproc_per_node}
            for name in MESH_DIMS[::-1]:
                row[name] = columns[name][i]
            for name in MESH_DIMS[::-1]:
                row[f"{name}_group"] = columns[f"{name}_group"][i]
            rows.append(row)
        rows.sort(key=lambda row: row["rank"])
        return rows


def _fmt_group(g: range) -> str:
    """``0,2`` for short groups, ``0-7`` for consecutive ranks, ``0..56/8`` (first..last/step)."""
    if len(g) <= 4 and g.step != 1 or len(g) == 1:
        return ",".join(map(str, g))
    if g.step == 1:
        return f"{g.start}-{g[-1]}"
    return f"{g.start}..{g[-1]}/{g.step}"


def format_rank_table(rows: list[dict], *, limit: int | None = None) -> str:
    """A fixed-width text table; ``limit`` keeps the first and last rows of huge tables."""
    cols = ["rank", "node", "local_rank", "tp", "cp", "dp", "pp",
            "tp_group", "cp_group", "dp_group", "pp_group"]
    shown = rows
    if limit is not None and len(rows) > limit:
        shown = rows[: limit // 2] + [None] + rows[-(limit - limit // 2):]
    text_rows = [[c for c in cols]]
    for row in shown:
        if row is None:
            text_rows.append(["..."] + [""] * (len(cols) - 1))
            continue
        text_rows.append([_fmt_group(row[c]) if c.endswith("_group") else str(row[c])
                          for c in cols])
    widths = [max(len(r[i]) for r in text_rows) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)).rstrip()
                     for r in text_rows)


# --- building ------------------------------------------------------------------------
def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"


def _backend_names(pg_backend: str) -> set[str]:
    """``"gloo"`` -> {gloo}; ``"cpu:gloo,cuda:nccl"`` -> {gloo, nccl}."""
    return {part.split(":")[-1] for part in pg_backend.split(",")}


def _init_default_group(backend: str | None) -> None:
    """Create torch.distributed's default group unless one exists (then check that it runs
    ``backend``, when one was asked for). A group created here lives until the process
    exits: destroying it and creating another on the same rendezvous store (torchrun's,
    tpkit-launch's, Slurm's) hangs, because the new group finds the old one's keys."""
    global _DEFAULT_GROUP
    if dist.is_initialized():
        have = dist.get_backend()
        if backend is not None and backend not in _backend_names(have):
            raise ValueError(f"backend={backend!r} was asked for, but the default process "
                             f"group of this process runs {have!r} and it lives until the "
                             f"process exits; use backend={have!r} (or None), or start a "
                             "new process for the other backend")
        return
    rendezvous = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if _DEFAULT_GROUP is not None and rendezvous:
        raise RuntimeError(
            "the default process group that tpkit.init_parallel() created was destroyed "
            "(torch.distributed.destroy_process_group()); it cannot be created again on the "
            "same rendezvous store in this process (the ranks would hang). Leave it alone: "
            "tpkit.destroy_parallel() frees only the layout's groups, and tpkit destroys the "
            "default group at exit")
    backend = backend or _default_backend()
    timeout = timedelta(seconds=float(os.environ.get("TPKIT_PG_TIMEOUT", 600)))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if rendezvous:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        # A plain `python script.py`: a world of one, no rendezvous needed.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    if _DEFAULT_GROUP is None:
        atexit.register(_destroy_default_group)
    _DEFAULT_GROUP = dist.group.WORLD


def _destroy_default_group() -> None:
    """At exit: destroy the default group if it is still the one init_parallel created
    (NCCL warns about a group left alive; the user may have destroyed it already). No
    barrier: a rank that exits after an error must not wait for the others."""
    if _DEFAULT_GROUP is not None and dist.is_initialized() \
            and dist.group.WORLD is _DEFAULT_GROUP:
        dist.destroy_process_group()


def _sub(mesh: DeviceMesh, config: ParallelConfig, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """The mesh over ``dims`` flattened to one dimension, reusing a 1-D mesh when all but
    one (or all) of the dims have size 1, so no duplicate communicator is created."""
    sizes = {"tp": config.tp, "cp": config.cp, "dp": config.dp, "pp": config.pp}
    real = tuple(d for d in dims if sizes[d] > 1)
    if len(real) == 0:
        return mesh[dims[-1]]
    if len(real) == 1:
        return mesh[real[0]]
    return mesh[real]._flatten(name)


def build_state(config: ParallelConfig, *, device_type: str | None = None) -> ParallelState:
    """Build every group of ``config`` over the initialised default process group."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; use tpkit.init_parallel()")
    t0 = time.perf_counter()
    world = dist.get_world_size()
    config = config.validate(world)
    backend = dist.get_backend()
    if device_type is None:
        device_type = "cuda" if backend == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (config.pp, config.dp, config.cp, config.tp),
                            mesh_dim_names=MESH_DIMS)
    a2a = p2p = None
    if config.cp_comm_type == "a2a+p2p":
        hier = mesh["cp"]._unflatten(0, (config.cp_p2p_size, config.cp_a2a_size),
                                     ("cp_p2p", "cp_a2a"))
        a2a, p2p = hier["cp_a2a"], hier["cp_p2p"]
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(device_type)
    state = ParallelState(
        config=config, mesh=mesh, rank=dist.get_rank(), world_size=world, backend=backend,
        device=device,
        tp_mesh=mesh["tp"], cp_mesh=mesh["cp"], dp_mesh=mesh["dp"], pp_mesh=mesh["pp"],
        dp_cp_mesh=_sub(mesh, config, ("dp", "cp"), "dp_cp"),
        tp_cp_mesh=_sub(mesh, config, ("cp", "tp"), "tp_cp"),
        mp_mesh=_sub(mesh, config, ("pp", "tp"), "mp"),
        amax_mesh=_sub(mesh, config, ("dp", "cp", "tp"), "amax"),
        cp_a2a_mesh=a2a, cp_p2p_mesh=p2p)
    if backend == "gloo" and device_type == "cpu" and config.tp > 1:
        shm.setup(state.tp_group)   # collective over the TP group; None keeps gloo
    state.build_seconds = time.perf_counter() - t0
    return state


def init_parallel(tp: int | None = None, cp: int | None = None, pp: int | None = None,
                  dp: int | None = None, *, sequence_parallel: bool | None = None,
                  cp_comm_type: str | None = None, cp_a2a_size: int | None = None,
                  config: ParallelConfig | None = None, backend: str | None = None,
                  seed: int | None = 1234) -> ParallelState:
    """Build the layout's groups and make it the current state; call it again after
    destroy_parallel() for another layout. The default process group is reused when one
    exists (torchrun's env://, Lightning's, your own: then ``backend`` must match it);
    otherwise it is created (env://, or a world of one) and kept until the process exits.
    Arguments left ``None`` come from ``TPKIT_*`` variables (what tpkit-launch exports),
    then from ParallelConfig's defaults. ``seed`` seeds the RNG tracker
    (tpkit.random.model_parallel_seed); None skips it."""
    global _CURRENT
    if _CURRENT is not None:
        raise RuntimeError("a parallel state is already initialised; call "
                           "tpkit.destroy_parallel() before init_parallel() with a new layout")
    if config is None:
        config = ParallelConfig.from_env(
            tp=tp, cp=cp, pp=pp, dp=dp, sequence_parallel=sequence_parallel,
            cp_comm_type=cp_comm_type, cp_a2a_size=cp_a2a_size)
    elif any(v is not None for v in (tp, cp, pp, dp, sequence_parallel, cp_comm_type,
                                      cp_a2a_size)):
        raise ValueError("pass either config= or individual sizes to init_parallel, not both")
    if backend is None and os.environ.get("TPKIT_BACKEND"):
        backend = os.environ["TPKIT_BACKEND"]  # exported by tpkit-launch
    if backend is not None and backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r} is not supported; use 'nccl' or 'gloo'")
    if dist.is_initialized():
        # Validate before building so a bad layout fails without touching the groups.
        config.validate(dist.get_world_size())
    elif "WORLD_SIZE" in os.environ:
        config.validate(int(os.environ["WORLD_SIZE"]))
    else:
        config.validate(1)
    shm_allreduce_enabled()   # a bad TPKIT_SHM_ALLREDUCE fails before any group exists
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA GPUs and none are visible; use backend='gloo'")
    _init_default_group(backend)
    state = build_state(config)
    _CURRENT = state
    if seed is not None:
        from .random import model_parallel_seed
        model_parallel_seed(seed, state)
    return state


def get_parallel_state() -> ParallelState:
    """The current state; raises if init_parallel() has not run (never a default)."""
    if _CURRENT is None:
        raise RuntimeError("tpkit parallel state is not initialised; call tpkit.init_parallel() "
                           "first (or launch through tpkit-launch / TPKitStrategy)")
    return _CURRENT


def resolve_state(state: "ParallelState | None" = None) -> ParallelState:
    """``state`` itself, or the current state when it is None (every ``state=None``
    keyword in tpkit means this)."""
    return get_parallel_state() if state is None else state


def is_initialized() -> bool:
    return _CURRENT is not None


def set_parallel_state(state: ParallelState | None) -> None:
    """Install ``state`` as the current one (for tests and frameworks building their own)."""
    global _CURRENT
    _CURRENT = state


def destroy_parallel() -> None:
    """Destroy every group of the current layout (tp, cp, dp, ... and their shared-memory
    transports), reset the RNG tracker and clear the current state, so that
    init_parallel() can build another layout. The default process group is left alone:
    it outlives layouts (init_parallel reuses it) and, if init_parallel created it, is
    destroyed at exit. Collective: every rank calls it (it starts with a barrier)."""
    global _CURRENT
    state, _CURRENT = _CURRENT, None
    from .random import get_rng_tracker
    get_rng_tracker().reset()
    if state is None or not dist.is_initialized():
        return
    if state.backend != "fake":
        # Tearing gloo groups down while a peer is still inside a collective on them
        # aborts the process ("terminate called without an active exception").
        dist.barrier()
        shm.release(state.tp_group)
    world = dist.group.WORLD
    groups = {}  # resolve every group first: meshes share groups by name
    for mesh in (state.mesh, state.dp_cp_mesh, state.tp_cp_mesh, state.mp_mesh,
                 state.amax_mesh, state.cp_a2a_mesh, state.cp_p2p_mesh):
        if mesh is not None:
            groups.update((id(g), g) for g in mesh.get_all_groups() if g is not world)
    for g in groups.values():
        dist.destroy_process_group(g)


def build_fake_state(config: ParallelConfig, world_size: int, rank: int = 0) -> ParallelState:
    """The state rank ``rank`` would build in a world of ``world_size``, on PyTorch's fake
    process group, in this process (no workers, no GPUs). Used by ``--dry-run`` and tests.
    Requires that no default process group exists; destroy it with destroy_fake_state()."""
    if dist.is_initialized():
        raise RuntimeError("build_fake_state needs a process without a default process group")
    config = config.validate(world_size)
    # Importing this module registers the "fake" backend (no public home in torch yet).
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        return build_state(config, device_type="cpu")
    except Exception:
        dist.destroy_process_group()
        raise


def destroy_fake_state(state: ParallelState) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
