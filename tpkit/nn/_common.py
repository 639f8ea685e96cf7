"""Small helpers shared by the torch-backend layers: the state a layer is bound to,
divisibility and shape checks with clear messages, and deterministic shard
initialisation. Parameter tags are tpkit.layout.param_tags'."""
from __future__ import annotations

import copy
import functools
import math

import torch
from torch import nn

from ..layout.param_tags import set_tags, set_tp_attrs, tags_of  # noqa: F401  (set_tp_attrs: layers)
from ..layout.random import MODEL_PARALLEL_RNG, get_rng_tracker
from ..layout.topology import resolve_state


class SharedRef:
    """Holds a ParallelState: its process groups can be neither pickled nor copied, so a
    deep copy of a model (EMA, Lightning) shares the state, as the copy shares the groups."""
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self


class ParallelModule(nn.Module):
    """Base of the layers bound to a ParallelState (``state``; ``group`` is its TP group).

    ``copy.deepcopy`` keeps the state shared and the params' tags (Parameter's own
    deepcopy drops Python attributes, which would silently unshard checkpoints)."""

    state = property(lambda self: self._state_ref.obj)
    group = property(lambda self: self._state_ref.obj.tp_group)

    def _bind_state(self, state):
        self._state_ref = SharedRef(resolve_state(state))
        return self.state

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        state = self.state  # shared, with its groups, by every submodule holding them
        memo.setdefault(id(state), state)
        for g in state.all_groups().values():
            memo.setdefault(id(g), g)
        for k, v in self.__dict__.items():
            new.__dict__[k] = copy.deepcopy(v, memo)
        for name, p in self._parameters.items():
            if p is not None:
                set_tags(new._parameters[name], tags_of(p))
        return new


def resolve_sp(sequence_parallel, state) -> bool:
    return bool(state.sequence_parallel if sequence_parallel is None else sequence_parallel)


def _choices(n: int, d: int) -> tuple[str, str]:
    """The multiples of ``d`` nearest ``n``, and the divisors of ``n``, as text."""
    near = [m for m in (n // d * d, n // d * d + d) if m > 0]
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    if len(divisors) > 8:
        divisors = divisors[:4] + ["..."] + divisors[-2:]
    return " or ".join(map(str, near)), ", ".join(map(str, divisors))


def divide(n: int, d: int, what: str, by: str | None = None) -> int:
    """``n // d``, or a ValueError naming ``what`` and the fix: the one divisibility check of
    tpkit.nn. ``d`` is the tensor-parallel size unless ``by`` names it."""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"{what}={n!r} must be a positive integer")
    if n % d:
        near, divisors = _choices(n, d)
        if by is None:
            raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}; "
                             f"use {what}={near} (a multiple of {d}), or a tp that divides "
                             f"{n} ({divisors})")
        raise ValueError(f"{what}={n} is not divisible by {by}={d}; use {what}={near} (a "
                         f"multiple of {d}), or {by} dividing {n} ({divisors})")
    return n // d


def local_kv_heads(groups: int, tp: int) -> int:
    """Key/value heads per TP rank: ``groups / tp``, or 1 when fewer kv heads than TP ranks
    (``tp`` a multiple of ``groups``): each rank then keeps the kv head its query heads use,
    replicated over the ``tp / groups`` ranks sharing it (their gradients are summed)."""
    if isinstance(groups, int) and not isinstance(groups, bool) and 0 < groups < tp \
            and tp % groups == 0:
        return 1
    if isinstance(groups, int) and 0 < groups < tp:
        raise ValueError(f"num_gqa_groups={groups} key/value heads cannot be shared evenly "
                         f"by tp={tp} ranks; use a tp that {groups} divides, or a multiple "
                         f"of {groups}")
    return divide(groups, tp, "num_gqa_groups")


def check_last_dim(x: torch.Tensor, expected: int, layer: str) -> None:
    if x.dim() < 1 or x.shape[-1] != expected:
        raise ValueError(f"{layer} expects an input whose last dim is {expected}, got shape "
                         f"{tuple(x.shape)}")


INPUT_FORMATS = ("sbhd", "bshd")   # TE's attn_input_format values tpkit's layers take


def check_sbh(x: torch.Tensor, hidden: int, layer: str, fmt: str = "sbhd") -> None:
    if x.dim() != 3 or x.shape[-1] != hidden:
        shape, what = (("[s, b", "sequence first") if fmt == "sbhd" else
                       ("[b, s", "batch first, attn_input_format='bshd'"))
        raise ValueError(f"{layer} expects hidden states {shape}, {hidden}] (3 dims, "
                         f"{what}), got shape {tuple(x.shape)}")


def check_input_format(fmt: str) -> int:
    """The sequence dim of ``attn_input_format`` (TE's name): 0 for "sbhd", 1 for "bshd"."""
    if fmt not in INPUT_FORMATS:
        raise ValueError(f"attn_input_format={fmt!r} is not supported; use 'sbhd' "
                         "([s, b, h], the default) or 'bshd' (batch-first [b, s, h])")
    return INPUT_FORMATS.index(fmt)


def init_shard(weight: torch.Tensor, init_method, fan_in: int, tp_size: int) -> None:
    """Initialise a weight shard: ``init_method(weight)`` or uniform(+-1/sqrt(fan_in)) (the
    global fan-in, nn.Linear's scale), on the RNG tracker's model-parallel stream so
    shards differ across TP ranks. Tests load full weights instead (tpkit.checkpoint)."""
    if weight.is_meta:   # shapes only (a dry run's model): no values to draw
        return
    tracker = get_rng_tracker()
    fn = init_method or (lambda w: torch.nn.init.uniform_(w, -1 / math.sqrt(fan_in),
                                                          1 / math.sqrt(fan_in)))
    if MODEL_PARALLEL_RNG in tracker.states_ and tracker.device.type == weight.device.type:
        with torch.no_grad(), tracker.fork():
            fn(weight)
    elif tp_size == 1:
        with torch.no_grad():
            fn(weight)
    else:
        raise ValueError("the RNG tracker has no model-parallel stream on this device, so TP "
                         "shards would be initialised identically; seed it with "
                         "tpkit.init_parallel(seed=...) / tpkit.layout.random.model_parallel_seed, "
                         "or load weights with tpkit.checkpoint.load_full_state_dict")


def no_autocast(device: torch.device | str):
    """Autocast off for ``device``'s type: maths that must stay in the dtype it chose
    (the router's fp32 logits and top-k, the attention kernels' fp32 statistics).
    Under an autocast their matmuls would run in its low precision, on CPU and on CUDA."""
    dev = torch.device(device).type
    return torch.autocast(dev, enabled=False)


def autocast_off(fn):
    """Decorator: ``fn(q, ...)`` runs with autocast off for ``q``'s device (see
    ``no_autocast``); the attention entry points, whose kernels choose their own dtypes."""
    @functools.wraps(fn)
    def wrapper(q, *args, **kwargs):
        with no_autocast(q.device):
            return fn(q, *args, **kwargs)
    return wrapper
