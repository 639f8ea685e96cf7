"""Gradient synchronisation under TPKitStrategy: the sequence-parallel TP sum (when it runs,
and what it sums) and Fabric's ``no_backward_sync``.

A parameter tagged ``sequence_parallel`` (a norm weight fed sequence-sharded activations)
gets, on each TP rank, the gradient of that rank's tokens only: the full gradient is their
TP sum. DDP averages data-parallel gradients at the end of every backward outside
``no_sync``, and averaging is idempotent (gradients it already averaged are equal on
every rank), so accumulating without ``no_sync`` stays correct. A sum is not idempotent:
summing accumulated gradients again would count earlier micro-batches ``tp`` times. So
``SequenceParallelSum`` remembers each gradient as it was when last summed (a copy, taken
at the first backward after a sum, only of gradients that exist then: none after
``zero_grad()``) and sums only what was added since. The TP sum therefore runs where
DDP's average runs, ``.grad`` is complete after every ``fabric.backward`` outside
``no_backward_sync``, and any accumulation pattern counts every micro-batch once.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext

from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn

from .. import grads
from ..layout.param_tags import is_sequence_parallel


class SequenceParallelSum:
    """The TP sum of the sequence-parallel gradients of the modules ``add``-ed (see the
    module docstring). ``deferred`` (inside ``no_backward_sync``) leaves it pending."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.params: list[nn.Parameter] = []
        self.pending = False
        self.deferred = False
        self._base: list = []   # (param, its gradient when last summed)

    def add(self, module: nn.Module) -> None:
        self.params += [p for p in module.parameters() if self._tagged(p)]

    _tagged = staticmethod(is_sequence_parallel)

    @staticmethod
    def _needed(state) -> bool:
        return state.tp_size > 1

    @staticmethod
    def _reduce(params, state) -> None:
        grads.sync_sequence_parallel_grads(params, state)

    def before_backward(self, state) -> None:
        if not self.pending and self._needed(state):
            self._base = grads.snapshot_grads(self.params)

    def after_backward(self, state) -> None:
        self.pending = True
        if not self.deferred:
            self.finalize(state)

    def finalize(self, state) -> None:
        """Sum what was added since the last sum (idempotent until the next backward)."""
        if not self.pending:
            return
        grads.reduce_since(self._base, lambda: self._reduce(self.params, state))
        self._base = []
        self.pending = False

    @contextmanager
    def defer(self, inner: AbstractContextManager):
        was, self.deferred = self.deferred, True
        try:
            with inner:
                yield
        finally:
            self.deferred = was


class ExpertGradSum(SequenceParallelSum):
    """The same bookkeeping for expert weights (tpkit.nn.MoE): what a backward added is
    summed over edp and divided by dp x cp (tpkit.grads.reduce_expert_grads), the
    reduction DDP would otherwise do, over the wrong group, for them."""

    _tagged = staticmethod(grads.reduced_here)   # not FSDP2's (DTensors): FSDP2 reduces them

    @staticmethod
    def _needed(state) -> bool:
        return state.edp_size > 1 or state.dp_cp_size > 1

    @staticmethod
    def _reduce(params, state) -> None:
        grads.reduce_expert_grads(params, state)


class TPKitBackwardSyncControl(_BackwardSyncControl):
    """``no_backward_sync``: skips DDP's/FSDP2's gradient sync and defers the SP sum (and
    the expert-gradient sum)."""

    def __init__(self, sp_sum: SequenceParallelSum, expert_sum: SequenceParallelSum | None = None):
        self._sp_sum = sp_sum
        self._expert_sum = expert_sum

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if isinstance(module, nn.parallel.DistributedDataParallel):
            inner = module.no_sync()
        elif hasattr(module, "set_requires_gradient_sync"):  # FSDP2
            inner = _FSDPNoSync(module)
        elif isinstance(module, nn.Module) and not any(
                isinstance(m, nn.parallel.DistributedDataParallel) for m in module.modules()):
            inner = nullcontext()   # dp x cp == 1: TPKitStrategy wraps nothing, nothing to sync
        else:
            raise TypeError(f"no_backward_sync needs a module set up by TPKitStrategy, got "
                            f"{type(module).__name__}")
        if self._expert_sum is not None:
            inner = self._expert_sum.defer(inner)
        return self._sp_sum.defer(inner)


class _FSDPNoSync(AbstractContextManager):
    def __init__(self, module):
        self.module = module

    def __enter__(self):
        self.module.set_requires_gradient_sync(False)

    def __exit__(self, *exc):
        self.module.set_requires_gradient_sync(True)
