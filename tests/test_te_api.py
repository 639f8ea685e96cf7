"""tpkit.te_api: a model written against Transformer Engine's PyTorch API runs on tpkit's
torch backend. The TE-API model (TE's docs' shapes: a TransformerLayer stack, Linear
column/row pairs with parallel_mode) equals, bitwise, the same model built from tpkit's
Megatron-named layers at tp=2 + SP, in training mode with TE's default dropouts; the
TE-only options (zero_centered_gamma, parallel_mode=None) against formulas written here;
every documented item that tpkit cannot do yet raises a ValueError."""
import pytest
import torch

from dist import run
from te_fake import cuda, fake_te  # noqa: F401  (fixtures)

S, B, H, F, HEADS = 8, 2, 16, 32, 4


def _seeded(fn, states, seed):
    """Run ``fn`` from the same RNG point (default generator and the tracker's streams)."""
    from tpkit.layout.random import get_rng_tracker
    get_rng_tracker().set_states(states)
    torch.manual_seed(seed)
    return fn()


def _te_vs_megatron():
    import tpkit
    import tpkit.nn as tnn
    import tpkit.te_api as te
    from tpkit.layout.random import get_rng_tracker
    st = tpkit.init_parallel(tp=2, sequence_parallel=True, seed=3)
    g = st.tp_group

    # TE's docs: a stack of TransformerLayers, then a column/row Linear pair (TE defaults:
    # hidden/attention dropout 0.1, trained in train mode).
    def te_model():
        layers = [te.TransformerLayer(H, F, HEADS, num_gqa_groups=2, tp_group=g,
                                      sequence_parallel=True, set_parallel_mode=True,
                                      fuse_qkv_params=True, normalization="RMSNorm",
                                      activation="swiglu") for _ in range(2)]
        col = te.Linear(H, F, parallel_mode="column", tp_group=g, sequence_parallel=True)
        row = te.Linear(F, H, parallel_mode="row", tp_group=g, sequence_parallel=True)
        return torch.nn.Sequential(*layers, col, row)

    def megatron_model():
        layers = [tnn.TransformerLayer(H, F, HEADS, num_gqa_groups=2, normalization="RMSNorm",
                                       activation="swiglu", hidden_dropout=0.1,
                                       attention_dropout=0.1) for _ in range(2)]
        return torch.nn.Sequential(*layers, tnn.ColumnParallelLinear(H, F),
                                   tnn.RowParallelLinear(F, H))

    a, b = te_model(), megatron_model()
    assert isinstance(a[2], te.Linear) and isinstance(a[2], tnn.ColumnParallelLinear)
    assert isinstance(a[3], tnn.RowParallelLinear)
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    torch.manual_seed(7)
    with torch.no_grad():
        for p in a.parameters():
            p.normal_(0, 0.3)      # same on both TP ranks; each keeps its own shard below
    b.load_state_dict(a.state_dict())
    torch.manual_seed(1)
    x = torch.randn(S, B, H)
    dy = torch.randn(S, B, H)
    rank = st.tp_rank
    xs, dys = x.chunk(2)[rank], dy.chunk(2)[rank]
    states = get_rng_tracker().get_states()
    out = {}
    for name, model in (("te", a), ("megatron", b)):
        xi = xs.clone().requires_grad_()
        y = _seeded(lambda: model(xi), states, 11)
        y.backward(dys)
        out[name] = (y, xi.grad, [p.grad for p in model.parameters()])
    (ya, ga, pa), (yb, gb, pb) = out["te"], out["megatron"]
    # dropout really ran (else the check would not cover TE's dropout defaults)
    a.eval()
    assert not torch.equal(a(xs), ya)
    assert torch.equal(ya, yb) and torch.equal(ga, gb)
    assert all(torch.equal(p, q) for p, q in zip(pa, pb))
    return True


def test_te_model_equals_megatron_layers_bitwise():
    assert run(_te_vs_megatron, 2) == [True, True]


def _te_only_options():
    """What tpkit's layers do not have: checked against formulas written here."""
    import torch.nn.functional as F_
    import tpkit
    import tpkit.te_api as te
    st = tpkit.init_parallel(tp=2, seed=3)
    # parallel_mode=None: the full weight, the same on every TP rank, no communication
    lin = te.Linear(H, F, tp_group=None if st.tp_size == 1 else st.tp_group)
    assert lin.weight.shape == (F, H)
    full = [torch.empty_like(lin.weight) for _ in range(2)]
    torch.distributed.all_gather(full, lin.weight.detach(), group=st.tp_group)
    assert torch.equal(full[0], full[1]), "a replicated weight differs across TP ranks"
    assert 0.018 < float(lin.weight.std()) < 0.028   # TE's default init: normal(0, 0.023)
    x = torch.randn(S, B, H)
    assert torch.equal(lin(x), x @ lin.weight.T + lin.bias)
    y, bias = te.Linear(H, F, tp_group=st.tp_group, return_bias=True)(x)
    assert bias.shape == (F,)
    # zero_centered_gamma: gamma starts at 0 and the norm multiplies by (1 + gamma)
    for cls in (te.LayerNorm, te.RMSNorm):
        n = cls(H, zero_centered_gamma=True)
        assert torch.equal(n.weight, torch.zeros(H))
        with torch.no_grad():
            n.weight.uniform_(-1, 1)
        ms = x.pow(2).mean(-1, keepdim=True)
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        want = ((x - mean) / torch.sqrt(var + 1e-5) * (1 + n.weight) + n.bias
                if cls is te.LayerNorm else x / torch.sqrt(ms + 1e-5) * (1 + n.weight))
        torch.testing.assert_close(n(x), want)
    # LayerNormLinear / LayerNormMLP: the norm's output goes into the parallel layers
    lnl = te.LayerNormLinear(H, F, tp_group=st.tp_group, parallel_mode="column",
                             return_layernorm_output=True)
    out, ln = lnl(x)
    assert torch.equal(ln, F_.layer_norm(x, (H,), lnl.layer_norm.weight,
                                         lnl.layer_norm.bias, 1e-5))
    assert torch.equal(out, F_.linear(ln, lnl.linear.weight, lnl.linear.bias))
    mlp = te.LayerNormMLP(H, F, tp_group=st.tp_group, set_parallel_mode=True,
                          normalization="RMSNorm")
    assert torch.equal(mlp(x), mlp.mlp(mlp.layer_norm(x)))
    mha = te.MultiheadAttention(H, HEADS, tp_group=st.tp_group, set_parallel_mode=True,
                                input_layernorm=True, attention_dropout=0.0)
    assert torch.equal(mha(x), mha.attention(mha.layernorm(x)))
    # attn_input_format="bshd" (TE's batch-first input, SP on dim 1) = the sbhd layer on
    # the transposed batch, with the same weights
    rank = st.tp_rank
    kw = dict(tp_group=st.tp_group, set_parallel_mode=True, sequence_parallel=True,
              hidden_dropout=0.0, attention_dropout=0.0)
    sbhd = te.TransformerLayer(H, F, HEADS, **kw)
    bshd = te.TransformerLayer(H, F, HEADS, attn_input_format="bshd", **kw)
    bshd.load_state_dict(sbhd.state_dict())
    mine = x.chunk(2, dim=0)[rank]                        # [s/tp, b, h]
    torch.testing.assert_close(bshd(mine.transpose(0, 1).contiguous()),
                               sbhd(mine).transpose(0, 1), rtol=1e-6, atol=1e-6)
    return True


def test_te_only_options():
    assert run(_te_only_options, 2) == [True, True]


def _refusals():
    """Each documented item tpkit cannot do yet, and each layout mismatch: a ValueError
    naming the item and what to use instead."""
    import tpkit
    import tpkit.te_api as te
    st = tpkit.init_parallel(tp=2, seed=3)
    g = st.tp_group
    x = torch.randn(S, B, H)
    layer = te.TransformerLayer(H, F, HEADS, tp_group=g, set_parallel_mode=True)
    calls = {
        "get_cpu_offload_context": lambda: te.get_cpu_offload_context(True),  # every layer
        "calibrating": lambda: te.fp8_autocast(False, True, "block").__enter__(),
        "onnx_export": lambda: te.onnx_export(True).__enter__(),   # at tp=2
        "inference_params": lambda: layer(x, inference_params=object()),
        "window_size": lambda: layer(x, window_size=(4, 0)),
        "parameters_split": lambda: te.Linear(H, F, tp_group=g, parallel_mode="column",
                                              parameters_split=("q", "k")),
        "tp_group=None": lambda: te.Linear(H, F, parallel_mode="column"),
        "set_parallel_mode=False": lambda: te.TransformerLayer(H, F, HEADS, tp_group=g),
        "layer_type": lambda: te.TransformerLayer(H, F, HEADS, tp_group=g,
                                                  set_parallel_mode=True,
                                                  layer_type="decoder"),
        "parallel_mode": lambda: te.Linear(H, F, tp_group=g, parallel_mode="diagonal"),
        "set_tensor_parallel_group": lambda: layer.set_tensor_parallel_group(None),
    }
    for what, call in calls.items():
        with pytest.raises(ValueError, match=what.split("=")[0]):
            call()
    # the disabled forms are TE's no-ops
    with te.fp8_model_init(False), te.onnx_export(False):
        ctx, sync = te.get_cpu_offload_context(False)
        with ctx:
            assert sync(x) is x
    layer.set_tensor_parallel_group(g)   # its own group: accepted
    return True


def test_not_yet_items_raise_value_errors():
    assert run(_refusals, 2) == [True, True]


# Parameters whose default differs from TE's on purpose (docs/te_api.md says why).
OWN_DEFAULTS = {"device"}   # TE: "cuda"; tpkit: the layout's device
OWN_PARAMS = {"self", "backend"}   # backend: tpkit's switch to hand over to TE


@pytest.mark.parametrize("name", ["Linear", "LayerNorm", "RMSNorm", "LayerNormLinear",
                                  "LayerNormMLP", "DotProductAttention", "TransformerLayer"])
def test_defaults_are_te_s(name, fake_te):
    """Every parameter of a tpkit.te_api class that TE's class also has (TE 2.20.2's
    signatures: tests/fake_te, compared with TE's release by test_te_contract) has TE's
    default, and every other one goes to TE's ``**kwargs`` (its norms' ``device``)."""
    import inspect

    import tpkit.te_api as te
    ours = inspect.signature(getattr(te, name).__init__).parameters
    theirs = inspect.signature(getattr(fake_te, name).__init__).parameters
    var_kw = any(q.kind is q.VAR_KEYWORD for q in theirs.values())
    for p, param in ours.items():
        if p in OWN_PARAMS:
            continue
        assert p in theirs or var_kw, f"{name}({p}=...) is not a parameter of TE's {name}"
        if p in theirs and p not in OWN_DEFAULTS and param.default is not param.empty:
            assert param.default == theirs[p].default, \
                f"{name}({p}) defaults to {param.default!r}, TE's to {theirs[p].default!r}"


def test_te_backend_hands_over_to_te(fake_te, cuda):
    """backend="te": TE's own class of the same name, built from the same (TE's)
    arguments; device=None is left to TE's default."""
    import tpkit.te_api as te
    lin = te.Linear(8, 16, bias=False, parallel_mode="column", return_bias=True, device=None,
                    backend="te")
    assert type(lin) is fake_te.Linear
    args = lin.init_args
    assert (args["in_features"], args["out_features"], args["bias"]) == (8, 16, False)
    assert (args["parallel_mode"], args["return_bias"], args["device"]) == \
        ("column", True, "cuda")
    layer = te.TransformerLayer(16, 32, 4, hidden_dropout=0.0, self_attn_mask_type="no_mask",
                                backend="te")
    assert type(layer) is fake_te.TransformerLayer
    assert (layer.init_args["hidden_dropout"], layer.init_args["attention_dropout"],
            layer.init_args["self_attn_mask_type"]) == (0.0, 0.1, "no_mask")
    norm = te.RMSNorm(16, zero_centered_gamma=True, backend="te")
    assert type(norm) is fake_te.RMSNorm and norm.init_args["zero_centered_gamma"] is True
