"""CUDA's autocast op policy on CPU, for tests (issue 48).

CPU autocast and CUDA autocast cast different ops: CPU widens ``index_copy``, ``cat`` and
``stack`` to a common dtype and runs norms, softmax, ``exp`` and ``sum`` in the low
precision; CUDA leaves ``index_copy`` alone (its dtypes must match) and runs those in
float32. Under ``cuda_rules()``, ``torch.autocast("cpu", dtype=...)`` casts as
``torch.autocast("cuda", dtype=...)`` would, so the CPU suite meets the dtypes a GPU run
meets.

How: a ``torch.library.Library("aten", "IMPL")`` registers kernels for the
``AutocastCPU`` dispatch key (the key ``torch.autocast("cpu")`` enables), replacing
PyTorch's CPU autocast kernels while it lives:

- every op of CUDA's lists gets a Python kernel with CUDA's policy
  (``lower_precision_fp``, ``fp32``, ``fp32_set_opt_dtype``, ``fp32_append_dtype``,
  ``promote``; ``WrapFunction_`` in ``ATen/autocast_mode.h``), which casts the eligible
  arguments (floating, not float64, on the CPU) and redispatches below autocast;
- every other op that has a CPU autocast kernel (the dispatcher is asked which) gets a
  fallthrough, so it runs uncast, as on CUDA;
- ``binary_cross_entropy`` raises, as CUDA autocast's banned kernel does.

The lists are not copied here: they are parsed from the installed PyTorch's own
``torch/include/ATen/autocast_mode.h`` (``AT_FORALL_LOWER_PRECISION_FP``,
``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``, ``AT_FORALL_PROMOTE``: the macros
``aten/src/ATen/autocast_mode.cpp`` registers for the CUDA key), so they follow the
installed release. Destroying the library restores PyTorch's CPU kernels.

Not modelled: the weight-cast cache (the casts are the same, only recomputed), kernels,
streams, NCCL (docs/testing.md).
"""
from __future__ import annotations

import contextlib
import os
import re

import torch

_KEY = torch._C.DispatchKey.AutocastCPU
_POLICIES = {"AT_FORALL_LOWER_PRECISION_FP": "lower_precision_fp", "AT_FORALL_FP32": "fp32",
             "AT_FORALL_FP32_SET_OPT_DTYPE": "fp32_set_opt_dtype",
             "AT_FORALL_PROMOTE": "promote"}


def header_path() -> str:
    return os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "autocast_mode.h")


def cuda_policy() -> dict[str, str]:
    """``{"aten::op.overload": policy}`` of CUDA autocast, from PyTorch's header."""
    text = open(header_path()).read()
    policy: dict[str, str] = {}
    for macro, name in _POLICIES.items():
        m = re.search(r"#define %s\(_\)(.*?)\n\n" % macro, text, re.S)
        assert m, f"{macro} not found in {header_path()}"
        for op, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", m.group(1)):
            policy[f"aten::{op}" + (f".{overload}" if overload else "")] = name
    m = re.search(r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE\(_\)(.*?)\n\n", text, re.S)
    assert m, "AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE not found"
    for name in re.findall(r'"(norm\.\w+)"', m.group(1)):
        policy["aten::" + name] = "fp32_append_dtype"
    assert policy.get("aten::mm") == "lower_precision_fp" and policy.get("aten::softmax.int") \
        == "fp32_set_opt_dtype" and policy.get("aten::index_put") == "promote", policy
    return policy


def _eligible(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_floating_point() \
        and t.dtype != torch.float64


def _cast(x, dtype):
    if _eligible(x):
        return x if x.dtype == dtype else x.to(dtype)
    if isinstance(x, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in x):
        return type(x)(_cast(t, dtype) for t in x)
    return x


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _promote(args, low):
    """CUDA's ``prioritize``: float32 wins over the low precision; float64 is ignored."""
    to = low
    for t in _tensors(args):
        if _eligible(t) and t.dtype == torch.float32:
            to = torch.float32
    return to


def _kernel(op, policy):
    schema = op._schema
    dtype_arg = next((i for i, a in enumerate(schema.arguments) if a.name == "dtype"), None)

    def kernel(*args, **kwargs):
        low = torch.get_autocast_dtype("cpu")
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
            if policy == "lower_precision_fp":
                return op(*_cast(args, low), **{k: _cast(v, low) for k, v in kwargs.items()})
            if policy == "fp32":
                return op(*_cast(args, torch.float32),
                          **{k: _cast(v, torch.float32) for k, v in kwargs.items()})
            if policy == "promote":
                to = _promote(list(args) + list(kwargs.values()), low)
                return op(*_cast(args, to), **{k: _cast(v, to) for k, v in kwargs.items()})
            first = args[0] if args else None
            if policy == "fp32_set_opt_dtype":
                if not _eligible(first):
                    return op(*args, **kwargs)
                args = list(args)
                if dtype_arg is not None and dtype_arg < len(args):
                    if args[dtype_arg] is None:
                        args[dtype_arg] = torch.float32
                elif kwargs.get("dtype") is None:
                    kwargs["dtype"] = torch.float32
                return op(*args, **kwargs)
            # fp32_append_dtype: norm.Scalar / norm.ScalarOpt_dim -> the *_dtype overload
            out = torch.float32 if _eligible(first) else first.dtype
            if op._overloadname == "Scalar":
                p = args[1] if len(args) > 1 else kwargs.get("p", 2)
                return torch.ops.aten.norm.ScalarOpt_dtype(first, p, dtype=out)
            p, dim = (list(args[1:3]) + [None, None])[:2]
            keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
            return torch.ops.aten.norm.ScalarOpt_dim_dtype(first, p, dim, keepdim, dtype=out)
    return kernel


def _overload(name: str):
    op, _, overload = name[len("aten::"):].partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def _banned(*args, **kwargs):
    raise RuntimeError("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are "
                       "unsafe to autocast (CUDA autocast's rule, tests/cuda_autocast.py)")


def install():
    """Register the CUDA policy on the AutocastCPU key; returns the library (``_destroy()``
    restores PyTorch's CPU kernels)."""
    policy = cuda_policy()
    cpu = [n for n in torch._C._dispatch_get_all_op_names()
           if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCPU")]
    lib = torch.library.Library("aten", "IMPL")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "Overriding a previously registered kernel"
        for name, pol in policy.items():
            try:
                op = _overload(name)
            except (AttributeError, RuntimeError):
                continue                    # an op this build lacks
            lib.impl(op, _kernel(op, pol), "AutocastCPU")
        for name in cpu:
            if name in policy:
                continue
            if name == "aten::binary_cross_entropy":
                lib.impl(_overload(name), _banned, "AutocastCPU")
            else:
                lib.impl(_overload(name), torch.library.fallthrough_kernel, "AutocastCPU")
    return lib


@contextlib.contextmanager
def cuda_rules():
    """Within: CPU autocast follows CUDA autocast's op policy."""
    lib = install()
    try:
        yield lib
    finally:
        lib._destroy()
