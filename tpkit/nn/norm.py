"""LayerNorm / RMSNorm for the torch backend, and the SP gradient all-reduce.

Under sequence parallelism each TP rank normalises only its ``s/tp`` tokens, so the
(replicated) norm parameters get a partial gradient on every rank; they are tagged
``sequence_parallel=True`` and ``sync_sequence_parallel_grads`` sums those gradients over
the TP group (Megatron's ``_allreduce_layernorm_grads``) before the optimizer step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ._backend import TEBackendMixin
from ._common import ParallelModule, divide, resolve_sp, resolve_state, set_tp_attrs
from .mappings import all_reduce_sum

__all__ = ["LayerNorm", "RMSNorm", "sync_sequence_parallel_grads"]


class _Norm(ParallelModule):
    def __init__(self, hidden_size, eps, bias, sequence_parallel, state, device, dtype):
        super().__init__()
        state = self._bind_state(state)
        divide(hidden_size, 1, "hidden_size")
        self.hidden_size, self.eps = hidden_size, eps
        self.sequence_parallel = resolve_sp(sequence_parallel, state)
        kw = {"device": state.device if device is None else device,
              "dtype": dtype or torch.get_default_dtype()}
        self.weight = set_tp_attrs(nn.Parameter(torch.ones(hidden_size, **kw)), None,
                                   sequence_parallel=self.sequence_parallel)
        if bias:
            self.bias = set_tp_attrs(nn.Parameter(torch.zeros(hidden_size, **kw)), None,
                                     sequence_parallel=self.sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def _check(self, x):
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"{type(self).__name__} expects a last dim of {self.hidden_size}, "
                             f"got shape {tuple(x.shape)}")

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class LayerNorm(TEBackendMixin, _Norm):
    """nn.LayerNorm over the last dim; params tagged ``sequence_parallel`` under SP."""
    _te_kind = "layernorm"  # backend="te": te.LayerNorm (tpkit.nn._backend)

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, bias: bool = True,
                 sequence_parallel: bool | None = None, state=None, device=None, dtype=None,
                 backend: str = "torch"):
        super().__init__(hidden_size, eps, bias, sequence_parallel, state, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)


class RMSNorm(TEBackendMixin, _Norm):
    """nn.RMSNorm over the last dim; weight tagged ``sequence_parallel`` under SP."""
    _te_kind = "rmsnorm"  # backend="te": te.RMSNorm (tpkit.nn._backend)

    def __init__(self, hidden_size: int, eps: float = 1e-5, *,
                 sequence_parallel: bool | None = None, state=None, device=None, dtype=None,
                 backend: str = "torch"):
        super().__init__(hidden_size, eps, False, sequence_parallel, state, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters tagged ``sequence_parallel=True``, in a deterministic order."""
    return [p for _, p in module.named_parameters() if getattr(p, "sequence_parallel", False)]


def sync_sequence_parallel_grads(module: nn.Module, state=None) -> int:
    """Sum the gradients of ``sequence_parallel`` params over the TP group with one
    flattened all-reduce (per dtype). Call after backward, before the optimizer step.
    Returns the number of gradients reduced."""
    state = resolve_state(state)
    grads = [p.grad for p in sequence_parallel_params(module) if p.grad is not None]
    if state.tp_size > 1:
        all_reduce_flat(grads, state.tp_group)
    return len(grads)


def all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` over ``group`` in place with one flattened all-reduce per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for bucket in by_dtype.values():
        flat = all_reduce_sum(_flatten_dense_tensors(bucket), group)
        for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(synced)
