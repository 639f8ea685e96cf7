"""Emulated fp8 for the torch backend: Transformer Engine's four training recipes.

Inside ``fp8_autocast(recipe=...)`` every matmul routed through ``linear(layer, x,
weight, bias)`` (tpkit.nn's one linear function) runs in emulated fp8:

- ``recipes``: ``DelayedScaling``, ``Float8CurrentScaling``, ``Float8BlockScaling``,
  ``MXFP8BlockScaling`` with TE's fields, by name ("delayed", "current", "block",
  "mxfp8"), dict or object (tpkit's or TE's); ``from_any``;
- ``quantize``: the casts (per tensor, per 1x128/128x128 tile, per 32-element MX block)
  and their scale formulas;
- ``amax``: ``layer.fp8_meta``, delayed scaling's amax histories and their reduction
  over the amax group;
- ``autocast``: ``fp8_autocast``, the process-wide state (``reset``), recompute replay;
- ``params``: ``fp8_model_init`` (weights held only as fp8 codes + scale, ``FP8Weight``)
  and ``with_master_weights`` (the optimizer's float32 masters, written back after each
  step);
- ``linear``: the emulated GEMMs (installed into tpkit.nn.linear on import), and the
  grouped one of MoE experts (installed into tpkit.nn.moe: per-expert scales by global
  expert index, docs/moe.md).

Which tensors share a scale across ranks, per recipe: docs/precision.md.
"""
from .amax import GRAD, INPUT, WEIGHT, FP8Meta, compute_scale, meta_of
from .autocast import fp8_autocast, is_active, recompute_contexts, reset
from .linear import linear
from .params import FP8Weight, fp8_model_init, register_gemm_layer, with_master_weights
from .quantize import current_scale, mx_exponent, quantize, quantize_blocks
from .recipes import (E4M3, E5M2, FORMATS, DelayedScaling, Float8BlockScaling,
                      Float8CurrentScaling, MMParams, MXFP8BlockScaling, QParams, from_any)

__all__ = ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling",
           "QParams", "MMParams", "from_any", "fp8_autocast", "linear", "reset", "is_active",
           "recompute_contexts", "FP8Meta", "meta_of", "compute_scale", "current_scale",
           "mx_exponent", "quantize", "quantize_blocks", "E4M3", "E5M2", "FORMATS", "INPUT",
           "WEIGHT", "GRAD", "FP8Weight", "fp8_model_init", "with_master_weights",
           "register_gemm_layer"]
