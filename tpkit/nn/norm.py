"""LayerNorm / RMSNorm for the torch backend.

Under sequence parallelism each TP rank normalises only its ``s/tp`` tokens, so the
(replicated) norm parameters get a partial gradient on every rank; they are tagged
``sequence_parallel=True`` and ``tpkit.grads.sync_sequence_parallel_grads`` (also
``tpkit.nn.sync_sequence_parallel_grads``) sums those gradients over the TP group before
the optimizer step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._backend import TEBackendMixin
from ._common import ParallelModule, divide, resolve_sp, set_tp_attrs

__all__ = ["LayerNorm", "RMSNorm"]


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

