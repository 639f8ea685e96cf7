"""fp8 parameters (TE's ``fp8_model_init``) on the torch backend, and their master weights.

Inside ``fp8_model_init(enabled=True)``, the weight of every tpkit linear layer built
there (``ColumnParallelLinear``, ``RowParallelLinear``, and what registers with
``register_gemm_layer``: te_api's plain ``Linear``) is stored as an ``FP8Weight``: one
byte of E4M3 code per element plus one float32 ``scale_inv`` (the module holds no
high-precision copy). Biases, norms, embeddings and MoE experts keep their dtype. The
conversion runs when the context exits (each weight initialised as usual first, then
quantized with a per-tensor current scale: ``448 / amax``).

``FP8Weight`` is a tensor subclass with the weight's nominal dtype (so its gradient is a
plain tensor of that dtype, as TE's Float8Tensor). Any op on it sees the dequantized
values (``codes * scale_inv``), except:
- the emulated fp8 GEMM (tpkit.fp8.linear) of a per-tensor recipe, which multiplies the
  stored codes with their own ``scale_inv`` (no second quantization); block recipes
  quantize the dequantized weight per block, as from any high-precision weight;
- ``copy_`` into it, which quantizes the source afresh (new codes, new scale): the one
  way to write it;
- any other in-place op on it, a ``ValueError`` (an optimizer updating it directly
  would otherwise lose its update).

Master weights, as TE documents for training with fp8-only parameters (the
high-precision copies live in the optimizer): ``with_master_weights(optimizer)`` swaps,
in the optimizer's param groups, each ``FP8Weight`` parameter for a float32 master copy
and registers two hooks on the optimizer: before ``step`` each parameter's gradient
moves to its master (``param.grad`` becomes None), after ``step`` each master is written
back into its parameter with ``copy_`` (quantized). The optimizer's state is the
masters'; the model's parameters stay fp8.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from ..nn.linear import ColumnParallelLinear, RowParallelLinear
from ..te.offload import mark_not_offload
from .quantize import amax, cast, current_scale
from .recipes import E4M3

__all__ = ["FP8Weight", "fp8_model_init", "with_master_weights", "register_gemm_layer",
           "is_fp8_weight"]

_GEMM_LAYERS: list[type] = [ColumnParallelLinear, RowParallelLinear]
_aten = torch.ops.aten


def register_gemm_layer(cls: type) -> type:
    """Let ``fp8_model_init`` store ``cls``'s ``weight`` in fp8 (a layer whose matmul is
    tpkit.nn.linear.linear_fn's)."""
    if cls not in _GEMM_LAYERS:
        _GEMM_LAYERS.append(cls)
    return cls


def _quantize(t: torch.Tensor, fmt=E4M3):
    t = t.detach()
    s = current_scale(amax(t), fmt[1])
    return cast(t, s, fmt), (1.0 / s).float().reshape(())


class FP8Weight(torch.Tensor):
    """A weight held as fp8 codes (``codes``, ``torch.float8_e4m3fn``) and one float32
    ``scale_inv``; it reports the weight's nominal dtype and dequantizes for any op (the
    module docstring)."""

    codes: torch.Tensor
    scale_inv: torch.Tensor

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                requires_grad: bool = False):
        t = torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=dtype,
                                                device=codes.device,
                                                requires_grad=requires_grad)
        t.codes, t.scale_inv = codes, scale_inv
        mark_not_offload(codes, scale_inv)   # the module's own bytes: nothing to offload
        return t

    def __init__(self, *args, **kwargs):
        pass

    @classmethod
    def quantize(cls, t: torch.Tensor) -> "FP8Weight":
        codes, scale_inv = _quantize(t)
        return cls(codes, scale_inv, t.dtype)

    def dequantize(self) -> torch.Tensor:
        return (self.codes.float() * self.scale_inv).to(self.dtype)

    def __repr__(self):
        return (f"FP8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, codes="
                f"{self.codes.dtype}, scale_inv={self.scale_inv.item():.6g})")

    def __tensor_flatten__(self):
        return ["codes", "scale_inv"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return FP8Weight(inner["codes"], inner["scale_inv"], dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (_aten.detach.default, _aten.alias.default):
            w = args[0]
            return FP8Weight(w.codes, w.scale_inv, w.dtype)
        if func is _aten.copy_.default and isinstance(args[0], FP8Weight):
            dst, src = args[0], args[1]
            if isinstance(src, FP8Weight):
                src = src.dequantize()
            codes, scale_inv = _quantize(src.to(dst.device))
            dst.codes.copy_(codes)
            dst.scale_inv.copy_(scale_inv)
            return dst
        _refuse_writes(func, args, kwargs)
        args, kwargs = tree_map_only(FP8Weight, FP8Weight.dequantize, (args, kwargs))
        return func(*args, **kwargs)


def _refuse_writes(func, args, kwargs) -> None:
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = kwargs.get(a.name, args[i] if i < len(args) else None)
        if any(isinstance(t, FP8Weight) for t in tree_flatten(value)[0]):
            raise ValueError(f"{func} writes into an fp8 parameter (fp8_model_init): it would "
                             "change a dequantized copy and lose the update; fp8 parameters "
                             "are written with copy_, as tpkit.fp8.with_master_weights("
                             "optimizer) does after each step")


def is_fp8_weight(t) -> bool:
    return isinstance(t, FP8Weight)


_ACTIVE: list[list | None] = []   # innermost last: the modules to convert, None: disabled


def _record(module, name, param):
    if _ACTIVE and _ACTIVE[-1] is not None and name == "weight" and \
            isinstance(module, tuple(_GEMM_LAYERS)):
        _ACTIVE[-1].append(module)


@contextlib.contextmanager
def fp8_model_init(enabled: bool = True):
    """TE's ``fp8_model_init``: tpkit linear layers built inside hold their weights only in
    fp8 (``FP8Weight``); ``enabled=False`` (also nested in an enabled one) builds them as
    usual. Train them with ``with_master_weights(optimizer)``."""
    todo = [] if enabled else None
    _ACTIVE.append(todo)
    handle = nn.modules.module.register_module_parameter_registration_hook(_record) \
        if len(_ACTIVE) == 1 else None
    ok = False
    try:
        yield
        ok = True
    finally:
        _ACTIVE.pop()
        if handle is not None:
            handle.remove()
    if ok and todo:
        for module in dict.fromkeys(todo):
            p = module._parameters.get("weight")
            if p is not None and not isinstance(p, FP8Weight):
                module._parameters["weight"] = nn.Parameter(
                    FP8Weight.quantize(p), requires_grad=p.requires_grad)
                _copy_tags(p, module._parameters["weight"])


def _copy_tags(src, dst) -> None:
    """Keep the parameter tags (tp_partition_dim, ...) the layer set on its weight."""
    for k, v in vars(src).items():
        if not k.startswith("_"):
            setattr(dst, k, v)


def with_master_weights(optimizer: torch.optim.Optimizer,
                        dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    """Put ``dtype`` master copies of the optimizer's fp8 parameters in their place in its
    param groups and hook the optimizer's step (module docstring); returns the optimizer.
    Call it before the first step (the optimizer holds no state yet)."""
    if hasattr(optimizer, "fp8_masters"):
        raise ValueError("with_master_weights(optimizer) twice: this optimizer holds master "
                         "weights already; call it once")
    if optimizer.state:
        raise ValueError("with_master_weights(optimizer) after the optimizer has taken a "
                         "step: its state belongs to the fp8 parameters; call it right "
                         "after building the optimizer")
    pairs = []
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            if isinstance(p, FP8Weight):
                master = nn.Parameter(p.detach().dequantize().to(dtype),
                                      requires_grad=p.requires_grad)
                _copy_tags(p, master)   # a TP shard's master is that shard (its tags)
                group["params"][i] = master
                pairs.append((p, master))
    if not pairs:
        raise ValueError("with_master_weights(optimizer): the optimizer holds no fp8 "
                         "parameter; build the model inside tpkit.fp8.fp8_model_init() "
                         "and the optimizer over model.parameters()")

    def before(opt, args, kwargs):
        for p, m in pairs:
            m.grad = None if p.grad is None else p.grad.to(m.dtype)
            p.grad = None

    def after(opt, args, kwargs):
        with torch.no_grad():
            for p, m in pairs:
                p.copy_(m)

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
    optimizer.fp8_masters = pairs
    return optimizer
