"""TPKitPrecision takes Lightning's precision plugins' arguments with their meaning.

MixedPrecision's: a given ``scaler`` is the one "16-mixed" scales the loss with (the
refusals of ``device`` and of a scaler for another precision are rows of
tests/test_bad_input.py).

TransformerEnginePrecision's (``weights_dtype``, ``recipe``, ``replace_layers``,
``fallback_compute_dtype``): one Fabric script runs with Lightning's plugin and with
``TPKitPrecision`` built from the same keywords (the one-word change), on the TE backend
(tests/fake_te, whose Linear/LayerNorm get weights and a forward here; tpkit.te believes
CUDA is there). Both must give the same layers (TE's Linear/LayerNorm where Lightning
puts them, the 10-wide Linear left alone by TE's shape rule), the same parameter dtypes
and copied weights, the same default dtype, input dtype and fallback-autocast dtype in
forward, the same fp8 recipe, a float32 output, and the same layers built under
``fabric.init_module()`` with ``replace_layers=True``; each record is also checked
against Lightning's documented contract. On the torch backend (no TE) the same keywords
mean the same except that ``nn.Linear`` becomes tpkit's emulated-fp8 ``FP8Linear``."""
import pytest
import torch

from dist import run

from tpkit.fabric import TPKitPrecision

CASES = {   # Lightning's TransformerEnginePrecision keyword sets
    "defaults": dict(weights_dtype=torch.bfloat16),
    "all-set": dict(weights_dtype=torch.float32, recipe={"fp8_format": "HYBRID",
                                                         "amax_history_len": 16},
                    replace_layers=False, fallback_compute_dtype=torch.bfloat16),
    "replace-at-init": dict(weights_dtype=torch.bfloat16, replace_layers=True),
}


def test_given_scaler_scales_the_loss():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)   # the default starts at 2**16
    p = TPKitPrecision("16-mixed", scaler=scaler)
    assert p.scaler is scaler
    w = torch.ones(2, requires_grad=True)
    p.backward((w * 3).sum(), None)
    assert torch.equal(w.grad, torch.full((2,), 12.0))
    assert TPKitPrecision("16-mixed").scaler is not scaler


def _give_te_weights(te):
    """TE's Linear/LayerNorm hold weight and bias parameters and compute; the fake's do
    neither (tests/fake_te is signatures only), so give them both, on CPU."""
    import functools
    import inspect

    import torch.nn.functional as F
    lin_init, ln_init = te.Linear.__init__, te.LayerNorm.__init__

    def bound(init, *args, **kwargs):
        b = inspect.signature(init).bind(None, *args, **kwargs)
        b.apply_defaults()
        return {**b.arguments.pop("kwargs", {}), **b.arguments}

    @functools.wraps(lin_init)   # the fake binds its arguments by this signature
    def linear(self, *args, **kwargs):
        lin_init(self, *args, **kwargs)
        a = bound(lin_init, *args, **kwargs)
        dt = a["params_dtype"] or torch.get_default_dtype()
        self.weight = torch.nn.Parameter(torch.empty(a["out_features"], a["in_features"],
                                                     dtype=dt))
        self.bias = torch.nn.Parameter(torch.zeros(a["out_features"], dtype=dt)) \
            if a["bias"] else None

    @functools.wraps(ln_init)
    def layer_norm(self, *args, **kwargs):
        ln_init(self, *args, **kwargs)
        a = bound(ln_init, *args, **kwargs)
        dt = a.get("dtype") or a["params_dtype"] or torch.get_default_dtype()
        self.eps = a["eps"]
        self.weight = torch.nn.Parameter(torch.ones(a["normalized_shape"], dtype=dt))
        self.bias = torch.nn.Parameter(torch.zeros(a["normalized_shape"], dtype=dt))

    te.Linear.__init__, te.LayerNorm.__init__ = linear, layer_norm
    te.Linear.forward = lambda self, x: F.linear(x, self.weight, self.bias)
    te.LayerNorm.forward = lambda self, x: F.layer_norm(
        x, self.weight.shape, self.weight, self.bias, self.eps)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.block = torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False))
        self.odd = torch.nn.Linear(16, 10)    # 10 % 16 != 0: TE's fp8 shape rule skips it
        self.seen = {}

    def forward(self, x, ids):
        import tpkit.fp8
        self.seen = {"x": x.dtype, "ids": ids.dtype, "default": torch.get_default_dtype(),
                     "emulated_fp8": tpkit.fp8.is_active()}
        return self.odd(self.block(self.norm(self.fc1(x))))


def _script(plugin, at_init: bool) -> dict:
    """The user's Fabric script; what it observed."""
    from lightning.fabric import Fabric

    from tpkit.fabric import TPKitStrategy
    entered, real = [], torch.autocast

    def spy(device_type, dtype=None, **kw):
        entered.append((device_type, dtype))
        return real(device_type, dtype=dtype, **kw)

    fabric = Fabric(accelerator="cpu", devices=1, strategy=TPKitStrategy(), plugins=[plugin])
    fabric.launch()
    torch.manual_seed(0)
    if at_init:
        with fabric.init_module():
            net = _Net()
        start = None
    else:
        net = _Net()
        start = {n: p.detach().clone() for n, p in net.named_parameters()}
    model = fabric.setup_module(net)
    x, ids = torch.randn(4, 16), torch.arange(4)
    torch.autocast = spy
    try:
        out = model(x, ids)
    finally:
        torch.autocast = real
    params = dict(net.named_parameters())
    rec = {"layers": {n: (type(m).__module__.split(".")[0], type(m).__name__)
                      for n, m in net.named_modules() if n},
           "dtypes": {n: p.dtype for n, p in params.items()},
           "copied": None if start is None else all(
               torch.equal(params[n].detach(), w.to(params[n].dtype)) for n, w in
               start.items() if n in params)
           and set(params) == set(start),
           "seen": net.seen, "out": out.dtype,
           "autocast": [(d, t) for d, t in entered if t is not None]}
    fabric.strategy.teardown()
    return rec


def _fp8_call(te, plugin):
    """(where, recipe) of the fp8 autocast the forward entered: TE's (its new or old
    name), else tpkit's emulated one (a model without TE modules: tpkit's rule)."""
    calls = [r for r in te.RECORD if r[0] in ("autocast", "fp8_autocast")]
    if calls:
        assert len(calls) == 1 and calls[0][1]["enabled"] is True, calls
        args = calls[0][1]
        where, r = "te", args.get("recipe", args.get("fp8_recipe"))
    else:
        where, r = "emulated", plugin.recipe
    fmt = getattr(r.fp8_format, "name", r.fp8_format)
    return where, (type(r).__name__, fmt, r.amax_history_len, r.margin)


def _one_word_change(case: str, te_backend: bool):
    import warnings

    import lightning.fabric.plugins.precision.transformer_engine as lte

    import te_fake
    import tpkit.te
    kw = CASES[case]
    out = {}
    if not te_backend:
        return {"tpkit": _script(TPKitPrecision(**kw), case == "replace-at-init")}
    te = te_fake.install()
    _give_te_weights(te)
    saved = tpkit.te._cuda_available, lte._TRANSFORMER_ENGINE_AVAILABLE
    tpkit.te._cuda_available, lte._TRANSFORMER_ENGINE_AVAILABLE = (lambda: True), True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # CUDA autocast on a CPU machine; TE's shapes
            for name, cls in (("lightning", lte.TransformerEnginePrecision),
                              ("tpkit", TPKitPrecision)):
                te.RECORD.clear()
                plugin = cls(**kw)
                out[name] = _script(plugin, case == "replace-at-init")
                out[name]["fp8_where"], out[name]["fp8"] = _fp8_call(te, plugin)
    finally:
        tpkit.te._cuda_available, lte._TRANSFORMER_ENGINE_AVAILABLE = saved
        te_fake.uninstall()
    return out


def _check_contract(rec: dict, kw: dict, replaced: dict) -> None:
    """Lightning's documented meaning of the keywords, on one plugin's record."""
    wd = kw["weights_dtype"]
    assert set(rec["dtypes"].values()) == {wd}, rec["dtypes"]    # module.to(weights_dtype)
    assert rec["seen"]["default"] == wd                          # weights_dtype in forward
    assert rec["seen"]["x"] == wd and rec["seen"]["ids"] == torch.int64   # floats only
    assert rec["out"] == torch.float32                           # back to the default dtype
    fallback = kw.get("fallback_compute_dtype") or wd            # defaults to weights_dtype
    assert [t for _, t in rec["autocast"]] == [fallback], rec["autocast"]
    assert rec["copied"] in (None, True)                         # the weights survive
    assert {n: rec["layers"][n] for n in replaced} == replaced, rec["layers"]


TE_LAYERS = {"fc1": ("transformer_engine", "Linear"), "norm": ("transformer_engine", "LayerNorm"),
             "block.0": ("transformer_engine", "Linear"), "odd": ("torch", "Linear")}
TORCH_LAYERS = {"fc1": ("tpkit", "FP8Linear"), "norm": ("torch", "LayerNorm"),
                "block.0": ("tpkit", "FP8Linear"), "odd": ("tpkit", "FP8Linear")}
AT_INIT = {**TE_LAYERS, "odd": ("transformer_engine", "Linear")}   # Lightning's class
# replacement at init has no shape rule
KEPT = {"fc1": ("torch", "Linear"), "norm": ("torch", "LayerNorm"),
        "block.0": ("torch", "Linear"), "odd": ("torch", "Linear")}


@pytest.mark.parametrize("case", list(CASES))
def test_lightning_te_plugin_arguments_mean_the_same(case):
    (out,) = run(_one_word_change, 1, case, True)
    ours, theirs = out["tpkit"], out["lightning"]
    kw = CASES[case]
    assert theirs["autocast"][0][0] == "cuda" and ours["autocast"][0][0] == "cpu"  # by design
    for rec in (ours, theirs):
        rec["autocast"] = [t for _, t in rec["autocast"]]
    assert theirs["fp8_where"] == "te"
    # tpkit enters TE's autocast for a model holding TE modules, its emulation otherwise
    assert ours.pop("fp8_where") == ("emulated" if case == "all-set" else "te")
    assert ours["seen"].pop("emulated_fp8") == (case == "all-set")
    theirs.pop("fp8_where"), theirs["seen"].pop("emulated_fp8")
    assert ours == theirs
    want_recipe = ("DelayedScaling", "HYBRID", 16, 0) if "recipe" in kw \
        else ("DelayedScaling", "HYBRID", 1024, 0)   # TE 2.20.2's DelayedScaling()
    assert ours["fp8"] == want_recipe
    ours["autocast"] = [("cpu", t) for t in ours["autocast"]]
    _check_contract(ours, kw, {"defaults": TE_LAYERS, "all-set": KEPT,
                               "replace-at-init": AT_INIT}[case])


@pytest.mark.parametrize("case", list(CASES))
def test_lightning_te_plugin_arguments_on_the_torch_backend(case):
    (out,) = run(_one_word_change, 1, case, False)
    rec, kw = out["tpkit"], CASES[case]
    _check_contract(rec, kw, KEPT if kw.get("replace_layers") is False else TORCH_LAYERS)
    assert rec["seen"]["emulated_fp8"]                          # tpkit.fp8 in forward
