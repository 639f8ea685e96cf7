"""Planted-bug guards for emulated fp8 (issue 26), through the public API only.

- The emulated linear against a quantiser written here from the format definitions
  (sign, exponent, mantissa bits, round half to even, saturation at the largest finite
  value), not torch's float8 dtypes, with the *delayed* scales a first step produces
  (!= 1, margin 0 and 1), values beyond the previous amax (saturation), E4M3 forward and
  E4M3/E5M2 gradients.
- ``fp8_autocast()`` without ``fp8_group`` under ``init_parallel`` reduces amaxes over
  the whole amax group (tp x dp): every rank records the global maximum, computed here
  from every rank's own inputs.
"""
import math

import pytest
import torch
import torch.nn as nn

from dist import run
from tpkit import fp8

# (mantissa bits, smallest normal exponent, largest finite value)
FORMATS = {"E4M3": (3, -6, 448.0), "E5M2": (2, -14, 57344.0)}


def fp8_round(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """``v`` (float64) saturated to ``fmt``'s range and rounded to the nearest value of the
    format (ties to even), subnormals included; returned as float64."""
    mant, emin, fmax = FORMATS[fmt]
    v = v.double().clamp(-fmax, fmax)
    a = v.abs()
    e = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a)))).clamp_min(emin)
    step = torch.pow(2.0, e - mant)
    return torch.sign(v) * torch.round(a / step) * step


def test_the_reference_quantiser_knows_the_formats():
    assert fp8_round(torch.tensor([1000.0, -1e9, 448.0, 449.0]), "E4M3").tolist() == \
        [448.0, -448.0, 448.0, 448.0]
    assert fp8_round(torch.tensor([1e6, 57344.0, 3.0, 2.4]), "E5M2").tolist() == \
        [57344.0, 57344.0, 3.0, 2.5]
    # E4M3 around 1: steps of 1/8; ties to even; subnormal step 2**-9
    assert fp8_round(torch.tensor([1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10]),
                     "E4M3").tolist() == [1.0, 1.25, 0.0, 2.0 ** -8]


class Lin(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        g = torch.Generator().manual_seed(i * o)
        self.weight = nn.Parameter(torch.randn(o, i, generator=g) / i ** 0.5)
        self.bias = nn.Parameter(torch.randn(o, generator=g))

    def forward(self, x):
        return fp8.linear(self, x, self.weight, self.bias)


@pytest.fixture(autouse=True)
def _clean():
    fp8.reset()
    yield
    fp8.reset()


def _scale(fmax, margin, amax):
    """The delayed-scaling formula in float32: fmax * 2**-margin / amax."""
    return (torch.tensor(fmax * 2.0 ** -margin, dtype=torch.float32)
            / torch.tensor(float(amax), dtype=torch.float32)).double()


@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
@pytest.mark.parametrize("margin", [0, 1])
def test_second_step_uses_the_delayed_scales(fmt, margin):
    fwd, bwd = "E4M3", ("E5M2" if fmt == "HYBRID" else "E4M3")
    layer = Lin(16, 8)
    recipe = fp8.DelayedScaling(fp8_format=fmt, margin=margin, amax_history_len=3)
    g = torch.Generator().manual_seed(margin)
    x1, g1 = torch.randn(6, 16, generator=g) * 3, torch.randn(6, 8, generator=g) * 50
    with fp8.fp8_autocast(recipe=recipe):
        y1 = layer(x1)
    y1.backward(g1)
    layer.zero_grad()
    # the scales step 2 must use, from step 1's amaxes (the history keeps only step 1)
    sx = _scale(FORMATS[fwd][2], margin, x1.abs().max())
    sw = _scale(FORMATS[fwd][2], margin, layer.weight.detach().abs().max())
    sg = _scale(FORMATS[bwd][2], margin, g1.abs().max())
    assert all(abs(s.item() - 1) > 0.1 for s in (sx, sw, sg))   # not the initial scale 1
    # step 2: larger values than step 1's amax, so some of them saturate
    x2 = torch.randn(6, 16, generator=g) * 3
    x2[0, :3] = torch.tensor([4.0, -3.0, 2.5]) * x1.abs().max()
    x2.requires_grad_()
    g2 = torch.randn(6, 8, generator=g) * 50
    g2[1, :2] = torch.tensor([-4.0, 3.0]) * g1.abs().max()
    with fp8.fp8_autocast(recipe=recipe):
        y2 = layer(x2)
    y2.backward(g2)

    def q(t, s, f):
        return fp8_round((t.detach().double() * s).float().double(), f)   # t*s in float32

    xq, wq, gq = q(x2, sx, fwd), q(layer.weight, sw, fwd), q(g2, sg, bwd)
    assert (xq.abs() == FORMATS[fwd][2]).any() and (gq.abs() == FORMATS[bwd][2]).any()
    y_ref = xq @ wq.t() / (sx * sw) + layer.bias.detach().double()
    torch.testing.assert_close(y2.double(), y_ref, rtol=2e-6, atol=1e-5)
    torch.testing.assert_close(x2.grad.double(), gq @ wq / (sg * sw), rtol=2e-6, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad.double(), gq.t() @ xq / (sg * sx),
                               rtol=2e-6, atol=1e-4)
    torch.testing.assert_close(layer.bias.grad.double(), g2.double().sum(0), rtol=1e-6, atol=0)


# --- the default amax group ----------------------------------------------------------------
def _default_group_worker():
    import tpkit
    from tpkit.checkpoint import load_full_state_dict
    from tpkit.nn import ColumnParallelLinear, RowParallelLinear
    fp8.reset()
    state = tpkit.init_parallel(tp=2, dp=2)
    g = torch.Generator().manual_seed(0)
    col, row = ColumnParallelLinear(8, 16), RowParallelLinear(16, 8)
    load_full_state_dict(col, {"weight": torch.randn(16, 8, generator=g),
                               "bias": torch.randn(16, generator=g)})
    load_full_state_dict(row, {"weight": torch.randn(8, 16, generator=g),
                               "bias": torch.randn(8, generator=g)})
    # each DP replica sees other data, of another size
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(10 + state.dp_rank))
    x = x * (1 + 5 * state.dp_rank)
    recipe = fp8.DelayedScaling(amax_history_len=4)
    with fp8.fp8_autocast(recipe=recipe):           # no fp8_group: state.amax_group
        h = col(x)
        y = row(h)
    y.square().sum().backward()
    local = [(x.abs().max().item(), col.weight.abs().max().item()),
             (h.detach().abs().max().item(), row.weight.abs().max().item())]
    hists = [m.fp8_meta.amax_history.max(dim=0).values[:2].tolist() for m in (col, row)]
    scales = [m.fp8_meta.scale[:2].tolist() for m in (col, row)]
    return local, hists, scales


def test_default_amax_group_reduces_over_tp_and_dp():
    results = run(_default_group_worker, 4)
    glob = [[max(r[0][layer][slot] for r in results) for slot in (0, 1)] for layer in (0, 1)]
    locs = {tuple(map(tuple, r[0])) for r in results}
    assert len(locs) == 4  # the ranks' own amaxes differ, so a missing reduction shows
    for _, hists, scales in results:
        assert hists == glob
        for layer in (0, 1):
            ref = [(_scale(448.0, 0, a)).item() for a in glob[layer]]
            assert scales[layer] == pytest.approx(ref, rel=1e-7)
    assert math.isfinite(glob[0][0])
