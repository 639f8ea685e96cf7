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
    from tpkit.random import get_rng_tracker
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
