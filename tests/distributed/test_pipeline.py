"""tpkit.distributed.pipeline: losses and gradients of a pipelined GPT (every schedule that runs on
CPU/gloo, composed with TP, SP, CP and DP) against the same GPT in one process, and the
ValueErrors of bad layouts. docs/pipeline.md says what has landed."""
import os

import pytest

from dist import run
from shared import register_trainer_runs, trainer_runs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BATCH, SEQ = 8, 16
TOL = 1e-5


def _cfg(layers, recompute=False):
    from tpkit.models.gpt import GPTConfig
    return GPTConfig(vocab_size=64, hidden_size=32, num_layers=layers, num_heads=4,
                     num_gqa_groups=2, ffn_hidden_size=64, recompute=recompute)


def _full_weights(model):
    """Layout-independent weights drawn at full shape, by parameter name."""
    import torch
    from tpkit.checkpoint import full_shapes
    out = {}
    for name, shape in sorted(full_shapes(model).items()):
        g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + len(shape))
        out[name] = (torch.randn(shape, generator=g) * 0.1) if len(shape) > 1 \
            else 1.0 + 0.1 * torch.randn(shape, generator=g)
    return out


def _batch():
    import torch
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 64, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _reference(layers, recompute=False):
    """One process, no pipeline: the batch-mean loss and every full gradient."""
    import tpkit
    from tpkit.models.gpt import GPT
    from tpkit.checkpoint import load_full_state_dict
    tpkit.init_parallel(tp=1, cp=1, pp=1)
    model = GPT(_cfg(layers, recompute))
    load_full_state_dict(model, _full_weights(model))
    x, y = _batch()
    loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _pipelined(layers, *, tp=1, cp=1, pp=2, schedule="1F1B", microbatches=4,
               virtual_stages=None, sp=False, recompute=False, steps=1, data_parallel="ddp"):
    """The pipelined run on this rank: (global loss, {name: full grad} of this stage's
    parameters, reported by the rank with tp = dp = cp = 0 only)."""
    import torch
    import torch.distributed as dist
    import tpkit
    from tpkit.models.gpt import GPT
    from tpkit.checkpoint import gather_param, load_full_state_dict
    from tpkit.grads import sync_sequence_parallel_grads
    from tpkit.layout.param_tags import tp_spec
    from tpkit.distributed.pipeline import build_pipeline
    state = tpkit.init_parallel(tp=tp, cp=cp, pp=pp, sequence_parallel=sp)
    model = GPT(_cfg(layers, recompute))
    load_full_state_dict(model, _full_weights(model))
    pipe = build_pipeline(model, microbatches=microbatches, schedule=schedule,
                          virtual_stages=virtual_stages, data_parallel=data_parallel)
    x, y = _batch()
    rows = slice(state.dp_rank * BATCH // state.dp_size, (state.dp_rank + 1) * BATCH // state.dp_size)
    calls = _count_reduce_scatters(dist, state.dp_cp_group)
    for _ in range(steps):
        calls.clear()   # the last step's (the first also infers shapes)
        loss = pipe.step(x[rows], target=y[rows])
    dist.reduce_scatter_single = calls.real
    loss = loss.clone()
    dist.all_reduce(loss, group=state.dp_cp_group)
    sync_sequence_parallel_grads(pipe.module, state)
    grads = {}
    for n, p in pipe.module.named_parameters():
        spec = tp_spec(p)
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad   # FSDP2's
        g = g if spec is None else gather_param(g, spec[0], spec[1], state.tp_group)
        grads[n] = g.clone()
    report = state.tp_rank == 0 and state.dp_cp_rank == 0
    if data_parallel == "fsdp":   # FSDP2's reduce-scatters in the last step, its units
        from torch.distributed.fsdp import FSDPModule, fully_shard
        states = {id(fully_shard.state(m)): fully_shard.state(m) for st in pipe.stage_modules
                  for m in st.modules() if isinstance(m, FSDPModule)}   # a unit of several
        groups = sum(len(s._fsdp_param_groups) for s in states.values())   # modules: one
        return loss.item() / state.dp_cp_size, (grads if report else {}), len(calls), groups
    return loss.item() / state.dp_cp_size, (grads if report else {})


def _count_reduce_scatters(dist, group):
    """Counts torch.distributed.reduce_scatter_single calls over ``group`` (FSDP2's
    gradient reduction) until ``dist.reduce_scatter_single = calls.real`` puts it back."""
    class Calls(list):
        pass
    calls = Calls()
    calls.real = dist.reduce_scatter_single

    def counted(*a, **k):
        if k.get("group") is group:
            calls.append(1)
        return calls.real(*a, **k)
    dist.reduce_scatter_single = counted
    return calls


def _pipelined_fsdp_cases(cases):
    """Several FSDP2 pipelines in one launch (each case's layout torn down after it)."""
    import tpkit
    from tpkit.fabric.setup import clear_dtensor_caches
    out = []
    for kw in cases:
        out.append(_pipelined(4, data_parallel="fsdp", steps=2, **kw))
        tpkit.destroy_parallel()
        clear_dtensor_caches()   # DTensor's caches name the destroyed layout's groups
    return out


def _check(ref, results, steps=1):
    ref_loss, ref_grads = ref
    seen = {}
    for loss, grads in results:
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (loss, ref_loss)
        for n, g in grads.items():
            assert n not in seen, f"{n} is held by two stages"
            seen[n] = g
    assert sorted(seen) == sorted(ref_grads)   # every parameter once, under its global name
    for n, g in seen.items():
        r = ref_grads[n] * steps
        err = (g - r).abs().max().item()
        assert err <= TOL * max(1.0, r.abs().max().item()), f"{n}: max error {err}"


@pytest.fixture(scope="module")
def ref4():
    return run(_reference, 1, 4)[0]


@pytest.fixture(scope="module")
def ref8():
    return run(_reference, 1, 8)[0]


# Every schedule torch 2.13 ships, on CPU/gloo, at pp=2 (4 blocks) and pp=4 (8 blocks).
@pytest.mark.parametrize("kw", [
    dict(schedule="1F1B"), dict(schedule="GPipe", microbatches=2),
    dict(schedule="Interleaved1F1B", virtual_stages=2), dict(schedule="LoopedBFS"),
    dict(schedule="InterleavedZeroBubble", microbatches=2), dict(schedule="ZBVZeroBubble"),
    dict(schedule="DualPipeV"),
    dict(schedule="1F1B", recompute=True),
], ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_schedules_pp2(ref4, kw):
    _check(ref4, run(_pipelined, 2, 4, **kw))


def test_gradients_accumulate_over_steps(ref4):
    _check(ref4, run(_pipelined, 2, 4, schedule="Interleaved1F1B", steps=2), steps=2)


@pytest.mark.parametrize("kw", [
    dict(schedule="1F1B"), dict(schedule="Interleaved1F1B", microbatches=8),
    dict(schedule="ZBVZeroBubble"), dict(schedule="DualPipeV", microbatches=8),
], ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_schedules_pp4(ref8, kw):
    _check(ref8, run(_pipelined, 4, 8, pp=4, **kw))


# FSDP2 inside the stages (issue 54): every schedule, gradients reduced once per step.
FSDP_SCHEDULES = [dict(schedule="1F1B"), dict(schedule="GPipe", microbatches=2),
                  dict(schedule="Interleaved1F1B"), dict(schedule="LoopedBFS"),
                  dict(schedule="InterleavedZeroBubble", microbatches=2),
                  dict(schedule="ZBVZeroBubble"), dict(schedule="DualPipeV")]


def test_fsdp_in_stages_every_schedule(ref4):
    """pp=2 x dp=2 with data_parallel='fsdp' (tpkit.distributed.fsdp in each stage): every
    schedule's gradients after two steps are the one-process gradients of the batch
    twice, and each FSDP2 unit reduce-scatters once in a step, not once per micro-batch
    (torch.distributed.reduce_scatter_single counted). One launch for all cases.
    Planted: the stage module left without its root unit (blocks only, so the schedule
    does not see an FSDPModule and cannot hold the sync back): the test failed (FSDP2
    raised in its forward prefetch)."""
    results = run(_pipelined_fsdp_cases, 4, FSDP_SCHEDULES)
    for i, kw in enumerate(FSDP_SCHEDULES):
        per_rank = [r[i] for r in results]
        _check(ref4, [(loss, grads) for loss, grads, _, _ in per_rank], steps=2)
        for _, _, calls, groups in per_rank:
            assert groups > 0 and calls == groups, (kw, calls, groups)


# pp=2 on 4 ranks with TP, SP, CP or DP inside each stage.
@pytest.mark.parametrize("kw", [
    dict(tp=2), dict(tp=2, sp=True, recompute=True), dict(cp=2), dict(),  # the last: dp=2
    dict(tp=2, schedule="Interleaved1F1B", recompute=True),
    dict(tp=2, sp=True, schedule="InterleavedZeroBubble"),
    dict(schedule="ZBVZeroBubble", data_parallel="allreduce"),
    dict(cp=2, schedule="DualPipeV", data_parallel="allreduce"),
], ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()) or "dp2")
def test_composition(ref4, kw):
    _check(ref4, run(_pipelined, 4, 4, **kw))


def test_all_four_dims(ref4):
    """pp 2 x dp 2 x cp 2 x tp 2 (SP) on 8 ranks."""
    _check(ref4, run(_pipelined, 8, 4, tp=2, cp=2, sp=True, schedule="Interleaved1F1B"))


# --- bad input: ValueErrors before anything runs ----------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(schedule="Zigzag"), "unknown; use one of"),
    (dict(num_blocks=6, pp=4), "6 blocks do not split evenly into pp x virtual_stages = 4 x 1"),
    (dict(schedule="Interleaved1F1B", virtual_stages=2, num_blocks=6),
     "6 blocks do not split evenly into pp x virtual_stages = 2 x 2"),
    (dict(microbatches=1), "microbatches=1 is fewer than the 2 pipeline stages; 1F1B"),
    (dict(schedule="DualPipeV", microbatches=3), "DualPipeV needs microbatches >= 2 x pp"),
    (dict(schedule="Interleaved1F1B", pp=4, microbatches=9, num_blocks=8),
     "microbatches=9 is not a multiple of the 2 rounds"),
    (dict(schedule="1F1B", virtual_stages=2), "runs one stage per rank"),
    (dict(schedule="ZBVZeroBubble", virtual_stages=3, num_blocks=6), "exactly two stages"),
    (dict(microbatches=0), "microbatches=0 must be an integer >= 1"),
    (dict(batch_size=6, microbatches=4), "local batch of 6 does not split into microbatches=4"),
    (dict(schedule="ZBVZeroBubble", recompute=True), "'ZBVZeroBubble' with recompute"),
    (dict(schedule="DualPipeV", recompute=True), "use 1F1B or Interleaved1F1B with recompute"),
])
def test_plan_errors(kw, match):
    from tpkit.distributed.pipeline import plan_pipeline
    args = dict(pp=2, num_blocks=4, microbatches=4, schedule="1F1B") | kw
    with pytest.raises(ValueError, match=match):
        plan_pipeline(**args)


def test_plan_stage_maps():
    """Which stages and blocks every rank runs (the independent reference: written out)."""
    from tpkit.distributed.pipeline import plan_pipeline
    loop = plan_pipeline(pp=2, num_blocks=8, microbatches=4, schedule="Interleaved1F1B")
    assert [loop.stages_of(r) for r in (0, 1)] == [[0, 2], [1, 3]]
    assert [list(loop.blocks_of(s)) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert loop.last_stage_rank == 1
    v = plan_pipeline(pp=2, num_blocks=4, microbatches=4, schedule="zbvzerobubble")
    assert v.schedule == "ZBVZeroBubble" and [v.stages_of(r) for r in (0, 1)] == [[0, 3], [1, 2]]
    assert v.last_stage_rank == 0


def _bad_models():
    import tpkit
    from tpkit.models.gpt import GPT
    from torch import nn
    from tpkit.distributed.pipeline import build_pipeline
    tpkit.init_parallel(pp=2)
    errors = []
    for model, kw in ((nn.Sequential(nn.Linear(2, 2)), {}),
                      (GPT(_cfg(4)), dict(schedule="ZBVZeroBubble", data_parallel="ddp")),
                      (GPT(_cfg(4)), dict(data_parallel="fsdp2")),
                      (GPT(_cfg(4)), dict(microbatches=2)),
                      (GPT(_cfg(4, recompute=True)),
                       dict(schedule="InterleavedZeroBubble", data_parallel="allreduce"))):
        try:
            build_pipeline(model, **({"microbatches": 4} | kw))
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_bad_models():
    errors = run(_bad_models, 4)[0]   # pp 2 x dp 2: no stage is built, nothing is sent
    assert len(errors) == 5
    assert "Sequential has no block list to split into pipeline stages" in errors[0]
    assert "data_parallel='allreduce'" in errors[1]
    assert "data_parallel='fsdp2' is unknown" in errors[2]
    assert "microbatches=2 <= pp=2" in errors[3] and "'allreduce'" in errors[3]
    assert "'InterleavedZeroBubble' with recompute" in errors[4]


# --- checkpoints across pp ----------------------------------------------------------------
def _full_local(module, opt, state):
    """{name: full tensor} of this rank's parameters and their Adam exp_avg (tp rank 0 and
    dp rank 0 report; None elsewhere), the lrs and the step."""
    from tpkit.checkpoint import gather_param
    from tpkit.layout.param_tags import tp_spec

    def full(t, p):
        spec = tp_spec(p)
        return t.detach().clone() if spec is None else gather_param(t, spec[0], spec[1],
                                                                     state.tp_group)
    names = {id(p): n for n, p in module.named_parameters()}
    params = {n: full(p, p) for n, p in module.named_parameters()}
    avg = {names[id(p)]: full(s["exp_avg"], p) for p, s in opt.state.items()}
    out = (params, avg, [g["lr"] for g in opt.param_groups])
    return out if state.tp_rank == 0 and state.dp_rank == 0 else None


def _ckpt_save(path, *, tp, pp):
    """One AdamW step of the pipelined GPT, saved; what was saved, full (_full_local)."""
    import torch
    import tpkit
    from tpkit.models.gpt import GPT
    from tpkit.checkpoint import load_full_state_dict, save
    from tpkit.distributed.pipeline import build_pipeline
    state = tpkit.init_parallel(tp=tp, pp=pp)
    model = GPT(_cfg(4))
    load_full_state_dict(model, _full_weights(model))
    pipe = build_pipeline(model, microbatches=4)
    x, y = _batch()
    rows = slice(state.dp_rank * BATCH // state.dp_size,
                 (state.dp_rank + 1) * BATCH // state.dp_size)
    opt = torch.optim.AdamW(pipe.module.parameters(), lr=1e-2)
    pipe.step(x[rows], target=y[rows])
    opt.step()
    opt.param_groups[0]["lr"] = 0.125     # a hyper-parameter the load must restore
    save(path, {"model": pipe.module, "optimizer": opt, "step": 1})
    return _full_local(pipe.module, opt, state)


def _ckpt_load(path, *, tp, pp):
    """Load into a fresh model (pipelined at pp > 1) and optimizer: _full_local + step."""
    import torch
    import tpkit
    from tpkit.models.gpt import GPT
    from tpkit.checkpoint import load
    from tpkit.distributed.pipeline import build_pipeline
    state = tpkit.init_parallel(tp=tp, pp=pp)
    model = GPT(_cfg(4))
    module = build_pipeline(model, microbatches=4).module if pp > 1 else model
    opt = torch.optim.AdamW(module.parameters(), lr=1.0)
    out = load(path, {"model": module, "optimizer": opt, "step": 0})
    got = _full_local(module, opt, state)
    return None if got is None else got + (out["step"],)


def _merge(results):
    params, avg, lrs = {}, {}, set()
    for r in results:
        if r is not None:
            params.update(r[0])
            avg.update(r[1])
            lrs.update(r[2])
            assert r[3:] in ((), (1,)), r[3:]   # the step, when loaded
    return params, avg, lrs


def test_checkpoint_across_pp(tmp_path):
    """Written at (pp=2, tp=2), loaded at (pp=1, tp=1), (pp=4) and back at (pp=2, tp=2);
    written at pp=4, loaded at (pp=2, tp=2) and pp=1: every parameter and Adam state
    exactly as written (gathered at the writing layout), under its global name, and the
    lr restored on every stage."""
    a, b = str(tmp_path / "pp2tp2"), str(tmp_path / "pp4")
    saved = {a: _merge(run(_ckpt_save, 4, a, tp=2, pp=2)),
             b: _merge(run(_ckpt_save, 4, b, tp=1, pp=4))}
    assert sorted(saved[a][0]) == sorted(saved[b][0])   # every parameter, once per layout
    for path, tp, pp in ((a, 1, 1), (a, 1, 4), (a, 2, 2), (b, 2, 2), (b, 1, 1)):
        params, avg, lrs = _merge(run(_ckpt_load, 4, path, tp=tp, pp=pp))
        ref_params, ref_avg, _ = saved[path]
        assert lrs == {0.125}, (path, tp, pp, lrs)
        assert sorted(params) == sorted(ref_params) == sorted(avg), (path, tp, pp)
        for n in ref_params:
            assert torch_equal(params[n], ref_params[n]), (path, tp, pp, n)
            assert torch_equal(avg[n], ref_avg[n]), (path, tp, pp, n)


def torch_equal(a, b):
    import torch
    return torch.equal(a, b)


# --- launch/train.py under tpkit-launch: the user's road ----------------------------------
STEPS, SAVE_AT = 8, 4
TRAIN_SMALL = ["--steps", str(STEPS), "--hidden", "32", "--layers", "4", "--heads", "4",
               "--gqa-groups", "2", "--ffn", "64", "--seq-len", "16", "--global-batch", "8",
               "--warmup", "2", "--log-every", "100"]
INTERLEAVED = ["--pp-schedule", "Interleaved1F1B"]
# MoE (docs/moe.md): blocks 1 and 3 are MoE, so one sits in a non-last stage at pp=2;
# the load-balancing loss is per micro-batch, so the reference runs the same 2 micro-batches
# (gradient accumulation at pp=1; micro-batch i is the same global rows at every layout)
# (a large aux coefficient, so that a wrong aux gradient shows well above the tolerance)
MOE = ["--moe-experts", "4", "--moe-topk", "2", "--moe-every", "2", "--moe-aux-coeff",
       "0.5", "--microbatches", "2"]


def _train_reference(extra=()):
    from tpkit.train import trainer as train
    return train.main(TRAIN_SMALL + list(extra))


CKPT = os.path.join("{work}", "pp-ckpt")     # in the shared launch's directory
SAVED = os.path.join(CKPT, f"step{SAVE_AT:06d}")
_M4 = ["--microbatches", "4"]
# launched in tests/shared.py's trainer launch (4 ranks, with other modules' runs)
LAUNCHED = {name: TRAIN_SMALL + extra for name, extra in {
    "pp2tp2": ["--pp", "2", "--tp", "2", *_M4, "--save", CKPT, "--save-every",
               str(SAVE_AT)],
    "pp2cp2": ["--pp", "2", "--cp", "2", *_M4],
    "pp2dp2": ["--pp", "2", "--microbatches", "2"],
    "pp4": ["--pp", "4", *_M4],
    "pp2tp2-interleaved-sp-recompute": ["--pp", "2", "--tp", "2", *_M4, *INTERLEAVED,
                                        "--sequence-parallel", "--recompute"],
    "pp2cp2-interleaved-recompute": ["--pp", "2", "--cp", "2", *_M4, *INTERLEAVED,
                                     "--recompute"],
    "pp2dp2-interleaved": ["--pp", "2", "--microbatches", "2", *INTERLEAVED],
    "pp4-interleaved-8layers": ["--pp", "4", "--layers", "8", *_M4, *INTERLEAVED],
    "moe-pp2dp2-ep2": ["--pp", "2", "--ep", "2", *MOE],
    "moe-pp2tp2-ep2-sp-interleaved-recompute": [
        "--pp", "2", "--tp", "2", "--sequence-parallel", "--ep", "2", "--etp", "1",
        *MOE, *INTERLEAVED, "--recompute"],
    "resume-pp4": ["--pp", "4", *_M4, "--resume", SAVED],
    "resume-pp1": ["--tp", "2", "--resume", SAVED],
}.items()}
register_trainer_runs(LAUNCHED)


@pytest.mark.slow
def test_train_py_launched_parity(tmp_path_factory):
    """launch/train.py under tpkit-launch (tests/shared.py's trainer launch, 4 ranks), 8
    steps at (pp, tp, cp, dp) = (2,2,1,1), (2,1,2,1), (2,1,1,2), (4,1,1,1), with 1F1B and
    Interleaved1F1B (also at pp=4 with 8 layers), with --sequence-parallel and --recompute, and (2,1,1,1)
    in the 2-rank pool (the same train.main; the launched road is the 4-rank launch's):
    the loss curve of one process (pp=1) within 1e-5 relative. A checkpoint written at
    (pp=2, tp=2) after 4 steps resumes at pp=4 and at pp=1 (tp=2, dp=2) with the losses of
    the uninterrupted run. A mixture of experts (4 experts, ep=2) at pp=2 x dp=2 (1F1B) and
    pp=2 x tp=2 with SP (Interleaved1F1B, recompute): the curve of one process (pp=1, ep=1)
    with the same micro-batches, the aux loss of the first stage's MoE layer included."""
    reference = run(_train_reference, 1)[0]
    assert reference[-1] < reference[0] - 0.3, reference   # it learns
    # (the same 4 micro-batches as the pipeline: 8 layers drift apart by rounding otherwise)
    ref8 = run(_train_reference, 1, ["--layers", "8", "--microbatches", "4"])[0]
    ref_moe = run(_train_reference, 1, MOE)[0]
    # the aux loss makes the curve depend on the micro-batches: the check can tell
    whole = run(_train_reference, 1, MOE[:-2])[0]
    assert max(abs(a - b) / b for a, b in zip(whole, ref_moe)) > 100 * TOL, (whole, ref_moe)
    runs = trainer_runs(tmp_path_factory)
    got = {name: runs[name] for name in LAUNCHED}
    for name, extra in {"pp2": ["--pp", "2", *_M4],
                        "pp2-interleaved": ["--pp", "2", *_M4, *INTERLEAVED]}.items():
        ranks = run(_train_reference, 2, extra)
        assert ranks[1] == ranks[0], name   # every rank reports the same global loss
        got[name] = ranks[0]
    for name, losses in got.items():
        want = reference[SAVE_AT:] if name.startswith("resume") else \
            ref8 if "8layers" in name else ref_moe if name.startswith("moe") else reference
        assert len(losses) == len(want), name
        for i, (x, y) in enumerate(zip(losses, want)):
            assert abs(x - y) <= TOL * abs(y), f"{name} step {i}: {x} vs {y}"
