"""Pipeline parallelism: step time at pp=2 and pp=4 against pp=1 of the same model doing the
same ranks' work, and the measured 1F1B bubble against the analytical (p-1)/(m+p-1).

    python -m bench.pipeline

The reference GPT (tpkit/models/gpt.py, 8 blocks) on ``world`` gloo ranks: pp=1 is dp=world (each
rank one world-th of the batch), pp=p is p stages x dp=world/p, same global batch, so every
layout does the same total work. The bubble: at pp=p with dp=1 (p ranks), 1F1B with m
micro-batches; ideal = (one process's step time of the whole model on the same batch) / p;
measured bubble = 1 - ideal / step time. CPU ranks share the machine's cores, so the
figures say how the schedule behaves here, not on GPUs.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from bench.common import (fmt, gloo_rank, median_step, spawn, table, token_batch,
                          write_section)
BATCH, SEQ, HIDDEN, LAYERS, M = 16, 64, 128, 8, 8
WARMUP, ITERS = 2, 5


def _model(state):
    from tpkit.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4,
                         num_gqa_groups=2, ffn_hidden_size=4 * HIDDEN), state)


def _worker(rank, world, port, pp, microbatches, out):
    gloo_rank(rank, world, port)
    import tpkit
    from tpkit.distributed.pipeline import build_pipeline
    state = tpkit.init_parallel(pp=pp)
    x, y = token_batch(state, BATCH, SEQ)
    model = _model(state)
    if pp > 1:
        pipe = build_pipeline(model, microbatches=microbatches, data_parallel="allreduce")
        step = lambda: pipe.step(x, target=y)   # noqa: E731
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
        step = lambda: ddp(x, y).backward()     # noqa: E731
    t = median_step(step, WARMUP, ITERS)
    if rank == 0:
        out.put(t)
    tpkit.destroy_parallel()
    dist.destroy_process_group()


def measure(world: int, pp: int, microbatches: int = M) -> float:
    """Median step time (s) of the layout, over ``world`` spawned gloo ranks."""
    return spawn(_worker, world, pp, microbatches)


def main() -> None:
    load0 = os.getloadavg()[0]
    t1 = measure(1, 1)                       # the whole model, one process
    rows = []
    for world in (2, 4):
        base = measure(world, 1)
        for pp in (2, 4):
            if pp > world:
                continue
            t = measure(world, pp)
            rows.append(dict(what=f"step time, pp={pp} x dp={world // pp} ({world} ranks, "
                             f"1F1B, {M} micro-batches)", figure=fmt(t, "ms"),
                             peer_name=f"pp=1 x dp={world}, same global batch",
                             peer=fmt(base, "ms"), ratio=t / base, target="~1 (same work)"))
    for pp in (2, 4):
        t = measure(pp, pp)
        bubble = 1 - (t1 / pp) / t
        analytic = (pp - 1) / (M + pp - 1)
        rows.append(dict(what=f"1F1B bubble, pp={pp}, m={M} (1 - (one-process step / pp) / "
                         f"step; {pp} ranks, dp=1)", figure=f"{bubble:.3f} (step "
                         f"{fmt(t, 'ms')}, one process {fmt(t1, 'ms')})",
                         peer_name="analytical (p-1)/(m+p-1)", peer=f"{analytic:.3f}",
                         ratio=bubble / analytic, target="~1"))
    load1 = os.getloadavg()[0]
    body = (f"The reference GPT ({LAYERS} blocks, hidden {HIDDEN}, seq {SEQ}, global batch "
            f"{BATCH}, float32) on gloo CPU ranks, one thread each (`python -m bench.pipeline`). "
            "Step = forward + backward of the global batch; medians of "
            f"{ITERS}. 1-minute load average {load0:.1f} before, {load1:.1f} after (on "
            f"{os.cpu_count()} cores): 4 ranks share the cores, so the 4-rank figures measure "
            "contention as much as the schedule.\n\n" + table(rows))
    write_section("pipeline", "Pipeline parallelism (1F1B on CPU)", body)
    print(table(rows))


if __name__ == "__main__":
    main()
