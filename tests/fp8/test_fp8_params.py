"""fp8 parameters (tpkit.fp8.fp8_model_init, TE's) with master weights in the optimizer,
and fp8_autocast(calibrating=True) on the torch backend.

References: the parameter bytes are counted by tests/memcount.py's tracker (storages,
nothing of tpkit) against a count by hand; training is compared with float32 training
of the same model (the fp8 recipes' launched test's bound, 3 % per step); calibration
with the formulas written here from TE's docs (amax = max |t|, scale = 448 / amax)."""
import gc

import pytest
import torch
import torch.nn.functional as F

from dist import run
from memcount import LiveBytes
from tpkit import fp8

FP8_REL = 0.03          # tests/fp8/test_fp8_recipes.py: each recipe within 3 % of float32
IN, HID, OUT = 32, 64, 16


@pytest.fixture(autouse=True)
def _clean_fp8_state():
    fp8.reset()
    yield
    fp8.reset()


def _mlp(dtype, seed=0):
    import tpkit.te_api as te
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        te.Linear(IN, HID, params_dtype=dtype, init_method=torch.nn.init.xavier_normal_),
        torch.nn.GELU(),
        te.Linear(HID, OUT, params_dtype=dtype, init_method=torch.nn.init.xavier_normal_))


def _built_bytes(fp8_init: bool) -> tuple[int, object]:
    gc.collect()
    with LiveBytes() as mem:
        base = mem.now
        with fp8.fp8_model_init(enabled=fp8_init):
            model = _mlp(torch.bfloat16)
        gc.collect()
        return mem.now - base, model


def _bytes_and_training(recipes):
    import tpkit
    tpkit.init_parallel()
    out = {}
    out["bf16"], _ = _built_bytes(False)
    out["fp8"], model = _built_bytes(True)
    out["weights"] = [(type(m.weight).__name__, str(m.weight.codes.dtype))
                      for m in model if hasattr(m, "weight")]
    out["no_hp_copy"] = all(t.dtype in (torch.float8_e4m3fn, torch.float32)
                            for m in model if hasattr(m, "weight")
                            for t in (m.weight.codes, m.weight.scale_inv))
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(64, IN, generator=g), torch.randn(64, OUT, generator=g)

    def train(recipe):
        with fp8.fp8_model_init(enabled=recipe is not None):
            model = _mlp(torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if recipe is not None:
            opt = fp8.with_master_weights(opt)
        losses = []
        for _ in range(20):
            with fp8.fp8_autocast(enabled=recipe is not None, recipe=recipe or "delayed"):
                loss = F.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, [type(p).__name__ for p in model.parameters()]

    out["fp32"], _ = train(None)
    for r in recipes:
        out[r] = train(r)
    return out


def test_fp8_weights_bytes_no_copy_and_20_steps_within_the_recipes_tolerance():
    recipes = ["delayed", "current"]     # the ones multiplying the stored codes as they are
    (res,) = run(_bytes_and_training, 1, recipes)
    # by hand: bf16 weights + biases; fp8: one byte per weight + a float32 scale each
    weights, biases = IN * HID + HID * OUT, HID + OUT
    assert res["bf16"] == 2 * (weights + biases)
    assert res["fp8"] == weights + 2 * 4 + 2 * biases
    assert res["fp8"] <= 0.55 * res["bf16"]
    assert res["weights"] == [("FP8Weight", "torch.float8_e4m3fn")] * 2 and res["no_hp_copy"]
    ref = res["fp32"]
    assert ref[-1] < 0.7 * ref[0], ref                    # it learns
    for r in recipes:
        losses, kinds = res[r]
        assert kinds == ["FP8Weight", "Parameter"] * 2, kinds  # still fp8 after 20 steps
        assert losses != ref
        for step, (a, b) in enumerate(zip(losses, ref)):
            assert abs(a - b) <= FP8_REL * b, (r, step, a, b)


def _calibration():
    import tpkit
    import tpkit.te_api as te
    tpkit.init_parallel()
    out = {}
    for recipe in ("delayed", "current"):
        model = _mlp(torch.float32, seed=3)
        x = torch.randn(8, IN, generator=torch.Generator().manual_seed(2), requires_grad=True)
        plain = model(x)
        plain.square().sum().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        x.grad = None
        model.zero_grad()
        with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe):
            y = model(x)
            h = F.gelu(model[0](x))                     # fc2's input, as the model saw it
        y.square().sum().backward()
        grads2 = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        want = [[448.0 / x.abs().max().item(), 448.0 / model[0].weight.abs().max().item()],
                [448.0 / h.abs().max().item(), 448.0 / model[2].weight.abs().max().item()]]
        got = [m.fp8_meta.scale[:2].tolist() for m in (model[0], model[2])]
        hist = [m.fp8_meta.amax_history[-1, :2].tolist() if recipe == "delayed" else None
                for m in (model[0], model[2])]
        out[recipe] = dict(equal=torch.equal(plain, y),
                           grads=all(torch.equal(a, b) for a, b in zip(grads, grads2)),
                           want=want, got=got, hist=hist,
                           amax=[[x.abs().max().item(), model[0].weight.abs().max().item()],
                                 [h.abs().max().item(), model[2].weight.abs().max().item()]])
    return out


def test_calibrating_records_amaxes_updates_scales_and_computes_in_high_precision():
    (res,) = run(_calibration, 1)
    for recipe, r in res.items():
        assert r["equal"] and r["grads"], recipe          # exactly high precision
        for got, want in zip(r["got"], r["want"]):
            assert got == pytest.approx(want, rel=1e-6), (recipe, got, want)
    for hist, amax in zip(res["delayed"]["hist"], res["delayed"]["amax"]):
        assert hist == pytest.approx(amax, rel=1e-7)    # the history holds the amaxes


def test_fp8_weight_refusals_and_writes():
    w = torch.randn(8, 4)
    p = torch.nn.Parameter(fp8.FP8Weight.quantize(w), requires_grad=True)
    F.linear(torch.randn(2, 4), p).sum().backward()
    with pytest.raises(ValueError, match="with_master_weights"):
        torch.optim.SGD([p], lr=0.1).step()               # would lose the update
    with pytest.raises(ValueError, match="holds no fp8 parameter"):
        fp8.with_master_weights(torch.optim.SGD([torch.nn.Parameter(w)], lr=0.1))
    with pytest.raises(ValueError, match="calibrate with 'delayed' or 'current'"):
        with fp8.fp8_autocast(enabled=False, calibrating=True, recipe="mxfp8"):
            pass
    opt = fp8.with_master_weights(torch.optim.SGD([p], lr=0.5))
    master = opt.param_groups[0]["params"][0]
    want = master.detach() - 0.5 * p.grad
    opt.step()
    assert p.grad is None and torch.equal(master.detach(), want)
    # the write: quantized afresh, scale = fp8_max / amax divided in float32 (not
    # ``448.0 / t``: torch computes that as reciprocal(t) * 448, an ulp off at times)
    s = torch.tensor(448.0) / want.abs().max()
    assert torch.equal(p.codes, (want * s).to(torch.float8_e4m3fn))
    assert p.scale_inv.item() == torch.reciprocal(s).item()   # float32, as TE stores it
    with pytest.raises(ValueError, match="holds master weights already"):
        fp8.with_master_weights(opt)
    q = torch.nn.Parameter(fp8.FP8Weight.quantize(w), requires_grad=True)
    adam = torch.optim.Adam([q])
    adam.state[q] = {"step": torch.tensor(1.0)}
    with pytest.raises(ValueError, match="after the optimizer has taken a step"):
        fp8.with_master_weights(adam)
