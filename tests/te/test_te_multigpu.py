"""Issue 40: the multi-GPU Transformer Engine paths, on CPU through the fake TE
(tests/fake_te, whose TE behaviour tests/te/test_te_contract_rows.py checks against TE's
source) and gloo ranks. One test per row of the issue's table; each fails with the
row's defect put back (the commits say how each was planted):

1. fp8 MoE: each expert's rows padded to TE's alignment before GroupedLinear;
2. a rank with no token still runs TE's GroupedLinear under fp8 (global amax buffer);
3. make_graphed_callables refused while tpkit's tracker states are registered with TE;
4. a lambda/partial over TE modules, or anything under TE's fp8, recomputes in TE's
   checkpoint;
5. save_hf's flag all-reduce on the default group's device (a group without a CPU
   backend rejects CPU tensors);
6./7. host syncs per forward: a constant, not growing with the experts or the layers;
8. TE's DotProductAttention forks the tracker for dropout under SP (TransformerLayer
   refused);
9. te_model_init converts the recipe;
10. destroying a layout drops TE's fp8 state of its groups.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import types

import pytest
import torch

import tpkit.te as tte
from dist import run
from te_fake import cuda, fake_state, fake_te  # noqa: F401  (fixtures)

H, F = 8, 16
_HOST = ("item", "tolist", "cpu", "numpy", "__int__", "__bool__", "__float__", "__index__")


@contextlib.contextmanager
def count_host_syncs():
    """Count the Tensor calls that copy a value to the host (``.item()``, ``.tolist()``,
    ``.cpu()``, ``int(t)``, ``bool(t)``...): on a GPU each one is a device->host sync."""
    counts = collections.Counter()
    own = {n: torch.Tensor.__dict__[n] for n in _HOST if n in torch.Tensor.__dict__}
    inherited = {n: getattr(torch.Tensor, n) for n in _HOST}

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            counts[name] += 1
            return fn(self, *args, **kwargs)
        return counted
    for name, fn in inherited.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name in _HOST:
            if name in own:
                setattr(torch.Tensor, name, own[name])
            else:
                delattr(torch.Tensor, name)


@contextlib.contextmanager
def _fake_te_on_rank():
    """The fake TE and a CUDA-believing tpkit.te inside a pool rank."""
    import te_fake
    te = te_fake.install()
    cuda_was, tte._cuda_available = tte._cuda_available, lambda: True
    try:
        yield te
    finally:
        tte._cuda_available = cuda_was
        te_fake.uninstall()


# --- rows 1, 2, 10 (and 5, 6): two gloo ranks, one launch ------------------------------------
def _route_to_expert0(moe):
    """Every token to expert 0 (top_k=1): expert 0's rank gets them all, the other none."""
    with torch.no_grad():
        moe.router_weight.zero_()
        moe.router_weight[0] = 1.0


def _rank_multi(tmp):
    import torch.distributed as dist

    import tpkit
    from tpkit.comm.collectives import any_rank, group_device
    from tpkit.nn import MoE
    out = {}
    rank = dist.get_rank()
    # row 5: a group without a CPU backend rejects CPU tensors; tpkit's flag goes to the
    # group's device, and save_hf exchanges it through any_rank on the default group
    g = dist.new_group([0, 1], backend="cuda:gloo")
    try:
        dist.all_reduce(torch.zeros(1), group=g)
    except RuntimeError as exc:
        out["cpu_on_cuda_group"] = str(exc)
    out["device"] = (group_device(g).type, group_device(None).type)
    out["any"] = (any_rank(rank == 0), any_rank(False))
    dist.destroy_process_group(g)
    st = tpkit.init_parallel(ep=2, seed=1)   # dp=2, ep=2: one layout for rows 1, 2, 5, 6
    import tpkit.models.hf as hf
    from tpkit.models import Llama, LlamaConfig
    calls = []
    real = hf.any_rank
    hf.any_rank = lambda flag, group: calls.append(group) or real(flag, group)
    try:
        model = Llama(LlamaConfig(64, 16, 32, 1, 4, num_gqa_groups=2), st)
        hf.save_hf(model, f"{tmp}/hf")
    finally:
        hf.any_rank = real
    out["hf_flag_groups"] = calls
    # row 6 at ep=2: host syncs per MoE forward at 2, 4, 8 local experts
    out["syncs"] = {}
    for local in (2, 4, 8):
        moe = MoE(H, F, 2 * local, 2)
        x = torch.randn(6, 2, H)
        moe(x)
        with count_host_syncs() as c:
            moe(x)
        out["syncs"][local] = dict(c)
    with _fake_te_on_rank() as te:
        q = te.FP8GlobalStateManager
        moe = MoE(H, F, 2, 1, backend="te")
        _route_to_expert0(moe)
        # 20 tokens (not a multiple of 16), positive: expert 0's logit wins for all
        x = (torch.rand(20, 1, H) + 0.1).requires_grad_()
        with tte.te_autocast(recipe="delayed"):        # amax group: both ranks
            y = moe(x)
        y.sum().backward()
        out["splits"] = [c[1]["m_splits"] for lin in (moe.te_experts.fc1, moe.te_experts.fc2)
                         for c in lin.calls if c[0] == "forward"]
        ref = MoE(H, F, 2, 1)   # the torch backend on the same weights
        ref.load_state_dict(moe.state_dict())
        out["close"] = bool(torch.allclose(ref(x), y, atol=1e-6))
        tpkit.destroy_parallel()
        # row 10: pp=2 (each rank its own stage: the amax group is not the world group,
        # so destroy_parallel destroys it); the second layout's autocast exit must not
        # reduce over the first layout's destroyed group
        q.reset()
        for step in range(2):
            tpkit.init_parallel(pp=2, seed=1)
            moe = MoE(H, F, 2, 1, backend="te")
            with tte.te_autocast(recipe="delayed"):
                moe(torch.randn(16, 1, H))
            out[f"keys{step}"] = len(q.quantization_state.autocast_arguments)
            tpkit.destroy_parallel()
            out[f"keys_after{step}"] = len(q.quantization_state.autocast_arguments)
    return out


def test_multi_gpu_paths_on_two_ranks(tmp_path):
    """Rows 1, 2, 5, 6 (ep=2) and 10 on two gloo ranks (one launch)."""
    r0, r1 = run(_rank_multi, 2, str(tmp_path), timeout=240)
    for r in (r0, r1):
        # row 5
        assert "No backend type associated with device type cpu" in r["cpu_on_cuda_group"]
        assert r["device"] == ("cuda", "cpu") and r["any"] == (True, False)
        assert r["hf_flag_groups"] == [None]
        # row 6: two syncs per forward (the all-to-all split sizes), at every expert count
        assert r["syncs"][2] == r["syncs"][4] == r["syncs"][8] == {"tolist": 2}, r["syncs"]
        # rows 1 and 2: both ranks ran fc1 and fc2 (the fake's amax reduction compared
        # their registrations), every split a multiple of 16, the product unchanged
        assert len(r["splits"]) == 2 and r["close"]
        for step in (0, 1):   # row 10: the destroyed layout's autocast key is gone
            assert r[f"keys{step}"] == 1 and r[f"keys_after{step}"] == 0
    # rank 0 gets both ranks' 20 tokens (40 -> 48 rows), rank 1 none (one block of 16 zeros)
    assert r0["splits"] == [[48], [48]] and r1["splits"] == [[16], [16]]


# --- row 6 at ep=1, row 7 -----------------------------------------------------------------------
def _rank_one():
    import tpkit
    import tpkit.fp8
    from tpkit.data import pack_sequences
    from tpkit.nn import ColumnParallelLinear, MoE
    from tpkit.nn.dot_product_attention import DotProductAttention
    out = {"moe": {}}
    tpkit.init_parallel(seed=1)
    for local in (2, 4, 8):
        moe = MoE(H, F, local, 2)
        x = torch.randn(6, 2, H)
        moe(x)
        with count_host_syncs() as c:
            moe(x)
        out["moe"][local] = dict(c)
    lins = [ColumnParallelLinear(H, H) for _ in range(3)]
    x = torch.randn(4, 1, H)
    with tpkit.fp8.fp8_autocast(recipe="delayed"):   # first use: the metas are made
        lins[0](x)
    with count_host_syncs() as c:
        with tpkit.fp8.fp8_autocast(recipe="delayed"):
            for lin in lins:
                x = lin(x)
    out["fp8"] = dict(c)
    attn = [DotProductAttention(2, 4, qkv_format="thd", attn_mask_type="padding_causal")
            for _ in range(3)]
    pb = pack_sequences([torch.arange(3), torch.arange(5)], multiple=1)
    kw = pb.attention_kwargs()
    q = torch.randn(8, 2, 4)
    per_layer = []
    for layer in attn:
        with count_host_syncs() as c:
            layer(q, q, q, qkv_format="thd", **kw)
        per_layer.append(dict(c))
    out["thd"] = per_layer
    with _fake_te_on_rank():   # row 1 at one rank: 20 tokens over 2 experts, under fp8
        moe = MoE(H, F, 2, 1, backend="te")
        x = torch.randn(20, 1, H)
        with tte.te_autocast(recipe="delayed"):
            y = moe(x)
        ref = MoE(H, F, 2, 1)
        ref.load_state_dict(moe.state_dict())
        out["fp8_splits"] = [c[1]["m_splits"] for c in moe.te_experts.fc1.calls]
        out["fp8_close"] = bool(torch.allclose(ref(x), y, atol=1e-6))
        out["plain_splits"] = moe.last_routing.tokens_per_expert.tolist()
    return out


def test_host_syncs_do_not_grow_with_experts_or_layers():
    """Row 1 (the fp8 padding at one rank) and rows 6 and 7 at one rank: one sync per MoE forward at 2, 4 and 8 experts (the
    split sizes; ep x etp = 1 needs no second), no host copy per fp8 amax record, and the
    THD checks of cu_seqlens once per batch (the first layer), not per layer."""
    (r,) = run(_rank_one, 1)
    assert r["moe"][2] == r["moe"][4] == r["moe"][8] == {"tolist": 1}, r["moe"]
    assert r["fp8"] == {}, r["fp8"]   # three fp8 layers and the scale update: no host copy
    assert r["thd"][0] and r["thd"][1:] == [{}, {}], r["thd"]
    # row 1 at one rank: each expert's rows padded to 16 (the product unchanged)
    (splits,) = r["fp8_splits"]
    assert splits == [-(-int(n) // 16) * 16 for n in r["plain_splits"]], (splits, r)
    assert r["fp8_close"]


# --- rows 3, 4, 8, 9: one process, the fake TE on a fake 8-rank state -----------------------
def test_graph_capture_refused_with_tpkit_tracker(fake_te, cuda, fake_state):
    """Row 3: TE's DotProductAttention registers tpkit's tracker states (ByteTensors);
    TE's make_graphed_callables then fails in register_generator_state, so
    tpkit.te.make_graphed_callables refuses it first, naming the combination."""
    from tpkit.layout.random import model_parallel_seed
    model_parallel_seed(1, fake_state)
    attn = tte.make("attention", fake_state, num_attention_heads=4, kv_channels=2,
                    attention_dropout=0.1)
    q = torch.zeros(4, 1, 2, 2)
    with pytest.raises(TypeError, match="register_generator_state"):
        fake_te.make_graphed_callables(attn, (q, q, q))   # TE's own: the defect
    with pytest.raises(ValueError, match="make_graphed_callables with tpkit's RNG tracker"):
        tte.make_graphed_callables(attn, (q, q, q))
    # with TE's graph-safe tracker it goes through (and TE's capture assertion holds)
    tracker = fake_te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1)
    ok = tte.make("attention", fake_state, num_attention_heads=4, kv_channels=2,
                  get_rng_state_tracker=lambda: tracker)
    assert tte.make_graphed_callables(ok, (q, q, q)) is ok


def test_te_modules_recompute_in_te_checkpoint(fake_te, cuda, fake_state):
    """Row 4: a lambda, a partial and a closure over a TE module, and any function under
    TE's fp8 autocast, go to TE's checkpoint: the module records its amaxes once per step
    (tpkit's own checkpoint would run it again in backward, recording them twice)."""
    from tpkit.layout.random import model_parallel_seed
    from tpkit.recompute import checkpoint
    model_parallel_seed(1, fake_state)
    lin = tte.make("grouped_linear", fake_state, num_gemms=2, in_features=4, out_features=4,
                   bias=False, device="cpu")

    def closure(t):
        return lin(t, [16, 16])
    fns = [lambda t: lin(t, [16, 16]), functools.partial(lin, m_splits=[16, 16]), closure]
    for fn in fns:
        assert tte.holds_te_modules(fn), fn
    assert not tte.holds_te_modules(lambda t: t * 2)
    recipe = {"recipe": "delayed", "reduce_amax": False}
    holder = types.SimpleNamespace(lin=lin)   # not scanned: reached through fp8 state only
    assert not tte.holds_te_modules(lambda t: holder.lin(t, [16, 16]))
    for fn in fns + [lambda t: holder.lin(t, [16, 16])]:
        lin.amax_records = 0
        x = torch.randn(32, 4, requires_grad=True)
        with tte.te_autocast(recipe=recipe):
            checkpoint(fn, x).sum().backward()
        assert lin.amax_records == 1, fn


def test_te_attention_forks_the_tracker_under_sp(fake_te, cuda, fake_state):
    """Row 8: TE's DotProductAttention skips the tracker's fork for dropout under SP
    (identical masks on different heads across TP ranks); tpkit builds it with SP off,
    so it forks as tpkit's torch attention does. TE's TransformerLayer passes SP to its
    attention itself: refused with attention dropout under SP and tp > 1."""
    from tpkit.layout.random import get_rng_tracker
    attn = tte.make("attention", fake_state, num_attention_heads=4, kv_channels=2,
                    attention_dropout=0.1)
    assert fake_state.sequence_parallel and attn.init_args["sequence_parallel"] is False
    ctx = attn.attention_dropout_ctx
    assert getattr(ctx, "__self__", None) is get_rng_tracker() and ctx.__name__ == "fork"
    with pytest.raises(ValueError, match=r"TransformerLayer with sequence_parallel=True, "
                                         r"tp=2 and attention_dropout=0.1"):
        tte.make("transformer_layer", fake_state, hidden_size=8, ffn_hidden_size=16,
                 num_attention_heads=4)
    tte.make("transformer_layer", fake_state, hidden_size=8, ffn_hidden_size=16,
             num_attention_heads=4, attention_dropout=0.0)


def test_te_model_init_takes_recipe_names(fake_te, cuda, fake_state):
    """Row 9: te_model_init(recipe="delayed") hands TE a DelayedScaling (TE stores the
    recipe as given and its modules ask it for its type: a string fails there)."""
    from transformer_engine.common.recipe import DelayedScaling
    for spec in ("delayed", {"recipe": "delayed", "margin": 1}):
        fake_te.RECORD.clear()
        with tte.te_model_init(recipe=spec):
            fake_te.Linear(4, 4, device="cpu")
        (name, args), = [r for r in fake_te.RECORD if r[0] == "quantized_model_init"]
        assert isinstance(args["recipe"], DelayedScaling), args
