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
    inf = torch.tensor([float("inf")])
    assert diff(inf, inf) == (0.0, 0.0)                     # no finite value: scale 0
    assert TOL.bad(float("nan"), 1.0) and TOL.bad(float("inf"), 1.0)
    assert TOL.bad(float("nan"), float("inf"))


def test_tolerances_and_the_finding_line_by_hand():
    """tpkit.verify's tolerances as documented (float32: 1000 eps of the largest value +
    1e-9; bf16 autocast: 8 bf16 eps + 1e-6) and the one-line report's wording."""
    from tpkit.verifier.findings import Finding, Tolerance
    f32, bf16 = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
    assert (TOL.rtol, TOL.atol) == (1000 * f32, 1e-9)
    b = tolerance("bf16-mixed")
    assert (b.rtol, b.atol) == (8 * bf16, 1e-6)
    t = Tolerance(0.01, 0.5, "")
    assert not t.bad(0.5 + 0.01 * 10.0, 10.0) and t.bad(0.5 + 0.01 * 10.0 + 1e-9, 10.0)
    assert not t.bad(0.6, 10.0) and t.bad(0.61, 10.0) and t.bad(0.51, 0.0)
    f = Finding(3, "output", "layers.0.mlp", [0, 3], 0.25, 2.0, hint="look here")
    assert f.line(t) == ("first difference at step 4: output of module 'layers.0.mlp' on "
                         "ranks 0,3: max |diff| 0.25 = 0.12 of the reference's max |value| "
                         "2 (tolerance 0.01)\n    hint: look here")
    one = Finding(0, "parameter gradient", "lin", [1], 3.0, 4.0)
    assert one.line(t).startswith("first difference at step 1: parameter gradient of module "
                                  "'lin' on rank 1: max |diff| 3 = 0.75 of")
    assert "\n" not in one.line(t)
    assert Finding(-1, "weights after loading", "w", "all").line(t).startswith(
        "first difference at loading: weights after loading of module 'w' on all ranks")
    assert Finding(-1, "dropout mask", "d", [0, 1], detail="same masks").line(t) == \
        "first difference at the dropout check: dropout mask of module 'd' on ranks 0,1: " \
        "same masks"
