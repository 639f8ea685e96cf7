"""The training loop's stall on a checkpoint save: ``tpkit.checkpoint.async_save`` vs the
synchronous ``tpkit.checkpoint.save``, measured in one run.

``python -m bench.recovery`` spawns 2 gloo processes (1 thread each) at tp=2, builds
tpkit/models/gpt.py's GPT (weights and AdamW state: the checkpoint) and, in interleaved rounds:
- times plain training steps (no save in flight);
- times a step followed by a synchronous save (the loop is blocked for the whole write);
- times a step followed by an ``async_save`` call (the loop is blocked while the tensors
  are copied to CPU and DCP plans the save; the write runs in a background thread), then
  the steps that follow while the write is in flight (on a 2-core machine the writer
  thread competes with training for the CPU), then ``wait()``.
The stall of a save is (step + save call) - the median plain step; per rank, the slower
rank's figure (the other waits for it in the next collective).
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = dict(hidden_size=512, num_layers=4, num_heads=8, num_gqa_groups=4,
             ffn_hidden_size=2048)
SEQ, BATCH, ROUNDS, AFTER = 64, 2, 4, 3


def _measure(save_dir: str, rounds: int) -> dict:
    import torch.distributed as dist
    import tpkit
    from tpkit.train import corpus
    from tpkit.models.gpt import GPT, GPTConfig
    from tpkit.checkpoint import async_save, save

    model = GPT(GPTConfig(vocab_size=corpus.VOCAB_SIZE, **SIZES))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = corpus.tokens()
    group = dist.new_group(backend="gloo")     # async_save's own (the write's collectives)
    buffers: dict = {}                         # its CPU copies, reused save to save
    n = [0]

    def step():
        n[0] += 1
        x, y = corpus.batch(data, n[0], BATCH, SEQ)
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out

    state = {"model": model, "optimizer": opt}
    for _ in range(2):
        step()
    save(os.path.join(save_dir, "warm"), state)   # first-save costs out of the rounds
    plain, sync, stall_async, after_async, wait_async, after_plain = [], [], [], [], [], []
    call_async = []
    for r in range(rounds):
        plain += [timed(step)[0] for _ in range(AFTER)]
        after_plain.append(sum(plain[-AFTER:]))
        sync.append(timed(lambda: (step(), save(os.path.join(save_dir, f"s{r}"), state)))[0])
        calls = []

        def step_and_async_save():
            step()
            t0 = time.perf_counter()
            pending = async_save(os.path.join(save_dir, f"a{r}"), state, process_group=group,
                                 buffers=buffers)
            calls.append(time.perf_counter() - t0)
            return pending
        t, pending = timed(step_and_async_save)
        stall_async.append(t)
        call_async += calls
        after_async.append(sum(timed(step)[0] for _ in range(AFTER)))
        wait_async.append(timed(pending.wait)[0])
        dist.barrier()
    dist.destroy_process_group(group)
    med = {k: statistics.median(v) for k, v in dict(
        plain=plain, sync=sync, stall_async=stall_async, after_async=after_async,
        wait_async=wait_async, after_plain=after_plain, call_async=call_async).items()}
    t = torch.tensor(list(med.values()), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)               # the slower rank's
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in
               os.walk(os.path.join(save_dir, "s0")) for f in fs)
    return dict(zip(med, t.tolist()), bytes=size,
                params=sum(p.numel() for p in model.parameters()) * tpkit.get_parallel_state()
                .tp_size)


def measure(rounds: int = ROUNDS) -> dict:
    from bench.common import run_tp2
    save_dir = tempfile.mkdtemp(prefix="tpkit-bench-recovery-")
    try:
        return run_tp2(_measure, save_dir, rounds)
    finally:
        shutil.rmtree(save_dir, ignore_errors=True)


def main(rounds: int = ROUNDS) -> dict:
    from bench.common import fmt, table, write_section
    load0 = os.getloadavg()[0]
    r = measure(rounds)
    load1 = os.getloadavg()[0]
    stall_sync, stall_async = r["sync"] - r["plain"], r["stall_async"] - r["plain"]
    rows = [
        dict(what="training-loop stall of one save (step + save call - plain step): "
                  "async_save", figure=fmt(stall_async, "s"),
             peer_name="synchronous save", peer=fmt(stall_sync, "s"),
             ratio=stall_async / stall_sync, target="< 1"),
        dict(what="of which the async_save call itself (copy to CPU, DCP's start)",
             figure=fmt(r["call_async"], "s"), peer_name="synchronous save",
             peer=fmt(stall_sync, "s"), ratio=r["call_async"] / stall_sync,
             target="informative"),
        dict(what=f"the {AFTER} steps after an async_save (its write in flight)",
             figure=fmt(r["after_async"], "s"), peer_name=f"{AFTER} steps with no save",
             peer=fmt(r["after_plain"], "s"), ratio=r["after_async"] / r["after_plain"],
             target="informative"),
        dict(what=f"wait() for the async write after those {AFTER} steps",
             figure=fmt(r["wait_async"], "s"), peer_name="synchronous save",
             peer=fmt(stall_sync, "s"), ratio=r["wait_async"] / stall_sync,
             target="informative"),
    ]
    body = (f"tpkit/models/gpt.py's GPT ({SIZES['hidden_size']} hidden, {SIZES['num_layers']} "
            f"layers, ffn {SIZES['ffn_hidden_size']}: {r['params'] / 1e6:.1f} M parameters) "
            f"with AdamW state at tp=2 on gloo, 2 processes with 1 thread each; a checkpoint "
            f"is {fmt(r['bytes'], 'MiB')} on local disk. Medians over {rounds} interleaved "
            f"rounds; each figure is the slower rank's. The stall is what the training loop "
            f"waits at the save: the whole write for `save`, the copy to CPU and DCP's "
            f"planning for `async_save` (whose write then runs in a background thread, "
            f"competing with training for the 2 cores). Plain step: "
            f"{fmt(r['plain'], 'ms')}. 1-minute load average {load0:.1f} before, "
            f"{load1:.1f} after.\n\n" + table(rows))
    write_section("recovery", "Checkpoint save stall (async_save vs save)", body)
    print(table(rows))
    return r


if __name__ == "__main__":
    main()
