"""What logging costs: tpkit.observe's MetricsLogger on vs off in the same training loop.

    python -m bench.observe

The README's size (launch/train.py's defaults: the reference GPT with hidden 128, 2 layers,
8 heads, 4 KV groups, ffn 512, seq 128, global batch 8, AdamW) at tp=2 x cp=2 on 4 gloo
ranks, one thread each. A block is 20 steps (two logging windows of 10, train.py's
--log-every); "on" times the phases (data, fwd+bwd, optimizer), calls ``log.step`` every
step (one all-gather and, on rank 0, a TensorBoard + CSV row and the progress line per
window), "off" runs the same loop bare. Blocks alternate on/off, ROUNDS each; figures are
medians. The logger's own time (inside ``phase`` bookkeeping and ``step``, on the rank
where it is largest) is measured too: it is the steadier figure on a shared machine, where
the wall-time ratio also holds the machine's drift between blocks.
"""
from __future__ import annotations

import io
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from bench.common import gloo_rank, spawn, write_section

WORLD, TP, CP = 4, 2, 2
SIZE = dict(hidden=128, layers=2, heads=8, gqa=4, ffn=512, seq=128, batch=8)
STEPS, EVERY, ROUNDS = 20, 10, 5


def _worker(rank, world, port, logdir, q):
    gloo_rank(rank, world, port)
    import tpkit
    from tpkit.models.gpt import GPT, GPTConfig
    from tpkit.comm.collectives import all_reduce_sum
    from tpkit.observe import MetricsLogger, model_flops_per_token
    state = tpkit.init_parallel(tp=TP, cp=CP, seed=1)
    s = SIZE
    cfg = GPTConfig(vocab_size=256, hidden_size=s["hidden"], num_layers=s["layers"],
                    num_heads=s["heads"], num_gqa_groups=s["gqa"], ffn_hidden_size=s["ffn"])
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = state.dp_size * state.cp_size
    g = torch.Generator().manual_seed(0)
    nothing = _Null()

    def block(log) -> tuple[float, float]:
        own = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(STEPS):
            with log.phase("data"):
                x = torch.randint(0, 256, (s["batch"], s["seq"] + 1), generator=g)
            with log.phase("fwd_bwd"):
                loss = model(x[:, :-1], x[:, 1:])
                loss.backward()
            with log.phase("optimizer"):
                for p in model.parameters():
                    p.grad = all_reduce_sum(p.grad, state.dp_cp_group) / n
                opt.step()
                opt.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            log.step(step, loss=loss.detach(), lr=1e-3)
            own += time.perf_counter() - t1
        dist.barrier()
        return time.perf_counter() - t0, own

    log = MetricsLogger(logdir, tokens_per_step=s["batch"] * s["seq"],
                        flops_per_token=model_flops_per_token(cfg, s["seq"]),
                        total_steps=STEPS * ROUNDS, every=EVERY, stream=io.StringIO())
    block(nothing)                                     # warm-up, both paths
    block(log)
    on, off, own = [], [], []
    for _ in range(ROUNDS):
        w, o = block(log)
        on.append(w)
        own.append(o)
        off.append(block(nothing)[0])
    log.close()
    own_max = torch.tensor([statistics.median(own)], dtype=torch.float64)
    dist.all_reduce(own_max, op=dist.ReduceOp.MAX)
    if rank == 0:
        q.put({"on": statistics.median(on), "off": statistics.median(off),
               "own": float(own_max)})
    tpkit.destroy_parallel()


class _Null:
    """The "off" loop: the same calls, doing nothing."""

    class _Phase:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    def phase(self, name):
        return self._Phase()

    def step(self, step, **kw):
        return None


def main() -> dict:
    with tempfile.TemporaryDirectory() as d:
        r = spawn(_worker, WORLD, d)
    load = os.getloadavg()[0]
    per = lambda t: t / STEPS * 1e3   # noqa: E731 (ms per step)
    rows = [
        ("step time, MetricsLogger on (every 10 steps) vs off, wall",
         f"{per(r['on']):.2f} ms", f"off: {per(r['off']):.2f} ms", r["on"] / r["off"], "<= 1.02"),
        ("the logger's own time per step (slowest rank) vs the step",
         f"{per(r['own']):.3f} ms", f"step off: {per(r['off']):.2f} ms", r["own"] / r["off"],
         "<= 0.02"),
    ]
    body = (f"The README's size (launch/train.py's defaults: hidden 128, 2 layers, seq 128, "
            f"global batch 8) at tp=2 x cp=2 on 4 gloo ranks, one thread each; blocks of "
            f"{STEPS} steps alternating logging on and off, {ROUNDS} rounds, medians "
            f"(`python -m bench.observe`). On: the phases timed, `MetricsLogger.step` every "
            f"step, one all-gather and a TensorBoard + CSV row with the progress line every "
            f"{EVERY} steps. The logger's own time is what its calls took on the rank where "
            f"they took longest; the wall ratio also holds the machine's drift between "
            f"blocks. 1-minute load average {load:.1f} after (on {os.cpu_count()} cores).\n\n"
            "| what | figure | peer / limit (same run) | ratio | target |\n"
            "| --- | --- | --- | --- | --- |\n" +
            "\n".join(f"| {w} | {f} | {p} | {x:.3f} | {t} |" for w, f, p, x, t in rows))
    write_section("observe", "Logging cost (tpkit.observe)", body)
    print(body)
    return r


if __name__ == "__main__":
    main()
