"""tpkit: tensor, sequence, context and data parallelism glued correctly.

Public API re-exports only; see DESIGN.md §4. Names resolve lazily so that importing a
submodule that needs no torch (``tpkit.config``, the ``tpkit-launch`` CLI) stays fast.
"""
import importlib

_EXPORTS = {
    "ParallelConfig": "config",
    "ParallelState": "topology",
    "init_parallel": "topology",
    "get_parallel_state": "topology",
    "destroy_parallel": "topology",
    "is_initialized": "topology",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tpkit' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
