"""The ``backend=`` hook of tpkit.nn constructors (TEBackendMixin): "torch" builds the
layer, "te"/"auto" with TE and CUDA build TE's module from the same arguments, options
TE lacks are refused, and TE or CUDA missing is an error for "te" and torch for "auto"."""
import pytest
import torch
from torch import nn

import tpkit.te as tte
from te_fake import cuda, fake_state, fake_te  # noqa: F401  (fixtures)
from tpkit.nn._backend import TEBackendMixin


class Column(TEBackendMixin, nn.Module):
    """Stand-in with ColumnParallelLinear's constructor signature."""
    _te_kind = "column"

    def __init__(self, in_features, out_features, bias=True, *, gather_output=False,
                 sequence_parallel=None, init_method=None, skip_bias_add=False,
                 return_bias=False, partition_sizes=None, state=None, device=None, dtype=None,
                 backend="torch"):
        super().__init__()
        self.built = (in_features, out_features)


class Row(TEBackendMixin, nn.Module):
    _te_kind = "row"

    def __init__(self, in_features, out_features, bias=True, *, input_is_parallel=True,
                 sequence_parallel=None, init_method=None, skip_bias_add=False,
                 return_bias=False, state=None, device=None, dtype=None, backend="torch"):
        super().__init__()


class Norm(TEBackendMixin, nn.Module):
    _te_kind = "layernorm"

    def __init__(self, hidden_size, eps=1e-5, *, bias=True, sequence_parallel=None,
                 state=None, device=None, dtype=None, backend="torch"):
        super().__init__()


def test_torch_backend_builds_the_layer_without_touching_te(monkeypatch):
    monkeypatch.setattr(tte, "import_te", lambda: pytest.fail("TE imported"))
    layer = Column(4, 8)
    assert type(layer) is Column and layer.built == (4, 8)
    assert type(Column(4, 8, backend="torch")) is Column
    assert type(Column(4, 8, backend="auto")) is Column  # CPU: auto is torch
    import copy
    assert type(copy.deepcopy(layer)) is Column


def test_te_backend_without_te_or_cuda_errors(monkeypatch, fake_te):
    with pytest.raises(RuntimeError, match="needs CUDA"):
        Column(4, 8, backend="te")
    monkeypatch.setattr(tte, "_cuda_available", lambda: True)
    import sys
    import te_fake
    te_fake.uninstall()  # first, so monkeypatch restores "absent", not the fake
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    with pytest.raises(ImportError, match=r"pip install 'tpkit\[te\]'"):
        Column(4, 8, backend="te")


def test_te_backend_builds_te_modules(fake_te, cuda, fake_state):
    from tpkit.layout.random import get_rng_tracker
    init = torch.nn.init.zeros_
    for backend in ("te", "auto"):
        m = Column(8, 16, bias=False, init_method=init, return_bias=True, state=fake_state,
                   dtype=torch.bfloat16, backend=backend)
        assert type(m) is fake_te.Linear
        a = m.init_args
        assert (a["in_features"], a["out_features"], a["bias"], a["return_bias"]) == (
            8, 16, False, True)
        assert a["parallel_mode"] == "column" and a["init_method"] is init
        assert a["tp_group"] is fake_state.tp_group and a["tp_size"] == 2
        assert a["sequence_parallel"] is True and a["params_dtype"] is torch.bfloat16
        assert a["get_rng_state_tracker"] is get_rng_tracker and a["device"] == "cuda"
    m = Row(16, 8, sequence_parallel=False, skip_bias_add=True, state=fake_state,
            device="cuda:0", backend="te")
    assert m.init_args["parallel_mode"] == "row" and m.init_args["return_bias"] is True
    assert m.init_args["sequence_parallel"] is False and m.init_args["device"] == "cuda:0"
    m = Norm(16, 1e-6, state=fake_state, dtype=torch.float16, backend="te")
    assert type(m) is fake_te.LayerNorm
    assert m.init_args["normalized_shape"] == 16 and m.init_args["eps"] == 1e-6
    assert m.init_args["kwargs"] == {"dtype": torch.float16}
    assert m.init_args["sequence_parallel"] is True


def test_te_backend_refuses_what_te_cannot_do(fake_te, cuda, fake_state):
    s = fake_state
    cases = [(lambda: Column(4, 8, gather_output=True, state=s, backend="te"), "gather_output"),
             (lambda: Column(4, 8, partition_sizes=(4, 4), state=s, backend="te"),
              "partition_sizes"),
             (lambda: Row(8, 4, input_is_parallel=False, state=s, backend="te"),
              "input_is_parallel=False"),
             (lambda: Norm(8, bias=False, state=s, backend="te"), "bias=False"),
             (lambda: Column(4, 8, state=s, backend="TE"), "backend='TE' is unknown")]
    for build, msg in cases:
        with pytest.raises(ValueError, match=msg):
            build()


def test_unknown_constructor_option_is_refused(fake_te, cuda, fake_state):
    class Extra(TEBackendMixin, nn.Module):
        _te_kind = "column"

        def __init__(self, in_features, out_features, *, fancy=False, state=None,
                     backend="torch"):
            super().__init__()

    assert type(Extra(4, 8, state=fake_state, backend="te")) is fake_te.Linear  # default ok
    with pytest.raises(ValueError, match=r"Extra\(fancy=True\) is not available with "
                                         "backend='te'"):
        Extra(4, 8, fancy=True, state=fake_state, backend="te")


# --- the real tpkit.nn constructors ----------------------------------------------------------
def test_tpkit_layers_take_backend(fake_te, cuda, fake_state):
    from tpkit.nn import ColumnParallelLinear, LayerNorm, RMSNorm, RowParallelLinear
    from tpkit.nn.dot_product_attention import DotProductAttention
    s = fake_state
    cases = [
        (ColumnParallelLinear(8, 16, state=s, backend="te"), fake_te.Linear,
         dict(in_features=8, out_features=16, parallel_mode="column")),
        (RowParallelLinear(16, 8, bias=False, state=s, backend="auto"), fake_te.Linear,
         dict(in_features=16, out_features=8, parallel_mode="row", bias=False)),
        (LayerNorm(16, state=s, backend="te"), fake_te.LayerNorm, dict(normalized_shape=16)),
        (RMSNorm(16, 1e-6, state=s, backend="te"), fake_te.RMSNorm, dict(eps=1e-6)),
        (DotProductAttention(4, 8, num_gqa_groups=2, attention_dropout=0.1, state=s,
                             backend="te"), fake_te.DotProductAttention,
         dict(num_attention_heads=4, kv_channels=8, num_gqa_groups=2, attention_dropout=0.1,
              tp_size=2, qkv_format="sbhd", attn_mask_type="causal")),
    ]
    for module, cls, expect in cases:
        assert type(module) is cls
        # TE's attention gets SP off: under SP it would not fork the tracker (issue 40)
        sp = type(module) is not fake_te.DotProductAttention
        assert module.init_args["sequence_parallel"] is sp
        for key, value in expect.items():
            assert module.init_args[key] == value, (cls, key)
    attn = cases[-1][0]
    assert attn.cp_group is s.cp_group and attn.cp_global_ranks == s.cp_global_ranks
    assert attn.cp_stream is cuda[0] and attn.cp_comm_type == "p2p"
    with pytest.raises(ValueError, match="cp_comm_type='a2a' differs from the state's 'p2p'"):
        DotProductAttention(4, 8, cp_comm_type="a2a", state=s, backend="te")


def test_tpkit_layers_torch_backend_unchanged():
    from tpkit import ParallelConfig
    from tpkit.nn import ColumnParallelLinear, LayerNorm
    from tpkit.nn.dot_product_attention import DotProductAttention
    from tpkit.layout.planning import build_fake_state, destroy_fake_state
    s = build_fake_state(ParallelConfig(), 1)
    try:
        for backend in ("torch", "auto"):  # auto: no TE, no CUDA here
            lin = ColumnParallelLinear(4, 8, state=s, backend=backend)
            assert type(lin) is ColumnParallelLinear and lin.weight.shape == (8, 4)
            assert type(LayerNorm(8, state=s, backend=backend)) is LayerNorm
            assert type(DotProductAttention(2, 4, state=s, backend=backend)) is \
                DotProductAttention
    finally:
        destroy_fake_state(s)


def test_wire_leaves_tpkit_torch_modules_alone(fake_te, fake_state):
    """tpkit's torch DotProductAttention shares TE's set_context_parallel_group name but
    takes its groups at construction: wiring skips it (and needs no CUDA stream)."""
    from tpkit.nn.dot_product_attention import DotProductAttention
    torch_attn = DotProductAttention(4, 8, state=fake_state)
    te_lin = fake_te.Linear(8, 8, tp_size=2, parallel_mode="column", device="cpu")
    model = torch.nn.ModuleDict({"attn": torch_attn, "lin": te_lin})
    assert tte.wire_parallel_groups(model, fake_state) == [
        ("lin", "set_tensor_parallel_group")]
    assert tte.wire_parallel_groups(torch.nn.Sequential(torch_attn), fake_state) == []
    assert tte.is_te_module(te_lin) and not tte.is_te_module(torch_attn)


class Block(TEBackendMixin, nn.Module):
    """Stand-in with tpkit.nn.TransformerLayer's constructor signature."""
    _te_kind = "transformer_layer"

    def __init__(self, hidden_size, ffn_hidden_size, num_attention_heads, *,
                 num_gqa_groups=None, normalization="LayerNorm", layernorm_epsilon=1e-5,
                 hidden_dropout=0.0, attention_dropout=0.0, attn_mask_type="causal",
                 bias=True, activation="gelu", sequence_parallel=None, init_method=None,
                 output_layer_init_method=None, state=None, device=None, dtype=None,
                 backend="torch"):
        super().__init__()


class MLP(TEBackendMixin, nn.Module):
    _te_kind = "mlp"

    def __init__(self, hidden_size, ffn_hidden_size, *, activation="gelu", state=None,
                 backend="torch"):
        super().__init__()


def test_transformer_layer_and_mlp(fake_te, cuda, fake_state):
    s = fake_state
    m = Block(16, 64, 4, num_gqa_groups=2, normalization="RMSNorm", activation="swiglu",
              attn_mask_type="no_mask", dtype=torch.bfloat16, state=s, backend="te")
    assert type(m) is fake_te.TransformerLayer
    a = m.init_args
    want = dict(hidden_size=16, ffn_hidden_size=64, num_attention_heads=4, num_gqa_groups=2,
                normalization="RMSNorm", activation="swiglu", self_attn_mask_type="no_mask",
                params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
                layernorm_epsilon=1e-5, bias=True, attn_input_format="sbhd",
                set_parallel_mode=True, tp_size=2, sequence_parallel=True)
    assert {k: a[k] for k in want} == want
    assert a["tp_group"] is s.tp_group
    assert m.core_attention.cp_group is s.cp_group  # CP wired through the layer
    with pytest.raises(ValueError, match="ParallelMLP has no Transformer Engine counterpart"):
        MLP(16, 64, state=s, backend="te")
    assert type(MLP(16, 64, state=s, backend="auto")) is MLP  # TE available, no counterpart


def test_tpkit_blocks_take_backend(fake_te, cuda, fake_state):
    from tpkit.nn.attention import ParallelSelfAttention
    from tpkit.nn.mlp import ParallelMLP
    from tpkit.nn.transformer import TransformerLayer
    s = fake_state
    m = TransformerLayer(16, 64, 4, activation="silu", hidden_dropout=0.1, state=s,
                         backend="te")
    assert type(m) is fake_te.TransformerLayer
    assert (m.init_args["activation"], m.init_args["hidden_dropout"]) == ("silu", 0.1)
    assert m.init_args["tp_group"] is s.tp_group and m.core_attention.cp_group is s.cp_group
    for cls in (ParallelMLP, ParallelSelfAttention):
        with pytest.raises(ValueError, match=f"{cls.__name__} has no Transformer Engine"):
            cls(16, 64 if cls is ParallelMLP else 4, state=s, backend="te")


def test_tpkit_blocks_torch_and_auto_on_cpu():
    from tpkit import ParallelConfig
    from tpkit.nn.mlp import ParallelMLP
    from tpkit.nn.transformer import TransformerLayer
    from tpkit.layout.planning import build_fake_state, destroy_fake_state
    s = build_fake_state(ParallelConfig(), 1)
    try:
        for backend in ("torch", "auto"):
            assert type(TransformerLayer(8, 16, 2, state=s, backend=backend)) is TransformerLayer
            assert type(ParallelMLP(8, 16, state=s, backend=backend)) is ParallelMLP
    finally:
        destroy_fake_state(s)


def test_fake_grouped_linear_math_and_init(fake_te):
    """The fake GroupedLinear (what tpkit.nn.MoE's TE backend is tested through): split i
    of the rows times weight{i} transposed plus bias{i}, each weight initialised by
    init_method; a split list of the wrong length is TE's ValueError."""
    seen = []
    lin = fake_te.GroupedLinear(3, 4, 5, init_method=lambda w: seen.append(w) or
                                torch.nn.init.normal_(w), device="cpu")
    assert [id(w) for w in seen] == [id(lin.weight0), id(lin.weight1), id(lin.weight2)]
    for i in range(3):
        getattr(lin, f"bias{i}").data.fill_(float(i))
    x, splits = torch.randn(6, 4), [2, 0, 4]
    ref = torch.cat([x[:2] @ lin.weight0.t(), x[2:] @ lin.weight2.t() + 2.0])
    torch.testing.assert_close(lin(x, splits), ref)
    torch.testing.assert_close(lin(x, torch.tensor(splits)), ref)
    with pytest.raises(ValueError, match="number of GEMMs"):
        lin(x, [6])
