"""Sharded checkpoints: save at one layout, load at another, identical next step; atomicity.

Pool (tests/dist.py): the writers and readers are the same processes. A checkpoint read by
fresh processes after the writers were SIGKILLed is test_userpath's train.py cycle, and a
Fabric save read at another layout after teardown is its fabric_layouts.py."""
import os

import pytest
import torch

from dist import run
from fabric_helpers import launch_fabric

LR = 0.05


def _fabric_model(tp, cp, sp, kind, seed):
    from fabric_helpers import Block, full_model, shard_into

    fabric, state = launch_fabric(tp=tp, cp=cp, sequence_parallel=sp, data_parallel=kind)
    model = shard_into(Block(state, sp=sp), full_model(seed), state)
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=LR))
    return fabric, fabric.strategy, model, opt


def _step(fabric, strategy, model, opt, batch):
    import torch.nn.functional as F

    from fabric_helpers import local_batch
    state = strategy.parallel_state
    x, y = local_batch(*batch, state)
    loss = F.mse_loss(model(x), y)
    fabric.backward(loss)
    opt.step()
    opt.zero_grad()
    return fabric.all_reduce(loss.detach(), group=state.dp_cp_group).item()


def _save_then_step(layout, path):
    from fabric_helpers import data
    fabric, strategy, model, opt = _fabric_model(*layout, seed=0)
    batches = data(2)
    first = _step(fabric, strategy, model, opt, batches[0])
    fabric.save(path, {"model": model, "optimizer": opt, "step": 1})
    second = _step(fabric, strategy, model, opt, batches[1])
    strategy.teardown()
    return first, second


def _load_then_step(layout, path):
    from fabric_helpers import data
    fabric, strategy, model, opt = _fabric_model(*layout, seed=7)  # other weights
    state = {"model": model, "optimizer": opt, "step": 0}
    remainder = fabric.load(path, state)
    loss = _step(fabric, strategy, model, opt, data(2)[1])
    strategy.teardown()
    return state["step"], remainder, loss


LOADS = [((4, 1, False, "ddp"), 4), ((1, 1, False, "ddp"), 1), ((2, 1, True, "fsdp"), 4),
         ((1, 2, False, "ddp"), 4)]


@pytest.mark.parametrize("save_layout", [(2, 2, True, "ddp"), (2, 1, True, "fsdp")])
def test_save_at_one_layout_resume_at_another(tmp_path, save_layout):
    path = str(tmp_path / "ckpt")
    (first, second), *_ = run(_save_then_step, 4, save_layout, path)
    assert first != pytest.approx(second)
    assert os.path.isdir(path) and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    for layout, world in LOADS:
        for step, remainder, loss in run(_load_then_step, world, layout, path):
            assert step == 1 and remainder == {}
            assert loss == pytest.approx(second, rel=1e-5), layout


# --- without Fabric: atomicity, errors, TE-style attributes ----------------------------------
class _TELike(torch.nn.Module):
    """A TE-style module: weight tagged tensor_model_parallel/partition_dim, fp8 extra state."""

    def __init__(self, tp):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(8 // tp, 4))
        self.weight.tensor_model_parallel, self.weight.partition_dim = True, 0

    def get_extra_state(self):
        return {"amax_history": torch.ones(3)}

    def set_extra_state(self, state):
        self.extra_loaded = state


def _te_like(path, tp, mode):
    import tpkit
    from tpkit.checkpoint import _dcp
    from tpkit.checkpoint import load_full_state_dict
    state = tpkit.init_parallel(tp=tp)
    m = _TELike(tp)
    if mode == "save":
        rows = torch.arange(8.0).repeat_interleave(4).view(8, 4)
        m.weight.data.copy_(rows.chunk(tp, 0)[state.tp_rank])
        _dcp.save(path, {"model": m})
        return None
    _dcp.load(path, {"model": m})
    again = _TELike(tp)   # a full state dict shards by TE's tags too
    load_full_state_dict(again, {"weight": torch.arange(8.0).repeat_interleave(4).view(8, 4)})
    assert torch.equal(again.weight, m.weight)
    return m.weight.detach().clone()


def test_te_partition_dim_reshards_and_extra_state_is_dropped(tmp_path):
    import torch.distributed.checkpoint as dcp
    path = str(tmp_path / "te")
    run(_te_like, 2, path, 2, "save")
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert "model.weight" in keys and not any("_extra_state" in k for k in keys)
    full = torch.arange(8.0).repeat_interleave(4).view(8, 4)
    out = run(_te_like, 4, path, 4, "load")
    torch.testing.assert_close(torch.cat(out, 0), full)


def _crash(path):
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    import tpkit
    from tpkit.checkpoint import _dcp
    tpkit.init_parallel(tp=2)
    m = torch.nn.Linear(4, 4)
    with torch.no_grad():
        m.weight.fill_(1.0)
    _dcp.save(path, {"model": m})
    with torch.no_grad():
        m.weight.fill_(2.0)
    real = FileSystemWriter.write_data

    def boom(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError("disk full (injected)")
        return real(self, plan, planner)

    FileSystemWriter.write_data = boom
    try:
        _dcp.save(path, {"model": m})
        raised = None
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raised = type(e).__name__ + str(e)
    finally:
        FileSystemWriter.write_data = real
    dist.barrier()
    _dcp.load(path, {"model": m})
    return raised, m.weight.detach().clone()


def test_crash_during_save_keeps_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    outs = run(_crash, 2, path)
    for raised, weight in outs:
        assert raised is not None and "disk full" in raised
        torch.testing.assert_close(weight, torch.ones(4, 4))  # the previous checkpoint
    assert os.listdir(tmp_path) == ["ckpt"]  # no partial directory left behind


class _Extra(torch.nn.Linear):
    def __init__(self):
        super().__init__(4, 4)
        self.extra = torch.nn.Parameter(torch.zeros(2))


def _mismatch(path, mode):
    import tpkit
    from tpkit.checkpoint import _dcp
    tpkit.init_parallel(tp=2)
    if mode == "save":
        _dcp.save(path, {"model": torch.nn.Linear(4, 4)})
        return None
    with pytest.raises(ValueError, match=r"'model.weight'.*\(4, 4\).*\(6, 4\)"):
        _dcp.load(path, {"model": torch.nn.Linear(4, 6)})
    with pytest.raises(KeyError, match="'other' that does not exist"):   # Fabric's type
        _dcp.load(path, {"model": torch.nn.Linear(4, 4), "other": torch.nn.Linear(2, 2)})
    with pytest.raises(ValueError, match=r"missing from checkpoint.*'model.extra'"):   # also
        _dcp.load(path, {"model": _Extra()})
    _dcp.load(path, {"model": _Extra()}, strict=False)
    return True


def test_unreshardable_shape_is_a_clear_error(tmp_path):
    path = str(tmp_path / "ckpt")
    run(_mismatch, 2, path, "save")
    assert run(_mismatch, 2, path, "load") == [True, True]


# --- tpkit.nn layers: vocab-parallel embedding, fused q/k/v, CP attention -------------------
def _gpt(layout, path, mode):
    from fabric_gpt import batches, build
    tp, cp, sp = layout
    fabric, state = launch_fabric(tp=tp, cp=cp, sequence_parallel=sp)
    model = build(state)
    if mode == "load":
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)  # not the saved weights
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))

    def step(batch):
        tokens, targets = batch
        n = tokens.shape[0] // state.dp_size
        loss = model(tokens[state.dp_rank * n:(state.dp_rank + 1) * n],
                     targets[state.dp_rank * n:(state.dp_rank + 1) * n])
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        return fabric.all_reduce(loss.detach(), group=state.dp_cp_group).item()

    b = batches(2)
    if mode == "save":
        step(b[0])
        fabric.save(path, {"model": model, "optimizer": opt})
    else:
        fabric.load(path, {"model": model, "optimizer": opt})
    out = step(b[1])
    fabric.strategy.teardown()
    return out


def test_tpkit_nn_model_reshards_across_layouts(tmp_path):
    path = str(tmp_path / "gpt")
    expected = run(_gpt, 4, (2, 2, True), path, "save")[0]
    for layout, world in (((4, 1, False), 4), ((1, 2, False), 4), ((1, 1, False), 1)):
        for loss in run(_gpt, world, layout, path, "load"):
            assert loss == pytest.approx(expected, rel=1e-5), layout


def _count_writes(path):
    import torch.nn.functional as F
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.planner import WriteItemType

    import tpkit
    from fabric_helpers import Block
    from tpkit.checkpoint import _dcp
    state = tpkit.init_parallel(tp=2, cp=2, sequence_parallel=True)
    model = Block(state, sp=True)
    opt = torch.optim.Adam(model.parameters())
    F.mse_loss(model(torch.randn(8, 2, 8)), torch.zeros(8, 2, 8)).backward()
    opt.step()
    written, real = [], FileSystemWriter.write_data

    def spy(self, plan, planner):
        written.extend(i.index.fqn for i in plan.items if i.type != WriteItemType.BYTE_IO)
        return real(self, plan, planner)

    FileSystemWriter.write_data = spy
    try:
        _dcp.save(path, {"model": model, "optimizer": opt})
    finally:
        FileSystemWriter.write_data = real
    return written


def test_each_chunk_is_written_by_one_replica(tmp_path):
    per_rank = run(_count_writes, 4, str(tmp_path / "ckpt"))
    # 14 tensor chunks per copy of the model (norm w/b, fc1 w/b: 2 segments x 2 TP chunks,
    # fc2.w: 2 chunks, fc2.b, head), the same for exp_avg and exp_avg_sq, plus 7 step
    # counters (7 params): 49 in all. The two CP replicas would write 98 without dedup.
    flat = [fqn for ranks in per_rank for fqn in ranks]
    assert len(flat) == 49 and len(set(flat)) == 34  # 9 keys x (param, 2 moments) + 7 steps
    assert sum(1 for f in flat if f == "model.fc1.weight.seg0") == 2  # one per TP shard
