"""``fp8_autocast``, its process-wide state, and the recompute frames that replay scales.

Triggers of delayed scaling's updates (as TE): the forward update runs when the outermost
``fp8_autocast`` exits normally; the backward update runs when the first fp8 layer of that
autocast (the last one to get its gradient in a sequential model) finishes its backward,
and covers every grad amax recorded since the previous backward update. Every rank of
``fp8_group`` must run the same layers in the same order (true for TP/CP/DP replicas of
one PP stage: ``state.amax_group``). Current and block recipes keep no history: nothing
is reduced or updated, and no group is needed.

Recompute (tpkit.recompute) records what each fp8 call used (the recipe, and the scales
of a per-tensor recipe); the recomputed forward replays them and records no amax, so
nothing is counted twice. Block recipes recompute their block scales from the same
(bitwise) inputs. Module state: one ``_STATE`` object (like TE's FP8GlobalStateManager);
``reset()`` clears it.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from ..nn.compile import compiled_blocks_alive
from ..nn.export import is_onnx_export
from ..layout.topology import get_parallel_state, is_initialized
from .amax import GRAD, INPUT, WEIGHT, FP8Meta, reduce_and_update
from .recipes import from_any

_UNRESOLVED = object()


class _Session:
    """One outermost fp8_autocast: its group (resolved when first needed) and the
    delayed-scaling layers it ran forward."""

    def __init__(self, fp8_group, reduce_amax: bool):
        self.fp8_group, self.reduce_amax = fp8_group, reduce_amax
        self._group = _UNRESOLVED if fp8_group is None else fp8_group
        self.fwd_metas: dict[int, FP8Meta] = {}
        self.first_taken = False

    @property
    def group(self):
        if self._group is _UNRESOLVED:
            self._group = _resolve_group()
        return self._group

    def update(self, metas: list[FP8Meta], slots: list[int]) -> None:
        if metas:
            reduce_and_update(metas, slots, self.group, self.reduce_amax)


@dataclasses.dataclass
class _Record:
    meta: FP8Meta
    scale: torch.Tensor | None   # per-tensor recipes: the [input, weight, ...] scales used
    recipe: object
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
        self.calibrating = False
        self.recording: list[_Frame] = []
        self.replay: _Frame | None = None
        self.bwd_pending: dict[int, FP8Meta] = {}


_STATE = _State()


def reset() -> None:
    """Forget every autocast, recompute frame and pending gradient amax (tests, errors)."""
    _STATE.__init__()


def is_active() -> bool:
    return _STATE.enabled


def _resolve_group():
    if is_initialized():
        return get_parallel_state().amax_group
    if not dist.is_initialized():
        return None  # a single process: nothing to reduce
    raise ValueError("fp8_autocast(fp8_group=None) with delayed scaling needs "
                     "tpkit.init_parallel() (it uses state.amax_group); pass fp8_group= "
                     "explicitly")


def _check_emulated(rec) -> None:
    if rec.fp8_dpa or rec.fp8_mha:
        raise ValueError("fp8_dpa/fp8_mha need Transformer Engine; the torch backend "
                         "quantizes linear layers only: set them False or use backend='te'")


def backward_update(rec: _Record) -> None:
    """After the first layer's backward: reduce and update every pending grad amax."""
    if rec.is_first:
        pending = list(_STATE.bwd_pending.values())
        _STATE.bwd_pending.clear()
        rec.session.update(pending, [GRAD])


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, recipe=None, fp8_group=None, *,
                 calibrating: bool = False):
    """Run tpkit linear layers in emulated fp8 with ``recipe`` (a name "delayed",
    "current", "block", "mxfp8", a recipe of tpkit or TE, or a dict; None: delayed).
    Nested contexts may switch fp8 off/on or change the recipe; the outermost one owns
    the amax group and runs delayed scaling's forward update when it exits normally.

    ``calibrating=True`` (TE's calibration) with fp8 off: the linear layers compute in
    high precision, exactly as outside any autocast, and record what fp8 would have used
    (delayed scaling: the input and weight amaxes into the history, reduced and turned
    into scales when the outermost autocast exits; current scaling: the scales). Only
    the forward is calibrated (as TE); expert GEMMs are not. With fp8 on it changes
    nothing (fp8 computes and records anyway)."""
    if enabled and is_onnx_export():
        raise ValueError("fp8_autocast(enabled=True) inside onnx_export(enabled=True): tpkit's "
                         "emulated fp8 is not exported (its scales are training state); "
                         "export without fp8_autocast")
    st = _STATE
    rec = from_any(recipe)
    _check_emulated(rec)
    if calibrating and not rec.per_tensor:
        raise ValueError(f"fp8_autocast(calibrating=True) with the {rec.name!r} recipe: "
                         "block recipes keep no per-tensor amax or scale to calibrate (they "
                         "scale each block when they cast); calibrate with 'delayed' or "
                         "'current'")
    if (enabled or calibrating) and compiled_blocks_alive():
        raise ValueError("fp8_autocast with blocks compiled by tpkit.compile_blocks: emulated "
                         "fp8 under torch.compile is not supported yet (its amax histories "
                         "and scales are process state updated in backward); run fp8 eagerly "
                         "(no compile_blocks / --compile) or compile without fp8")
    prev = (st.enabled, st.recipe, st.calibrating)
    outermost = st.session is None and st.replay is None
    if outermost:
        session = _Session(fp8_group, getattr(rec, "reduce_amax", True))
        if rec.name == "delayed":
            session.group  # noqa: B018  (resolve now: a bad setup fails before any work)
        st.session = session
    elif fp8_group is not None and st.session is not None and \
            fp8_group is not st.session.group:
        raise ValueError("a nested fp8_autocast passes another fp8_group than the outermost "
                         "one; pass it to the outermost fp8_autocast only")
    st.enabled, st.recipe, st.calibrating = bool(enabled), rec, bool(calibrating)
    ok = False
    try:
        yield
        ok = True
    finally:
        st.enabled, st.recipe, st.calibrating = prev
        if outermost:
            st.session = None
            if ok:
                session.update(list(session.fwd_metas.values()), [INPUT, WEIGHT])


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
