"""ONNX export mode: the flag behind Transformer Engine's ``onnx_export`` (public as
``tpkit.te_api.onnx_export``).

Inside ``onnx_export(True)`` tpkit's layers take the paths ``torch.onnx.export`` (torch's
default exporter, ``dynamo=True``: ``torch.export`` then ONNX) can trace: the
vocab-parallel cross entropy at one TP rank is ``F.cross_entropy``'s formula (no
host-side id check, which is data-dependent control flow), and every collective of the
layers is refused with a ValueError (an ONNX graph of one rank's shard would silently
compute something else than the model), and so is a MoE layer (its dispatch has
data-dependent shapes). What cannot be exported is refused on entry:
a layout with tp, cp, pp or ep above 1, and the emulated fp8 of ``tpkit.fp8`` (its
scales and amax histories are training state; the exported graph would freeze them).
"""
from __future__ import annotations

import contextlib

import torch

from ..layout.topology import get_parallel_state, is_initialized

__all__ = ["export_mode", "is_onnx_export", "check_exportable"]

_ENABLED = [False]


def is_onnx_export() -> bool:
    """True inside ``onnx_export(enabled=True)``."""
    return _ENABLED[0]


def _refuse(what: str) -> None:
    raise ValueError(
        f"onnx_export(enabled=True): {what}. An ONNX graph holds one process's computation, "
        "and tpkit's model-parallel layers split each layer over ranks that talk through "
        "collectives ONNX cannot express; export at tp=cp=pp=ep=1: gather the checkpoint "
        "to full weights (tpkit.checkpoint.load_full, or save_hf/from_hf), build the model "
        "in a single process (tpkit.init_parallel() with no launcher), load them and export")


def check_exportable(group_size: int, where: str) -> None:
    """Refuse a collective over ``group_size`` ranks during an export (``where``: the
    layer's call), and TorchScript's tracing exporter; a no-op outside onnx_export."""
    if not _ENABLED[0]:
        return
    if group_size > 1:
        _refuse(f"{where} runs a collective over {group_size} ranks")
    if torch.jit.is_tracing():
        raise ValueError("torch.onnx.export(..., dynamo=False) inside onnx_export(enabled="
                         "True): TorchScript's tracing exporter is not supported (it traces "
                         "shapes as tensors where tpkit's layers need integers); use "
                         "dynamo=True, torch's default exporter")


@contextlib.contextmanager
def export_mode(enabled: bool = False):
    """The flag behind ``tpkit.te_api.onnx_export`` (its public home, which also refuses
    fp8): refuses a layout that cannot be exported, then sets ``is_onnx_export()``."""
    if not isinstance(enabled, bool):
        raise ValueError(f"onnx_export(enabled={enabled!r}) takes True or False")
    if enabled and is_initialized():
        s = get_parallel_state()
        sizes = {"tp": s.tp_size, "cp": s.cp_size, "pp": s.pp_size, "ep": s.ep_size}
        bad = {k: v for k, v in sizes.items() if v > 1}
        if bad:
            _refuse("the current layout has " + ", ".join(f"{k}={v}" for k, v in bad.items()))
    saved = _ENABLED[0]
    _ENABLED[0] = enabled or saved
    try:
        yield
    finally:
        _ENABLED[0] = saved
