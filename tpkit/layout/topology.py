"""What a layout is: ParallelState, the DeviceMesh and every process group it holds,
and the one "current state" slot of this process.

Rank order (docs/design.md, "Layout and rank order"): TP innermost, then CP, DP, PP
outermost, i.e. ``rank = tp + TP*(cp + CP*(dp + DP*pp))`` — the mesh ``(pp, dp, cp, tp)``
in row-major order. The groups (GROUP_NAMES; docs/design.md has the table of who uses
which) are built once by ``build_state`` and kept as attributes: tp, cp, dp, pp, the
flattened dp_cp, tp_cp, mp (tp x pp) and amax (tp x cp x dp of one stage), and the two
hierarchical CP levels of ``a2a+p2p``, the expert groups etp, ep, edp, etp_ep (and
``expert_mesh``, the 2-D (ep, etp) view of them that sharded checkpoints place expert
weights on). Groups over dimensions of size 1 alias the size-1
tp/cp/... group instead of creating duplicates; NCCL creates communicators lazily, so a
size-1 group that is never used costs nothing there.

Starting and ending layouts (init_parallel, destroy_parallel, the default process
group's lifetime) is tpkit.layout.parallel_state's; planning a layout without workers (the fake
process group, the rank table as text) is tpkit.layout.planning's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..comm import shm
from .config import ParallelConfig

MESH_DIMS = ("pp", "dp", "cp", "tp")
GROUP_NAMES = ("tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "mp", "amax", "cp_a2a", "cp_p2p",
               "etp", "ep", "edp", "etp_ep")
# The expert layers' decomposition of one stage's tp*cp*dp ranks (Megatron-Core's
# "parallel folding", order tp-ep-dp): etp innermost, then ep, then edp.
EXPERT_DIMS = ("edp", "ep", "etp")

_CURRENT: "ParallelState | None" = None


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
    etp_mesh: DeviceMesh | None = None
    ep_mesh: DeviceMesh | None = None
    edp_mesh: DeviceMesh | None = None
    etp_ep_mesh: DeviceMesh | None = None
    # (ep, etp) as a 2-D mesh of the groups above (no group of its own): the placement of
    # expert weights' shards in sharded checkpoints (tpkit/checkpoint/_dcp.py)
    expert_mesh: DeviceMesh | None = None
    build_seconds: float = 0.0
    # The full length of the last sequence sharded over CP in this layout (written by
    # tpkit.cp.sharding's shard_sequence / shard_position_ids; None: none yet): CP attention
    # (nn.DotProductAttention) refuses it as its local length (a full sequence would
    # attend to all of it on every rank).
    last_sharded_len: int | None = None

    # --- groups ----------------------------------------------------------------
    tp_group = property(lambda self: self.tp_mesh.get_group())
    cp_group = property(lambda self: self.cp_mesh.get_group())
    dp_group = property(lambda self: self.dp_mesh.get_group())
    pp_group = property(lambda self: self.pp_mesh.get_group())
    dp_cp_group = property(lambda self: self.dp_cp_mesh.get_group())
    tp_cp_group = property(lambda self: self.tp_cp_mesh.get_group())
    mp_group = property(lambda self: self.mp_mesh.get_group())
    amax_group = property(lambda self: self.amax_mesh.get_group())
    etp_group = property(lambda self: self.etp_mesh.get_group())
    ep_group = property(lambda self: self.ep_mesh.get_group())
    edp_group = property(lambda self: self.edp_mesh.get_group())
    etp_ep_group = property(lambda self: self.etp_ep_mesh.get_group())

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
    etp_rank = property(lambda self: self.etp_mesh.get_local_rank())
    ep_rank = property(lambda self: self.ep_mesh.get_local_rank())
    edp_rank = property(lambda self: self.edp_mesh.get_local_rank())
    etp_size = property(lambda self: self.config.expert_tp)
    ep_size = property(lambda self: self.config.ep)
    edp_size = property(lambda self: self.config.edp)
    sequence_parallel = property(lambda self: self.config.sequence_parallel)
    cp_comm_type = property(lambda self: self.config.cp_comm_type)

    @property
    def cp_global_ranks(self) -> list[int]:
        """Global ranks of this rank's CP group, in CP-rank order (TE's cp_global_ranks)."""
        return self.cp_mesh.mesh.tolist()

    def group_ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group ``name`` (one of GROUP_NAMES), in group-rank
        order."""
        m = getattr(self, f"{name}_mesh")
        if m is None:
            raise ValueError(f"group {name!r} does not exist for cp_comm_type="
                             f"{self.config.cp_comm_type!r}")
        return m.mesh.flatten().tolist()

    def all_groups(self) -> dict[str, object]:
        """The groups of GROUP_NAMES this layout has, by name."""
        return {n: getattr(self, f"{n}_group") for n in GROUP_NAMES
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
        if self.config.has_experts:
            c = self.config
            for row in rows:   # the expert coordinates, from their formula (EXPERT_DIMS)
                local = row["rank"] % (c.tp * c.cp * c.dp)
                row["etp"] = local % c.expert_tp
                row["ep"] = local // c.expert_tp % c.ep
                row["edp"] = local // (c.expert_tp * c.ep)
        return rows


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


def _expert_meshes(mesh: DeviceMesh, config: ParallelConfig, stage: DeviceMesh,
                   dp_cp: DeviceMesh) -> dict:
    """The etp, ep, edp and etp x ep meshes: ``stage`` (the flattened tp*cp*dp ranks of
    this pipeline stage) unflattened as (edp, ep, etp). Without an expert decomposition
    (ep = 1, etp = tp) the dense groups are the same rank sets and are reused: etp = tp,
    edp = ``dp_cp``, etp x ep = tp, and ep is any size-1 mesh of the layout."""
    if not config.has_experts:
        one = next((mesh[d] for d in MESH_DIMS if mesh[d].size() == 1), None)
        if one is not None:
            return dict(etp_mesh=mesh["tp"], ep_mesh=one, edp_mesh=dp_cp,
                        etp_ep_mesh=mesh["tp"],
                        expert_mesh=None if config.tp == 1 else
                        mesh[(one.mesh_dim_names[0], "tp")])
    sizes = {"edp": config.edp, "ep": config.ep, "etp": config.expert_tp}
    hier = stage._unflatten(0, tuple(sizes[d] for d in EXPERT_DIMS), EXPERT_DIMS)
    both = [d for d in ("ep", "etp") if sizes[d] > 1]
    etp_ep = hier["etp"] if not both else hier[both[0]] if len(both) == 1 \
        else hier[("ep", "etp")]._flatten("etp_ep")
    return dict(etp_mesh=hier["etp"], ep_mesh=hier["ep"], edp_mesh=hier["edp"],
                etp_ep_mesh=etp_ep, expert_mesh=hier[("ep", "etp")])


def _default_group_timeout():
    """The default process group's timeout (None where it cannot be read: a fake group)."""
    try:
        dev = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return dist.group.WORLD._get_backend(dev).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


@contextlib.contextmanager
def _timeout_of_the_default_group():
    """Groups created inside wait as long as the default group (TPKIT_PG_TIMEOUT under
    init_parallel, the strategy's timeout under Fabric). torch gives every new group its own
    default instead (30 minutes on gloo, 10 on NCCL; measured: tp, cp and dp x cp groups at
    1800 s under a 90 s default group), so a collective that some ranks never enter (a
    clip under ``if rank == 0``) would hang that long. DeviceMesh passes no timeout down,
    and every group-creating path of torch asks ``_get_default_timeout`` then."""
    c10d = dist.distributed_c10d
    timeout = _default_group_timeout()
    saved = getattr(c10d, "_get_default_timeout", None)
    if timeout is None or saved is None:
        yield
        return
    c10d._get_default_timeout = lambda backend: timeout
    try:
        yield
    finally:
        c10d._get_default_timeout = saved


def build_state(config: ParallelConfig, *, device_type: str | None = None) -> ParallelState:
    """Build every group of ``config`` over the initialised default process group; every
    group times out like the default group."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; use tpkit.init_parallel()")
    with _timeout_of_the_default_group():
        return _build_state(config, device_type)


def _build_state(config: ParallelConfig, device_type: str | None) -> ParallelState:
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
    amax = _sub(mesh, config, ("dp", "cp", "tp"), "amax")
    dp_cp = _sub(mesh, config, ("dp", "cp"), "dp_cp")
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(device_type)
    state = ParallelState(
        config=config, mesh=mesh, rank=dist.get_rank(), world_size=world, backend=backend,
        device=device,
        tp_mesh=mesh["tp"], cp_mesh=mesh["cp"], dp_mesh=mesh["dp"], pp_mesh=mesh["pp"],
        dp_cp_mesh=dp_cp,
        tp_cp_mesh=_sub(mesh, config, ("cp", "tp"), "tp_cp"),
        mp_mesh=_sub(mesh, config, ("pp", "tp"), "mp"),
        amax_mesh=amax, cp_a2a_mesh=a2a, cp_p2p_mesh=p2p,
        **_expert_meshes(mesh, config, amax, dp_cp))
    if backend == "gloo" and device_type == "cpu" and config.tp > 1:
        shm.setup(state.tp_group)   # collective over the TP group; None keeps gloo
    if backend == "gloo" and device_type == "cpu" and config.cp > 1:
        for group in _ring_groups(state):   # collective over each; None keeps gloo
            shm.setup_p2p(group)
    state.build_seconds = time.perf_counter() - t0
    return state


def _ring_groups(state: ParallelState) -> list:
    """The groups the context-parallel ring exchanges K/V over: the CP group (p2p) and,
    for a2a+p2p, its point-to-point sub-group."""
    groups = [state.cp_group]
    if state.cp_p2p_mesh is not None and state.cp_p2p_mesh.size() > 1:
        groups.append(state.cp_p2p_group)
    return groups


_DESTROY_HOOKS: list = []


def add_destroy_hook(fn) -> None:
    """Call ``fn(groups)`` with the process groups ``destroy_groups`` is about to destroy
    (tpkit.te drops Transformer Engine's fp8 state that refers to them)."""
    if fn not in _DESTROY_HOOKS:
        _DESTROY_HOOKS.append(fn)


def destroy_groups(state: ParallelState) -> None:
    """Release the TP and CP groups' shared-memory transports and destroy every group of
    ``state`` except the default one, releasing them at once (not at the next cyclic
    garbage collection). Collective; the caller makes sure no rank is still inside a
    collective on them (destroy_parallel starts with a barrier)."""
    for group in (state.tp_group, *_ring_groups(state)):
        shm.release(group)   # a group without a transport: nothing to do
    world = dist.group.WORLD
    groups = {}  # resolve every group first: meshes share groups by name
    meshes = [m for m in (state.mesh, state.dp_cp_mesh, state.tp_cp_mesh, state.mp_mesh,
                          state.amax_mesh, state.cp_a2a_mesh, state.cp_p2p_mesh,
                          state.etp_mesh, state.ep_mesh, state.edp_mesh, state.etp_ep_mesh)
              if m is not None]
    for mesh in meshes:
        groups.update((id(g), g) for g in mesh.get_all_groups() if g is not world)
    for hook in _DESTROY_HOOKS:
        hook(list(groups.values()))
    for g in groups.values():
        dist.destroy_process_group(g)
    # A DeviceMesh holds its groups in ``_pg_registry``, and a root mesh and the meshes
    # flattened from it refer to each other: without this the destroyed groups (gloo's
    # loop threads, which wake every 10 ms; NCCL communicators) live on until Python's
    # cyclic GC happens to run, and a process that builds many layouts piles them up.
    for mesh in meshes:
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


# --- the current state ---------------------------------------------------------------
def get_parallel_state() -> ParallelState:
    """The current state; raises if init_parallel() has not run (never a default)."""
    if _CURRENT is None:
        raise RuntimeError("tpkit parallel state is not initialised; call tpkit.init_parallel() "
                           "first; under Lightning Fabric build the model after "
                           "fabric.launch() (TPKitStrategy builds the layout there)")
    return _CURRENT


def resolve_state(state: "ParallelState | None" = None) -> ParallelState:
    """``state`` itself, or the current state when it is None (every ``state=None``
    keyword in tpkit means this)."""
    return get_parallel_state() if state is None else state


def is_initialized() -> bool:
    return _CURRENT is not None


def set_parallel_state(state: ParallelState | None) -> None:
    """Install ``state`` as the current one (frameworks that build their own state with
    build_state; init_parallel and destroy_parallel use it)."""
    global _CURRENT
    _CURRENT = state

