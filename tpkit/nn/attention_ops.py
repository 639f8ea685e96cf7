"""The fused attention kernels per device, chosen in this one place (docs/design.md §12).

A *block op* computes attention of one block of queries against one block of keys and
values, returning the output and its log-sum-exp (LSE), and runs that block's backward
from the *final* output and LSE. That is FlashAttention's split, which the context-parallel
drivers (``tpkit.nn.fused_cp``) use to compute a long sequence block by block and merge
the blocks by their LSEs. Tensors use ``tpkit.nn.attention_math``'s grouped layout: q
``[b, g, r, s, d]``, k/v ``[b, g, 1, s, d]``; every op hands grouped-query attention to the
kernel without repeating K/V in memory where the kernel allows it.

=========================  ===================================================================
device, case               op
=========================  ===================================================================
CPU                        ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
                           backward (PyTorch's fused CPU kernel). Half types are computed in
                           float32: the kernel's bf16 path is ~35x slower than its float32 one
                           on CPUs without AMX / AVX512-BF16 (BENCHMARKS.md's machine).
                           float64 runs in float64 (exact to ~1e-15).
CUDA, fp16/bf16            ``aten._scaled_dot_product_flash_attention`` (+ backward): native
                           GQA, dropout replayed from the saved philox seed/offset
CUDA, float32              ``aten._scaled_dot_product_efficient_attention`` (+ backward)
anything else              ``None``: the caller runs the plain-torch reference kernels
                           (``tpkit.nn.context_parallel``): CPU dropout (the CPU kernel has
                           none), CUDA float64, other devices, or ``TPKIT_FUSED_ATTN=0``
=========================  ===================================================================

Masks are ``BlockMask`` values: ``FULL`` (every key) or ``CAUSAL`` (a diagonal block of
equal lengths, first query aligned with first key). A packed-sequence (THD) mask would be
one more field of ``BlockMask`` that an op translates for its kernel.
"""
from __future__ import annotations

import dataclasses

import torch

from ..layout.config import fused_attn_enabled
from ..layout.random import get_rng_tracker

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Which keys of a block each query sees: all (``causal=False``) or those at or before
    its own position in a diagonal block (``causal=True``; equal query and key lengths)."""
    causal: bool = False


FULL, CAUSAL = BlockMask(False), BlockMask(True)
# The ops by name, each op registered when built: a compiled region's CP ring (an opaque
# custom op, fused_cp) names its op.
BY_NAME: dict[str, BlockOp] = {}


class BlockOp:
    """One fused kernel. ``forward`` returns ``(out, lse, state)`` with ``out`` like ``q`` in
    ``compute_dtype``, ``lse [b, g, r, sq]`` in ``lse_dtype`` and ``state`` what backward
    needs to replay dropout (or None); ``backward`` returns ``(dq, dk, dv)`` in the compute
    dtype, dk/dv ``[b, g, 1, sk, d]``. Inputs must already be in ``compute_dtype``."""
    name = "?"
    supports_dropout = False
    # backward needs the state of the very forward call that computed its block (CUDA's
    # kernels: philox seed/offset, sequence bookkeeping): the CP drivers then run the
    # forward on the backward's schedule, one call per backward call (tpkit.nn.fused_cp)
    needs_state = False
    min_piece_rows = 128  # smallest K/V piece worth a kernel call (fused_cp splits by it)
    min_fwd_piece_rows = 128  # the same in the ring's forward (no gradient buffers there)
    tile_pieces = 2           # backward: query rows per call, in pieces ...
    max_tile_rows = None      # ... and at most this many rows (None: no bound)

    def __init__(self):
        BY_NAME[self.name] = self   # a compiled region's CP ring names its op (fused_cp)

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def forward(self, q, k, v, mask: BlockMask, scale: float, dropout_p: float = 0.0):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, mask: BlockMask, scale: float,
                 dropout_p: float = 0.0, state=None):
        raise NotImplementedError


class CpuFlashOp(BlockOp):
    """PyTorch's fused CPU kernel. MHA runs as one call on ``[b, g, s, d]`` views; GQA as
    one call per batch element on ``[g, r, s, d]`` with K/V expanded over ``r`` (a stride-0
    view, never copied); the backward kernel returns per-head dK/dV, summed over ``r``."""
    name = "cpu_flash"
    min_piece_rows = 128  # two K/V pieces in flight bound peak memory (bench/: cp=2 0.56x)
    # forward: whole chunks. Its peak (out, two chunks of K/V, one block's out) stays under
    # the backward's (out, dq/dk/dv, pieces); 8x fewer calls, merges and messages
    min_fwd_piece_rows = 1 << 30
    # backward tiles of 4 pieces, at most 1024 rows: half the calls of 2-piece tiles at
    # S=4096 (512 rows), within the memory target (cp=2: 0.56x of cp=1 at S=4096, 0.58x
    # at S=16384, where 4 pieces would be 2048 rows)
    tile_pieces, max_tile_rows = 4, 1024

    def compute_dtype(self, dtype):
        return torch.promote_types(dtype, torch.float32)

    def forward(self, q, k, v, mask, scale, dropout_p=0.0):
        assert dropout_p == 0.0, "select() routes CPU dropout to the reference kernels"
        b, g, r = q.shape[:3]
        if r == 1:
            o, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, 0], k[:, :, 0], v[:, :, 0], 0.0, mask.causal, scale=scale)
            return o.unsqueeze(2), lse.unsqueeze(2), None
        outs = [aten._scaled_dot_product_flash_attention_for_cpu(
            q[i], *(t[i].expand(-1, r, -1, -1) for t in (k, v)), 0.0, mask.causal, scale=scale)
            for i in range(b)]
        return torch.stack([o for o, _ in outs]), torch.stack([l for _, l in outs]), None

    def backward(self, dout, q, k, v, out, lse, mask, scale, dropout_p=0.0, state=None):
        b, g, r = q.shape[:3]
        if r == 1:
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout[:, :, 0], q[:, :, 0], k[:, :, 0], v[:, :, 0], out[:, :, 0],
                lse[:, :, 0], 0.0, mask.causal, scale=scale)
            return dq.unsqueeze(2), dk.unsqueeze(2), dv.unsqueeze(2)
        grads = [aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout[i], q[i], *(t[i].expand(-1, r, -1, -1) for t in (k, v)), out[i], lse[i],
            0.0, mask.causal, scale=scale) for i in range(b)]
        return (torch.stack([dq for dq, _, _ in grads]),
                torch.stack([dk.sum(1, keepdim=True) for _, dk, _ in grads]),
                torch.stack([dv.sum(1, keepdim=True) for _, _, dv in grads]))


def _heads(x: torch.Tensor) -> torch.Tensor:
    """Grouped ``[b, g, r, s, d]`` -> ``[b, g*r, s, d]`` (a view: heads are g-major)."""
    b, g, r, s, d = x.shape
    return x.reshape(b, g * r, s, d)


class CudaFlashOp(BlockOp):
    """FlashAttention-2 through ATen (fp16/bf16). GQA is native (K/V keep ``g`` heads);
    dropout is drawn inside the RNG tracker's model-parallel stream and replayed in
    backward from the philox seed/offset the forward returns."""
    name = "cuda_flash"
    supports_dropout = True
    needs_state = True
    min_piece_rows = min_fwd_piece_rows = 2048

    def forward(self, q, k, v, mask, scale, dropout_p=0.0):
        b, g, r, s, d = q.shape
        args = (_heads(q), k[:, :, 0], v[:, :, 0], dropout_p, mask.causal, False)
        if dropout_p > 0.0:
            with get_rng_tracker().fork():
                res = aten._scaled_dot_product_flash_attention(*args, scale=scale)
        else:
            res = aten._scaled_dot_product_flash_attention(*args, scale=scale)
        out, lse, cq, ck, mq, mk, seed, offset = res[:8]
        return out.view(b, g, r, s, d), lse.view(b, g, r, s), (cq, ck, mq, mk, seed, offset)

    def backward(self, dout, q, k, v, out, lse, mask, scale, dropout_p=0.0, state=None):
        b, g, r, s, d = q.shape
        cq, ck, mq, mk, seed, offset = state
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            _heads(dout), _heads(q), k[:, :, 0], v[:, :, 0], _heads(out),
            lse.reshape(b, g * r, s).contiguous(), cq, ck, mq, mk, dropout_p, mask.causal,
            seed, offset, scale=scale)
        return dq.view(b, g, r, s, d), dk.unsqueeze(2), dv.unsqueeze(2)


class CudaEfficientOp(BlockOp):
    """Memory-efficient attention (float32 on CUDA). The kernel has no GQA, so a grouped
    block is one call per query head of a group (``r`` calls on ``[b, g, s, d]`` views,
    K/V never repeated). Its LSE is padded to 32 rows; backward gets it padded again."""
    name = "cuda_efficient"
    supports_dropout = True
    needs_state = True
    min_piece_rows = min_fwd_piece_rows = 2048

    def forward(self, q, k, v, mask, scale, dropout_p=0.0):
        r, sq = q.shape[2], q.shape[3]
        outs, lses, states = [], [], []
        for j in range(r):
            args = (q[:, :, j], k[:, :, 0], v[:, :, 0], None, True, dropout_p, mask.causal)
            if dropout_p > 0.0:
                with get_rng_tracker().fork():
                    o, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
                        *args, scale=scale)
            else:
                o, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
                    *args, scale=scale)
            outs.append(o)
            lses.append(lse[..., :sq])
            states.append((seed, offset))
        return torch.stack(outs, 2), torch.stack(lses, 2), states

    def backward(self, dout, q, k, v, out, lse, mask, scale, dropout_p=0.0, state=None):
        b, g, r, sq, _ = q.shape
        pad = -(-sq // 32) * 32
        dqs, dk, dv = [], 0, 0
        for j in range(r):
            lse_j = lse.new_zeros(b, g, pad)
            lse_j[..., :sq] = lse[:, :, j]
            seed, offset = state[j]
            dq_j, dk_j, dv_j, _ = aten._scaled_dot_product_efficient_attention_backward(
                dout[:, :, j], q[:, :, j], k[:, :, 0], v[:, :, 0], None, out[:, :, j],
                lse_j, seed, offset, dropout_p, [True, True, True, False], mask.causal,
                scale=scale)
            dqs.append(dq_j)
            dk, dv = dk + dk_j, dv + dv_j
        return torch.stack(dqs, 2), dk.unsqueeze(2), dv.unsqueeze(2)


_CPU, _FLASH, _EFFICIENT = CpuFlashOp(), CudaFlashOp(), CudaEfficientOp()


def select(device: torch.device, dtype: torch.dtype, dropout_p: float = 0.0):
    """The block op for a call (device, dtype, dropout), or None for the reference kernels.
    The comm type does not matter: every CP driver runs the same block op."""
    if not fused_attn_enabled():
        return None
    if device.type == "cpu":
        return _CPU if dropout_p == 0.0 and dtype in (
            torch.float32, torch.float64, torch.bfloat16, torch.float16) else None
    if device.type == "cuda":
        if dtype in (torch.float16, torch.bfloat16):
            return _FLASH
        if dtype == torch.float32:
            return _EFFICIENT
    return None
