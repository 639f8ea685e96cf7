"""TPKitPrecision: CPU autocast, recipes, emulated fp8 with the amax group, the TE path."""
import pytest
import torch

from dist import run


class _Probe(torch.nn.Module):
    """Records the autocast state its forward runs under."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen = None

    def forward(self, x):
        self.seen = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        return self.lin(x)


@pytest.mark.parametrize("prec,dtype", [("bf16-mixed", torch.bfloat16),
                                        ("16-mixed", torch.float16)])
def test_mixed_autocast_follows_the_model_device(prec, dtype):
    from lightning.fabric import Fabric

    from tpkit.fabric import TPKitPrecision
    plugin = TPKitPrecision(prec)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup(_Probe())
    out = model(torch.randn(2, 4))
    assert model.module.seen == (True, dtype)  # CPU autocast, not a hard-coded "cuda"
    assert out.dtype == torch.float32          # convert_output
    if prec == "16-mixed":                      # loss scaling state round-trips
        assert plugin.state_dict()["scale"] > 1
        plugin.load_state_dict({**plugin.state_dict(), "scale": 8.0})
        assert plugin.state_dict()["scale"] == 8.0


def test_recipe_from_dict_and_argument_errors():
    from tpkit.fabric import TPKitPrecision
    from tpkit.fp8 import DelayedScaling
    p = TPKitPrecision("fp8", recipe={"fp8_format": "E4M3", "amax_history_len": 4, "margin": 1})
    assert p.recipe == DelayedScaling(fp8_format="E4M3", amax_history_len=4, margin=1)
    with pytest.raises(ValueError, match="precision='bf16'.*use one of"):
        TPKitPrecision("bf16")
    with pytest.raises(ValueError, match="only apply to precision='fp8'"):
        TPKitPrecision("bf16-mixed", recipe={})
    with pytest.raises(ValueError, match=r"recipe='HYBRID' is not an fp8 recipe name; use "
                                         r"one of \['block', 'current', 'delayed', 'mxfp8'\]"):
        TPKitPrecision("fp8", recipe="HYBRID")
    with pytest.raises(TypeError, match="recipe=3 must be a recipe name"):
        TPKitPrecision("fp8", recipe=3)
    from tpkit import fp8
    for name, cls in (("current", fp8.Float8CurrentScaling), ("block", fp8.Float8BlockScaling),
                      ("mxfp8", fp8.MXFP8BlockScaling), ("delayed", fp8.DelayedScaling)):
        assert TPKitPrecision("fp8", recipe=name).recipe == cls()
    p = TPKitPrecision("fp8", recipe={"recipe": "block", "w_block_scaling_dim": 1})
    assert p.recipe == fp8.Float8BlockScaling(w_block_scaling_dim=1)


def _fp8_train(steps):
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    import tpkit.fp8
    from tpkit.fabric import TPKitPrecision, TPKitStrategy
    from tpkit.fabric.replace import FP8Linear

    seen_groups, real = [], tpkit.fp8.fp8_autocast

    def spy(*args, **kwargs):
        seen_groups.append(kwargs.get("fp8_group"))
        return real(*args, **kwargs)

    tpkit.fp8.fp8_autocast = spy
    try:
        strategy = TPKitStrategy(tp=2)
        prec = TPKitPrecision("fp8", recipe={"fp8_format": "HYBRID", "amax_history_len": 2},
                              replace_layers=True)
        fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy, plugins=[prec])
        fabric.launch()
        state = strategy.parallel_state
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16),
                                  torch.nn.Linear(16, 16))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with pytest.warns(UserWarning, match=r"1 \(LayerNorm"):
            model, opt = fabric.setup(net, opt)
        assert isinstance(net[0], FP8Linear) and isinstance(net[2], FP8Linear)
        torch.manual_seed(1 + state.rank)  # different data per rank: amaxes differ
        x = torch.randn(4, 16) * (1 + state.rank)
        for _ in range(steps):
            loss = F.mse_loss(model(x), torch.zeros(4, 16))
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
        amax = net[0].fp8_meta.amax_history.clone()
        ok = all(g is state.amax_group for g in seen_groups) and len(seen_groups) == steps
        strategy.teardown()
        return ok, amax, loss.item()
    finally:
        tpkit.fp8.fp8_autocast = real


def test_fp8_emulated_passes_the_amax_group():
    outs = run(_fp8_train, 4, 2)
    for ok, amax, loss in outs:
        assert ok  # forward_context entered fp8_autocast(fp8_group=state.amax_group)
        torch.testing.assert_close(amax, outs[0][1])  # amaxes reduced over the amax group
    assert outs[0][1].abs().sum() > 0


def _te_path():
    import te_fake
    import tpkit.te
    te = te_fake.install()
    saved = tpkit.te._cuda_available
    tpkit.te._cuda_available = lambda: True
    try:
        from lightning.fabric import Fabric

        from tpkit.fabric import TPKitPrecision, TPKitStrategy
        # a Precision *instance* goes to the strategy (or plugins=[...]); Fabric's
        # precision= argument accepts strings only
        strategy = TPKitStrategy(tp=2, precision=TPKitPrecision("fp8"))
        fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
        fabric.launch()
        state = strategy.parallel_state

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.te_lin = te.Linear(8, 8, tp_size=2, parallel_mode="column", device="cpu")
                self.lin = torch.nn.Linear(8, 8)

            def forward(self, x):
                return self.lin(x)

        net = Net()
        model = fabric.setup(net)
        te.RECORD.clear()
        model(torch.randn(2, 8))
        (name, args), = te.RECORD
        wired = [c for c in net.te_lin.calls if c[0] == "set_tensor_parallel_group"]
        out = (name, args["amax_reduction_group"] is state.amax_group,
               len(wired) == 1 and wired[0][1]["tp_group"] is state.tp_group)
        strategy.teardown()
        return out
    finally:
        tpkit.te._cuda_available = saved
        te_fake.uninstall()


def test_te_path_wires_groups_and_passes_the_amax_group():
    assert run(_te_path, 4) == [("autocast", True, True)] * 4
