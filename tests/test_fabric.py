"""TPKitStrategy through Lightning Fabric on gloo ranks vs a single-process reference."""
import pytest
import torch

from dist import run
from fabric_helpers import reference_losses

STEPS = 3
LR = 0.05


def _train(tp, cp, sp, dp_kind, steps, clip=None, precision=None):
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    import tpkit.fabric  # noqa: F401  (registers "tpkit")
    from fabric_helpers import Block, data, full_model, local_batch, shard_into
    from tpkit.fabric import TPKitStrategy

    strategy = TPKitStrategy(tp=tp, cp=cp, sequence_parallel=sp, data_parallel=dp_kind)
    world = torch.distributed.get_world_size()
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision=precision)
    fabric.launch()
    state = strategy.parallel_state
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
    out = {"losses": losses, "norms": norms, "sampler": strategy.distributed_sampler_kwargs}
    strategy.teardown()
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
