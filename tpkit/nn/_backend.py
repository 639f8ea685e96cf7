"""Which implementation a tpkit.nn constructor builds: tpkit's torch layers or TE's.

``backend="torch"`` always builds tpkit's own layers; ``"te"`` builds the Transformer
Engine module and fails loudly when TE or CUDA is missing; ``"auto"`` picks TE only when
TE imports *and* CUDA is available, so one model file runs on CPU and on GPUs.
tpkit.te is imported lazily: nothing here touches transformer_engine for "torch".
"""
from __future__ import annotations

BACKENDS = ("auto", "torch", "te")


def resolve_backend(backend: str = "auto") -> str:
    """``"torch"`` or ``"te"`` for a requested backend (see the module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; use one of {BACKENDS}")
    if backend == "torch":
        return "torch"
    from .. import te
    if backend == "te":
        te.require_te()  # raises with what to install / that CUDA is needed
        return "te"
    return "te" if te.te_available() else "torch"


def build_te(kind: str, state=None, **te_kwargs):
    """The TE module for ``kind`` (a key of tpkit.te.KINDS) built for ``state``."""
    from .. import te
    return te.make(kind, state, **te_kwargs)


def te_module_or_none(kind: str, backend: str, state=None, **te_kwargs):
    """For constructors: the TE module when ``backend`` resolves to TE, else None (the
    caller then builds its torch implementation)."""
    if resolve_backend(backend) != "te":
        return None
    return build_te(kind, state, **te_kwargs)
