"""Megatron-Core-compatible getters over the current ParallelState.

Code written against ``megatron.core.parallel_state`` (and DeepSpeed's ``mpu``) can call
these. Every getter raises when nothing is initialised — never a 0 or a wrong group.
"""
from __future__ import annotations

from .topology import get_parallel_state, is_initialized


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
