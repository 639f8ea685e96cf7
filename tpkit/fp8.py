"""Emulated fp8 with delayed scaling for the torch backend, and TE-compatible recipes.

Inside ``fp8_autocast`` every matmul routed through ``linear(layer, x, weight, bias)``
(tpkit.nn's one linear function) quantizes its input and weight to E4M3 and, in backward,
its output gradient to E5M2 (``HYBRID``) or E4M3 (``E4M3``), per tensor: ``t * scale``
saturated and rounded to nearest by torch's float8 dtypes (as TE's cast). Each GEMM then
multiplies the quantized values in float32 and scales the result by
``(1/scale_a) * (1/scale_b)``, as TE's fp8 GEMM does, so the emulation sees the same
quantized operands as TE (checked against TE on an H100: BENCHMARKS.md, tests/test_gpu.py).
Scales are *delayed*: a step quantizes with the scale computed from earlier steps' amaxes.

Per layer (``layer.fp8_meta``): an amax history ``[amax_history_len, 3]`` (input, weight,
grad; row 0 is the step being recorded) and three scales. An update (one per step for the
forward slots, one per backward for the grad slot):
1. the recorded row-0 amaxes of all layers are all-reduced (MAX) over ``fp8_group`` in ONE
   collective on one flat tensor (skipped for a group of one or ``reduce_amax=False``);
2. every ``interval``-th update the scale becomes ``fp8_max * 2**-margin / amax`` (float32,
   TE 2.x's formula, not rounded to a power of two) with amax = max of the history
   ('max'), row 0 ('most_recent') or ``algo(history)``; an amax of 0 or inf/nan keeps the
   previous scale and an overflowing ratio gives float32's max (as TE);
3. the history rolls by one and row 0 restarts at zero.
Triggers (as TE): the forward update runs when the outermost ``fp8_autocast`` exits; the
backward update runs when the first fp8 layer of that autocast (the last one to get its
gradient in a sequential model) finishes its backward, and covers every grad amax recorded
since the previous backward update. Every rank of ``fp8_group`` must run the same layers in
the same order (true for TP/CP/DP replicas of one PP stage: ``state.amax_group``).

Recompute (tpkit.recompute) records which scales each fp8 call used; the recomputed
forward replays them and records no amax, so nothing is counted twice.
Module state: one ``_STATE`` object (like TE's FP8GlobalStateManager); ``reset()`` clears it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .collectives import all_reduce_max
from .nn import linear as _nn_linear
from .topology import get_parallel_state, is_initialized

E4M3 = (torch.float8_e4m3fn, 448.0)
E5M2 = (torch.float8_e5m2, 57344.0)
FORMATS = {"E4M3": (E4M3, E4M3), "HYBRID": (E4M3, E5M2)}  # (forward, backward)
INPUT, WEIGHT, GRAD = 0, 1, 2


# --- recipe --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """TE's ``DelayedScaling`` fields the emulation honours (``interval`` and
    ``override_linear_precision`` as in TE 1.x; ``(fprop, dgrad, wgrad)`` True = that GEMM
    runs unquantized)."""

    margin: int = 0
    interval: int = 1
    fp8_format: str = "HYBRID"
    amax_history_len: int = 1024
    amax_compute_algo: str | Callable = "max"
    override_linear_precision: tuple = (False, False, False)
    reduce_amax: bool = True

    def __post_init__(self):
        fmt = getattr(self.fp8_format, "name", self.fp8_format)  # TE's Format enum or a str
        if not isinstance(fmt, str) or fmt.upper() not in FORMATS:
            raise ValueError(f"fp8_format={self.fp8_format!r} is not supported; use 'E4M3' or "
                             "'HYBRID' (E4M3 forward, E5M2 backward)")
        object.__setattr__(self, "fp8_format", fmt.upper())
        for name, low in (("margin", None), ("interval", 1), ("amax_history_len", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or (low is not None and v < low):
                raise ValueError(f"{name}={v!r} must be an integer"
                                 + (f" >= {low}" if low is not None else ""))
        algo = self.amax_compute_algo
        if not callable(algo) and algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo={algo!r} must be 'max', 'most_recent' or a "
                             "callable(amax_history) -> amax")
        olp = tuple(self.override_linear_precision)
        if len(olp) != 3 or not all(isinstance(b, bool) for b in olp):
            raise ValueError(f"override_linear_precision={self.override_linear_precision!r} "
                             "must be three bools (fprop, dgrad, wgrad)")
        object.__setattr__(self, "override_linear_precision", olp)

    @property
    def formats(self):
        return FORMATS[self.fp8_format]

    @classmethod
    def from_any(cls, recipe) -> "DelayedScaling":
        """A recipe from None (defaults), a DelayedScaling, a dict (Lightning's recipe dict,
        fp8_format as a string) or a TE DelayedScaling object (duck-typed, TE not imported)."""
        if recipe is None:
            return cls()
        if isinstance(recipe, cls):
            return recipe
        names = [f.name for f in dataclasses.fields(cls)]
        if isinstance(recipe, Mapping):
            unknown = sorted(set(recipe) - set(names) - {"scaling_factor_compute_algo",
                                                         "fp8_dpa", "fp8_mha"})
            if unknown:
                raise ValueError(f"unknown fp8 recipe keys {unknown}; known keys: {names}")
            get = recipe.get
        elif hasattr(recipe, "margin") and hasattr(recipe, "fp8_format"):
            get = lambda k, d=None: getattr(recipe, k, d)  # noqa: E731
        else:
            raise TypeError(f"recipe={recipe!r} is not a DelayedScaling, a dict or a TE "
                            "DelayedScaling recipe")
        if get("scaling_factor_compute_algo") is not None:
            raise ValueError("scaling_factor_compute_algo is not supported by the emulated fp8 "
                             "(the scale is 2**(floor(log2(fp8_max/amax)) - margin)); drop it")
        if get("fp8_dpa", False) or get("fp8_mha", False):
            raise ValueError("fp8_dpa/fp8_mha need Transformer Engine; the torch backend "
                             "quantizes linear layers only: set them False or use backend='te'")
        return cls(**{n: get(n) for n in names if get(n) is not None})


def compute_scale(amax: torch.Tensor, scale: torch.Tensor, fp8_max, margin: int) -> torch.Tensor:
    """TE 2.x's delayed-scaling update: ``(fp8_max * 2**-margin) / amax`` in float32; the
    old ``scale`` where amax is 0 or not finite; float32's max where the ratio overflows
    (transformer_engine/common/recipe/delayed_scaling.cu). No power-of-two rounding."""
    scaled_max = torch.as_tensor(fp8_max, dtype=torch.float32) * (2.0 ** -margin)
    amax = amax.float()
    new = scaled_max / amax
    new = torch.where(torch.isinf(new), torch.full_like(new, torch.finfo(torch.float32).max),
                      new)
    ok = (amax > 0) & torch.isfinite(amax)
    return torch.where(ok, new, scale.float()).to(scale.dtype)


# --- per-layer meta ----------------------------------------------------------------------------
class FP8Meta:
    """Amax history ``[len, 3]`` and scales ``[3]`` (input, weight, grad) of one layer."""

    def __init__(self, recipe: DelayedScaling):
        self.recipe = recipe
        self.amax_history = torch.zeros(recipe.amax_history_len, 3)
        self.scale = torch.ones(3)
        self.updates = [0, 0]  # forward, backward updates so far

    def record(self, slot: int, t: torch.Tensor) -> None:
        if t.numel():
            a = t.detach().abs().max().float().cpu()
            self.amax_history[0, slot] = torch.maximum(self.amax_history[0, slot], a)

    def update(self, slots: list[int]) -> None:
        """Step 2 and 3 of the module docstring for ``slots`` (after the reduction)."""
        r = self.recipe
        which = 1 if slots == [GRAD] else 0
        self.updates[which] += 1
        hist = self.amax_history[:, slots]
        if self.updates[which] % r.interval == 0:
            if r.amax_compute_algo == "max":
                amax = hist.max(dim=0).values
            elif r.amax_compute_algo == "most_recent":
                amax = hist[0]
            else:
                amax = torch.as_tensor(r.amax_compute_algo(hist.clone()),
                                       dtype=torch.float32).reshape(len(slots))
            fwd, bwd = r.formats
            fmax = torch.tensor([bwd[1] if s == GRAD else fwd[1] for s in slots])
            self.scale[slots] = compute_scale(amax, self.scale[slots], fmax, r.margin)
        hist = torch.roll(hist, -1, dims=0)
        hist[0] = 0.0
        self.amax_history[:, slots] = hist


def meta_of(layer, recipe: DelayedScaling) -> FP8Meta:
    """The layer's FP8Meta (created on first use with ``recipe``)."""
    meta = getattr(layer, "fp8_meta", None)
    if meta is None:
        meta = FP8Meta(recipe)
        setattr(layer, "fp8_meta", meta)
    elif meta.recipe is not recipe:
        if meta.recipe.amax_history_len != recipe.amax_history_len:
            raise ValueError(f"{type(layer).__name__} has an fp8 amax history of length "
                             f"{meta.recipe.amax_history_len} but the recipe asks for "
                             f"{recipe.amax_history_len}; use one recipe per model")
        meta.recipe = recipe
    return meta


# --- global state, sessions, recompute frames ---------------------------------------------------
class _Session:
    """One outermost fp8_autocast: its group and the layers it ran forward."""

    def __init__(self, group, reduce_amax: bool):
        self.group, self.reduce_amax = group, reduce_amax
        self.fwd_metas: dict[int, FP8Meta] = {}
        self.first_taken = False


@dataclasses.dataclass
class _Record:
    meta: FP8Meta
    scale: torch.Tensor
    recipe: DelayedScaling
    session: _Session
    is_first: bool


class _Frame:
    """What one checkpointed forward did in fp8, for its recompute to replay."""

    def __init__(self):
        self.enabled, self.recipe, self.records, self.cursor = False, None, [], 0

    def next(self, meta: FP8Meta) -> _Record:
        if self.cursor >= len(self.records) or self.records[self.cursor].meta is not meta:
            raise RuntimeError("the recomputed forward runs fp8 layers in another order than "
                               "the original forward; checkpointed functions must be "
                               "deterministic")
        self.cursor += 1
        return self.records[self.cursor - 1]


class _State:
    def __init__(self):
        self.enabled, self.recipe, self.session = False, None, None
        self.recording: list[_Frame] = []
        self.replay: _Frame | None = None
        self.bwd_pending: dict[int, FP8Meta] = {}


_STATE = _State()


def reset() -> None:
    """Forget every autocast, recompute frame and pending gradient amax (tests, errors)."""
    global _STATE
    _STATE = _State()


def is_active() -> bool:
    return _STATE.enabled


def _resolve_group(fp8_group):
    if fp8_group is not None:
        return fp8_group
    if is_initialized():
        return get_parallel_state().amax_group
    if not dist.is_initialized():
        return None  # a single process: nothing to reduce
    raise ValueError("fp8_autocast(fp8_group=None) needs tpkit.init_parallel() (it uses "
                     "state.amax_group); pass fp8_group= explicitly")


def _reduce_and_update(metas: list[FP8Meta], slots: list[int], session: _Session) -> None:
    if not metas:
        return
    flat = torch.cat([m.amax_history[0, slots] for m in metas])
    group = session.group
    if session.reduce_amax and group is not None and dist.get_world_size(group) > 1:
        dev = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(group) == "nccl" else torch.device("cpu")
        flat = all_reduce_max(flat.to(dev).contiguous(), group).cpu()
    for i, m in enumerate(metas):
        m.amax_history[0, slots] = flat[i * len(slots):(i + 1) * len(slots)]
        m.update(slots)


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, recipe=None, fp8_group=None):
    """Run tpkit linear layers in emulated fp8 (see the module docstring). Nested contexts
    may switch fp8 off/on or change the recipe; the outermost one owns the amax group and
    runs the forward update when it exits normally."""
    st = _STATE
    rec = DelayedScaling.from_any(recipe)
    prev = (st.enabled, st.recipe)
    outermost = st.session is None and st.replay is None
    if outermost:
        session = _Session(_resolve_group(fp8_group), rec.reduce_amax)
        st.session = session
    elif fp8_group is not None and st.session is not None and fp8_group is not st.session.group:
        raise ValueError("a nested fp8_autocast passes another fp8_group than the outermost "
                         "one; pass it to the outermost fp8_autocast only")
    st.enabled, st.recipe = bool(enabled), rec
    ok = False
    try:
        yield
        ok = True
    finally:
        st.enabled, st.recipe = prev
        if outermost:
            st.session = None
            if ok:
                _reduce_and_update(list(session.fwd_metas.values()), [INPUT, WEIGHT], session)


def recompute_contexts():
    """(forward, recompute) context factories for one checkpointed region (tpkit.recompute):
    forward records the fp8 calls; recompute replays their scales, flags and fp8 state and
    records no amax."""
    frame = _Frame()

    @contextlib.contextmanager
    def forward():
        st = _STATE
        frame.enabled, frame.recipe, frame.records = st.enabled, st.recipe, []
        st.recording.append(frame)
        try:
            yield
        finally:
            st.recording.remove(frame)

    @contextlib.contextmanager
    def recompute():
        st = _STATE
        prev = (st.enabled, st.recipe, st.replay)
        frame.cursor = 0
        st.enabled, st.recipe, st.replay = frame.enabled, frame.recipe, frame
        try:
            yield
        finally:
            st.enabled, st.recipe, st.replay = prev

    return forward, recompute


# --- the emulated linear ----------------------------------------------------------------------------
def quantize(t: torch.Tensor, scale: torch.Tensor, fmt) -> torch.Tensor:
    """``t * scale`` saturated to ``fmt``'s range and rounded to nearest (float8 dtype)."""
    dtype, fmax = fmt
    s = scale.to(device=t.device, dtype=torch.float32)
    return (t.float() * s).clamp(-fmax, fmax).to(dtype)


def _gemm(a: torch.Tensor, b: torch.Tensor, alpha) -> torch.Tensor:
    """``(a @ b) * alpha`` in float32 with autocast off (the fp8 GEMM's accumulation)."""
    with torch.autocast(a.device.type, enabled=False):
        out = a.float().matmul(b.float())
        return out if alpha is None else out * alpha


def _inv(scale: torch.Tensor, device) -> torch.Tensor:
    return 1.0 / scale.to(device=device, dtype=torch.float32)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, rec: _Record, out_dtype):
        fwd, _ = rec.recipe.formats
        fprop, dgrad, wgrad = rec.recipe.override_linear_precision
        xq, wq = quantize(x, rec.scale[INPUT], fwd), quantize(weight, rec.scale[WEIGHT], fwd)
        ix, iw = _inv(rec.scale[INPUT], x.device), _inv(rec.scale[WEIGHT], x.device)
        if fprop:
            out = _gemm(x, weight.t(), None)
        else:
            out = _gemm(xq, wq.t(), ix * iw)
        if bias is not None:
            out = out + bias.float()
        ctx.save_for_backward(x if wgrad else xq, weight if dgrad else wq, ix, iw)
        ctx.rec, ctx.has_bias = rec, bias is not None
        ctx.dtypes = (x.dtype, weight.dtype)
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, g):
        x_w, w_d, ix, iw = ctx.saved_tensors
        rec = ctx.rec
        meta = rec.meta
        _, bwd = rec.recipe.formats
        _, dgrad, wgrad = rec.recipe.override_linear_precision
        meta.record(GRAD, g)
        _STATE.bwd_pending[id(meta)] = meta
        gq = quantize(g, meta.scale[GRAD], bwd)
        ig = _inv(meta.scale[GRAD], g.device)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if dgrad:
                dx = _gemm(g, w_d, None)
            else:
                dx = _gemm(gq, w_d, ig * iw)
            dx = dx.to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            g2 = (g if wgrad else gq).reshape(-1, g.shape[-1])
            xs = x_w.reshape(-1, x_w.shape[-1])
            dw = _gemm(g2.t(), xs, None if wgrad else ig * ix).to(ctx.dtypes[1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.reshape(-1, g.shape[-1]).float().sum(0).to(g.dtype)
        if rec.is_first:
            pending = list(_STATE.bwd_pending.values())
            _STATE.bwd_pending.clear()
            _reduce_and_update(pending, [GRAD], rec.session)
        return dx, dw, db, None, None


def linear(layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear(x, weight, bias)``, in emulated fp8 with ``layer``'s meta inside
    fp8_autocast. The hook tpkit.nn's linear function calls."""
    st = _STATE
    if not st.enabled:
        return F.linear(x, weight, bias)
    if st.replay is not None:
        rec = st.replay.next(getattr(layer, "fp8_meta", None))
    else:
        session = st.session
        meta = meta_of(layer, st.recipe)
        meta.record(INPUT, x)
        meta.record(WEIGHT, weight)
        session.fwd_metas[id(meta)] = meta
        first = not session.first_taken and (torch.is_grad_enabled() or bool(st.recording))
        session.first_taken |= first
        rec = _Record(meta, meta.scale.clone(), st.recipe, session, first)
    for frame in st.recording:
        frame.records.append(rec)
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    return _FP8Linear.apply(x, weight, bias, rec, out_dtype)


# tpkit.nn's parallel linear layers matmul through this module's ``linear`` from now on
# (F.linear outside fp8_autocast): installed, not imported by nn (docs/design.md, "Layers").
_nn_linear.set_matmul(linear)
