"""A block op that behaves like CUDA's for the context-parallel drivers (issue 48).

``CudaLikeOp`` has ``CudaFlashOp``'s shape on the ring (tpkit.nn.attention_ops): the same
piece rows in forward and backward (``min_piece_rows == min_fwd_piece_rows``, here 2 so
that test-sized sequences are cut into several pieces), 2-piece query tiles without a row
bound, dropout supported, ``needs_state``; and its backward REQUIRES the state its forward
saved for that very call: a missing state fails as CudaFlashOp's unpacking of ``None``
does, and a state of another call (other block shapes or mask) is refused. Dropout masks
are drawn from a per-call seed kept in the state, so a backward given the wrong call's
state computes the wrong gradient. The maths is ``tpkit.nn.attention_math``'s block
forward/backward in the compute dtype (float64 stays float64).

``use(op)`` makes DotProductAttention pick the op for every CP call (it patches the
``select`` that tpkit.nn.dot_product_attention imported).
"""
from __future__ import annotations

import contextlib

import torch

from tpkit.nn import dot_product_attention as dpa_mod
from tpkit.nn.attention_math import block_backward, block_forward
from tpkit.nn.attention_ops import BlockOp, CudaFlashOp


class CudaLikeOp(BlockOp):
    name = "cuda_like"
    supports_dropout = True
    needs_state = CudaFlashOp.needs_state
    min_piece_rows = min_fwd_piece_rows = 2
    tile_pieces, max_tile_rows = CudaFlashOp.tile_pieces, CudaFlashOp.max_tile_rows

    def __init__(self):
        super().__init__()
        self.calls = 0          # forward calls since reset(): the dropout seeds
        self.backward_calls = 0

    def reset(self):
        self.calls = self.backward_calls = 0

    def compute_dtype(self, dtype):
        return torch.promote_types(dtype, torch.float32)

    def forward(self, q, k, v, mask, scale, dropout_p=0.0):
        self.calls += 1
        gen = torch.Generator().manual_seed(1000 + self.calls) if dropout_p > 0.0 else None
        out, lse = block_forward(q, k, v, scale, mask.causal, dropout_p, gen)
        return out, lse, ("cuda_like", 1000 + self.calls, tuple(q.shape), tuple(k.shape), mask)

    def backward(self, dout, q, k, v, out, lse, mask, scale, dropout_p=0.0, state=None):
        self.backward_calls += 1
        _, seed, qs, ks, m = state   # None: "cannot unpack non-iterable NoneType object"
        if (qs, ks, m) != (tuple(q.shape), tuple(k.shape), mask):
            raise RuntimeError(f"cuda_like: backward of a block q{tuple(q.shape)} "
                               f"k{tuple(k.shape)} {mask} got the state of q{qs} k{ks} {m}")
        gen = torch.Generator().manual_seed(seed) if dropout_p > 0.0 else None
        delta = (dout * out).sum(-1)
        return block_backward(q, k, v, dout, lse, delta, scale, mask.causal, dropout_p, gen)


@contextlib.contextmanager
def use(op):
    real = dpa_mod.select
    dpa_mod.select = lambda device, dtype, dropout_p=0.0: op
    try:
        yield op
    finally:
        dpa_mod.select = real
