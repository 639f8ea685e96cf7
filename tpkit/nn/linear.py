"""Column- and row-parallel linear layers (Megatron-Core / TE semantics, torch backend).

ColumnParallelLinear shards the output features (weight ``[out/tp, in]``): without SP
its input passes through f (copy_to_tp_region: all-reduce of the input gradient); with
SP the ``[s/tp, b, in]`` input is all-gathered along the sequence first
(``sequence_dim=1``: batch-first ``[b, s/tp, in]``). RowParallelLinear
shards the input features (weight ``[out, in/tp]``) and sums the partial outputs with g
(all-reduce) or, under SP, a reduce-scatter to ``[s/tp, b, out]``; its bias is replicated
and added after the reduction (tagged ``sequence_parallel=True`` under SP, since each rank
then sees only its tokens' share of the bias gradient).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import mappings
from ._backend import TEBackendMixin
from ._common import (ParallelModule, check_last_dim, divide, init_shard,
                      resolve_sp, set_tp_attrs)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "linear_fn", "set_matmul"]


def _plain_matmul(layer: nn.Module, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


_MATMUL = _plain_matmul
_SHAPES = ("[s/tp, b, h]", "[b, s/tp, h]")   # by sequence_dim


def set_matmul(fn):
    """Install ``fn(layer, x, weight, bias)`` as the matmul of every parallel linear layer
    (None: ``F.linear`` again); returns the previous one. tpkit.fp8 installs its emulated
    fp8 linear when it is imported (plain ``F.linear`` outside ``fp8_autocast``): the hook
    keeps nn below fp8 in the import order (docs/design.md, "Layers")."""
    global _MATMUL
    prev, _MATMUL = _MATMUL, (fn or _plain_matmul)
    return prev


def linear_fn(layer: nn.Module, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """The ONE place where every Column/RowParallelLinear matmul happens: the installed
    matmul (``set_matmul``), to which ``layer`` is passed so that it can keep per-layer
    state (tpkit.fp8's ``layer.fp8_meta``). A module global looked up at call time, so
    assigning ``tpkit.nn.linear.linear_fn`` reroutes every layer too."""
    return _MATMUL(layer, x, weight, bias)


class _ParallelLinearBase(ParallelModule):
    def _setup(self, in_features, out_features, bias, skip_bias_add, return_bias,
               sequence_parallel, state, device, dtype, sequence_dim=0):
        self._bind_state(state)
        if sequence_dim not in (0, 1):
            raise ValueError(f"sequence_dim={sequence_dim!r} must be 0 ([s, b, h]) or 1 "
                             "(batch-first [b, s, h])")
        self.sequence_dim = sequence_dim
        self.tp_size = self.state.tp_size
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = resolve_sp(sequence_parallel, self.state)
        self.return_bias = bool(skip_bias_add or return_bias)
        self.use_bias = bool(bias)
        device = self.state.device if device is None else device
        return {"device": device, "dtype": dtype or torch.get_default_dtype()}

    def _finish(self, out, bias):
        if self.return_bias:
            return out, bias
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp={self.tp_size}, bias={self.use_bias}, "
                f"sequence_parallel={self.sequence_parallel}")


class ColumnParallelLinear(TEBackendMixin, _ParallelLinearBase):
    """Y = X A^T + b with A split by rows (output features) over the TP group.

    ``partition_sizes`` (optional, global sizes summing to out_features) says the output
    is several segments each sharded on its own (fused q/k/v, gate/up): the local
    weight is the concatenation of this rank's chunk of every segment, and the params
    carry ``tp_partition_sizes`` so tpkit.checkpoint can rebuild the full layout."""
    _te_kind = "column"  # backend="te": te.Linear(parallel_mode="column") (tpkit.nn._backend)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 gather_output: bool = False, sequence_parallel: bool | None = None,
                 init_method=None, skip_bias_add: bool = False, return_bias: bool = False,
                 partition_sizes: tuple[int, ...] | None = None, sequence_dim: int = 0,
                 state=None, device=None, dtype=None, backend: str = "torch"):
        super().__init__()
        kw = self._setup(in_features, out_features, bias, skip_bias_add, return_bias,
                         sequence_parallel, state, device, dtype, sequence_dim)
        divide(in_features, 1, "in_features")
        if partition_sizes is not None:
            partition_sizes = tuple(partition_sizes)
            if sum(partition_sizes) != out_features:
                raise ValueError(f"partition_sizes={partition_sizes} must sum to "
                                 f"out_features={out_features}")
            local = sum(divide(p, self.tp_size, "partition_sizes entry")
                        for p in partition_sizes)
        else:
            local = divide(out_features, self.tp_size, "out_features")
        if gather_output and self.return_bias:
            raise ValueError("gather_output=True with skip_bias_add/return_bias would return a "
                             "sharded bias for a gathered output; use one or the other")
        self.gather_output = gather_output
        self.partition_sizes = partition_sizes
        self.output_size_per_partition = local
        self.weight = set_tp_attrs(nn.Parameter(torch.empty(local, in_features, **kw)), 0,
                                   partition_sizes)
        init_shard(self.weight, init_method, in_features, self.tp_size)
        if self.use_bias:
            self.bias = set_tp_attrs(nn.Parameter(torch.zeros(local, **kw)), 0, partition_sizes)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        check_last_dim(x, self.in_features, type(self).__name__)
        if self.sequence_parallel:
            if x.dim() < 2 + self.sequence_dim:
                raise ValueError(f"{type(self).__name__} with sequence_parallel=True expects "
                                 f"{_SHAPES[self.sequence_dim]} input, got shape "
                                 f"{tuple(x.shape)}")
            x = mappings.gather_from_sp_region(x, self.group, self.sequence_dim)
        else:
            x = mappings.copy_to_tp_region(x, self.group, inplace_grad=True)
        bias = self.bias if not self.return_bias else None
        out = linear_fn(self, x, self.weight, bias)
        if self.gather_output:
            out = mappings.gather_from_tp_region(out, self.group, -1)
        return self._finish(out, self.bias)


class RowParallelLinear(TEBackendMixin, _ParallelLinearBase):
    """Y = X A^T + b with A split by columns (input features) over the TP group."""
    _te_kind = "row"  # backend="te": te.Linear(parallel_mode="row") (tpkit.nn._backend)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 input_is_parallel: bool = True, sequence_parallel: bool | None = None,
                 init_method=None, skip_bias_add: bool = False, return_bias: bool = False,
                 sequence_dim: int = 0, state=None, device=None, dtype=None,
                 backend: str = "torch"):
        super().__init__()
        kw = self._setup(in_features, out_features, bias, skip_bias_add, return_bias,
                         sequence_parallel, state, device, dtype, sequence_dim)
        divide(out_features, 1, "out_features")
        local = divide(in_features, self.tp_size, "in_features")
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence_parallel=True needs "
                             "input_is_parallel=True (the input is the column layer's shard)")
        self.input_is_parallel = input_is_parallel
        self.input_size_per_partition = local
        self.weight = set_tp_attrs(nn.Parameter(torch.empty(out_features, local, **kw)), 1)
        init_shard(self.weight, init_method, in_features, self.tp_size)
        if self.use_bias:
            self.bias = set_tp_attrs(nn.Parameter(torch.zeros(out_features, **kw)), None,
                                     sequence_parallel=self.sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        name = type(self).__name__
        if self.input_is_parallel:
            check_last_dim(x, self.input_size_per_partition, name)
        else:
            check_last_dim(x, self.in_features, name)
            x = mappings.scatter_to_tp_region(x, self.group, -1)
        out = linear_fn(self, x, self.weight, None)
        if self.sequence_parallel:
            d = self.sequence_dim
            if out.dim() < 2 + d or out.shape[d] % self.tp_size:
                raise ValueError(f"{name} with sequence_parallel=True needs a sequence length "
                                 f"(dim {d}) divisible by tp={self.tp_size}, got shape "
                                 f"{tuple(out.shape)}; pad the sequence")
            out = mappings.reduce_scatter_to_sp_region(out, self.group, d)
        else:
            out = mappings.reduce_from_tp_region(out, self.group, inplace=True)
        if self.return_bias or self.bias is None:
            return self._finish(out, self.bias)
        return self._finish(out + self.bias, self.bias)
