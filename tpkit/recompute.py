"""Activation recompute that restores every RNG stream, with TE's ``checkpoint`` signature.

``checkpoint(function, *args, ...)`` runs ``function`` without keeping its activations
and runs it again in backward. Dropout must draw the same masks both times, so the CPU
generator, the current CUDA device's generator (when CUDA is available) and the states of
the RNG tracker (``tpkit.layout.random.get_rng_tracker()`` unless ``get_rng_state_tracker`` is
given) are recorded before the forward and restored around the recompute.

``distribute_saved_activations=True`` keeps only this rank's 1/tp slice of the first tensor
argument (flattened, zero-padded to a multiple of the TP size, so no tail is dropped) and
all-gathers it over ``tp_group`` before the recompute: saved bytes per rank shrink by tp.
That input must be the same on every TP rank, so it is refused under sequence parallelism
(the input is already 1/tp per rank there), as in Megatron.

``use_reentrant=False`` runs ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
with a context that restores the tracker states and replays the fp8 scales; it does not
support ``distribute_saved_activations`` (ValueError: the non-reentrant checkpoint keeps
its inputs alive itself, so there is nothing to distribute).

Transformer Engine: a function that reaches TE modules (a module, a bound method, or a
lambda/partial/closure over them), and any function checkpointed inside TE's fp8
autocast, runs TE's own checkpoint (``tpkit.te.checkpoint``): only there do TE's modules
replay the first forward's fp8 scales in the recompute instead of recording their amaxes
a second time.

fp8 (``tpkit.fp8``): the first forward records amaxes and the scales each fp8 matmul used;
the recompute replays those scales and records no amax, so nothing is counted twice and
the recomputed forward is bitwise the original one.
"""
from __future__ import annotations

import contextlib

import torch

from . import fp8, te
from .comm.collectives import all_gather, group_rank, group_size
from .layout.random import get_rng_tracker
from .layout.topology import get_parallel_state, is_initialized


# --- RNG and autocast capture ----------------------------------------------------------------
class _RNGSnapshot:
    """CPU, current-CUDA-device and tracker RNG states at one moment."""

    def __init__(self, get_tracker):
        self.get_tracker = get_tracker
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        self.tracker = get_tracker().get_states()

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        self.get_tracker().set_states(self.tracker)


@contextlib.contextmanager
def _rng_restored(snapshot: _RNGSnapshot):
    """Run the block from ``snapshot``'s RNG states; the states from before come back after."""
    outer = _RNGSnapshot(snapshot.get_tracker)
    snapshot.restore()
    try:
        yield
    finally:
        outer.restore()


def _autocast_contexts():
    """Contexts re-entering the torch autocast settings active now (CPU and CUDA)."""
    ctxs = []
    for dev in ("cpu", "cuda"):
        if dev == "cuda" and not torch.cuda.is_available():
            continue
        ctxs.append(torch.amp.autocast(dev, enabled=torch.is_autocast_enabled(dev),
                                       dtype=torch.get_autocast_dtype(dev),
                                       cache_enabled=torch.is_autocast_cache_enabled()))
    return ctxs


def _fp8_contexts():
    """(forward, recompute) context factories from tpkit.fp8."""
    return fp8.recompute_contexts()


# --- distributed saved activations -------------------------------------------------------------
def _split(t: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of ``t`` flattened and zero-padded to a multiple of the group size
    (a fresh tensor: a view would keep the whole storage alive)."""
    size, rank = group_size(group), group_rank(group)
    chunk = -(-t.numel() // size)
    flat = t.detach().reshape(-1)
    part = flat[rank * chunk:(rank + 1) * chunk]
    out = torch.zeros(chunk, dtype=t.dtype, device=t.device)
    out[:part.numel()] = part
    return out


def _gather(chunk: torch.Tensor, shape: torch.Size, group) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    return all_gather(chunk, group)[:numel].view(shape)


# --- reentrant checkpoint -------------------------------------------------------------------------
class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, opts, kwargs, *args):
        distribute, get_tracker, tp_group, context_fn = opts
        ctx.run_function, ctx.kwargs, ctx.tp_group = run_function, kwargs, tp_group
        user_forward, ctx.user_recompute = context_fn()
        ctx.rng = _RNGSnapshot(get_tracker)
        ctx.autocast = _autocast_contexts()
        fp8_forward, fp8_recompute = _fp8_contexts()
        ctx.fp8_recompute = fp8_recompute
        with torch.no_grad(), fp8_forward(), user_forward:
            outputs = run_function(*args, **kwargs)
        ctx.distributed_index = None
        saved = list(args)
        if distribute:
            idx = next((i for i, a in enumerate(args) if torch.is_tensor(a)), None)
            if idx is not None:
                ctx.distributed_index = idx
                ctx.shape0 = args[idx].shape
                ctx.grad0 = args[idx].requires_grad
                saved[idx] = _split(args[idx], tp_group)
        ctx.inputs = [None if torch.is_tensor(a) else a for a in saved]
        ctx.save_for_backward(*[a if torch.is_tensor(a) else None for a in saved])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("tpkit.recompute.checkpoint (use_reentrant=True) does not work "
                               "with torch.autograd.grad(); use .backward() or use_reentrant=False")
        inputs = [t if t is not None else a for t, a in zip(ctx.saved_tensors, ctx.inputs)]
        if ctx.distributed_index is not None:
            i = ctx.distributed_index
            inputs[i] = _gather(inputs[i], ctx.shape0, ctx.tp_group).requires_grad_(ctx.grad0)
        detached = []
        for a in inputs:
            if torch.is_tensor(a):
                d = a.detach()
                d.requires_grad_(a.requires_grad)
                a = d
            detached.append(a)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            stack.enter_context(_rng_restored(ctx.rng))
            for c in ctx.autocast:
                stack.enter_context(c)
            stack.enter_context(ctx.fp8_recompute())
            stack.enter_context(ctx.user_recompute)
            outputs = ctx.run_function(*detached, **ctx.kwargs)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        if not pairs:
            raise RuntimeError("no output of the checkpointed function requires grad; "
                               "checkpoint() is not needed here")
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None) + tuple(
            a.grad if torch.is_tensor(a) and a.requires_grad else None for a in detached)


# --- non-reentrant checkpoint ---------------------------------------------------------------------
def _non_reentrant_context_fn(get_tracker, user_context_fn):
    """context_fn for torch.utils.checkpoint: records the tracker states in the forward and
    restores them (and the fp8 scales) around the recompute. torch restores CPU/CUDA RNG."""
    box = {}
    fp8_forward, fp8_recompute = _fp8_contexts()
    user_fwd, user_rec = user_context_fn()

    @contextlib.contextmanager
    def forward_ctx():
        box["tracker"] = get_tracker().get_states()
        with fp8_forward(), user_fwd:
            yield

    @contextlib.contextmanager
    def recompute_ctx():
        tracker = get_tracker()
        outer = tracker.get_states()
        tracker.set_states(box["tracker"])
        try:
            with fp8_recompute(), user_rec:
                yield
        finally:
            tracker.set_states(outer)

    return forward_ctx(), recompute_ctx()


def _noop_context_fn():
    return contextlib.nullcontext(), contextlib.nullcontext()


# --- public ------------------------------------------------------------------------------------------
def checkpoint(function, *args, distribute_saved_activations: bool = False,
               get_rng_state_tracker=None, tp_group=None, use_reentrant: bool = True,
               **kwargs):
    """Recompute ``function(*args, **kwargs)`` in backward instead of saving its activations
    (TE's ``te.distributed.checkpoint`` signature; see the module docstring). A
    ``context_fn`` keyword returning (forward_ctx, recompute_ctx), as torch's and TE's
    checkpoint take, is honoured in both modes; other keywords go to ``function``."""
    # TE modules keep fp8 state that only TE's checkpoint replays (its recompute phase):
    # any function reaching them (a module, a bound method, a lambda or partial over
    # them), and anything recomputed inside TE's fp8 autocast, goes to TE's checkpoint.
    if te.holds_te_modules(function) or te.fp8_enabled():
        return te.checkpoint(function, *args,
                             distribute_saved_activations=distribute_saved_activations,
                             get_rng_state_tracker=get_rng_state_tracker, tp_group=tp_group,
                             use_reentrant=use_reentrant, **kwargs)
    user_context_fn = kwargs.pop("context_fn", None) or _noop_context_fn
    if get_rng_state_tracker is None:
        get_rng_state_tracker = get_rng_tracker
    elif not callable(get_rng_state_tracker):
        raise TypeError(f"get_rng_state_tracker={get_rng_state_tracker!r} must be a callable "
                        "returning the tracker (e.g. tpkit.layout.random.get_rng_tracker), as in TE")
    if not use_reentrant:
        if distribute_saved_activations:
            raise ValueError("distribute_saved_activations=True needs use_reentrant=True "
                             "(the non-reentrant checkpoint keeps its inputs itself)")
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=False,
            context_fn=lambda: _non_reentrant_context_fn(get_rng_state_tracker, user_context_fn),
            **kwargs)
    if distribute_saved_activations:
        state = get_parallel_state() if tp_group is None or is_initialized() else None
        if tp_group is None:
            tp_group = state.tp_group
        if state is not None and state.sequence_parallel and tp_group is state.tp_group:
            raise ValueError("distribute_saved_activations=True splits an input that every TP "
                             "rank holds whole; with sequence_parallel=True it is already "
                             "1/tp per rank: drop distribute_saved_activations (as Megatron)")
    return _Checkpoint.apply(function, (distribute_saved_activations, get_rng_state_tracker,
                                        tp_group, user_context_fn), kwargs, *args)
