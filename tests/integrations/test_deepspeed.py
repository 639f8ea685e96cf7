"""DeepSpeed integration: every mpu getter vs the ParallelState it wraps, ZeRO 0/1/2 over
tpkit's groups vs DDP and a single-process reference (TP, DP and CP), and DeepSpeed's
activation checkpointing replaying dropout from tpkit's RNG tracker.

One harness call on 4 gloo ranks runs every scenario (importing DeepSpeed and building
its engines is the slow part); the tests below assert on its cached results. Pool
(tests/dist.py): DeepSpeed's comm wraps the harness's group here; the same training as a
script under tpkit-launch, over two layouts in one process, is test_userpath's ds_train.py.
"""
import importlib.util
import os
import re
import sys

import pytest
import torch

from dist import run

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="needs deepspeed (pip install tpkit[deepspeed])")

WORLD = 4
GETTER_LAYOUTS = [(2, 1, 2, 1), (2, 2, 1, 1), (1, 2, 2, 1), (2, 1, 1, 2)]  # tp, cp, dp, pp
FAMILY_GROUP = {"tensor_model_parallel": "tp", "slice_parallel": "tp", "model_parallel": "mp",
                "data_parallel": "dp", "pipeline_model_parallel": "pp", "pipe_parallel": "pp",
                "sequence_parallel": "cp", "sequence_data_parallel": "dp_cp"}
SUFFIXES = ("group", "rank", "world_size", "group_ranks", "src_rank")
TRAIN_LAYOUTS = [(2, 1, 2), (2, 2, 1), (1, 2, 2)]  # tp, cp, dp
B, S, D, H = 4, 8, 8, 16  # global batch, sequence, hidden, ffn
STEPS, LR = 3, 0.5
CLIP = 0.1  # below every step's gradient norm (about 0.29-0.41), so clipping is active


# --- models: the single-process reference and its TP version ------------------------
class RefMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(D, H)
        self.fc2 = torch.nn.Linear(H, D)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def full_weights():
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in RefMLP().state_dict().items()}


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, S, D, generator=g), torch.randn(B, S, D, generator=g)


def reference_run(clip=None):
    """Losses, grads (first step) and weights after every step of plain SGD on the
    global batch with the mean-squared-error over every element (clipped to ``clip``)."""
    model = RefMLP()
    model.load_state_dict(full_weights())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, weights, grads = [], [], None
    for step in range(STEPS):
        x, t = batch(step)
        loss = ((model(x) - t) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if grads is None:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        if clip is not None:
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > clip
        opt.step()
        losses.append(loss.item())
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, grads, weights


class TPMLP(torch.nn.Module):
    """RefMLP with fc1 column-parallel and fc2 row-parallel (tpkit.nn), loaded from the
    reference's full weights."""

    def __init__(self, state):
        from tpkit.checkpoint import load_full_state_dict
        from tpkit.nn import ColumnParallelLinear, RowParallelLinear
        super().__init__()
        self.state = state
        self.fc1 = ColumnParallelLinear(D, H, state=state)
        self.fc2 = RowParallelLinear(H, D, state=state)
        load_full_state_dict(self, full_weights(), state)

    def forward(self, x, dropout=0.0):
        import torch.nn.functional as F
        from tpkit.layout.random import get_rng_tracker
        h = torch.tanh(self.fc1(x))
        if dropout:
            with get_rng_tracker().fork():  # TP-sharded activations: model-parallel stream
                h = F.dropout(h, dropout)
        y = self.fc2(h)
        return F.dropout(y, dropout) if dropout else y  # replicated: default stream

    def full_state_dict(self):
        from tpkit.checkpoint import full_state_dict
        return full_state_dict(self, self.state)

    def full_grads(self, get_grad):
        from tpkit.checkpoint import gather_param
        out = {}
        for name, p in self.named_parameters():
            dim = getattr(p, "tp_partition_dim", None)
            g = get_grad(p)
            out[name] = g.clone() if dim is None else gather_param(g, dim, None, self.state.tp_group)
        return out


# --- worker ----------------------------------------------------------------------------
def _quiet_deepspeed():
    import logging
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import importlib
    import deepspeed
    # not `import deepspeed.comm.torch as m`: that binds deepspeed.comm's `torch` attribute,
    # which is the torch package itself
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    from deepspeed.utils import logger
    logger.setLevel(logging.WARNING)
    # DeepSpeed JIT-compiles a shared-memory all-reduce op (~40-60 s of g++ on a cold
    # cache) that only inference_all_reduce uses, and only when LOCAL_SIZE is set;
    # training never touches it, so tests skip the build (TPKIT_TEST_DS_SHM=1 keeps it).
    if os.environ.get("TPKIT_TEST_DS_SHM") != "1":
        assert ds_torch.__name__ == "deepspeed.comm.torch" and hasattr(ds_torch, "build_shm_op")
        ds_torch.build_shm_op = lambda: None
    return deepspeed


def _getters(layout):
    import torch.distributed as dist
    import tpkit
    from tpkit.layout import parallel_state as ps
    from tpkit.integrations.deepspeed import DeepSpeedMPU
    tp, cp, dp, pp = layout
    s = tpkit.init_parallel(tp=tp, cp=cp, dp=dp, pp=pp)
    out = {"values": {}, "group_ranks": {}, "wraps": {}}
    for mpu_kind, mpu in (("current", DeepSpeedMPU()), ("explicit", DeepSpeedMPU(s))):
        for fam, gname in FAMILY_GROUP.items():
            for suf in SUFFIXES:
                name = f"get_{fam}_{suf}"
                v = getattr(mpu, name)()
                if suf == "group":
                    out["wraps"][(mpu_kind, name)] = v is getattr(s, f"{gname}_group")
                    out["group_ranks"][(mpu_kind, name)] = (dist.get_process_group_ranks(v),
                                                            dist.get_rank(v), dist.get_world_size(v))
                else:
                    out["values"][(mpu_kind, name)] = v
        dpc = {f"{k}(cp=True)": getattr(mpu, f"get_data_parallel_{k}")(with_context_parallel=True)
               for k in ("rank", "world_size", "group_ranks", "src_rank")}
        dpc["group(cp=True)"] = mpu.get_data_parallel_group(with_context_parallel=True) is s.dp_cp_group
        for k in ("get_pipeline_model_parallel_first_rank", "get_pipeline_model_parallel_last_rank",
                  "is_pipeline_first_stage", "is_pipeline_last_stage",
                  "model_parallel_is_initialized"):
            dpc[k] = getattr(mpu, k)()
        out["values"].update({(mpu_kind, k): v for k, v in dpc.items()})
    # the Megatron getters over the same state must agree with the mpu
    mpu = DeepSpeedMPU()
    out["megatron"] = {
        "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
               ps.get_tensor_model_parallel_src_rank(),
               ps.get_tensor_model_parallel_group() is mpu.get_tensor_model_parallel_group()),
        "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
               ps.get_data_parallel_group_ranks(),
               ps.get_data_parallel_group() is mpu.get_data_parallel_group()),
        "dp_cp": (ps.get_data_parallel_rank(True), ps.get_data_parallel_world_size(True),
                  ps.get_data_parallel_group_ranks(True),
                  ps.get_data_parallel_group(True) is mpu.get_sequence_data_parallel_group()),
        "pp": (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
               ps.get_pipeline_model_parallel_first_rank(), ps.get_pipeline_model_parallel_last_rank(),
               ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()),
        "cp": (ps.get_context_parallel_rank(), ps.get_context_parallel_world_size(),
               ps.get_context_parallel_global_ranks()),
        "mp": ps.get_model_parallel_group() is mpu.get_model_parallel_group(),
    }
    out["has_initialize_sequence_parallel"] = hasattr(mpu, "initialize_sequence_parallel")
    out["repr"] = repr(mpu)
    tpkit.destroy_parallel()
    return out


def _local_batch(step, s):
    """This rank's slice: batch split over DP, sequence split in contiguous halves over CP."""
    x, t = batch(step)
    bs, ss = B // s.dp_size, S // s.cp_size
    sl = (slice(s.dp_rank * bs, (s.dp_rank + 1) * bs), slice(s.cp_rank * ss, (s.cp_rank + 1) * ss))
    return x[sl].contiguous(), t[sl].contiguous()


def _train(deepspeed, s, stage, clip=None, mark=True):
    """STEPS SGD steps of TPMLP; stage None means torch DDP over tpkit's dp group."""
    import torch.distributed as dist
    from tpkit.integrations.deepspeed import (DeepSpeedMPU, mark_tensor_parallel_params,
                                              sequence_share)
    model = TPMLP(s)
    if mark:
        assert mark_tensor_parallel_params(model) == 3
    if stage is None:
        assert s.cp_size == 1
        engine = torch.nn.parallel.DistributedDataParallel(model, process_group=s.dp_group)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    else:
        cfg = {"train_micro_batch_size_per_gpu": B // s.dp_size, "gradient_accumulation_steps": 1,
               "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
               "steps_per_print": 10 ** 9, "gradient_clipping": clip or 0.0}
        engine, opt, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=cfg,
            mpu=DeepSpeedMPU())
    out = {"losses": [], "weights": [], "replicas_equal": True}
    for step in range(STEPS):
        x, t = _local_batch(step, s)
        sq = ((engine(x) - t) ** 2).sum()
        loss = sequence_share(sq, x.numel(), s)  # this CP rank's share of the replica mean
        if stage is None:
            opt.zero_grad()
            loss.backward()
            opt.step()
        else:
            engine.backward(loss)
            if step == 0:
                from deepspeed.utils import safe_get_full_grad
                out["grads"] = model.full_grads(safe_get_full_grad)
            engine.step()
        # global loss: shares add over CP, replicas average over DP
        g = loss.detach().clone()
        dist.all_reduce(g, group=s.dp_cp_group)
        out["losses"].append(g.item() / s.dp_size)
        full = model.full_state_dict()
        out["weights"].append(full)
        flat = torch.cat([v.flatten() for v in full.values()])
        copies = [torch.empty_like(flat) for _ in range(s.dp_cp_size)]
        dist.all_gather(copies, flat, group=s.dp_cp_group)
        out["replicas_equal"] &= all(torch.equal(c, flat) for c in copies)
    if stage is not None:
        out["engine"] = {"dp_world_size": engine.dp_world_size,
                         "seq_dp_world_size": engine.seq_dp_world_size,
                         "sequence_parallel_size": engine.sequence_parallel_size,
                         "mp_world_size": engine.mp_world_size,
                         "seq_dp_ranks": dist.get_process_group_ranks(engine.seq_data_parallel_group),
                         "dp_cp_ranks": s.group_ranks("dp_cp")}
        engine.destroy()
    return out


def _training(deepspeed, layout):
    import tpkit
    tp, cp, dp = layout
    s = tpkit.init_parallel(tp=tp, cp=cp, dp=dp)
    out = {}
    for stage in ((None, 0, 1, 2) if cp == 1 else (0, 1, 2)):
        out["ddp" if stage is None else f"zero{stage}"] = _train(deepspeed, s, stage)
    if tp > 1 and cp == 1:
        out["clip"] = _train(deepspeed, s, 2, clip=CLIP)
        out["clip_unmarked"] = _train(deepspeed, s, 2, clip=CLIP, mark=False)
    tpkit.destroy_parallel()
    return out


def _rng_snapshot():
    from tpkit.layout.random import get_rng_tracker
    return torch.get_rng_state(), get_rng_tracker().get_states()


def _rng_restore(snap):
    from tpkit.layout.random import get_rng_tracker
    torch.set_rng_state(snap[0])
    get_rng_tracker().set_states(snap[1])


def _checkpointing(deepspeed):
    """deepspeed.checkpointing.checkpoint (partitioned activations, TP=2) replays both
    dropout streams from tpkit's tracker: outputs, grads and the streams' positions
    afterwards equal a run without recompute."""
    import tpkit
    from tpkit.integrations.deepspeed import (configure_activation_checkpointing,
                                              restore_deepspeed_rng)
    from tpkit.layout.random import get_rng_tracker, model_parallel_seed
    ckpt = deepspeed.checkpointing
    out = {}
    s = tpkit.init_parallel(tp=1, cp=2, dp=2, seed=7)
    try:
        configure_activation_checkpointing(partition_activations=True)
    except ValueError as e:
        out["tp1_error"] = str(e)
    tpkit.destroy_parallel()

    s = tpkit.init_parallel(tp=2, dp=2, seed=7)
    original = ckpt.get_cuda_rng_tracker
    mpu = configure_activation_checkpointing(partition_activations=True)
    tracker = get_rng_tracker()
    out["one_tracker"] = (ckpt.get_cuda_rng_tracker() is tracker
                          and ckpt._CUDA_RNG_STATE_TRACKER is tracker)
    out["ds_mp_size"] = ckpt.mp_size
    out["mpu_state"] = mpu.state is s
    # DeepSpeed's seeding entry point now seeds tpkit's streams
    ckpt.model_parallel_cuda_manual_seed(11)
    via_ds = _rng_snapshot()
    model_parallel_seed(11, s)
    direct = _rng_snapshot()
    out["seed_same"] = (torch.equal(via_ds[0], direct[0])
                        and all(torch.equal(via_ds[1][k], direct[1][k]) for k in direct[1]))

    model = TPMLP(s)
    x0 = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(3))
    runs = {}
    start = _rng_snapshot()
    for name in ("plain", "checkpoint"):
        _rng_restore(start)
        model.zero_grad()
        x = x0.clone().requires_grad_()
        if name == "plain":
            y = model(x, 0.5)
        else:
            # tensors only: with partition_activations DeepSpeed 0.19.8 recomputes with an
            # extra trailing None after non-tensor arguments
            y = ckpt.checkpoint(lambda t: model(t, 0.5), x)
        (y * torch.arange(y.numel()).view_as(y)).sum().backward()
        runs[name] = {"y": y.detach(), "x.grad": x.grad,
                      **{n: p.grad.clone() for n, p in model.named_parameters()},
                      "after": _rng_snapshot()}
    p, c = runs["plain"], runs["checkpoint"]
    out["dropped"] = bool((p["y"] == 0).any())  # default-stream dropout was on
    mp = "model-parallel-rng"
    out["forked"] = not torch.equal(p["after"][1][mp], start[1][mp])  # and the forked one
    out["equal"] = {k: torch.equal(p[k], c[k]) for k in p if k != "after"}
    out["streams_after_equal"] = (torch.equal(p["after"][0], c["after"][0]) and all(
        torch.equal(p["after"][1][k], c["after"][1][k]) for k in p["after"][1]))
    restore_deepspeed_rng()
    out["restored"] = ckpt.get_cuda_rng_tracker is original
    tpkit.destroy_parallel()
    return out


def _worker():
    deepspeed = _quiet_deepspeed()
    # checkpointing first: it must work before any deepspeed.initialize (Megatron order)
    res = {"checkpointing": _checkpointing(deepspeed)}
    res["getters"] = {l: _getters(l) for l in GETTER_LAYOUTS}
    res["train"] = {l: _training(deepspeed, l) for l in TRAIN_LAYOUTS}
    return res


@pytest.fixture(scope="module")
def ds_results():
    return run(_worker, WORLD, timeout=300)


# --- getters -----------------------------------------------------------------------------
def _coords(r, tp, cp, dp):
    return r % tp, (r // tp) % cp, (r // (tp * cp)) % dp, r // (tp * cp * dp)


@pytest.mark.parametrize("layout", GETTER_LAYOUTS, ids=[str(l) for l in GETTER_LAYOUTS])
def test_every_getter_matches_the_layout(ds_results, layout):
    from test_topology import expected_groups
    tp, cp, dp, pp = layout
    for r, res in enumerate(ds_results):
        out = res["getters"][layout]
        exp = expected_groups(r, tp, cp, dp, pp)
        for kind in ("current", "explicit"):
            for fam, g in FAMILY_GROUP.items():
                ranks, grank, gsize = out["group_ranks"][(kind, f"get_{fam}_group")]
                assert out["wraps"][(kind, f"get_{fam}_group")], (r, fam)
                assert ranks == exp[g], (r, fam)
                v = lambda suf: out["values"][(kind, f"get_{fam}_{suf}")]  # noqa: E731
                assert v("group_ranks") == exp[g], (r, fam)
                assert v("rank") == exp[g].index(r) == grank, (r, fam)
                assert v("world_size") == len(exp[g]) == gsize, (r, fam)
                assert v("src_rank") == exp[g][0], (r, fam)
            val = lambda k: out["values"][(kind, k)]  # noqa: E731
            assert val("rank(cp=True)") == exp["dp_cp"].index(r)
            assert val("world_size(cp=True)") == dp * cp
            assert val("group_ranks(cp=True)") == exp["dp_cp"]
            assert val("src_rank(cp=True)") == exp["dp_cp"][0]
            assert val("group(cp=True)") is True
            p = _coords(r, tp, cp, dp)[3]
            assert val("get_pipeline_model_parallel_first_rank") == exp["pp"][0]
            assert val("get_pipeline_model_parallel_last_rank") == exp["pp"][-1]
            assert val("is_pipeline_first_stage") == (p == 0)
            assert val("is_pipeline_last_stage") == (p == pp - 1)
            assert val("model_parallel_is_initialized") is True
        t, c, d, p = _coords(r, tp, cp, dp)
        m = out["megatron"]
        assert m["tp"] == (t, tp, exp["tp"][0], True)
        assert m["dp"] == (d, dp, exp["dp"], True)
        assert m["dp_cp"] == (exp["dp_cp"].index(r), dp * cp, exp["dp_cp"], True)
        assert m["pp"] == (p, pp, exp["pp"][0], exp["pp"][-1], p == 0, p == pp - 1)
        assert m["cp"] == (c, cp, exp["cp"])
        assert m["mp"] is True
        # DeepSpeed treats an mpu with this method as its own Ulysses mpu and then
        # drops the data- and model-parallel groups.
        assert out["has_initialize_sequence_parallel"] is False
        assert out["repr"] == f"DeepSpeedMPU(tp={tp}, cp={cp}, dp={dp}, pp={pp}, rank={r})"


def _deepspeed_probes():
    """Every ``mpu.<name>`` the installed DeepSpeed calls, read from its sources."""
    root = os.path.dirname(importlib.util.find_spec("deepspeed").origin)
    names = set()
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f), encoding="utf-8", errors="replace") as fh:
                    names.update(re.findall(r"\bmpu\.((?:get|is)_[A-Za-z_]+)", fh.read()))
    return names


def test_mpu_answers_every_name_deepspeed_probes():
    from tpkit.integrations.deepspeed import DeepSpeedMPU
    probes = _deepspeed_probes()
    assert "get_sequence_data_parallel_group" in probes and len(probes) > 15  # the grep works
    missing = sorted(n for n in probes if not callable(getattr(DeepSpeedMPU, n, None)))
    assert missing == []


# --- training ----------------------------------------------------------------------------
def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("layout", TRAIN_LAYOUTS, ids=[f"tp{l[0]}cp{l[1]}dp{l[2]}" for l in TRAIN_LAYOUTS])
def test_zero_matches_reference_and_ddp(ds_results, layout):
    ref_losses, ref_grads, ref_weights = reference_run()
    tp, cp, dp = layout
    runs = ds_results[0]["train"][layout]
    names = (["ddp"] if cp == 1 else []) + ["zero0", "zero1", "zero2"]
    assert set(names) <= set(runs)
    for r, res in enumerate(ds_results):
        for name in names:
            out = res["train"][layout][name]
            assert out["replicas_equal"], (r, name)  # identical across DP (and CP) replicas
            for step in range(STEPS):
                assert _rel(out["losses"][step], ref_losses[step]) <= 1e-5, (r, name, step)
                if "ddp" in runs:
                    assert _rel(out["losses"][step], runs["ddp"]["losses"][step]) <= 1e-5
                for k, v in ref_weights[step].items():
                    torch.testing.assert_close(out["weights"][step][k], v, rtol=1e-5, atol=1e-6,
                                               msg=f"rank {r} {name} step {step} {k}")
            if name != "ddp":
                # DeepSpeed sums over CP and averages over DP (see the module docstring)
                e = out["engine"]
                assert e["sequence_parallel_size"] == cp and e["seq_dp_world_size"] == dp * cp
                assert e["dp_world_size"] == dp and e["mp_world_size"] == tp
                assert e["seq_dp_ranks"] == e["dp_cp_ranks"]
                for k, g in ref_grads.items():
                    torch.testing.assert_close(out["grads"][k], g, rtol=1e-5, atol=1e-7,
                                               msg=f"rank {r} {name} grad {k}")


# --- errors --------------------------------------------------------------------------------
def test_missing_deepspeed_names_the_extra(monkeypatch):
    from tpkit.integrations import deepspeed as tds
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` -> ImportError
    for call in (tds.require_deepspeed, tds.DeepSpeedMPU,
                 lambda: tds.configure_activation_checkpointing(None)):
        with pytest.raises(ImportError, match=re.escape("pip install tpkit[deepspeed]")):
            call()


def test_gradient_clipping_needs_marked_tp_params(ds_results):
    """ZeRO clips with the global norm only when TP shards carry tensor_model_parallel
    (mark_tensor_parallel_params); unmarked, DeepSpeed counts TP rank 0's shards only."""
    _, _, ref_weights = reference_run(clip=CLIP)
    _, _, unclipped = reference_run()
    for r, res in enumerate(ds_results):
        marked, unmarked = res["train"][(2, 1, 2)]["clip"], res["train"][(2, 1, 2)]["clip_unmarked"]
        assert marked["replicas_equal"]
        for step in range(STEPS):
            for k, v in ref_weights[step].items():
                torch.testing.assert_close(marked["weights"][step][k], v, rtol=1e-5, atol=1e-6,
                                           msg=f"rank {r} step {step} {k}")
        w, ref, free = (torch.cat([d[k].flatten() for k in sorted(d)])
                        for d in (unmarked["weights"][0], ref_weights[0], unclipped[0]))
        assert not torch.allclose(w, ref, atol=1e-4)   # a wrong norm clips differently
        assert not torch.allclose(w, free, atol=1e-4)  # ... and clipping was on


def test_activation_checkpointing_replays_tpkit_streams(ds_results):
    for r, res in enumerate(ds_results):
        out = res["checkpointing"]
        assert out["one_tracker"] and out["mpu_state"] and out["restored"]
        assert out["ds_mp_size"] == 2  # DeepSpeed partitions over the TP group
        assert out["seed_same"]
        assert out["dropped"] and out["forked"]
        assert all(out["equal"].values()), out["equal"]
        assert out["streams_after_equal"]


def test_partition_activations_needs_tp(ds_results):
    for res in ds_results:
        msg = res["checkpointing"].get("tp1_error", "")
        assert "TP=1" in msg and "partition_activations=False" in msg


def test_sequence_share_and_argument_errors():
    from types import SimpleNamespace
    from tpkit.integrations.deepspeed import configure_activation_checkpointing, sequence_share
    one = SimpleNamespace(cp_size=1)
    assert sequence_share(torch.tensor(6.0), 4, one).item() == 1.5
    with pytest.raises(ValueError, match="num_tokens must be positive"):
        sequence_share(torch.tensor(1.0), 0, one)
    with pytest.raises(ValueError, match="different ParallelState"):
        configure_activation_checkpointing(SimpleNamespace(), mpu=SimpleNamespace(state=object()))
