"""``TPKitPrecision("fp8", replace_layers=True)``: route plain nn.Linear layers through
tpkit's emulated fp8 (torch backend).

Only exact ``nn.Linear`` instances are replaced, by an ``FP8Linear`` that keeps the *same*
Parameter objects (so an optimizer built before ``fabric.setup`` still holds them) and
whose matmul is ``tpkit.fp8.linear`` — ``F.linear`` outside fp8 autocast, so the math is
unchanged. A replicated layer stays replicated: sharding it over TP would change its
parameters, which is the model's decision, not the precision plugin's. Skipped, with one
warning listing the names: nn.Linear subclasses (their forward may not be nn.Linear's,
e.g. MultiheadAttention's out_proj is never called) and nn.LayerNorm (emulated fp8
quantizes GEMMs only; a norm has nothing to convert).
"""
from __future__ import annotations

import warnings

from torch import nn

from .. import fp8


class FP8Linear(nn.Linear):
    """nn.Linear whose matmul goes through tpkit.fp8.linear (emulated fp8 in autocast)."""

    def forward(self, x):
        return fp8.linear(self, x, self.weight, self.bias)


def replace_layers(module: nn.Module) -> list[str]:
    """Swap exact nn.Linear children (recursively) for FP8Linear in place; returns the
    replaced names and warns about the skipped ones."""
    replaced, skipped = [], []
    for name, child in list(module.named_modules()):
        for cname, c in list(child.named_children()):
            full = f"{name}.{cname}" if name else cname
            if type(c) is nn.Linear:
                new = FP8Linear.__new__(FP8Linear)
                new.__dict__ = c.__dict__  # same parameters, hooks and attributes
                setattr(child, cname, new)
                replaced.append(full)
            elif isinstance(c, nn.Linear) and not isinstance(c, FP8Linear):
                skipped.append(f"{full} ({type(c).__name__}: an nn.Linear subclass)")
            elif isinstance(c, nn.LayerNorm):
                skipped.append(f"{full} (LayerNorm: emulated fp8 converts GEMMs only)")
    if skipped:
        warnings.warn("TPKitPrecision(replace_layers=True) left these layers unchanged: "
                      + ", ".join(skipped), stacklevel=2)
    return replaced
