"""Starting and ending layouts, and the Megatron-Core-style getters over the current one.

``init_parallel`` builds a layout's groups (tpkit.layout.topology.build_state) over the default
process group and makes it the current state; ``destroy_parallel`` frees them.

Lifetimes: a layout's groups live from init_parallel() to destroy_parallel(); the default
process group outlives layouts (torch cannot create it twice on one rendezvous store), so
any number of init/destroy cycles run over one default group, destroyed once at exit when
init_parallel created it (docs/design.md, "State lifetime").

The getters (second half) let code written against ``megatron.core.parallel_state`` (and
DeepSpeed's ``mpu``) run on tpkit. Every getter raises when nothing is initialised —
never a 0 or a wrong group.
"""
from __future__ import annotations

import atexit
import gc
import os
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from . import topology
from .config import ParallelConfig, fused_attn_enabled, note_layout_built
from .random import get_rng_tracker, model_parallel_seed
from ..comm.shm import shm_allreduce_enabled, shm_p2p_enabled
from .topology import (ParallelState, build_state, get_parallel_state, is_initialized,  # noqa: F401
                       resolve_state, set_parallel_state)

# The default process group init_parallel created in this process (a weak reference: a
# strong one would keep it alive past its destruction, see release_default_group; None: it
# created none). It outlives every layout and is destroyed once, at interpreter exit
# (_destroy_default_group).
_DEFAULT_GROUP: "weakref.ref | None" = None


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
    timeout = pg_timeout()
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
    _DEFAULT_GROUP = weakref.ref(dist.group.WORLD)


def pg_timeout(env=None) -> timedelta:
    """The default process group's timeout: ``TPKIT_PG_TIMEOUT`` seconds, else 600 (every
    collective on it fails after this long instead of hanging; TPKitStrategy uses it
    too)."""
    env = os.environ if env is None else env
    raw = env.get("TPKIT_PG_TIMEOUT", "600")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"TPKIT_PG_TIMEOUT={raw!r} must be a positive number of seconds "
                         "(e.g. TPKIT_PG_TIMEOUT=600)")
    return timedelta(seconds=seconds)


def _destroy_default_group() -> None:
    """At exit: destroy the default group if it is still the one init_parallel created
    (NCCL warns about a group left alive; the user may have destroyed it already). No
    barrier: a rank that exits after an error must not wait for the others."""
    if _DEFAULT_GROUP is not None and dist.is_initialized() \
            and dist.group.WORLD is _DEFAULT_GROUP():
        release_default_group()


def release_default_group() -> bool:
    """Destroy torch.distributed's default process group and every group left, and free
    them now, before the interpreter finalizes: tpkit-launch's workers and ``tpkit-train``
    call it when the script is done. True when every group was freed here (their
    backends' threads joined), False when there was none or something still holds one.

    Why: each gloo group runs worker threads, and a worker thread drops its last
    collective's Work (and so that Work's tensors) only when it next gets the CPU. If that
    happens during interpreter finalization, releasing a tensor's Python object needs the
    GIL, CPython ends the thread (pthread_exit) and the unwinding aborts the process:
    "terminate called without an active exception", SIGABRT after the script finished
    (torch issue 190489; likely under CPU load). ``destroy_process_group`` alone does not
    help while a Python object still holds a group: only a group's destructor joins its
    worker threads, so this also collects the garbage that may hold them. No barrier: a
    rank that stops early (an error) must not wait for the others; the peers' last
    collective has its data already (exiting would close the sockets as well)."""
    if not dist.is_initialized():
        return False
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {})) or [dist.group.WORLD]
    refs = [weakref.ref(g) for g in groups]
    del groups
    dist.destroy_process_group()
    gc.collect()   # Fabric's and tpkit's objects may hold them in reference cycles
    return all(r() is None for r in refs)


def init_parallel(tp: int | None = None, cp: int | None = None, pp: int | None = None,
                  dp: int | None = None, *, sequence_parallel: bool | None = None,
                  cp_comm_type: str | None = None, cp_a2a_size: int | None = None,
                  ep: int | None = None, etp: int | None = None,
                  config: ParallelConfig | None = None, backend: str | None = None,
                  seed: int | None = 1234) -> ParallelState:
    """Build the layout's groups and make it the current state; call it again after
    destroy_parallel() for another layout. The default process group is reused when one
    exists (torchrun's env://, Lightning's, your own: then ``backend`` must match it);
    otherwise it is created (env://, or a world of one) and kept until the process exits.
    Arguments left ``None`` come from ``TPKIT_*`` variables (what tpkit-launch exports),
    then from ParallelConfig's defaults. ``ep``/``etp`` re-cut each stage's tp*cp*dp
    ranks for the expert layers (docs/moe.md). ``seed`` seeds the RNG tracker
    (tpkit.layout.random.model_parallel_seed); None skips it."""
    if is_initialized():
        raise RuntimeError("a parallel state is already initialised; call "
                           "tpkit.destroy_parallel() before init_parallel() with a new layout")
    if config is None:
        config = ParallelConfig.from_env(
            tp=tp, cp=cp, pp=pp, dp=dp, sequence_parallel=sequence_parallel,
            cp_comm_type=cp_comm_type, cp_a2a_size=cp_a2a_size, ep=ep, etp=etp,
            given_as="init_parallel's {name} argument")
    elif any(v is not None for v in (tp, cp, pp, dp, sequence_parallel, cp_comm_type,
                                      cp_a2a_size, ep, etp)):
        raise ValueError("pass either config= or individual sizes to init_parallel, not both")
    if backend is None and os.environ.get("TPKIT_BACKEND"):
        backend = os.environ["TPKIT_BACKEND"]  # exported by tpkit-launch
    if backend is not None and backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r} is not supported; use 'nccl' or 'gloo'")
    # Validate before building so a bad layout fails without touching the groups.
    if dist.is_initialized():
        world, where = dist.get_world_size(), "the default process group's size"
    elif "WORLD_SIZE" in os.environ:
        world, where = int(os.environ["WORLD_SIZE"]), "$WORLD_SIZE, set by the launcher"
    else:
        world, where = 1, "no $WORLD_SIZE: a process started without a launcher is a world of one"
    try:
        config.validate(world)
    except ValueError as e:
        raise ValueError(f"{e} [world size {world}: {where}]") from None
    shm_allreduce_enabled()   # a bad TPKIT_SHM_ALLREDUCE fails before any group exists
    shm_p2p_enabled()         # so does a bad TPKIT_SHM_P2P
    fused_attn_enabled()      # and so does a bad TPKIT_FUSED_ATTN
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA GPUs and none are visible; use backend='gloo'")
    _init_default_group(backend)
    state = build_state(config)
    set_parallel_state(state)
    note_layout_built()   # the launch's layout flags bound this first layout only
    if seed is not None:
        model_parallel_seed(seed, state)
    return state


def destroy_parallel() -> None:
    """Destroy every group of the current layout (tp, cp, dp, ... and their shared-memory
    transports), reset the RNG tracker and clear the current state, so that
    init_parallel() can build another layout. The default process group is left alone:
    it outlives layouts (init_parallel reuses it) and, if init_parallel created it, is
    destroyed at exit. Collective: every rank calls it (it starts with a barrier)."""
    state = get_parallel_state() if is_initialized() else None
    set_parallel_state(None)
    get_rng_tracker().reset()
    if state is None or not dist.is_initialized():
        return
    if state.backend != "fake":
        # Tearing gloo groups down while a peer is still inside a collective on them
        # aborts the process ("terminate called without an active exception").
        dist.barrier()
    topology.destroy_groups(state)


# --- Megatron-Core getters ------------------------------------------------------------
def model_parallel_is_initialized() -> bool:
    return is_initialized()


# --- tensor parallel ---------------------------------------------------------------
def get_tensor_model_parallel_group():
    return get_parallel_state().tp_group


def get_tensor_model_parallel_rank() -> int:
    return get_parallel_state().tp_rank


def get_tensor_model_parallel_world_size() -> int:
    return get_parallel_state().tp_size


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group."""
    return get_parallel_state().group_ranks("tp")[0]


def get_tensor_model_parallel_ranks() -> list[int]:
    return get_parallel_state().group_ranks("tp")


# --- context parallel --------------------------------------------------------------
def get_context_parallel_group():
    return get_parallel_state().cp_group


def get_context_parallel_global_ranks() -> list[int]:
    return get_parallel_state().cp_global_ranks


def get_context_parallel_rank() -> int:
    return get_parallel_state().cp_rank


def get_context_parallel_world_size() -> int:
    return get_parallel_state().cp_size


def get_hierarchical_context_parallel_groups():
    """``[a2a_group, p2p_group]`` for cp_comm_type='a2a+p2p' (TE's order), else None."""
    s = get_parallel_state()
    return None if s.cp_a2a_mesh is None else [s.cp_a2a_group, s.cp_p2p_group]


def get_tensor_and_context_parallel_group():
    return get_parallel_state().tp_cp_group


def get_tensor_and_context_parallel_world_size() -> int:
    s = get_parallel_state()
    return s.tp_size * s.cp_size


# --- data parallel -----------------------------------------------------------------
def get_data_parallel_group(with_context_parallel: bool = False):
    s = get_parallel_state()
    return s.dp_cp_group if with_context_parallel else s.dp_group


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    s = get_parallel_state()
    return s.dp_cp_rank if with_context_parallel else s.dp_rank


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    s = get_parallel_state()
    return s.dp_cp_size if with_context_parallel else s.dp_size


def get_data_parallel_group_ranks(with_context_parallel: bool = False) -> list[int]:
    return get_parallel_state().group_ranks("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return get_data_parallel_group_ranks(with_context_parallel)[0]


# --- pipeline parallel -------------------------------------------------------------
def get_pipeline_model_parallel_group():
    return get_parallel_state().pp_group


def get_pipeline_model_parallel_rank() -> int:
    return get_parallel_state().pp_rank


def get_pipeline_model_parallel_world_size() -> int:
    return get_parallel_state().pp_size


def get_pipeline_model_parallel_first_rank() -> int:
    return get_parallel_state().group_ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return get_parallel_state().group_ranks("pp")[-1]


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    s = get_parallel_state()
    return s.pp_rank == s.pp_size - 1


# --- model parallel (tp x pp) and fp8 amax -----------------------------------------
def get_model_parallel_group():
    return get_parallel_state().mp_group


def get_amax_reduction_group():
    """tp x cp x dp of this pipeline stage: Megatron's default fp8 amax group."""
    return get_parallel_state().amax_group


# --- expert parallel (Megatron-Core's names; docs/moe.md) -------------------------------
def get_expert_model_parallel_group():
    return get_parallel_state().ep_group


def get_expert_model_parallel_rank() -> int:
    return get_parallel_state().ep_rank


def get_expert_model_parallel_world_size() -> int:
    return get_parallel_state().ep_size


def get_expert_tensor_parallel_group():
    return get_parallel_state().etp_group


def get_expert_tensor_parallel_rank() -> int:
    return get_parallel_state().etp_rank


def get_expert_tensor_parallel_world_size() -> int:
    return get_parallel_state().etp_size


def get_expert_tensor_and_model_parallel_group():
    return get_parallel_state().etp_ep_group


def get_expert_data_parallel_group():
    return get_parallel_state().edp_group


def get_expert_data_parallel_rank() -> int:
    return get_parallel_state().edp_rank


def get_expert_data_parallel_world_size() -> int:
    return get_parallel_state().edp_size
