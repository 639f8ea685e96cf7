"""TPKitStrategy through Lightning Fabric on gloo ranks vs a single-process reference.

Pool (tests/dist.py): Lightning finds the harness's default group and skips creating one;
Fabric creating it (tpkit-launch or its own launcher) is test_fabric_conformance, and several
Fabric layouts over it in one process are test_userpath's fabric_layouts.py."""
import pytest
import torch

from dist import run
from fabric_helpers import launch_fabric, reference_losses

STEPS = 3
LR = 0.05


def _train(tp, cp, sp, dp_kind, steps, clip=None, precision=None):
    import torch.nn.functional as F

    import tpkit.fabric  # noqa: F401  (registers "tpkit")
    from fabric_helpers import Block, data, full_model, local_batch, shard_into

    fabric, state = launch_fabric(tp=tp, cp=cp, sequence_parallel=sp, data_parallel=dp_kind,
                                  precision=precision)
    model = shard_into(Block(state, sp=sp), full_model(), state)
    if dp_kind == "fsdp":  # FSDP2 replaces the parameters: optimizer after sharding
        model = fabric.setup_module(model)
        opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=LR))
    else:
        model, opt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=LR))
    losses, norms = [], []
    for x, y in data(steps):
        x, y = local_batch(x, y, state)
        loss = F.mse_loss(model(x), y)  # mean over this rank's tokens (the convention)
        fabric.backward(loss)
        if clip is not None:
            norms.append(fabric.clip_gradients(model, opt, max_norm=clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), group=state.dp_cp_group).item())
    out = {"losses": losses, "norms": norms, "sampler": fabric.strategy.distributed_sampler_kwargs}
    fabric.strategy.teardown()
    return out


LAYOUTS = [  # (tp, cp, dp, sp, data_parallel)
    (2, 1, 2, True, "ddp"),
    (2, 2, 1, True, "ddp"),
    (1, 2, 2, False, "ddp"),
    (4, 1, 1, False, "ddp"),
    (2, 1, 2, True, "fsdp"),
]


@pytest.mark.parametrize("tp,cp,dp,sp,kind", LAYOUTS)
def test_losses_match_single_process(tp, cp, dp, sp, kind):
    ref, ref_norms = reference_losses(STEPS, lr=LR, clip=0.5)
    outs = run(_train, tp * cp * dp, tp, cp, sp, kind, STEPS, clip=0.5)
    for r, out in enumerate(outs):
        torch.testing.assert_close(out["losses"], ref, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(out["norms"], ref_norms, rtol=1e-5, atol=1e-7)
        tp_rank, dp_rank = r % tp, r // (tp * cp)
        assert out["sampler"] == {"num_replicas": dp, "rank": dp_rank}, (r, tp_rank)
    assert ref[-1] < ref[0]  # it trains (so matching losses is not trivially true)


# --- the same through tpkit.nn layers with CP attention -----------------------------------
def _train_gpt(tp, cp, sp, kind, steps):
    from fabric_gpt import batches, build

    fabric, state = launch_fabric(tp=tp, cp=cp, sequence_parallel=sp, data_parallel=kind)
    model = fabric.setup_module(build(state))
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=LR))
    losses, norms = [], []
    for tokens, targets in batches(steps):
        rows = slice(state.dp_rank * tokens.shape[0] // state.dp_size,
                     (state.dp_rank + 1) * tokens.shape[0] // state.dp_size)
        loss = model(tokens[rows], targets[rows])
        fabric.backward(loss)
        norms.append(fabric.clip_gradients(model, opt, max_norm=1.0).item())
        opt.step()
        opt.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), group=state.dp_cp_group).item())
    fabric.strategy.teardown()
    return losses, norms


GPT_LAYOUTS = [(2, 1, 2, True, "ddp"), (2, 2, 1, True, "ddp"), (1, 2, 2, False, "ddp"),
               (4, 1, 1, False, "ddp"), (1, 2, 2, False, "fsdp")]


@pytest.fixture(scope="module")
def gpt_reference():
    return run(_train_gpt, 1, 1, 1, False, "ddp", STEPS)[0]


@pytest.mark.parametrize("tp,cp,dp,sp,kind", GPT_LAYOUTS)
def test_tpkit_nn_gpt_matches_single_process(tp, cp, dp, sp, kind, gpt_reference):
    ref_losses, ref_norms = gpt_reference
    assert ref_losses[-1] < ref_losses[0]
    for losses, norms in run(_train_gpt, tp * cp * dp, tp, cp, sp, kind, STEPS):
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=1e-6)


def _train_without_sp_sync(steps):
    import tpkit.grads as grads
    real = grads.sync_sequence_parallel_grads
    grads.sync_sequence_parallel_grads = lambda params, state: 0
    try:
        return _train(2, 1, True, "ddp", steps)["losses"]
    finally:
        grads.sync_sequence_parallel_grads = real


def test_sequence_parallel_sync_is_what_makes_it_match():
    ref, _ = reference_losses(STEPS, lr=LR)
    for losses in run(_train_without_sp_sync, 4, STEPS):     # every rank
        assert losses[0] == pytest.approx(ref[0], rel=1e-5)     # forward is unaffected
        assert losses[-1] != pytest.approx(ref[-1], rel=1e-3)   # the updates are not


def _fsdp_optimizer_first():
    from fabric_helpers import Block
    fabric, state = launch_fabric(tp=2, data_parallel="fsdp")
    model = Block(state)
    with pytest.raises(ValueError, match="optimizer must be created after the module is sharded"):
        fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.strategy.teardown()
    return True


def test_fsdp_optimizer_created_too_early_is_a_clear_error():
    assert run(_fsdp_optimizer_first, 4) == [True] * 4


def _clip_and_meta_init():
    from commcount import count_collectives
    from fabric_gpt import TinyGPT, batches
    fabric, state = launch_fabric(tp=2, sequence_parallel=True)
    with fabric.init_module(empty_init=True):   # meta device: no memory, no init
        plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    was_meta = all(p.is_meta for p in plain.parameters())
    fabric.setup_module(plain)                  # materialised by reset_parameters()
    materialized = all(not p.is_meta and torch.isfinite(p).all() for p in plain.parameters())
    model = TinyGPT(state)  # tpkit.nn layers place parameters on state.device themselves
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    tokens, targets = batches(1)[0]
    with count_collectives() as sp_sum:
        fabric.strategy.finalize_gradients()   # nothing pending before any backward
    fabric.backward(model(tokens[:2], targets[:2]))   # ends with the SP sum over TP
    with count_collectives() as calls:
        fabric.clip_gradients(model, opt, max_norm=1.0)
        fabric.clip_gradients(model, opt, max_norm=1.0)  # SP sum already done: not again
    fabric.strategy.teardown()
    return was_meta, materialized, len(sp_sum), [(c.op, c.group_size) for c in calls]


def test_meta_init_and_one_norm_collective_per_clip():
    for was_meta, materialized, sp_sum, calls in run(_clip_and_meta_init, 4):
        assert was_meta and materialized and sp_sum == 0
        assert calls == [("all_reduce", 2)] * 2   # one norm all-reduce over TP per clip


def _accumulate(steps):
    import torch.nn.functional as F

    from fabric_helpers import Block, data, full_model, local_batch, shard_into
    fabric, state = launch_fabric(tp=2, sequence_parallel=True)
    model = shard_into(Block(state, sp=True), full_model(), state)
    model, opt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=LR))
    losses = []
    for x, y in data(steps):
        x, y = local_batch(x, y, state)
        total = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(2, 1), y.chunk(2, 1))):  # 2 micro-batches
            with fabric.no_backward_sync(model, enabled=i == 0):
                loss = F.mse_loss(model(xm), ym) / 2
                fabric.backward(loss)
            total += loss.detach()
        fabric.clip_gradients(model, opt, max_norm=0.5)
        opt.step()
        opt.zero_grad()
        losses.append(fabric.all_reduce(total, group=state.dp_cp_group).item())
    fabric.strategy.teardown()
    return losses


def test_gradient_accumulation_with_no_backward_sync():
    ref, _ = reference_losses(STEPS, lr=LR, clip=0.5)
    for losses in run(_accumulate, 4, STEPS):
        torch.testing.assert_close(losses, ref, rtol=1e-5, atol=1e-7)
