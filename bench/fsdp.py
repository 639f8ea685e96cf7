"""FSDP2 per block vs FSDP2 as one unit vs DDP: step time and memory, 4 gloo ranks.

    python -m bench.fsdp

4 spawned gloo processes (1 thread each), dp=4, tpkit/models/gpt.py's GPT (float32,
AdamW). One process set builds three copies of the same weights: DDP over the data ranks,
``tpkit.distributed.fsdp.shard_model(units="model")`` (the whole model one fully_shard unit: what
``data_parallel="fsdp"`` did before issue 54) and ``shard_model(units="blocks")`` (a unit
per block, the default), and times their training steps (forward + backward + AdamW step)
interleaved in rounds, so all three see the same load. Memory, counted from the storages
of each rank's tensors (a CPU has no allocator statistics): the peak of the parameters
live during a forward (hooks on every module, one untimed forward).
"""
from __future__ import annotations

import os

import torch

from bench.common import (fmt, gloo_rank, interleaved_rounds, machine, round_medians, spawn,
                          table, token_batch, write_section)

CFG = dict(vocab_size=256, hidden_size=256, num_layers=8, num_heads=8, num_gqa_groups=4,
           ffn_hidden_size=1024)
SEQ, BATCH = 128, 8
ROUNDS, WARMUP = 15, 3


def _storages(tensors) -> int:
    from torch.distributed.tensor import DTensor
    seen = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _worker(rank, world, port, out):
    gloo_rank(rank, world, port)
    import copy

    import torch.distributed as dist

    import tpkit
    from tpkit.distributed.fsdp import shard_model
    from tpkit.models.gpt import GPT, GPTConfig
    state = tpkit.init_parallel(seed=1234)
    torch.manual_seed(0)
    base = GPT(GPTConfig(**CFG), state)
    models = {"ddp": torch.nn.parallel.DistributedDataParallel(
                  copy.deepcopy(base), process_group=state.dp_cp_group),
              "fsdp one unit": shard_model(copy.deepcopy(base), state, units="model"),
              "fsdp per block": shard_model(copy.deepcopy(base), state, units="blocks")}
    x, y = token_batch(state, BATCH, SEQ)
    peaks, steps, losses = {}, {}, {}
    for name, model in models.items():
        raw = model.module if name == "ddp" else model
        peak = peaks.setdefault(name, [0])

        def record(*_, raw=raw, peak=peak):
            peak[0] = max(peak[0], _storages(raw.parameters()))
        hooks = [h for m in raw.modules() for h in (m.register_forward_pre_hook(record),
                                                    m.register_forward_hook(record))]
        with torch.no_grad():   # one forward measured, outside the timed steps
            model(x, y)
        for h in hooks:
            h.remove()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt, name=name):
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            losses.setdefault(name, float(loss.detach()))   # the first step's
        steps[name] = (step, raw, opt)
    times = interleaved_rounds({k: v[0] for k, v in steps.items()}, WARMUP, ROUNDS)
    med, ratio = round_medians(times, WARMUP, peer="ddp")
    if rank == 0:
        out.put((med, ratio, {k: v[0] for k, v in peaks.items()}, losses))
    tpkit.destroy_parallel()
    dist.destroy_process_group()


def main() -> None:
    med, ratio, peaks, losses = spawn(_worker, 4)
    rows = []
    for name in ("fsdp per block", "fsdp one unit"):
        rows.append(dict(what=f"{name}: step time", figure=fmt(med[name], "ms"),
                         peer_name="DDP", peer=fmt(med["ddp"], "ms"),
                         ratio=ratio[name]))
    for name in ("fsdp per block", "fsdp one unit"):
        rows.append(dict(what=f"{name}: peak parameter bytes live in forward, per rank",
                         figure=fmt(peaks[name], "MiB"), peer_name="DDP",
                         peer=fmt(peaks["ddp"], "MiB"), ratio=peaks[name] / peaks["ddp"],
                         target="per block: one block + 1/4 of the rest" if "block" in name
                         else ""))
    load = os.getloadavg()[0]
    body = (f"tpkit/models/gpt.py's GPT (h={CFG['hidden_size']}, L={CFG['num_layers']}, "
            f"ffn={CFG['ffn_hidden_size']}, s={SEQ}, global batch {BATCH}), float32, dp=4 on 4 "
            f"gloo processes with 1 thread each on {machine()}; step = forward + backward + "
            f"AdamW step; the three copies timed interleaved (bench.common.interleaved_rounds, "
            f"shared with bench.compile), {ROUNDS} rounds after {WARMUP} warmup rounds; a "
            "step-time ratio is the median over rounds of the copy's time / DDP's time in the "
            "same round (`python -m bench.fsdp`). Memory from the storages of each rank's "
            "tensors (no allocator statistics on CPU). First-step losses: "
            + ", ".join(f"{k} {v:.6f}" for k, v in losses.items())
            + f". 1-minute load average {load:.1f} at the end (2 cores, shared with other "
            "jobs). On CPU the all-gathers do not overlap compute: the step-time ratios are "
            "FSDP's communication cost on gloo, not its GPU speed.\n\n" + table(rows))
    write_section("fsdp", "FSDP2 per block vs one unit vs DDP (CPU, 4 ranks)", body)
    print(body, flush=True)


if __name__ == "__main__":
    main()
