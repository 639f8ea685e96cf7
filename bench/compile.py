"""torch.compile on the torch backend: compiled vs eager training step, and the compile
time paid once.

    python -m bench.compile

2 gloo processes (1 thread each), tp=2 with sequence parallelism, tpkit/models/gpt.py's
GPT at the README's size (launch/train.py's defaults) and at a compute-bound size (the
sizes of bench.train). Per size, one process pair builds the model once, keeps an eager
copy and a copy whose blocks ``tpkit.compile_blocks`` compiled (inductor, a fresh cache
directory: the compile is cold), checks both give the same loss, and times the training
step (forward + backward + AdamW step) of the two interleaved in rounds, so both see the
same load. The compile time is the compiled copy's first step minus its median step.
"""
from __future__ import annotations

import copy
import os
import tempfile

import torch

from bench.common import (fmt, gloo_rank, interleaved_rounds, round_medians, spawn, table,
                          token_batch, write_section)
from bench.train import SIZES

ROUNDS, WARMUP = 7, 2


def _worker(rank, world, port, size, cache, out):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    gloo_rank(rank, world, port)
    import torch.distributed as dist

    import tpkit
    from tpkit.models.gpt import GPT, GPTConfig
    _, cfg, seq, batch, _ = size
    state = tpkit.init_parallel(tp=2, sequence_parallel=True)
    torch.manual_seed(0)
    eager = GPT(GPTConfig(vocab_size=256, **cfg), state)
    compiled = tpkit.compile_blocks(copy.deepcopy(eager))
    x, y = token_batch(state, batch, seq)
    steps, losses = {}, {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt, name=name):
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.setdefault(name, float(loss.detach()))   # the first step's
        steps[name] = step
    times = interleaved_rounds(steps, WARMUP, ROUNDS)
    first = times["compiled"][0]
    med, _ = round_medians(times, WARMUP)
    if rank == 0:
        out.put((med, first, losses))
    tpkit.destroy_parallel()
    dist.destroy_process_group()


def main() -> None:
    rows, notes = [], []
    for size in SIZES:
        name, cfg, seq, batch, _ = size
        with tempfile.TemporaryDirectory() as cache:
            med, first, losses = spawn(_worker, 2, size, cache)
        label = (f"{name} (h={cfg['hidden_size']}, ffn={cfg['ffn_hidden_size']}, "
                 f"L={cfg['num_layers']}, s={seq}, b={batch})")
        rows.append(dict(what=f"{label}: compiled step (inductor)",
                         figure=fmt(med["compiled"], "ms"), peer_name="eager step",
                         peer=fmt(med["eager"], "ms"),
                         ratio=med["compiled"] / med["eager"], target="<= 1.0x"))
        rows.append(dict(what=f"{label}: compile time, paid once (first compiled step minus "
                              "the median step, cold cache)",
                         figure=fmt(first - med["compiled"], "s"), peer_name="eager step",
                         peer=fmt(med["eager"], "ms"),
                         ratio=(first - med["compiled"]) / med["eager"],
                         target="steps to amortise"))
        notes.append(f"{name}: first-step loss eager {losses['eager']:.6f}, compiled "
                     f"{losses['compiled']:.6f}")
        print(rows[-2], rows[-1], flush=True)
    load = os.getloadavg()[0]
    body = ("tpkit/models/gpt.py's GPT at tp=2 with sequence parallelism, 2 gloo processes "
            "with 1 thread each, float32; training step = forward + backward + AdamW step; "
            f"eager and compiled copies of the same weights timed interleaved, medians of "
            f"{ROUNDS} rounds after {WARMUP} (`python -m bench.compile`). Compiled: "
            "`tpkit.compile_blocks(model)` (each block `torch.compile(fullgraph=True)`, "
            "inductor's C++ backend; stem, head and loss eager). "
            + "; ".join(notes) + f". 1-minute load average {load:.1f} at the end (2 cores, "
            "shared with other jobs). The GPU goal (the torch backend compiled >= 1.0x the TE "
            "backend in bf16) is measured by `python -m bench.gpu` (its compile rows) and "
            "`tests/test_gpu.py::test_compiled_block_matches_eager_on_gpu` (`-m gpu`) when a GPU "
            "is available.\n\n" + table(rows))
    write_section("compile", "torch.compile (compiled vs eager step, CPU)", body)


if __name__ == "__main__":
    main()
