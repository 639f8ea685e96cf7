"""ParallelMLP: fc1 column-parallel -> activation -> fc2 row-parallel (Megatron's MLP).

Without SP the block issues one all-reduce forward (fc2's g) and one backward (fc1's f);
with SP one all-gather + one reduce-scatter each way. Gated activations ("swiglu",
"geglu") make fc1 ``2*ffn`` wide as two independently sharded segments ``[gate; up]``
(``tp_partition_sizes=(ffn, ffn)``), so each rank holds matching gate and up rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import TEBackendMixin
from ._common import ParallelModule, check_input_format, check_sbh, divide, resolve_sp
from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ParallelMLP", "ACTIVATIONS"]

def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation: Transformer Engine's "gelu"/"geglu" (measured
    against TE 2.20.2 on an H100, tests/test_gpu.py), so both backends compute one function."""
    return F.gelu(x, approximate="tanh")


_PLAIN = {"gelu": gelu, "relu": F.relu, "silu": F.silu}
_GATED = {"swiglu": F.silu, "geglu": gelu}
ACTIVATIONS = tuple(_PLAIN) + tuple(_GATED)


class ParallelMLP(TEBackendMixin, ParallelModule):
    """``fc2(act(fc1(x)))`` on ``[s, b, h]`` (``[s/tp, b, h]`` under SP). "gelu" is TE's
    tanh-approximated GELU (``F.gelu(approximate="tanh")``), as the TE backend computes.
    ``attn_input_format="bshd"``: batch-first ``[b, s, h]`` (SP shards dim 1), as
    TransformerLayer's."""
    _te_kind = "mlp"  # no TE counterpart without the norm: backend="te" refuses, "auto" = torch

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, activation: str = "gelu",
                 bias: bool = True, sequence_parallel: bool | None = None, init_method=None,
                 output_layer_init_method=None, attn_input_format: str = "sbhd", state=None,
                 device=None, dtype=None, backend: str = "torch"):
        super().__init__()
        self.sequence_dim = check_input_format(attn_input_format)
        self.attn_input_format = attn_input_format
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported; use one of "
                             f"{ACTIVATIONS}")
        self._bind_state(state)
        self.sequence_parallel = resolve_sp(sequence_parallel, self.state)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        divide(hidden_size, 1, "hidden_size")
        divide(ffn_hidden_size, self.state.tp_size, "ffn_hidden_size")
        self.activation = activation
        gated = activation in _GATED
        kw = dict(sequence_parallel=self.sequence_parallel, state=self.state, device=device,
                  dtype=dtype, sequence_dim=self.sequence_dim)
        self.linear_fc1 = ColumnParallelLinear(
            hidden_size, ffn_hidden_size * (2 if gated else 1), bias, init_method=init_method,
            partition_sizes=(ffn_hidden_size, ffn_hidden_size) if gated else None, **kw)
        self.linear_fc2 = RowParallelLinear(
            ffn_hidden_size, hidden_size, bias, input_is_parallel=True,
            init_method=output_layer_init_method or init_method, **kw)
        self._act = (_GATED if gated else _PLAIN)[activation]
        self._gated = gated

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        check_sbh(hidden_states, self.hidden_size, type(self).__name__, self.attn_input_format)
        h = self.linear_fc1(hidden_states)
        if self._gated:
            gate, up = h.chunk(2, dim=-1)
            h = self._act(gate) * up
        else:
            h = self._act(h)
        return self.linear_fc2(h)
