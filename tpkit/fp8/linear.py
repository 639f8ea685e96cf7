"""The emulated fp8 linear: what every tpkit linear layer's matmul becomes inside
``fp8_autocast`` (installed into tpkit.nn.linear with ``set_matmul``).

``y = x w^T (+ b)``, ``dx = g w``, ``dw = g^T x`` with ``x`` seen as [tokens, in]:
- *per-tensor recipes* (delayed, current): ``x`` and ``w`` are cast to the forward format
  (E4M3) and ``g`` to the backward one (E5M2 for HYBRID, else E4M3), one scale each; every
  GEMM multiplies the fp8 values in float32 and scales the product by ``(1/s_a)(1/s_b)``,
  as TE's fp8 GEMM does (checked against TE on an H100: BENCHMARKS.md, tests/test_gpu.py);
- *block recipes* (block, mxfp8): each GEMM operand is quantized with its blocks along the
  dimension the GEMM contracts (``x``: along ``in`` for fprop and along the tokens for
  wgrad; ``w``: along ``in`` for fprop, along ``out`` for dgrad; ``g``: along ``out`` for
  dgrad, along the tokens for wgrad; a 2-D tile serves both), every version from the
  high-precision tensor as TE does, then dequantized (float32) and multiplied in float32.
What stays in high precision: the GEMM's accumulation and output, the bias, everything
outside the linear layers, and what ``backward_override`` ("high_precision": backward
GEMMs on the original ``x``, ``w`` and ``g``; "dequantized": on the dequantized forward
operands and the original ``g``) or, for delayed scaling, ``override_linear_precision``
keep unquantized. Per-tensor amaxes and scales live in ``layer.fp8_meta``
(tpkit.fp8.amax).

Expert GEMMs (``grouped_linear``, installed into tpkit.nn.moe with ``set_grouped_mm``):
one such GEMM per local expert, as TE's GroupedLinear, each expert with its own scales,
kept in ``moe.fp8_meta_fc1/fc2`` by *global* expert index (so the amax reduction over the
amax group never mixes two experts), all in one autograd Function so that delayed
scaling's backward update runs once, after every expert's gradient amax.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..nn import linear as _nn_linear
from ..nn import moe as _nn_moe
from . import autocast as _ac
from .amax import GRAD, INPUT, WEIGHT, ExpertMeta, meta_of
from .params import FP8Weight
from .quantize import Blocks, amax, cast, current_scale, gemm, quantize_blocks

_QPARAMS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")


def _inv(scale: torch.Tensor, device) -> torch.Tensor:
    return 1.0 / scale.to(device=device, dtype=torch.float32)


def _current(recipe, role: int, t: torch.Tensor) -> torch.Tensor:
    """Current scaling's scale of ``t`` in ``role`` (its QParams, its format's max)."""
    q = getattr(recipe, _QPARAMS[role])
    fwd, bwd = recipe.formats
    fmax = (bwd if role == GRAD else fwd)[1]
    return current_scale(amax(t), fmax, power_2=q.power_2_scale, epsilon=q.amax_epsilon)


def _blocks(recipe, role: int, t2: torch.Tensor, contract_cols: bool) -> Blocks:
    """``t2`` quantized per the recipe's blocks for ``role``, the blocks running along the
    columns (``contract_cols``, the GEMM contracts dim 1) or the rows."""
    n = recipe.block_len
    shape = (n, n) if recipe.dims(role) == 2 else ((1, n) if contract_cols else (n, 1))
    fwd, bwd = recipe.formats
    fmt = bwd if role == GRAD else fwd
    if recipe.name == "mxfp8":
        return quantize_blocks(t2, shape, fmt, mx=True)
    q = getattr(recipe, _QPARAMS[role])
    return quantize_blocks(t2, shape, fmt, mx=False, power_2=q.power_2_scale,
                           epsilon=q.amax_epsilon)


def _pack(b: Blocks):
    return b.data, b.scale_inv


class _Saved:
    """What one expert GEMM's forward keeps for its backward (the autograd ctx's role)."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _forward(ctx, x, weight, bias, rec, out_dtype):
    """One emulated fp8 GEMM ``x weight^T (+ bias)``; what the backward needs goes on
    ``ctx`` (an autograd ctx, or one expert's ``_Saved``)."""
    r = rec.recipe
    ctx.rec, ctx.has_bias, ctx.out_dtype = rec, bias is not None, out_dtype
    ctx.dtypes, ctx.xshape = (x.dtype, weight.dtype), x.shape
    bo = getattr(r, "backward_override", None)
    x2 = x.reshape(-1, x.shape[-1])
    if r.per_tensor:
        fwd, _ = r.formats
        fprop, dgrad, wgrad = getattr(r, "override_linear_precision", (False,) * 3)
        keep_x, keep_w = wgrad or bo == "high_precision", dgrad or bo == "high_precision"
        sx, sw = rec.scale[INPUT], rec.scale[WEIGHT]
        xq, ix = cast(x, sx, fwd), _inv(sx, x.device)
        if isinstance(weight, FP8Weight) and weight.codes.dtype == fwd[0]:
            wq, iw = weight.codes, weight.scale_inv.to(device=x.device, dtype=torch.float32)
        else:   # fp8_model_init's weights multiply as stored, with their own scale
            wq, iw = cast(weight, sw, fwd), _inv(sw, x.device)
        out = gemm(x, weight.t()) if fprop else gemm(xq, wq.t(), ix * iw)
        ctx.save_for_backward(x if keep_x else xq, weight if keep_w else wq, ix, iw)
    else:
        xr, wr = _blocks(r, INPUT, x2, True), _blocks(r, WEIGHT, weight, True)
        # the product of the dequantized x seen as x.shape: a fresh tensor, not a view
        # (autograd forbids in-place ops on a view a custom Function returns)
        out = gemm(xr.dequantize().view(*x.shape[:-1], -1), wr.dequantize().t())
        if bo == "high_precision":
            ctx.save_for_backward(x2, weight)
        else:
            if bo is None:   # wgrad contracts x over the tokens, dgrad w over `out`
                xr = _blocks(r, INPUT, x2, False) if r.dims(INPUT) == 1 else xr
                wr = _blocks(r, WEIGHT, weight, False) if r.dims(WEIGHT) == 1 else wr
            ctx.blocks = (xr.block, wr.block)
            ctx.save_for_backward(*_pack(xr), *_pack(wr))
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _backward(ctx, g, want_dx, want_dw, want_db):
    """The gradients of one ``_forward`` GEMM: (dx, dw, db), None where not wanted."""
    rec = ctx.rec
    r, meta = rec.recipe, rec.meta
    bo = getattr(r, "backward_override", None)
    g2 = g.reshape(-1, g.shape[-1])
    if bo is not None:
        x_b, w_b = _high_precision_operands(ctx)
        dx = gemm(g2, w_b) if want_dx else None
        dw = gemm(g2.t(), x_b) if want_dw else None
    elif r.per_tensor:
        dx, dw = _per_tensor_backward(ctx, r, meta, g, g2, want_dx, want_dw)
    else:
        xd, xs, wd, ws = ctx.saved_tensors
        (xb, wb) = ctx.blocks
        gr = _blocks(r, GRAD, g2, True)
        gc = gr if r.dims(GRAD) == 2 else None
        dx = dw = None
        if want_dx:
            dx = gemm(gr.dequantize(), Blocks(wd, ws, wb).dequantize())
        if want_dw:
            gc = gc or _blocks(r, GRAD, g2, False)
            dw = gemm(gc.dequantize().t(), Blocks(xd, xs, xb).dequantize())
    if dx is not None:
        dx = dx.reshape(ctx.xshape).to(ctx.dtypes[0])
    if dw is not None:
        dw = dw.to(ctx.dtypes[1])
    db = None
    if ctx.has_bias and want_db:
        db = g2.float().sum(0).to(g.dtype)
    return dx, dw, db


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, rec, out_dtype):
        return _forward(ctx, x, weight, bias, rec, out_dtype)

    @staticmethod
    def backward(ctx, g):
        dx, dw, db = _backward(ctx, g, *ctx.needs_input_grad[:3])
        _ac.backward_update(ctx.rec)
        return dx, dw, db, None, None


def _high_precision_operands(ctx):
    """backward_override's operands: the originals, or the forward's fp8 ones
    dequantized to the activation dtype."""
    r = ctx.rec.recipe
    saved = ctx.saved_tensors
    if r.backward_override == "high_precision":
        x, w = saved[0], saved[1]
        return x.reshape(-1, x.shape[-1]), w
    if r.per_tensor:
        xq, wq, ix, iw = saved
        x, w = xq.float() * ix, wq.float() * iw
    else:
        xb, wb = ctx.blocks
        x, w = Blocks(saved[0], saved[1], xb).dequantize(), Blocks(saved[2], saved[3], wb).dequantize()
    act = ctx.out_dtype
    return x.reshape(-1, x.shape[-1]).to(act), w.to(act)


def _per_tensor_backward(ctx, r, meta, g, g2, want_dx, want_dw):
    x_w, w_d, ix, iw = ctx.saved_tensors
    _, bwd = r.formats
    _, dgrad, wgrad = getattr(r, "override_linear_precision", (False,) * 3)
    if r.name == "delayed":
        meta.record(GRAD, g)
        _ac._STATE.bwd_pending[id(meta.root)] = meta.root
        sg = meta.scale[GRAD]
    else:
        sg = _current(r, GRAD, g)
        meta.set_scale(GRAD, sg)
    gq = cast(g, sg, bwd)
    ig = _inv(sg, g.device)
    dx = dw = None
    if want_dx:
        dx = gemm(g, w_d) if dgrad else gemm(gq, w_d, ig * iw)
    if want_dw:
        g_ = (g if wgrad else gq).reshape(-1, g.shape[-1])
        dw = gemm(g_.t(), x_w.reshape(-1, x_w.shape[-1]), None if wgrad else ig * ix)
    return dx, dw


def _take_record(existing, fresh) -> "_ac._Record":
    """This fp8 call's record: replayed by a recompute (``existing()``: the layer's meta),
    else a new one (``fresh(recipe, session)`` -> (meta, per-tensor scales or None)),
    appended to every recording frame."""
    st = _ac._STATE
    if st.replay is not None:
        rec = st.replay.next(existing())
    else:
        session = st.session
        meta, scale = fresh(st.recipe, session)
        first = not session.first_taken and (torch.is_grad_enabled() or bool(st.recording))
        session.first_taken |= first
        rec = _ac._Record(meta, scale, st.recipe, session, first)
    for frame in st.recording:
        frame.records.append(rec)
    return rec


def _out_dtype(x):
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _calibrate(layer, r, session, x, weight) -> None:
    """fp8_autocast(calibrating=True) with fp8 off: what the fp8 forward would record."""
    meta = meta_of(layer, r)
    if r.name == "delayed":
        meta.record(INPUT, x)
        meta.record(WEIGHT, weight)
        session.fwd_metas[id(meta)] = meta
    else:
        meta.set_scale(INPUT, _current(r, INPUT, x))
        meta.set_scale(WEIGHT, _current(r, WEIGHT, weight))


def linear(layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear(x, weight, bias)``, in emulated fp8 with ``layer``'s meta inside
    fp8_autocast. The hook tpkit.nn's linear function calls."""
    st = _ac._STATE
    if not st.enabled:
        if st.calibrating and st.replay is None:
            _calibrate(layer, st.recipe, st.session, x, weight)
        return F.linear(x, weight, bias)

    def fresh(r, session):
        meta = meta_of(layer, r)
        scale = None
        if r.name == "delayed":
            meta.record(INPUT, x)
            meta.record(WEIGHT, weight)
            session.fwd_metas[id(meta)] = meta
            scale = meta.scale.clone()
        elif r.name == "current":
            scale = torch.stack([_current(r, INPUT, x), _current(r, WEIGHT, weight)])
            meta.set_scale(INPUT, scale[0])
            meta.set_scale(WEIGHT, scale[1])
        return meta, scale

    rec = _take_record(lambda: getattr(layer, "fp8_meta", None), fresh)
    return _FP8Linear.apply(x, weight, bias, rec, _out_dtype(x))


# --- grouped (expert) GEMMs ------------------------------------------------------------------
class _Expert:
    """One expert's record inside a grouped GEMM: its column of the scales and meta."""

    def __init__(self, rec, expert: int):
        self.recipe, self.meta = rec.recipe, ExpertMeta(rec.meta, expert)
        self.scale = None if rec.scale is None else rec.scale[:, expert]


class _FP8Grouped(torch.autograd.Function):
    """Rows of ``x`` in groups of ``counts``; group e times ``w[e]`` ([L, k, n]), each an
    emulated fp8 GEMM of expert ``first + e`` (``_forward`` with ``w[e]^T`` as the dense
    weight [n, k]: the blocks run along the contracted dimension as for a linear layer).
    One Function for all experts, so the delayed backward update runs once, after every
    expert's gradient amax is recorded."""

    @staticmethod
    def forward(ctx, x, w, rec, counts, first, out_dtype):
        ctx.rec, ctx.counts, ctx.parts = rec, counts, []
        outs = []
        for e, xe in enumerate(x.split(counts, 0)):
            part = _Saved()
            outs.append(_forward(part, xe, w[e].t().contiguous(), None,
                                 _Expert(rec, first + e), out_dtype))
            ctx.parts.append(part)
        return torch.cat(outs, 0) if outs else x.new_zeros(0, w.shape[-1], dtype=out_dtype)

    @staticmethod
    def backward(ctx, g):
        want_dx, want_dw = ctx.needs_input_grad[:2]
        dxs, dws = [], []
        for part, ge in zip(ctx.parts, g.split(ctx.counts, 0)):
            dx, dw, _ = _backward(part, ge.contiguous(), want_dx, want_dw, False)
            dxs.append(dx)
            dws.append(None if dw is None else dw.t())
        _ac.backward_update(ctx.rec)
        dx = torch.cat(dxs, 0) if want_dx else None
        dw = torch.stack(dws) if want_dw else None
        return dx, dw, None, None, None, None


def grouped_linear(layer, name: str, x: torch.Tensor, w: torch.Tensor, counts: list[int],
                   first_expert: int, num_experts: int):
    """The grouped GEMM of tpkit.nn.moe (installed with ``set_grouped_mm``): inside
    fp8_autocast, each local expert's GEMM in emulated fp8 with the scales of global
    expert ``first_expert + e`` in ``layer.fp8_meta_<name>`` ([3, num_experts]: see
    tpkit.fp8.amax); outside, the plain grouped GEMM."""
    if not _ac._STATE.enabled:
        return _nn_moe.plain_grouped_mm(x, w, counts)
    if layer is None:
        raise ValueError("grouped_mm inside fp8_autocast needs layer= (the module that "
                         "keeps the experts' fp8 scales) and name=; pass them as tpkit.nn."
                         "MoE does, or leave fp8_autocast")
    attr = f"fp8_meta_{name}"
    ws = w.split(1, 0)

    def fresh(r, session):
        meta = meta_of(layer, r, attr, num_experts)
        scale = None
        if r.per_tensor:
            for e, xe in enumerate(x.split(counts, 0)):
                ge = first_expert + e
                if r.name == "delayed":   # every held expert's weight, tokens or not
                    meta.record(INPUT, xe, ge)
                    meta.record(WEIGHT, ws[e], ge)
                else:
                    meta.set_scale(INPUT, _current(r, INPUT, xe), ge)
                    meta.set_scale(WEIGHT, _current(r, WEIGHT, ws[e]), ge)
            if r.name == "delayed":
                session.fwd_metas[id(meta)] = meta
            scale = meta.scale.clone()
        return meta, scale

    rec = _take_record(lambda: getattr(layer, attr, None), fresh)
    return _FP8Grouped.apply(x, w, rec, list(counts), first_expert, _out_dtype(x))


# tpkit.nn's parallel linear layers matmul through this module's ``linear`` from now on
# (F.linear outside fp8_autocast), and MoE's expert GEMMs through ``grouped_linear``:
# installed, not imported by nn (docs/design.md, "Layers").
_nn_linear.set_matmul(linear)
_nn_moe.set_grouped_mm(grouped_linear)
