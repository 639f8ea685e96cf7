"""``TPKitPrecision("fp8", replace_layers=...)``: the layers Lightning's
TransformerEnginePrecision replaces, replaced on tpkit's two backends.

Where TE runs, ``replace_with_te`` does what Lightning's plugin does: every ``nn.Linear``
(subclasses included) whose in/out features divide by 8/16 (TE's fp8 GEMM shapes; the
others stay, with a warning) becomes TE's ``Linear``, every ``nn.LayerNorm`` TE's
``LayerNorm``, each with its own new parameters holding a copy of the weights (so an
optimizer must be built after ``fabric.setup_module``, as with Lightning's plugin). Unlike
Lightning's, a LayerNorm TE cannot represent (several normalized dims, no affine weight)
is left as it is, with a warning, instead of being replaced wrongly.

On the torch backend ``replace_layers`` routes plain nn.Linear layers through tpkit's
emulated fp8:

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

import torch
from torch import nn

from .. import fp8


class FP8Linear(nn.Linear):
    """nn.Linear whose matmul goes through tpkit.fp8.linear (emulated fp8 in autocast)."""

    def forward(self, x):
        return fp8.linear(self, x, self.weight, self.bias)


def replace_layers(module: nn.Module, warn: bool = True) -> list[str]:
    """Swap exact nn.Linear children (recursively) for FP8Linear in place; returns the
    replaced names and (``warn``) warns about the skipped ones."""
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
    if skipped and warn:
        warnings.warn("TPKitPrecision(replace_layers=True) left these layers unchanged: "
                      + ", ".join(skipped), stacklevel=2)
    return replaced


def replace_with_te(module: nn.Module, te) -> list[str]:
    """Swap nn.Linear / nn.LayerNorm children (recursively) for ``te``'s (the imported
    ``transformer_engine.pytorch``) Linear / LayerNorm, copying the weights; returns the
    replaced names and warns about the skipped ones (see the module docstring)."""
    replaced, skipped = [], []

    def visit(parent: nn.Module, prefix: str) -> None:
        for cname, c in list(parent.named_children()):
            full = f"{prefix}{cname}"
            if isinstance(c, nn.Linear):
                if c.in_features % 8 or c.out_features % 16:
                    skipped.append(f"{full} (Linear {c.in_features}->{c.out_features}: TE's "
                                   "fp8 needs in_features % 8 == 0 and out_features % 16 == 0;"
                                   " pad the layer)")
                    continue
                new = te.Linear(c.in_features, c.out_features, bias=c.bias is not None,
                                params_dtype=c.weight.dtype, device=c.weight.device)
                with torch.no_grad():
                    new.weight.copy_(c.weight)
                    if c.bias is not None:
                        new.bias.copy_(c.bias)
            elif isinstance(c, nn.LayerNorm):
                if len(c.normalized_shape) != 1 or c.weight is None:
                    skipped.append(f"{full} (LayerNorm{tuple(c.normalized_shape)}, "
                                   f"elementwise_affine={c.weight is not None}: TE's LayerNorm "
                                   "normalizes one dim with a weight)")
                    continue
                new = te.LayerNorm(c.normalized_shape[0], eps=c.eps, dtype=c.weight.dtype,
                                   device=c.weight.device)
                with torch.no_grad():
                    new.weight.copy_(c.weight)
                    if c.bias is not None:
                        new.bias.copy_(c.bias)
                    else:                 # nn.LayerNorm(bias=False): TE's bias stays zero
                        new.bias.zero_()
            else:
                visit(c, full + ".")
                continue
            setattr(parent, cname, new)
            replaced.append(full)

    visit(module, "")
    if skipped:
        warnings.warn("TPKitPrecision(replace_layers) left these layers as they are: "
                      + ", ".join(skipped), stacklevel=2)
    return replaced
