"""tpkit.verify's comparison when a value is not a finite number (issue 52): NaN or inf
where the reference is finite is a difference wherever it occurs (an output, a parameter
gradient, a step's update, the loss, the weights after loading), reported with a
non-finite size, never as agreement and never as 0; an inf in the reference does not make
every other difference tolerable (the tolerance is relative to the reference's largest
*finite* value); the same non-finite value at the same place on both sides agrees.

The records are built here by hand (one rank, layout 1x1x1) in the shape tpkit.verifier's
recorder writes them, so each case isolates one value; the references are the cases'
own expectations, not tpkit's arithmetic."""
import math

import pytest
import torch

from tpkit.verifier.compare import compare_layout
from tpkit.verifier.findings import diff, tolerance
from tpkit.verifier.run import Layout

TOL = tolerance("32-true")
KEY = ("lin", 0)


def _records(out=None, grad=None, update=None, loss=None, initial=None):
    """(reference, [rank 0]) records of one step of a model with one module "lin" (an
    output ``[rows=2, seq=4, 3]``), its parameter "lin.weight" and a 0-dim loss."""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(3, 3, generator=g)
    o = torch.randn(2, 4, 3, generator=g)
    gw = torch.randn(3, 3, generator=g)
    step = -0.1 * gw
    ref = {"initial": {"lin.weight": w0},
           "steps": [{"order": [KEY, ("(model)", 0)],
                      "out": {KEY: o, ("(model)", 0): torch.tensor(1.5)},
                      "inp": {}, "lin": {}, "gin": {}, "gout": {},
                      "grads": {"lin.weight": gw}, "params": {"lin.weight": w0 + step}}],
           "meta": {"params": {"lin.weight": {"module": "lin"}},
                    "modules": {"lin": {"cls": "Linear"}, "(model)": {"cls": "M"}}}}

    def with_(t, change):
        t = t.clone()
        if change is not None:
            change(t)
        return t
    rank = {"coords": {"dp": 0, "cp": 0, "tp": 0}, "meta": ref["meta"], "stale": 0,
            "missing": 0,
            "initial": {"lin.weight": with_(w0, initial)},
            "steps": [{"order": ref["steps"][0]["order"],
                       "out": {KEY: with_(o, out),
                               ("(model)", 0): with_(torch.tensor(1.5), loss)},
                       "inp": {}, "lin": {}, "gin": {}, "gout": {},
                       "grads": {"lin.weight": with_(gw, grad)},
                       "params": {"lin.weight": w0 + with_(step, update)}}]}
    return ref, [rank]


def _first(ref, ranks):
    return compare_layout(ref, ranks, Layout(1, 1, 1), 2, 4, TOL)


def _set(value, at=(0, 1)):
    def change(t):
        t[at] = value
    return change


def test_identical_records_agree():
    ref, ranks = _records()
    assert _first(ref, ranks) is None


BAD = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}


@pytest.mark.parametrize("value", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("where, what, module", [
    ("out", "output", "lin"),
    ("grad", "parameter gradient", "lin"),
    ("update", "update of the parameter", "lin"),
    ("loss", "output", "(model)"),
    ("initial", "weights after loading", "lin"),
])
def test_a_non_finite_value_where_the_reference_is_finite_is_a_difference(value, where, what,
                                                                         module):
    at = () if where == "loss" else ((0, 1, 2) if where == "out" else (0, 1))
    ref, ranks = _records(**{where: _set(BAD[value], at)})
    f = _first(ref, ranks)
    assert f is not None, (where, value)
    assert (f.what, f.module) == (what, module), (f.what, f.module)
    assert not math.isfinite(f.diff), f.diff        # its size says so, not 0 or a number
    line = f.line(TOL)
    assert ("nan" in line or "inf" in line) and "missing" not in line, line


@pytest.mark.parametrize("where", ["out", "grad", "update"])
def test_an_inf_in_the_reference_does_not_hide_other_differences(where):
    """The reference holds an inf (both sides do, at the same place); elsewhere the layout
    is off by 50 % of the largest finite value: a difference."""
    at = (0, 1, 2) if where == "out" else (0, 1)
    ref, ranks = _records()
    side = {"out": lambda r: r["steps"][0]["out"][KEY],
            "grad": lambda r: r["steps"][0]["grads"]["lin.weight"],
            "update": lambda r: r["steps"][0]["params"]["lin.weight"]}[where]
    for r in (ref, ranks[0]):
        side(r)[at] = float("inf")
    mine = side(ranks[0])
    far = (1, 0, 0) if where == "out" else (1, 0)
    mine[far] += 0.5 * float(side(ref)[side(ref).isfinite()].abs().max())
    f = _first(ref, ranks)
    assert f is not None and f.module == "lin", f


@pytest.mark.parametrize("value", list(BAD), ids=list(BAD))
def test_the_same_non_finite_value_at_the_same_place_agrees(value):
    ref, ranks = _records()
    for r in (ref, ranks[0]):
        r["steps"][0]["out"][KEY][0, 1, 2] = BAD[value]
        r["steps"][0]["grads"]["lin.weight"][2, 2] = BAD[value]
    assert _first(ref, ranks) is None


def test_a_nan_against_an_inf_or_inf_of_the_other_sign_differs():
    for mine, theirs in (("nan", "+inf"), ("+inf", "-inf"), ("-inf", "nan")):
        ref, ranks = _records()
        ref["steps"][0]["out"][KEY][1, 1, 1] = BAD[theirs]
        ranks[0]["steps"][0]["out"][KEY][1, 1, 1] = BAD[mine]
        f = _first(ref, ranks)
        assert f is not None and f.module == "lin", (mine, theirs)


def test_diff_by_hand():
    a = torch.tensor([1.0, 2.0, float("inf"), float("nan")])
    assert diff(a, a) == (0.0, 2.0)                         # scale: the largest finite value
    d, s = diff(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 3.0]))
    assert math.isnan(d) and s == 3.0
    d, s = diff(torch.tensor([1.0, 7.0]), torch.tensor([1.0, float("inf")]))
    assert math.isinf(d) and s == 1.0
    assert diff(torch.tensor([0.5, -3.0]), torch.tensor([1.0, -1.0])) == (2.0, 1.0)
    assert diff(torch.zeros(0), torch.zeros(0)) == (0.0, 0.0)
    assert TOL.bad(float("nan"), 1.0) and TOL.bad(float("inf"), 1.0)
    assert TOL.bad(float("nan"), float("inf"))
