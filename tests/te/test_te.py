"""tpkit.te and backend resolution: errors without TE/CUDA, the fake TE's modules built
with the state's groups, autocast shims, and group wiring on multi-rank gloo layouts."""
import sys

import pytest
import torch

import tpkit.te as tte
from dist import run
from te_fake import cuda, fake_state, fake_te  # noqa: F401  (fixtures)
from tpkit.nn._backend import resolve_backend

TE_HINT = r"pip install 'tpkit\[te\]'"


# --- resolution and errors ------------------------------------------------------------------
def test_auto_on_cpu_resolves_to_torch():
    assert not torch.cuda.is_available()
    assert resolve_backend("auto") == "torch"
    assert resolve_backend("torch") == "torch"


def test_te_missing_raises_with_install_hint(monkeypatch, cuda):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import fails
    for call in (tte.import_te, lambda: resolve_backend("te"), lambda: tte.make("row")):
        with pytest.raises(ImportError, match=TE_HINT) as info:
            call()
        assert "CUDA" in str(info.value) and "backend='torch'" in str(info.value)
    assert resolve_backend("auto") == "torch"  # auto: a documented choice, not an error


def test_te_without_cuda_raises(fake_te):
    assert resolve_backend("auto") == "torch"
    with pytest.raises(RuntimeError, match="needs CUDA.*torch.cuda.is_available"):
        resolve_backend("te")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        tte.te_autocast()


def test_auto_picks_te_with_te_and_cuda(fake_te, cuda):
    assert resolve_backend("auto") == "te" and resolve_backend("te") == "te"
    assert resolve_backend("torch") == "torch"


def test_unknown_backend_and_kind(fake_te, cuda, fake_state):
    with pytest.raises(ValueError, match="backend='tex'.*'auto', 'torch', 'te'"):
        resolve_backend("tex")
    with pytest.raises(ValueError, match="kind='mlp'"):
        tte.make("mlp", fake_state)


def test_te_1x_refused(fake_te, cuda, monkeypatch):
    monkeypatch.setattr(sys.modules["transformer_engine"], "__version__", "1.13.0")
    with pytest.raises(ImportError, match="1.13.0.*TE 2.x"):
        resolve_backend("te")


# --- building ---------------------------------------------------------------------------------
def test_make_builds_te_modules_with_state_kwargs(fake_te, cuda, fake_state):
    from tpkit.nn import RowParallelLinear
    from tpkit.layout.random import get_rng_tracker
    s = fake_state
    parallel = {"tp_group": s.tp_group, "tp_size": 2, "sequence_parallel": True,
                "get_rng_state_tracker": get_rng_tracker}
    cases = [  # kind, TE args given, TE class, expected recorded args
        ("column", dict(in_features=8, out_features=16, bias=False, params_dtype=torch.bfloat16),
         fake_te.Linear, dict(parallel, parallel_mode="column", bias=False,
                              params_dtype=torch.bfloat16, in_features=8, out_features=16)),
        ("row", dict(in_features=16, out_features=8), fake_te.Linear,
         dict(parallel, parallel_mode="row", bias=True, device="cuda")),
        ("layernorm_linear", dict(in_features=8, out_features=24, normalization="RMSNorm"),
         fake_te.LayerNormLinear, dict(parallel, parallel_mode="column",
                                       normalization="RMSNorm")),
        ("layernorm_mlp", dict(hidden_size=8, ffn_hidden_size=32), fake_te.LayerNormMLP,
         dict(parallel, set_parallel_mode=True, activation="gelu")),
        ("attention", dict(num_attention_heads=4, kv_channels=2, attn_mask_type="causal"),
         # TE's attention gets SP off: under SP it would not fork the tracker (issue 40)
         fake_te.DotProductAttention, dict(parallel, num_attention_heads=4, cp_group=None,
                                           sequence_parallel=False)),
        ("transformer_layer", dict(hidden_size=8, ffn_hidden_size=32, num_attention_heads=4,
                                   hidden_dropout=0.0, attention_dropout=0.0),
         fake_te.TransformerLayer, dict(parallel, set_parallel_mode=True, hidden_dropout=0.0)),
        ("layernorm", dict(normalized_shape=8, eps=1e-6, params_dtype=torch.bfloat16),
         fake_te.LayerNorm, dict(sequence_parallel=True, eps=1e-6, params_dtype=None,
                                 kwargs={"dtype": torch.bfloat16})),
        ("rmsnorm", dict(normalized_shape=8, device="cpu"), fake_te.RMSNorm,
         dict(sequence_parallel=True, kwargs={"device": "cpu"})),
    ]
    for kind, given, cls, expect in cases:
        m = tte.make(kind, s, **given)
        assert type(m) is cls, kind
        for key, value in expect.items():
            got = m.init_args[key]
            assert got is value or got == value, (kind, key, got, value)
        if hasattr(m, "tp_size"):
            assert m.tp_size == 2
    # through the constructors' hook
    m = RowParallelLinear(4, 4, state=s, backend="te")
    assert type(m) is fake_te.Linear and m.init_args["parallel_mode"] == "row"
    # the state without SP: SP off; a layer may still opt out under SP
    m = tte.make("column", s, in_features=4, out_features=4, sequence_parallel=False)
    assert m.init_args["sequence_parallel"] is False


def test_make_refuses_contradicting_args(fake_te, cuda, fake_state):
    bad = [("column", dict(parallel_mode="row"), "parallel_mode='row' contradicts"),
           ("layernorm_mlp", dict(set_parallel_mode=False), "set_parallel_mode=False"),
           ("row", dict(tp_size=4), "tp_size=4 contradicts the parallel state"),
           ("row", dict(tp_group=None), "tp_group=None contradicts")]
    for kind, kwargs, msg in bad:
        with pytest.raises(ValueError, match=msg):
            tte.make(kind, fake_state, in_features=4, out_features=4, **kwargs)


def test_make_attention_wires_cp(fake_te, cuda, fake_state):
    s = fake_state
    a = tte.make("attention", s, num_attention_heads=4, kv_channels=8)
    b = tte.make("transformer_layer", s, hidden_size=8, ffn_hidden_size=16,
                 num_attention_heads=4, attention_dropout=0.0)
    assert len(cuda) == 1  # one stream per state, shared
    for m in (a, b.core_attention):
        assert m.cp_group is s.cp_group and m.cp_stream is cuda[0]
        assert m.cp_global_ranks == s.cp_global_ranks == [1, 3]
        assert m.cp_comm_type == "p2p"


def test_tp_size_mismatch_refused_before_wiring(fake_te, cuda, fake_state):
    model = torch.nn.Sequential(
        fake_te.Linear(4, 4, tp_size=2, parallel_mode="column", device="cpu"),
        fake_te.TransformerLayer(8, 16, 2, tp_size=1, device="cpu"))
    with pytest.raises(ValueError, match=r"module '1' \(TransformerLayer\) was built with "
                                         r"tp_size=1 but the parallel state has tp=2"):
        tte.wire_parallel_groups(model, fake_state)
    assert all(not m.calls for m in model.modules() if hasattr(m, "calls"))
    assert cuda == []


def test_wire_needs_cuda_stream_for_cp(fake_te, fake_state, monkeypatch):
    """Without CUDA there is no stream to give TE's CP attention: an error, never None."""
    model = fake_te.DotProductAttention(4, 8, tp_size=2)
    with pytest.raises(RuntimeError, match="cp=2.*needs a CUDA stream"):
        tte.wire_parallel_groups(model, fake_state)


# --- autocast and model-init shims --------------------------------------------------------
def test_autocast_shim_new_and_old_names(fake_te, cuda, fake_state, monkeypatch):
    recipe = sys.modules["transformer_engine.common.recipe"].DelayedScaling()
    with tte.te_autocast(recipe=recipe, state=fake_state):
        pass
    name, args = fake_te.RECORD[-1]
    assert name == "autocast" and args["recipe"] is recipe and args["enabled"] is True
    assert args["amax_reduction_group"] is fake_state.amax_group  # not TE's world default
    with tte.te_autocast(enabled=False, group="g"):
        pass
    assert fake_te.RECORD[-1][1]["amax_reduction_group"] == "g"
    with tte.te_model_init(recipe=recipe):
        pass
    assert fake_te.RECORD[-1] == ("quantized_model_init", dict(
        enabled=True, recipe=recipe, preserve_high_precision_init_val=False))
    # TE < 2.9: only the fp8_* names exist
    monkeypatch.delattr(fake_te, "autocast")
    monkeypatch.delattr(fake_te, "quantized_model_init")
    fake_te.RECORD.clear()
    with tte.te_autocast(recipe=recipe, state=fake_state):
        pass
    name, args = fake_te.RECORD[0]
    assert name == "fp8_autocast" and args["fp8_recipe"] is recipe
    assert args["fp8_group"] is fake_state.amax_group
    with tte.te_model_init(enabled=False):
        pass
    assert fake_te.RECORD[-1][0] == "fp8_model_init"


# --- fp8 recipes on the TE backend ---------------------------------------------------------
def test_te_recipe_from_names_dicts_and_tpkit_objects(fake_te, cuda, monkeypatch):
    """tpkit.te builds TE's own recipe object (the fake's classes carry TE 2.20.2's fields,
    checked by the contract test) from every form tpkit accepts."""
    import tpkit.fp8 as fp8
    for var in ("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "NVTE_BACKWARD_OVERRIDE"):
        monkeypatch.delenv(var, raising=False)
    mod = sys.modules["transformer_engine.common.recipe"]
    for name, cls in (("delayed", mod.DelayedScaling), ("current", mod.Float8CurrentScaling),
                      ("block", mod.Float8BlockScaling), ("mxfp8", mod.MXFP8BlockScaling)):
        r = tte.te_recipe(name)
        assert type(r) is cls and r == cls()
        assert type(tte.te_recipe(getattr(fp8, cls.__name__)())) is cls
    te_obj = mod.Float8CurrentScaling()
    assert tte.te_recipe(te_obj) is te_obj and tte.te_recipe(None) is None
    r = tte.te_recipe({"recipe": "block", "x_block_scaling_dim": 2, "w_block_scaling_dim": 1,
                       "fp8_format": "HYBRID"})
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.fp8_format) == \
        (2, 1, mod.Format.HYBRID)
    r = tte.te_recipe({"fp8_format": "E4M3", "amax_history_len": 16})   # Lightning's dict
    assert type(r) is mod.DelayedScaling and (r.fp8_format, r.amax_history_len) == \
        (mod.Format.E4M3, 16)
    # TE keeps the QParams on the class; tpkit sets them on the object so both backends agree
    r = tte.te_recipe(fp8.Float8CurrentScaling(use_power_2_scales=True))
    assert r.use_power_2_scales and r.fp8_quant_fwd_inp.power_2_scale and \
        r.fp8_quant_bwd_grad.power_2_scale and not mod.Float8CurrentScaling.fp8_quant_fwd_inp.power_2_scale
    assert isinstance(r.fp8_gemm_fprop, mod.MMParams) and not r.fp8_gemm_fprop.use_split_accumulator
    with pytest.raises(ValueError, match="interval=4 is not a field of the installed"):
        tte.te_recipe(fp8.DelayedScaling(interval=4))
    with pytest.raises(ValueError, match=r"recipe='nvfp4' is not an fp8 recipe name"):
        tte.te_recipe("nvfp4")
    with pytest.raises(TypeError, match="is not an fp8 recipe"):
        tte.te_recipe(object())
    with pytest.raises(ValueError, match="Transformer Engine refused.*E5M2"):
        tte.te_recipe({"fp8_format": "E5M2"})
    monkeypatch.delattr(mod, "Float8BlockScaling")        # an older TE
    with pytest.raises(ValueError, match="has no Float8BlockScaling; upgrade it"):
        tte.te_recipe("block")


def test_te_autocast_hands_te_its_recipe_or_refuses_what_the_gpu_cannot_run(
        fake_te, cuda, fake_state, monkeypatch):
    mod = sys.modules["transformer_engine.common.recipe"]
    for name, cls in (("current", mod.Float8CurrentScaling), ("block", mod.Float8BlockScaling)):
        with tte.te_autocast(recipe=name, state=fake_state):
            pass
        kind, args = fake_te.RECORD[-1]
        assert kind == "autocast" and type(args["recipe"]) is cls
        assert args["amax_reduction_group"] is fake_state.amax_group
    n = len(fake_te.RECORD)
    # the fake answers as an H100 does: MXFP8 needs compute capability 10.0
    with pytest.raises(ValueError, match=r"MXFP8BlockScaling cannot run here .*compute "
                                         r"capability 10\.0 or higher.*does not fall back"):
        tte.te_autocast(recipe="mxfp8", state=fake_state)
    assert len(fake_te.RECORD) == n                    # refused before TE's autocast
    monkeypatch.setitem(fake_te.SUPPORT, "fp8_block_scaling", (False, "FP8 block scaled GEMM "
                        "requires compute capability 9.0 or higher and CUDA >= 12.9."))
    with pytest.raises(ValueError, match="Float8BlockScaling cannot run here.*CUDA >= 12.9"):
        tte.te_autocast(recipe=mod.Float8BlockScaling(), state=fake_state)
    monkeypatch.setitem(fake_te.SUPPORT, "mxfp8", (True, ""))   # a Blackwell GPU
    with tte.te_autocast(recipe="mxfp8", state=fake_state):
        pass
    assert type(fake_te.RECORD[-1][1]["recipe"]) is mod.MXFP8BlockScaling


# --- wiring on real gloo groups -------------------------------------------------------------
def _wire_rank(tp, cp, comm, a2a):
    import torch.distributed as dist
    import te_fake
    import tpkit
    te = te_fake.install()
    streams = []
    saved = tte._cuda_available, tte._new_cuda_stream
    tte._cuda_available = lambda: True
    tte._new_cuda_stream = lambda: streams.append(("stream", dist.get_rank())) or streams[-1]
    try:
        s = tpkit.init_parallel(tp=tp, cp=cp, cp_comm_type=comm, cp_a2a_size=a2a,
                                sequence_parallel=tp > 1)
        # a model of TE TransformerLayers built the way a user would (tp_size only)
        model = torch.nn.Sequential(*[te.TransformerLayer(
            8, 16, 4, tp_size=tp, sequence_parallel=tp > 1, set_parallel_mode=True,
            device="cpu") for _ in range(2)])
        wired = tte.wire_parallel_groups(model, s)
        tte.wire_parallel_groups(model, s)  # again: same stream, no new one
        ranks = lambda g: dist.get_process_group_ranks(g)  # noqa: E731
        seen = {}
        for name, m in model.named_modules():
            for method, args in getattr(m, "calls", []):
                if method == "set_tensor_parallel_group":
                    rec = {"tp": ranks(args["tp_group"])}
                else:
                    g = args["cp_group"]
                    rec = {"cp": [ranks(x) for x in g] if isinstance(g, list) else ranks(g),
                           "cp_global_ranks": args["cp_global_ranks"],
                           "stream": args["cp_stream"], "comm": args["cp_comm_type"],
                           "same_stream": args["cp_stream"] is streams[0]}
                seen.setdefault((name, type(m).__name__), []).append((method, rec))
        expect = {"tp": s.group_ranks("tp"), "cp": s.group_ranks("cp"),
                  "cp_global_ranks": s.cp_global_ranks, "cp_rank": s.cp_rank}
        if comm == "a2a+p2p":
            expect["cp_list"] = [s.group_ranks("cp_a2a"), s.group_ranks("cp_p2p")]
            expect["a2a_rank"] = dist.get_rank(s.cp_a2a_group)
            expect["p2p_rank"] = dist.get_rank(s.cp_p2p_group)
        return {"wired": wired, "seen": seen, "expect": expect, "streams": streams,
                "rank": dist.get_rank()}
    finally:
        tte._cuda_available, tte._new_cuda_stream = saved
        te_fake.uninstall()


@pytest.mark.parametrize("tp,cp,comm,a2a", [
    (2, 2, "p2p", None), (1, 4, "a2a+p2p", 2), (2, 2, "a2a", None), (4, 1, "p2p", None)])
def test_wire_parallel_groups_multirank(tp, cp, comm, a2a):
    results = run(_wire_rank, 4, tp, cp, comm, a2a)
    te_kinds = {"LayerNormLinear", "DotProductAttention", "Linear", "LayerNormMLP"}
    for out in results:
        exp, seen, rank = out["expect"], out["seen"], out["rank"]
        assert out["streams"] == ([("stream", rank)] if cp > 1 else [])  # one per state
        names = {n for n, _ in out["wired"]}
        # every TE module of both layers (and the layers) was wired directly
        assert names == {f"{i}{sub}" for i in range(2) for sub in (
            "", ".layernorm_qkv", ".core_attention", ".proj", ".layernorm_mlp")}
        methods = {(n, m) for n, m in out["wired"]}
        assert len(methods) == len(out["wired"])  # each (module, method) once per call
        # the fake recorded a setter call on every wired module (the loop below is not empty)
        assert {n for n, _ in seen} == names, (sorted(names), sorted(seen))
        for (name, cls), calls in seen.items():
            assert cls in te_kinds | {"TransformerLayer"}
            tp_calls = [r for m, r in calls if m == "set_tensor_parallel_group"]
            cp_calls = [r for m, r in calls if m == "set_context_parallel_group"]
            assert tp_calls and all(r["tp"] == exp["tp"] for r in tp_calls), (name, tp_calls)
            wants_cp = cls in ("TransformerLayer", "DotProductAttention") and cp > 1
            assert bool(cp_calls) == wants_cp, (name, cp_calls)
            for r in cp_calls:
                assert r["comm"] == comm and r["same_stream"]
                assert r["cp_global_ranks"] == exp["cp_global_ranks"]
                if comm == "a2a+p2p":
                    assert r["cp"] == exp["cp_list"]  # [a2a group, p2p group]
                    # TE indexes cp_global_ranks[p2p_rank * a2a_size + a2a_rank] and
                    # numbers the CP rank a2a_size * p2p_rank + a2a_rank: both must match.
                    i = exp["p2p_rank"] * a2a + exp["a2a_rank"]
                    assert exp["cp_global_ranks"][i] == rank and i == exp["cp_rank"]
                else:
                    assert r["cp"] == exp["cp"]
    if comm == "a2a+p2p":  # cp=4, a2a=2: a2a pairs are consecutive, p2p strides by 2
        assert [o["expect"]["cp_list"] for o in results][0] == [[0, 1], [0, 2]]


# --- recompute hand-off -------------------------------------------------------------------------
def test_recompute_delegates_te_modules_to_te_checkpoint(fake_te, cuda, fake_state):
    from tpkit.layout.random import get_rng_tracker
    from tpkit.recompute import checkpoint
    from tpkit.layout.topology import set_parallel_state

    class Wrap(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, scale=1.0):
            return x * 2 * scale

    te_block = Wrap(fake_te.Linear(4, 4, tp_size=2, device="cpu"))
    torch_block = Wrap(torch.nn.Linear(4, 4))
    assert tte.holds_te_modules(te_block) and tte.holds_te_modules(te_block.forward)
    assert not tte.holds_te_modules(torch_block) and not tte.holds_te_modules(len)
    set_parallel_state(fake_state)
    try:
        x = torch.ones(2, 4, requires_grad=True)
        out = checkpoint(te_block, x, scale=3.0)
        assert torch.equal(out, torch.full((2, 4), 6.0))
        name, args = fake_te.RECORD[-1]
        assert name == "checkpoint" and args["function"] is te_block
        assert args["get_rng_state_tracker"] is get_rng_tracker  # tpkit's, not TE's None
        assert args["tp_group"] is fake_state.tp_group  # the state's, not the world
        assert args["use_reentrant"] is True and args["distribute_saved_activations"] is False
        n = len(fake_te.RECORD)
        checkpoint(torch_block, x).sum().backward()  # torch modules: tpkit's own recompute
        assert len(fake_te.RECORD) == n
    finally:
        set_parallel_state(None)
