"""Mixture of experts: bytes the token dispatch/combine moves per step against the count
the router's decisions give, and step time at ep=2 and ep=4 against ep=1 on the same ranks.

    python -m bench.moe

The reference GPT (tpkit/models/gpt.py) with every block's MLP a tpkit.nn.MoE (E experts, top-k)
on ``WORLD`` gloo ranks, dp=WORLD, one thread each; only ``ep`` changes (ep=1: every rank
holds every expert and nothing is dispatched; ep=p: each rank holds E/p experts, the
expert-data-parallel group is WORLD/p ranks). A step is forward + backward + the gradient
reduction (DDP over dp for the dense weights, tpkit.grads.reduce_expert_grads over edp for
the experts), the same work at every ep.

Bytes: ``torch.distributed.all_to_all_single`` is wrapped for one step and counts the
bytes each rank sends to *other* ranks (its own chunk stays in memory), summed over the
ranks; the per-expert count exchange (int64) is counted apart. The analytical count is
read off the routing itself: every kept (token, expert) pair whose expert lives on another
ep rank moves its hidden vector four times a step (dispatch and combine forward, and
their gradients backward): 4 * pairs * hidden * 4 bytes (fp32). Uniform routing would
give pairs = tokens * k * (ep-1)/ep.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from bench.common import (fmt, gloo_rank, median_step, spawn, table, token_batch,
                          write_section)

WORLD, BATCH, SEQ, HIDDEN, LAYERS, EXPERTS, TOPK = 4, 16, 128, 128, 2, 8, 2
WARMUP, ITERS = 2, 7


def _model(state):
    from tpkit.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4,
                         num_gqa_groups=2, ffn_hidden_size=2 * HIDDEN,
                         moe_experts=EXPERTS, moe_topk=TOPK), state)


class _Bytes:
    """Counts what all_to_all_single sends to other ranks (tokens and counts apart)."""

    def __init__(self):
        self.tokens = self.counts = 0
        self._orig = dist.all_to_all_single

    def __enter__(self):
        def counting(output, input, output_split_sizes=None, input_split_sizes=None,
                     group=None, async_op=False):
            size, me = dist.get_world_size(group), dist.get_rank(group)
            rows = input.shape[0]
            splits = input_split_sizes or [rows // size] * size
            row_bytes = input[:1].numel() * input.element_size()
            sent = sum(n for j, n in enumerate(splits) if j != me) * row_bytes
            if input.is_floating_point():
                self.tokens += sent
            else:
                self.counts += sent
            return self._orig(output, input, output_split_sizes, input_split_sizes,
                              group=group, async_op=async_op)
        dist.all_to_all_single = counting
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._orig


def _remote_pairs(model, state) -> int:
    """Kept (token, expert) pairs of this rank's last forward whose expert is on another ep
    rank: from the router's decisions (indices and keep mask), not from the dispatcher."""
    n = 0
    for moe in model.moe_layers():
        r = moe.last_routing
        owner = torch.div(r.indices, EXPERTS // state.ep_size, rounding_mode="floor")
        n += int((r.keep & (owner != state.ep_rank)).sum())
    return n


def _worker(rank, world, port, ep, out):
    gloo_rank(rank, world, port)
    import tpkit
    from tpkit.grads import reduce_expert_grads
    from tpkit.layout.param_tags import is_expert
    state = tpkit.init_parallel(ep=ep)
    x, y = token_batch(state, BATCH, SEQ)
    model = _model(state)
    DDP = torch.nn.parallel.DistributedDataParallel
    DDP._set_params_and_buffers_to_ignore_for_model(
        model, [n for n, p in model.named_parameters() if is_expert(p)])
    ddp = DDP(model, process_group=state.dp_cp_group)

    def step():
        model.zero_grad(set_to_none=True)
        ddp(x, y).backward()
        reduce_expert_grads(model, state)

    t = median_step(step, WARMUP, ITERS)
    with _Bytes() as b:
        step()
    want = 4 * _remote_pairs(model, state) * HIDDEN * 4
    sums = torch.tensor([b.tokens, b.counts, want], dtype=torch.float64)
    dist.all_reduce(sums)
    if rank == 0:
        out.put((t, *sums.tolist()))
    tpkit.destroy_parallel()
    dist.destroy_process_group()


def measure(ep: int):
    """(median step time s, token bytes, count bytes, analytical token bytes) at ``ep``."""
    return spawn(_worker, WORLD, ep)


def main() -> None:
    load0 = os.getloadavg()[0]
    res = {ep: measure(ep) for ep in (1, 2, 4)}
    load1 = os.getloadavg()[0]
    tokens = BATCH * SEQ
    rows = []
    for ep in (2, 4):
        t, sent, counts, want = res[ep]
        uniform = 4 * tokens * TOPK * (ep - 1) / ep * HIDDEN * 4 * LAYERS
        rows.append(dict(what=f"dispatch + combine bytes per step, ep={ep} (all ranks, fwd + "
                         f"bwd; uniform routing would move {fmt(uniform, 'MiB')}; count "
                         f"exchange {counts / 1024:.1f} KiB apart)", figure=fmt(sent, "MiB"),
                         peer_name="analytical, from the router's decisions: 4 x remote "
                         "(token, expert) pairs x hidden x 4 B", peer=fmt(want, "MiB"),
                         ratio=sent / want, target="1"))
    t1 = res[1][0]
    for ep in (2, 4):
        rows.append(dict(what=f"step time, ep={ep} x edp={WORLD // ep} ({WORLD} ranks)",
                         figure=fmt(res[ep][0], "ms"), peer_name=f"ep=1 x edp={WORLD}, "
                         "same model and batch", peer=fmt(t1, "ms"), ratio=res[ep][0] / t1,
                         target="~1 (same work)"))
    assert res[1][1] == 0, "ep=1 must not dispatch"
    body = (f"The reference GPT ({LAYERS} blocks, every MLP a tpkit.nn.MoE of {EXPERTS} "
            f"experts, top-{TOPK}, hidden {HIDDEN}, expert width {2 * HIDDEN}, seq {SEQ}, "
            f"global batch {BATCH}, float32) on {WORLD} gloo CPU ranks (dp={WORLD}), one "
            "thread each (`python -m bench.moe`). Step = forward + backward + gradient "
            f"reduction; medians of {ITERS}. 1-minute load average {load0:.1f} before, "
            f"{load1:.1f} after (on {os.cpu_count()} cores; {WORLD} ranks share them, so "
            "step times include waiting for a core). ep=1 moves no tokens (every rank "
            "holds every expert); ep>1 trades that for 1/ep of the expert weights per "
            "rank.\n\n" + table(rows))
    write_section("moe", "Mixture of experts (all-to-all dispatch on CPU)", body)
    print(table(rows))


if __name__ == "__main__":
    main()
