"""The trainer's step (issue 50 item 2): gradient accumulation issues the data-parallel
gradient reduction once per step, not once per micro-batch (DDP's bucket all-reduces
counted through a comm hook, every other collective by tests/commcount.py), and gives the
losses of the same global batch without accumulation; the fused AdamW
(``--optimizer-impl fused``, torch's ``fused=True``) trains to the same losses as the
multi-tensor one; a Llama from scratch trains to the one-process losses at pp=2, pp=2 x
tp=2, tp=2 x cp=2 with SP and FSDP2 with recompute. Pool (tests/dist.py), a Llama
(``--arch llama``)."""
import pytest

from dist import run

ARGS = ["--arch", "llama", "--steps", "3", "--hidden", "32", "--layers", "2", "--heads", "4",
        "--gqa-groups", "2", "--ffn", "64", "--seq-len", "16", "--global-batch", "8",
        "--warmup", "1", "--log-every", "100"]
REL = 1e-5


def _train(extra):
    """(losses, DDP bucket reductions per step, other collectives per step by op)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from commcount import count_collectives
    from tpkit.train import Trainer, parse
    job, _ = parse(ARGS + list(extra))
    trainer = Trainer(job)
    (ddp,) = [m for m in trainer.model.modules() if isinstance(m, DDP)]
    buckets = []

    def hook(group, bucket):
        buckets.append(bucket.index())
        fut = torch.distributed.all_reduce(bucket.buffer().div_(group.size()), group=group,
                                           async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    ddp.register_comm_hook(ddp.process_group, hook)
    with count_collectives() as calls:
        losses = trainer.fit()
    steps = job.training.steps
    ops = {}
    for c in calls:
        ops[c.op] = ops.get(c.op, 0) + 1
    group = trainer.optimizer.param_groups[0]
    assert (bool(group["fused"]), bool(group["foreach"])) == \
        ((True, False) if job.optimizer.impl == "fused" else (False, True)), group
    return losses, len(buckets) / steps, {k: v / steps for k, v in ops.items()}


@pytest.fixture(scope="module")
def one_microbatch():
    return run(_train, 2, ["--optimizer-impl", "foreach"])[0]


def test_accumulation_reduces_gradients_once_per_step(one_microbatch):
    """4 micro-batches: the same bucket reductions and collectives per step as 1 (with a
    reduction per micro-batch there would be 4x the buckets; seen failing so with
    ``no_backward_sync`` disabled in Trainer.step_loss), and the same losses."""
    losses1, buckets1, ops1 = one_microbatch
    losses4, buckets4, ops4 = run(_train, 2, ["--microbatches", "4",
                                              "--optimizer-impl", "foreach"])[0]
    assert buckets1 >= 1 and buckets4 == buckets1
    # the hook's own all-reduce is counted too: the same count per step
    assert ops4 == ops1, (ops1, ops4)
    for a, b in zip(losses4, losses1):
        assert a == pytest.approx(b, rel=REL)


def test_fused_adamw_trains_as_the_multi_tensor_one(one_microbatch):
    losses, _, _ = run(_train, 2, ["--optimizer-impl", "fused"])[0]
    for a, b in zip(losses, one_microbatch[0]):
        assert a == pytest.approx(b, rel=REL)
    assert losses[-1] < losses[0]


def _losses(extra):
    from tpkit.train import Trainer, parse
    job, _ = parse(ARGS + ["--seq-len", "32"] + list(extra))
    return Trainer(job).fit()


@pytest.fixture(scope="module")
def llama_ref():
    return run(_losses, 1, ["--optimizer-impl", "foreach"])[0]


@pytest.mark.parametrize("nproc,layout", [
    (4, ["--tp", "2", "--cp", "2", "--sequence-parallel"]),
    (4, ["--pp", "2", "--tp", "2", "--microbatches", "4", "--optimizer-impl", "fused"]),
    (2, ["--data-parallel", "fsdp", "--recompute"])], ids=["tp2-cp2-sp", "pp2-tp2",
                                                           "fsdp2-recompute"])
@pytest.mark.slow
def test_llama_trains_the_same_at_every_layout(llama_ref, nproc, layout):
    """A Llama from scratch (the layout-independent init) gives the one-process losses at
    the reference GPT's layouts, pipeline stages included (Llama's pp protocol)."""
    for losses in run(_losses, nproc, layout):
        assert losses == pytest.approx(llama_ref, rel=REL), (layout, losses, llama_ref)
