"""fp8 casts of the emulation: per-tensor, per block (1x128 / 128x128 tiles) and MX
(32-element blocks with E8M0 scales), written from TE 2.20.2's quantizers.

Every cast is ``t * scale`` in float32, saturated to the format's range and rounded to
nearest by torch's float8 dtypes (TE's saturating cast). Scales:
- *delayed*: from the amax history (tpkit.fp8.amax);
- *current* and *block* (``current_scale``, TE's ``compute_scale_from_amax``): an amax
  below ``amax_epsilon`` counts as ``amax_epsilon``; an amax of 0, inf or nan gives 1;
  else ``fp8_max / amax`` (float32 division), float32's max where that overflows, and
  rounded *down* to a power of two when the recipe says so;
- *MX* (``mx_exponent``): the E8M0 exponent of ``amax * (1/fp8_max)`` (float32 product)
  rounded *up* to a power of two, so the block's largest element never saturates; the
  cast multiplies by ``2**(127 - e)`` (1 for an all-zero block) and the scale stored for
  the GEMM is ``2**(e - 127)``; a block holding inf or nan comes out as zeros and nans,
  as from TE's kernels.
A block covers ``(rows, cols)`` elements of the tensor seen as 2-D ``[prod(shape[:-1]),
shape[-1]]``; a last partial block (a tail) is a block of what is there.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

_F32_MAX = torch.finfo(torch.float32).max


def amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| in float32 (0 for an empty tensor), on t's device."""
    if not t.numel():
        return torch.zeros((), device=t.device)
    return t.detach().abs().amax().float()


def current_scale(amax: torch.Tensor, fp8_max: float, *, power_2: bool = False,
                  epsilon: float = 0.0) -> torch.Tensor:
    """Current/block scaling's scale from amaxes (any shape; see the module docstring)."""
    a = amax.float()
    a = torch.where(a < epsilon, torch.full_like(a, epsilon), a)   # nan stays nan
    s = torch.tensor(fp8_max, dtype=torch.float32, device=a.device) / a
    s = torch.where(torch.isinf(s), torch.full_like(s, _F32_MAX), s)
    if power_2:
        _, e = torch.frexp(s)   # s = m * 2**e with m in [0.5, 1): 2**floor(log2 s) = 2**(e-1)
        s = torch.ldexp(torch.ones_like(s), e - 1)
    bad = (a == 0) | torch.isinf(a) | torch.isnan(a)
    return torch.where(bad, torch.ones_like(s), s)


def mx_exponent(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """The biased E8M0 exponent (int32, 0..255) of each block: ``amax * (1/fp8_max)``
    rounded up to a power of two (no round-up for an exact power of two, nor for a
    subnormal at most half the smallest normal); 0 for 0, 254 for inf, 255 for nan."""
    v = amax.float() * torch.tensor(1.0 / fp8_max, dtype=torch.float32)
    bits = v.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    up = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    e = exp + up.to(exp.dtype)
    e = torch.where(v == 0, torch.zeros_like(e), e)
    e = torch.where(torch.isinf(v), torch.full_like(e, 0xFE), e)
    return torch.where(torch.isnan(v), torch.full_like(e, 0xFF), e)


def mx_multiplier(e: torch.Tensor) -> torch.Tensor:
    """What the cast multiplies by: ``2**(127 - e)`` as float32 bits, 1 for ``e == 0``."""
    m = ((254 - e.clamp(max=254)) << 23).view(torch.float32)
    m = torch.where(e == 0, torch.ones_like(m), m)
    return torch.where(e == 0xFF, torch.full_like(m, float("nan")), m)


def cast(t: torch.Tensor, scale: torch.Tensor, fmt) -> torch.Tensor:
    """``t * scale`` saturated to ``fmt``'s range and rounded to nearest (float8 dtype)."""
    dtype, fmax = fmt
    s = scale.to(device=t.device, dtype=torch.float32)
    return (t.float() * s).clamp(-fmax, fmax).to(dtype)


quantize = cast  # the per-tensor cast's old name


@dataclasses.dataclass
class Blocks:
    """A 2-D tensor quantized per block: fp8 ``data`` [R, C], the float32 dequantization
    scale of each block ``scale_inv`` [ceil(R/r), ceil(C/c)] and the block ``(r, c)``."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple

    def dequantize(self) -> torch.Tensor:
        r, c = self.block
        R, C = self.data.shape
        s = self.scale_inv.repeat_interleave(r, 0).repeat_interleave(c, 1)[:R, :C]
        return self.data.float() * s


def _tiles(t2: torch.Tensor, block) -> torch.Tensor:
    """``t2`` zero-padded to whole blocks, as [R/r, r, C/c, c] (zeros leave amaxes alone)."""
    r, c = block
    R, C = t2.shape
    p = F.pad(t2, (0, -C % c, 0, -R % r))
    return p.view(p.shape[0] // r, r, p.shape[1] // c, c)


def quantize_blocks(t2: torch.Tensor, block, fmt, *, mx: bool, power_2: bool = False,
                    epsilon: float = 0.0) -> Blocks:
    """Quantize the 2-D ``t2`` per ``block`` (rows, cols): MX scales when ``mx``, else
    block scaling's (``current_scale`` of each block's amax)."""
    dtype, fmax = fmt
    R, C = t2.shape
    tiles = _tiles(t2.detach().float(), block)
    a = tiles.abs().amax(dim=(1, 3))
    if mx:
        e = mx_exponent(a, fmax)
        mult = mx_multiplier(e)
        scale_inv = torch.ldexp(torch.ones_like(a), e - 127)
    else:
        mult = current_scale(a, fmax, power_2=power_2, epsilon=epsilon)
        scale_inv = torch.reciprocal(mult)
    q = (tiles * mult[:, None, :, None]).clamp(-fmax, fmax).to(dtype)
    q = q.view(tiles.shape[0] * block[0], tiles.shape[2] * block[1])[:R, :C]
    return Blocks(q, scale_inv, tuple(block))


def gemm(a: torch.Tensor, b: torch.Tensor, alpha=None) -> torch.Tensor:
    """``(a @ b) * alpha`` in float32 with autocast off (the fp8 GEMM's accumulation)."""
    with torch.autocast(a.device.type, enabled=False):
        out = a.float().matmul(b.float())
        return out if alpha is None else out * alpha
