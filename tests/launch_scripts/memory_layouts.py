"""Worker script for tests/memory/test_memory.py: tpkit.memory's estimate against the live
tensor bytes measured on every rank (tests/memcount.py's LiveBytes, which counts
storages and knows nothing of the estimator), at many layouts in one launch.

    tpkit-launch --nproc-per-node 4 memory_layouts.py [NAME ...]

For each layout of LAYOUTS (or those named): init_parallel at that layout, a small GPT
(tpkit.models.gpt) trained two steps with AdamW the way launch/train.py does it (DDP or
FSDP2 over dp x cp, tpkit.distributed.pipeline schedules, recompute, emulated fp8, experts, packed
documents), all inside the counting mode; the peak of live bytes during the second step
is compared with ``tpkit.memory.estimate_memory`` for that rank; destroy_parallel.
Rank 0 prints one line per layout: ``MEM name estimate measured ratio`` (the ratio of
the worst rank), then ``DONE``. ``MEMDEBUG=1`` also prints every rank's pair, rank 0's
live storages by op after a backward and its estimate's terms (for calibrating the
estimator against a new layer).
"""
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))

import tpkit  # noqa: E402
from memcount import LiveBytes  # noqa: E402
from tpkit.layout.config import ParallelConfig  # noqa: E402
from tpkit.memory import MemoryJob, ModelShape, estimate_memory  # noqa: E402

from tpkit.models.gpt import GPT, GPTConfig  # noqa: E402   # the reference GPT

H, HEADS, GROUPS, FFN, LAYERS, V, SEQ, BATCH = 64, 4, 2, 256, 4, 256, 128, 8

# name -> (layout, job options)
LAYOUTS = {
    "tp2-dp2": (dict(tp=2), {}),
    "tp2-sp-dp2": (dict(tp=2, sequence_parallel=True), {}),
    "cp2-p2p-dp2": (dict(cp=2, cp_comm_type="p2p"), {}),
    "tp2-cp2-all_gather": (dict(tp=2, cp=2, cp_comm_type="all_gather"), {}),
    "cp2-a2a-dp2": (dict(cp=2, cp_comm_type="a2a"), {}),
    "cp4-a2a+p2p": (dict(cp=4, cp_comm_type="a2a+p2p", cp_a2a_size=2), {}),
    "pp2-1F1B-dp2": (dict(pp=2), dict(pp_schedule="1F1B", microbatches=4)),
    "pp2-interleaved-tp2": (dict(pp=2, tp=2), dict(pp_schedule="Interleaved1F1B",
                                                   microbatches=4)),
    "pp2-zb-dp2": (dict(pp=2), dict(pp_schedule="InterleavedZeroBubble", microbatches=4)),
    "pp2-gpipe-dp2": (dict(pp=2), dict(pp_schedule="GPipe", microbatches=4)),
    "dp4-fsdp": (dict(), dict(data_parallel="fsdp")),
    "cp2-dp2-fsdp": (dict(cp=2), dict(data_parallel="fsdp")),
    "tp2-dp2-recompute": (dict(tp=2), dict(recompute=True)),
    "dp4-recompute": (dict(), dict(recompute=True)),
    "tp2-dp2-fp8": (dict(tp=2), dict(precision="fp8")),
    "tp2-dp2-bf16": (dict(tp=2), dict(precision="bf16-mixed")),
    "ep2-dp4-moe": (dict(ep=2), dict(experts=4)),
    "cp2-dp2-packed": (dict(cp=2), dict(packed=True)),
}


def job_of(opts: dict) -> MemoryJob:
    experts = opts.pop("experts", 0)
    model = ModelShape(layers=LAYERS, hidden=H, ffn=FFN, heads=HEADS, kv_heads=GROUPS, vocab=V,
                       experts=experts, topk=2, capacity_factor=1.0 if experts else None)
    return MemoryJob(model=model, seq_len=SEQ, **opts)


def run_layout(name: str):
    layout, opts = LAYOUTS[name]
    opts = dict(opts)
    state = tpkit.init_parallel(**layout)
    dp = state.dp_size
    job = job_of(opts)
    m = job.microbatches
    packed = job.packed
    job = MemoryJob(**{**job.__dict__, "micro_batch": 1 if packed else BATCH // dp // m,
                       "seq_len": 4 * SEQ // 2 if packed else SEQ})
    cfg = GPTConfig(vocab_size=V, hidden_size=H, num_layers=LAYERS, num_heads=HEADS,
                    num_gqa_groups=GROUPS, ffn_hidden_size=FFN, recompute=job.recompute,
                    moe_experts=job.model.experts, moe_topk=2,
                    moe_capacity_factor=job.model.capacity_factor)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (BATCH, SEQ), generator=g)
    y = torch.randint(0, V, (BATCH, SEQ), generator=g)
    rows = slice(state.dp_rank * (BATCH // dp), (state.dp_rank + 1) * (BATCH // dp))
    x, y = x[rows], y[rows]
    counter = LiveBytes()
    if os.environ.get("MEMDEBUG"):
        counter.names = {}
    with counter:
        model = GPT(cfg, state)
        pipe = None
        if state.pp_size > 1:
            from tpkit.distributed.pipeline import build_pipeline
            pipe = build_pipeline(model, microbatches=m, schedule=job.pp_schedule,
                                  data_parallel="allreduce", state=state,
                                  device=torch.device("cpu"))
            model = pipe.module
        elif job.data_parallel == "fsdp":
            from torch.distributed.fsdp import fully_shard
            fully_shard(model, mesh=state.dp_cp_mesh)
        elif state.dp_cp_size > 1:
            from tpkit.layout.param_tags import is_expert
            experts = [n for n, p in model.named_parameters() if is_expert(p)]
            torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, experts)
            model = torch.nn.parallel.DistributedDataParallel(
                model, process_group=state.dp_cp_group)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        dbg = os.environ.get("MEMDEBUG") and dist.get_rank() == 0
        if dbg:
            print("setup", counter.now, flush=True)
        fp8 = None
        if job.precision == "fp8":
            from tpkit import fp8 as fp8mod
            fp8 = fp8mod
        for step in range(2):   # the second step: the optimizer states exist
            if step == 1:
                counter.reset_peak()
            ctx = fp8.fp8_autocast(enabled=True, recipe="delayed",
                                   fp8_group=state.dp_cp_group) if fp8 else \
                torch.autocast("cpu", dtype=torch.bfloat16) \
                if job.precision == "bf16-mixed" else _null()
            with ctx:
                if pipe is not None:
                    pipe.step(x, target=y)
                elif packed:
                    from tpkit.data import pack_sequences
                    docs = [torch.randint(0, V, (SEQ // 2,), generator=g) for _ in range(4)]
                    row = pack_sequences(docs, state=state).shard(state)
                    loss = model(row.tokens, row.labels, row.position_ids,
                                 **row.attention_kwargs())
                    loss.backward()
                else:
                    model(x, y).backward()
            if dbg and step == 1:
                import collections
                agg = collections.Counter()
                for k, n in counter.live.items():
                    agg[counter.names.get(k, ("?", ()))] += n
                for k, n in agg.most_common(25):
                    print("   ", n, k)
            if dbg:
                print("step", step, "after bwd now", counter.now, "peak", counter.peak, flush=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dbg:
                print("after opt now", counter.now, "peak", counter.peak, flush=True)
        measured = counter.peak
    del model, opt, pipe
    est = estimate_memory(job, ParallelConfig(**layout).validate(state.world_size),
                          rank=state.rank)
    if os.environ.get("MEMDEBUG") and dist.get_rank() == 0:
        print(est, flush=True)
    out = torch.tensor([float(est.peak), float(measured)], dtype=torch.float64)
    gathered = [torch.zeros_like(out) for _ in range(state.world_size)]
    dist.all_gather(gathered, out)
    tpkit.destroy_parallel()
    if dist.get_rank() == 0:
        worst = max(gathered, key=lambda t: abs(t[0] / t[1] - 1))
        if os.environ.get("MEMDEBUG"):
            print("per rank (estimate, measured):", [(int(t[0]), int(t[1])) for t in gathered])
        print(f"MEM {name} {int(worst[0])} {int(worst[1])} {worst[0] / worst[1]:.3f} "
              f"[{est.phase}]", flush=True)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main():
    # tpkit.comm.shm's CPU transports map shared-memory segments (megabytes per group) that a
    # device does not have: the estimate is of device memory, so they are off here
    os.environ["TPKIT_SHM_ALLREDUCE"] = os.environ["TPKIT_SHM_P2P"] = "0"
    names = sys.argv[1:] or list(LAYOUTS)
    dist.init_process_group("gloo")
    for name in names:
        run_layout(name)
    if dist.get_rank() == 0:
        print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
