"""The reference's records against one layout's, and the first difference with a hint.

Each rank's recorded tensor is compared with *its piece of the reference*: the
reference's tensor cut the way the layout cuts it (this DP replica's rows, this CP
rank's load-balanced chunks of the sequence, this TP rank's sequence slice under SP or
feature slice, by segments for a fused column-parallel output). Which cut applies is read
off the shapes (the batch and sequence sizes of the batch, the layout's sizes) and the
layer's tags (a column-parallel layer's ``tp_partition_sizes``), so any module's output
can be compared, tpkit's layers and the model's own. Parameters and gradients are
compared whole (gathered by the ranks).

Order of the search, per step: outputs in forward order (the first that differs); then
gradients in backward order (the module where a gradient goes wrong: its input or own
parameter gradients differ while the gradient reaching its output agrees, the innermost
such); then the parameters after the optimizer step. Dropout masks are checked on their
own (``dropout_findings``).
"""
from __future__ import annotations

import dataclasses

import torch

from ..checkpoint import shard_tensor
from ..cp import cp_chunk_ids
from .findings import Finding, Tolerance, diff, hint_grad, hint_output, hint_update, module_rank

__all__ = ["compare_layout", "expected_piece"]


def _dims(shape, rows: int, seq: int):
    """(sequence dim, batch dim or None) of an activation of the reference, else (None, None)."""
    if len(shape) < 2:
        return (0, None) if len(shape) == 1 and shape[0] == seq else (None, None)
    a, b = shape[0], shape[1]
    if a == rows and b == seq:
        return 1, 0
    if a == seq and b in (rows, 1):
        return 0, (1 if b == rows else None)
    if b == seq and a in (rows, 1):
        return 1, (0 if a == rows else None)
    if a == seq:          # positions' rows (nanoGPT's wpe(arange(t))): no batch dim
        return 0, None
    return None, None


def expected_piece(ref: torch.Tensor, local_shape, coords: dict, layout, rows: int, seq: int,
                   segments=None):
    """(the reference's piece that this rank should hold, None) or (None, why not)."""
    local_shape = tuple(local_shape)
    x = ref
    if x.dim() != len(local_shape):
        return None, f"shape {local_shape} where the reference has {tuple(ref.shape)}"
    sd, bd = _dims(tuple(ref.shape), rows, seq)
    if bd is not None and layout.dp > 1:
        x = x.chunk(layout.dp, bd)[coords["dp"]]
    if sd is not None:
        if layout.cp > 1:
            if local_shape[sd] == seq:
                return None, "unsharded"
            chunks = x.chunk(2 * layout.cp, sd)
            x = torch.cat([chunks[i] for i in cp_chunk_ids(coords["cp"], layout.cp)], sd)
        if layout.tp > 1 and local_shape[sd] * layout.tp == x.shape[sd]:
            x = x.chunk(layout.tp, sd)[coords["tp"]]
    if layout.tp > 1:
        for k in reversed(range(x.dim())):
            if k not in (sd, bd) and local_shape[k] * layout.tp == x.shape[k]:
                segs = segments if k == x.dim() - 1 and segments \
                    and sum(segments) == x.shape[k] else None
                x = shard_tensor(x, k, segs, coords["tp"], layout.tp)
                break
    if tuple(x.shape) != local_shape:
        return None, (f"shape {local_shape} where this rank's piece of the reference's "
                      f"{tuple(ref.shape)} is {tuple(x.shape)}")
    return x, None


class _Side:
    """One kind of record (outputs, gradients) of one step, every rank against the
    reference; ``check(key)`` -> None (agrees or not recorded) or a Finding."""

    def __init__(self, kind, step, ref, ranks, ctx):
        self.kind, self.step, self.ref, self.ranks, self.ctx = kind, step, ref, ranks, ctx
        self.cache = {}

    def check(self, key, what):
        if key in self.cache:
            return self.cache[key]
        self.cache[key] = f = self._check(key, what)
        return f

    def _check(self, key, what):
        ctx = self.ctx
        ref = self.ref["steps"][self.step][self.kind].get(key)
        have = [(r, res["steps"][self.step][self.kind][key]) for r, res in enumerate(self.ranks)
                if self.step < len(res["steps"]) and key in res["steps"][self.step][self.kind]]
        if ref is None or not have:
            return None
        name = key[0]
        if ref.dim() == 0:
            if self.kind != "out":   # the loss's own gradient: 1 / (dp * cp) by design
                return None
            mean = sum(float(t) for _, t in have) / len(have)
            d, s = diff(torch.tensor(mean), ref)
            return Finding(self.step, what, name, "all", d, s) if ctx.tol.bad(d, s) else None
        if self.kind in ("gin", "gout") and ctx.layout.dp > 1 and \
                _dims(tuple(ref.shape), ctx.rows, ctx.seq)[1] is None:
            return None   # no batch dim: each DP replica's gradient is a part of the sum
        segs = None
        if self.kind in ("out", "gout"):
            segs = self.ranks[0]["meta"]["modules"].get(name, {}).get("sizes")
        bad, worst, scale, note = [], 0.0, 0.0, None
        for r, t in have:
            exp, why = expected_piece(ref, t.shape, self.ranks[r]["coords"], ctx.layout,
                                      ctx.rows, ctx.seq, segs)
            if exp is None:
                bad.append(r)
                note = why
                continue
            d, s = diff(t, exp)
            scale = max(scale, s)
            if ctx.tol.bad(d, s):
                bad.append(r)
                worst = _worse(worst, d)
        if not bad:
            return None
        if ctx.layout.cp > 1 and note is None and self.kind == "out" and all(
                _matches(ref, t, self.ranks[r]["coords"], whole, ctx, segs)
                for r, t in have if r in bad
                for whole in [dataclasses.replace(ctx.layout, cp=1)]):
            note = "unsharded"
        f = Finding(self.step, what, name, bad, worst, scale)
        if note == "unsharded":
            f.detail = (f"its output is the unsharded sequence's ({ctx.seq} tokens) on every "
                        f"CP rank, where cp={ctx.layout.cp} gives each its "
                        f"{ctx.seq // ctx.layout.cp} tokens")
            f.hint = ("the sequence reached this module unsharded: shard the model's inputs "
                      "over CP (a plan's shard_inputs with tpkit.data.shard_sequence; tpkit's "
                      "own models shard in forward)")
        elif note:
            f.detail = note
        return f


def _worse(worst: float, d: float) -> float:
    """The larger difference, NaN above all (``max`` would keep 0.0 before a NaN)."""
    return d if d != d or not d <= worst else worst


def _matches(ref, t, coords, layout, ctx, segs) -> bool:
    """``t`` is this rank's piece of ``ref`` at ``layout`` (e.g. without CP)."""
    exp, _ = expected_piece(ref, t.shape, coords, layout, ctx.rows, ctx.seq, segs)
    return exp is not None and not ctx.tol.bad(*diff(t, exp))


@dataclasses.dataclass
class _Ctx:
    layout: object
    rows: int
    seq: int
    tol: Tolerance


def _values(res, step, kind, name):
    """A rank's gathered tensor; for parameters after a step, the step's update (the
    parameter minus its value before the step: small next to the weights themselves)."""
    if step < 0:
        return res["initial"].get(name, "absent")
    got = res["steps"][step][kind].get(name, "absent")
    if kind == "params" and isinstance(got, torch.Tensor):
        before = res["initial"] if step == 0 else res["steps"][step - 1]["params"]
        prev = before.get(name)
        return got - prev if isinstance(prev, torch.Tensor) and prev.shape == got.shape \
            else "absent"
    return got


def _param_findings(step, kind, ref, ranks, ctx, what):
    """{param name: Finding} for the gathered parameters (or gradients, or a step's
    updates) that differ."""
    out = {}
    for name in (ref["steps"][step][kind] if step >= 0 else ref["initial"]):
        want = _values(ref, step, kind, name)
        bad, worst, scale = [], 0.0, 0.0
        floor = 0.0   # an update is read off a rounded parameter: a few of its ulps
        if kind == "params" and want is not None:
            p = ref["steps"][step][kind][name]
            floor = 4 * torch.finfo(p.dtype).eps * diff(p, p)[1]   # of its finite values
        for r, res in enumerate(ranks):
            got = _values(res, step, kind, name)
            if isinstance(got, str) or (got is None) != (want is None):
                bad.append(r)
                continue
            if want is None:
                continue
            if got.shape != want.shape:
                bad.append(r)
                continue
            d, s = diff(got, want)
            scale = max(scale, s)
            if ctx.tol.bad(max(d - floor, 0.0), s):
                bad.append(r)
                worst = _worse(worst, d)
        if bad:
            owner = ref["meta"]["params"].get(name, {}).get("module", name)
            out[name] = Finding(step, what, owner, bad, worst, scale,
                                detail="" if worst or scale else "missing or of another shape")
            out[name].param = name
    return out


def _first_by_module(findings: dict, order):
    pos = module_rank(order)
    return min(findings.values(), key=lambda f: pos.get(f.module, len(pos))) if findings else None


def compare_layout(ref: dict, ranks: list, layout, rows: int, seq: int, tol: Tolerance):
    """The first Finding (None: everything agrees) and the number of comparisons."""
    ctx = _Ctx(layout, rows, seq, tol)
    loaded = _param_findings(-1, None, ref, ranks, ctx, "weights after loading")
    if loaded:
        f = _first_by_module(loaded, ref["steps"][0]["order"] if ref["steps"] else [])
        f.hint = ("the layout's weights, gathered by their TP tags, are not the reference's: "
                  "a parameter's tp_partition_dim / segments do not match how it was loaded")
        return f
    for step in range(len(ref["steps"])):
        order = ref["steps"][step]["order"]
        out = _Side("out", step, ref, ranks, ctx)
        inp = _Side("inp", step, ref, ranks, ctx)
        errors = [r["error"] for r in ranks if r.get("error") and r["error"][0] == step]
        for key in order:
            f = out.check(key, "output")
            if f is not None:
                if inp.check(key, "input") is not None:
                    f, key = _enclosing(f, key, order, out, inp)
                hint_output(f, key, step, ref, ranks, ctx)
                if errors:
                    f.hint += f"\n    then '{errors[0][1]}' raised {errors[0][2]}"
                return f
        if errors:
            _, where, msg = errors[0]
            return Finding(step, "error", where,
                           sorted(r for r, res in enumerate(ranks) if res.get("error")),
                           detail=f"raised {msg}",
                           hint="every module before it agrees with the reference")
        f = _backward(step, order, ref, ranks, ctx)
        if f is not None:
            return f
        after = _param_findings(step, "params", ref, ranks, ctx, "update of the parameter")
        if after:
            f = _first_by_module(after, order)
            hint_update(f, ranks)
            return f
    return None


def _enclosing(f, key, order, out, inp):
    """``key``'s output differs but so does its input, which no compared module gave it
    (the difference starts in code between modules, or in modules only the layout has):
    the innermost enclosing module whose input agrees, where the difference starts."""
    name, pos = key[0], order.index(key)
    child = name
    while name != "(model)":
        name = name.rpartition(".")[0] or "(model)"
        parent = next((k for k in order[pos:] if k[0] == name), None)
        if parent is None:
            break
        if inp.check(parent, "input") is None:
            g = out.check(parent, "output") or f
            g = Finding(g.step, "output", name, g.ranks, g.diff, g.scale, detail=g.detail)
            g.detail = g.detail or (
                f"max |diff| {g.diff:.3g} = {g.diff / max(g.scale, 1e-30):.2g} of the "
                f"reference's max |value| {g.scale:.3g}; its input agrees, and inside it "
                f"'{child}' already receives a different input")
            return g, parent
    return f, key


def _backward(step, order, ref, ranks, ctx):
    gin = _Side("gin", step, ref, ranks, ctx)
    gout = _Side("gout", step, ref, ranks, ctx)
    grads = _param_findings(step, "grads", ref, ranks, ctx, "parameter gradient")
    by_module = {}
    for f in grads.values():
        by_module.setdefault(f.module, f)
    origins = []
    for key in reversed(order):
        bad_out = gout.check(key, "output gradient")
        if bad_out is not None:
            continue
        bad = (by_module.get(key[0]) if key[1] == 0 else None) or gin.check(key, "input gradient")
        if bad is not None:
            origins.append(bad)
    if origins:   # the first in forward order (completion order: inner modules first)
        pos = module_rank(order)
        pick = min(origins, key=lambda f: pos.get(f.module, len(pos)))
        hint_grad(pick, step, ref, ranks, ctx)
        return pick
    if grads:
        f = _first_by_module(grads, order)
        hint_grad(f, step, ref, ranks, ctx)
        return f
    for key in reversed(order):
        f = gout.check(key, "output gradient")
        if f is not None:
            return f
    return None
