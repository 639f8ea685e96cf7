"""What a verification found and the hints tpkit gives about it: tolerances by precision,
``Finding`` (one line of the report), the hints read off a module's type, tags and the
reference's records, and the dropout-mask check across TP ranks."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

__all__ = ["Finding", "Tolerance", "tolerance", "dropout_findings", "diff", "module_rank",
           "hint_output", "hint_grad", "hint_update"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float          # of the reference tensor's largest magnitude
    atol: float
    why: str

    def bad(self, diff: float, scale: float) -> bool:
        return not diff <= self.rtol * scale + self.atol


def tolerance(precision: str) -> Tolerance:
    """float32: 1000 x float32's epsilon (sums in another order over a few layers);
    bf16 autocast: 8 x bfloat16's epsilon."""
    if precision == "bf16-mixed":
        eps = torch.finfo(torch.bfloat16).eps
        return Tolerance(8 * eps, 1e-6, "bf16 autocast: 8 x bfloat16 eps of the largest value")
    eps = torch.finfo(torch.float32).eps
    return Tolerance(1000 * eps, 1e-9, "float32: 1000 x float32 eps of the largest value")


@dataclasses.dataclass
class Finding:
    step: int                 # 0-based; -1: before the first step
    what: str                 # output / input gradient / parameter gradient / ...
    module: str
    ranks: list
    diff: float = 0.0
    scale: float = 0.0
    hint: str = ""
    detail: str = ""

    def line(self, tol: Tolerance) -> str:
        where = f"step {self.step + 1}" if self.step >= 0 else \
            ("the dropout check" if self.what == "dropout mask" else "loading")
        ranks = "all ranks" if self.ranks == "all" else \
            f"rank{'s' if len(self.ranks) > 1 else ''} {','.join(map(str, self.ranks))}"
        rel = self.diff / max(self.scale, 1e-30)
        how = self.detail or (f"max |diff| {self.diff:.3g} = {rel:.2g}"
                              f" of the reference's max |value| {self.scale:.3g} "
                              f"(tolerance {tol.rtol:.1g})")
        return (f"first difference at {where}: {self.what} of module '{self.module}' on "
                f"{ranks}: {how}" + (f"\n    hint: {self.hint}" if self.hint else ""))


def diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b|, max |b|): ``b`` is the reference. The same value at the same place
    agrees, non-finite ones too (NaN where the reference has NaN, an inf of the same sign);
    NaN or inf anywhere else makes the difference NaN or inf. The scale is the reference's
    largest *finite* magnitude (an inf in it must not make every difference tolerable)."""
    a, b = a.double(), b.double()
    if not a.numel():
        return 0.0, 0.0
    same = (a == b) | (a.isnan() & b.isnan())
    d = (a - b).abs().masked_fill(same, 0.0)
    finite = b[b.isfinite()]
    return float(d.max()), float(finite.abs().max()) if finite.numel() else 0.0


def module_rank(order):
    """module name -> position of its first call in forward order."""
    pos = {}
    for i, (name, _) in enumerate(order):
        pos.setdefault(name, i)
    return pos


# --- hints: what tpkit knows about the module ------------------------------------------
_ATTENTION = ("PlannedAttention", "ParallelSelfAttention", "MultiheadAttention")


def hint_output(f, key, step, ref, ranks, ctx):
    if f.hint:
        return
    name = key[0]
    mine = ranks[0]["meta"]["modules"].get(name, {})
    cls = mine.get("cls", "?")
    weights = ref["initial"] if step == 0 else ref["steps"][step - 1]["params"]
    if cls in _ATTENTION:
        f.hint = (f"'{name}' is tpkit's {cls}: check its plan (qkv= names in the order q, k, v; "
                  "heads and kv_heads) and that the model's query heads use kv heads as "
                  "tpkit's do (query heads [i*g, (i+1)*g) share kv head i, Hugging Face's "
                  "repeat_kv; a model that tiles the kv heads with .repeat() splits differently)")
        return
    x = ref["steps"][step]["lin"].get(key)
    if cls in ("ColumnParallelLinear", "RowParallelLinear") and x is not None:
        w, b = weights.get(f"{name}.weight"), weights.get(f"{name}.bias")
        style = "Row() splits its weight along dim 1 (the input features)" \
            if cls == "RowParallelLinear" else "Column() splits its weight along dim 0 " \
            "(the output features)"
        want = ref["steps"][step]["out"].get(key)
        linear = w is not None and want is not None and x.shape[-1] == w.shape[-1] and \
            not ctx.tol.bad(*diff(F.linear(x, w, b), want))
        if not linear:
            f.hint = (f"'{name}' does not compute nn.Linear's x @ weight.T + bias in the "
                      f"reference (is its weight stored transposed, [in, out]?), but {style} "
                      "as nn.Linear's: the style does not match the weight's layout")
        else:
            f.hint = (f"'{name}' ({cls}) holds the reference's weights; check its style: "
                      "Column() for the first of two projections, Row() for the second, "
                      "Column(segments=...) for a fused weight (gate/up, q/k/v)")
        return
    mods = ranks[0]["meta"]["modules"]
    columns = [m for m, info in mods.items() if m.startswith(f"{name}.")
               and "." not in m[len(name) + 1:] and info.get("cls") == "ColumnParallelLinear"
               and info.get("split_dim") == 0 and info.get("sizes") is None]
    if columns:   # a fused projection split in the forward (gate/up, q/k/v), one segment
        f.hint = (f"'{name}' ({cls}) is the first module whose output differs and its inputs "
                  f"agree; its column-parallel child '{columns[0]}' has no segments: if "
                  f"'{name}' splits that output into parts (a fused gate/up or q/k/v "
                  "projection, .chunk/.split), each rank holds a slice of the concatenation, "
                  "not its share of every part: give it Column(segments=(size, size, ...)) "
                  "in the plan")
        return
    f.hint = (f"'{name}' ({cls}) is the first module whose output differs; the modules "
              "before it agree, so look at what it computes or receives besides its input")


def hint_grad(f, step, ref, ranks, ctx):
    name = getattr(f, "param", None)
    if name is None:
        f.hint = (f"the gradient goes wrong in '{f.module}': its output's gradient agrees, "
                  "its input's does not (a custom autograd function or a collective's "
                  "backward)")
        return
    meta = ranks[0]["meta"]["params"].get(name, {})
    if meta.get("dim") is None and ctx.layout.tp > 1:
        want = ref["steps"][step]["grads"][name]
        groups = {}
        for res in ranks:
            c = res["coords"]
            groups.setdefault((c["cp"], c["dp"]), []).append(res["steps"][step]["grads"][name])
        parts = next(iter(groups.values()))
        if want is not None and all(p is not None for p in parts):
            total = torch.stack(parts).sum(0)
            summed = not ctx.tol.bad(*diff(total, want))
            if summed and not meta.get("sp"):
                f.hint = (f"'{name}' is replicated over TP and its TP ranks' gradients add up "
                          "to the reference's: each holds the gradient of its own tokens "
                          "(sequence parallel) and they were not summed; tag it "
                          "sequence_parallel (Replicate() and Norm() do; "
                          "tpkit.layout.param_tags.set_tp_attrs(p, None, sequence_parallel=True))")
                return
            if summed:
                f.hint = f"'{name}' is tagged sequence_parallel but was not summed over TP"
                return
    f.hint = f"the gradient of '{name}' differs while the gradients reaching '{f.module}' agree"


def hint_update(f, ranks):
    stale = max(r["stale"] for r in ranks)
    missing = max(r["missing"] for r in ranks)
    if stale or missing:
        f.hint = (f"the optimizer holds {stale} tensor(s) that are not the model's "
                  f"parameters and misses {missing} of them: it was built from parameters "
                  "that tpkit.parallelize replaced; build it from the parallelized model")
    else:
        f.hint = ("the gradients agree but the updated parameters do not: the optimizer "
                  "(or a hook) treats this parameter differently across ranks")


def dropout_findings(ranks: list, order) -> list:
    """The first dropout (forward order) whose masks are wrong, across the TP ranks of one
    (cp, dp) coordinate: where the input is split over TP the masks must differ
    (independent draws); where it is the same on every TP rank they must agree (else the
    replicas diverge)."""
    groups = {}
    for r, res in enumerate(ranks):
        c = res["coords"]
        groups.setdefault((c["cp"], c["dp"]), []).append(r)
    pos = module_rank(order)
    names = sorted({n for res in ranks for n in res["masks"]}, key=lambda n: pos.get(n, 1 << 30))
    for name in names:
        for members in groups.values():
            if len(members) < 2:
                continue
            got = [ranks[r]["masks"].get(name) for r in members]
            if any(g is None for g in got):
                continue
            same_input = all(g[0].shape == got[0][0].shape and torch.equal(g[0], got[0][0])
                             for g in got)
            same_mask = all(g[1].shape == got[0][1].shape and torch.equal(g[1], got[0][1])
                            for g in got)
            if not same_input and same_mask:
                return [Finding(-1, "dropout mask", name, members, detail=(
                    "the same mask on every TP rank while its input is split over TP"),
                    hint="draw it from the model-parallel stream: "
                         "`with tpkit.layout.random.get_rng_tracker().fork(): x = dropout(x)`")]
            if same_input and not same_mask:
                return [Finding(-1, "dropout mask", name, members, detail=(
                    "different masks on the TP ranks of a replicated input (the replicas "
                    "diverge)"), hint="draw it from the default stream, outside "
                                      "get_rng_tracker().fork()")]
    return []
