"""tpkit: tensor, sequence, context and data parallelism glued correctly.

Public API re-exports only; see DESIGN.md §4.
"""
from .config import ParallelConfig
from .topology import (ParallelState, destroy_parallel, get_parallel_state, init_parallel,
                       is_initialized)

__all__ = ["ParallelConfig", "ParallelState", "init_parallel", "get_parallel_state",
           "destroy_parallel", "is_initialized"]
__version__ = "0.1.0"
