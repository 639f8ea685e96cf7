"""Planted-bug guards for checkpoints (issue 26): after loading, the run must go on as if
it had never stopped, optimizer included.

A model of tpkit.nn layers trains under Fabric + TPKitStrategy; the checkpoint written
after two Adam steps at one layout (DDP or FSDP2) is loaded at another layout (DDP <->
FSDP2, other tp/cp/dp) and two more steps are taken. The losses of *both* steps after the
load are compared with a single-process torch model trained four steps without stopping:
the second one follows an ``optimizer.step()`` on the loaded Adam moments and step
counter, so a dropped or half-written optimizer state shows. Every rank's losses are
compared, not rank 0's."""
import pytest
import torch
import torch.nn.functional as F

from dist import run

H, FFN, S, B, LR, STEPS = 8, 16, 8, 8, 0.05, 4


def _weights():
    g = torch.Generator().manual_seed(0)
    return {"0.weight": torch.randn(FFN, H, generator=g) / H ** 0.5,
            "0.bias": torch.randn(FFN, generator=g) * 0.1,
            "2.weight": torch.randn(H, FFN, generator=g) / FFN ** 0.5,
            "2.bias": torch.randn(H, generator=g) * 0.1}


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g))
            for _ in range(STEPS)]


def _reference():
    """Single process, plain torch layers, four uninterrupted Adam steps."""
    model = torch.nn.Sequential(torch.nn.Linear(H, FFN), torch.nn.GELU(approximate="tanh"),
                                torch.nn.Linear(FFN, H))
    model.load_state_dict(_weights())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _worker(layout, path, mode):
    import torch.distributed as dist
    from lightning.fabric import Fabric

    from tpkit.checkpoint import load_full_state_dict
    from tpkit.fabric import TPKitStrategy
    from tpkit.nn import ColumnParallelLinear, RowParallelLinear
    tp, cp, kind = layout
    strategy = TPKitStrategy(tp=tp, cp=cp, data_parallel=kind)
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    state = strategy.parallel_state
    model = torch.nn.Sequential(ColumnParallelLinear(H, FFN), torch.nn.GELU(approximate="tanh"),
                                RowParallelLinear(FFN, H))
    w = _weights()
    if mode == "load":
        w = {k: v * -0.5 for k, v in w.items()}  # not the saved weights
    load_full_state_dict(model, w)
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=LR))

    def step(x, y):
        x = x.chunk(state.dp_size, 1)[state.dp_rank].chunk(state.cp_size, 0)[state.cp_rank]
        y = y.chunk(state.dp_size, 1)[state.dp_rank].chunk(state.cp_size, 0)[state.cp_rank]
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        return fabric.all_reduce(loss.detach(), group=state.dp_cp_group).item()

    batches = _batches()
    if mode == "save":
        losses = [step(*b) for b in batches[:2]]
        fabric.save(path, {"model": model, "optimizer": opt, "step": 2})
    else:
        ckpt = {"model": model, "optimizer": opt, "step": 0}
        fabric.load(path, ckpt)
        assert ckpt["step"] == 2
        losses = [step(*b) for b in batches[2:]]
    strategy.teardown()
    return losses


@pytest.mark.parametrize("save,loads", [
    ((2, 1, "ddp"), [(1, 1, "fsdp"), (4, 1, "ddp")]),
    ((2, 1, "fsdp"), [(1, 2, "fsdp"), (2, 2, "ddp")]),
], ids=["ddp-tp2dp2", "fsdp-tp2dp2"])
def test_training_goes_on_after_load_at_another_layout(tmp_path, save, loads):
    ref = _reference()
    path = str(tmp_path / "ckpt")
    for losses in run(_worker, 4, save, path, "save"):
        assert losses == pytest.approx(ref[:2], rel=1e-5)
    for layout in loads:
        for rank, losses in enumerate(run(_worker, 4, layout, path, "load")):
            assert losses == pytest.approx(ref[2:], rel=1e-5), (layout, rank)
