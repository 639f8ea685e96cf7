"""tpkit.pipeline: losses and gradients of a pipelined GPT (every schedule that runs on
CPU/gloo, composed with TP, SP, CP and DP) against the same GPT in one process, and the
ValueErrors of bad layouts. The launched road (train.py --pp under tpkit-launch) is
tests/test_train.py / tests/launch_scripts/pipeline_train.py."""
import os
import sys

import pytest

from dist import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))
BATCH, SEQ = 8, 16
TOL = 1e-5


def _cfg(layers, recompute=False):
    from gpt import GPTConfig
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
    from gpt import GPT
    from tpkit.checkpoint import load_full_state_dict
    tpkit.init_parallel(tp=1, cp=1, pp=1)
    model = GPT(_cfg(layers, recompute))
    load_full_state_dict(model, _full_weights(model))
    x, y = _batch()
    loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _pipelined(layers, *, tp=1, cp=1, pp=2, schedule="1F1B", microbatches=4,
               virtual_stages=None, sp=False, recompute=False, steps=1):
    """The pipelined run on this rank: (global loss, {name: full grad} of this stage's
    parameters, reported by the rank with tp = dp = cp = 0 only)."""
    import torch
    import torch.distributed as dist
    import tpkit
    from gpt import GPT
    from tpkit.checkpoint import gather_param, load_full_state_dict
    from tpkit.grads import sync_sequence_parallel_grads
    from tpkit.param_tags import tp_spec
    from tpkit.pipeline import build_pipeline
    state = tpkit.init_parallel(tp=tp, cp=cp, pp=pp, sequence_parallel=sp)
    model = GPT(_cfg(layers, recompute))
    load_full_state_dict(model, _full_weights(model))
    wrap = None
    if state.dp_cp_size > 1:
        def wrap(m):
            return torch.nn.parallel.DistributedDataParallel(m, process_group=state.dp_cp_group)
    pipe = build_pipeline(model, microbatches=microbatches, schedule=schedule,
                          virtual_stages=virtual_stages, wrap=wrap)
    x, y = _batch()
    rows = slice(state.dp_rank * BATCH // state.dp_size, (state.dp_rank + 1) * BATCH // state.dp_size)
    for _ in range(steps):
        loss = pipe.step(x[rows], target=y[rows])
    loss = loss.clone()
    dist.all_reduce(loss, group=state.dp_cp_group)
    sync_sequence_parallel_grads(pipe.module, state)
    grads = {}
    for n, p in pipe.module.named_parameters():
        spec = tp_spec(p)
        g = p.grad if spec is None else gather_param(p.grad, spec[0], spec[1], state.tp_group)
        grads[n] = g.clone()
    report = state.tp_rank == 0 and state.dp_cp_rank == 0
    return loss.item() / state.dp_cp_size, (grads if report else {})


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


@pytest.mark.parametrize("schedule,v", [("1F1B", None), ("GPipe", None),
                                        ("Interleaved1F1B", 2)])
def test_schedules_pp2(ref4, schedule, v):
    _check(ref4, run(_pipelined, 2, 4, schedule=schedule, virtual_stages=v))
