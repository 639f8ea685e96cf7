"""tpkit: tensor, sequence, context and data parallelism glued correctly.

Public API re-exports only (docs/design.md maps the package). Names resolve lazily:
``import tpkit`` does not import torch, so submodules that need none (``tpkit.layout.config``,
the ``tpkit-launch`` CLI) stay fast.
"""
import importlib

_EXPORTS = {
    "ParallelConfig": "layout.config",
    "ParallelState": "layout.topology",
    "init_parallel": "layout.parallel_state",
    "get_parallel_state": "layout.topology",
    "destroy_parallel": "layout.parallel_state",
    "is_initialized": "layout.topology",
    "parallelize": "plans",
    "verify": "verifier",
    "compile_blocks": "nn",
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
