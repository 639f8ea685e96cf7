"""Layouts that fit a device: ``step_cost`` (a step's time, roughly, to rank them) and
``suggest_layouts`` (tp/cp/pp/dp, recompute and FSDP at one world size, cheapest first)."""
from __future__ import annotations

import dataclasses

from ..layout.config import ParallelConfig
from .job import MemoryJob
from .estimate import _dtype_bytes, _estimate


# --- layouts that fit -----------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# step_cost's machine: dense bf16 throughput and link speeds of a typical 8-GPU node
FLOPS, NVLINK, NETWORK = 400e12, 200e9, 25e9


def step_cost(job: MemoryJob, c: ParallelConfig, nproc_per_node: int = 8) -> float:
    """The ranking of ``suggest_layouts``: an idealised step time in seconds on
    ``FLOPS``/``NVLINK``/``NETWORK`` (400 TFLOP/s per device, 200 GB/s inside a node,
    25 GB/s per device across nodes): the model FLOPs (6 per parameter and token, plus
    attention: ``ModelShape.flops_per_token``, the count MFU uses) / (tp*cp*pp) stretched by the pipeline bubble (pp-1)/(m*v) and by 4/3 with
    recompute, plus the bytes of the tp all-reduces (or SP's gathers), the cp K/V
    exchange, the dp gradient all-reduce (fsdp: gathers as well) and the pp sends, each
    over the link it uses. Only the order means something."""
    mo = job.model
    a = _dtype_bytes(job.precision)
    m = job.microbatches
    tokens = job.micro_batch * m * job.seq_len
    flops = tokens * mo.flops_per_token(job.seq_len, causal=True)   # MFU's count, causal
    v = (job.virtual_stages or 2) if c.pp > 1 and job.pp_schedule.lower() != "1f1b" else 1
    t = flops / (c.tp * c.cp * c.pp) / FLOPS * (1 + (c.pp - 1) / (m * v))
    if job.recompute:
        t *= 4 / 3
    act = tokens / c.cp * mo.hidden * a * mo.layers / c.pp       # one [s, b, h] per layer
    if c.tp > 1:
        t += 4 * 2 * act * (c.tp - 1) / c.tp / NVLINK
    if c.cp > 1:
        link = NVLINK if c.tp * c.cp <= nproc_per_node else NETWORK
        kv = act * 2 * mo.groups / mo.heads
        t += 2 * kv * (c.cp - 1) / link
    per_layer = 2 * mo.hidden * mo.hidden + 2 * mo.hidden * mo.groups * mo.head_dim \
        + (3 if mo.gated else 2) * mo.hidden * mo.ffn
    params = (mo.layers * per_layer + 2 * mo.vocab * mo.hidden) / (c.tp * c.pp) * 4
    dp = c.dp * c.cp
    if dp > 1:
        link = NVLINK if c.tp * c.cp * c.dp <= nproc_per_node else NETWORK
        t += 2 * params * (dp - 1) / dp * (1.5 if job.data_parallel == "fsdp" else 1) / link
    if c.pp > 1:
        t += 2 * m * v * tokens / m / c.cp * mo.hidden * a / c.tp / NETWORK
    return t


def suggest_layouts(job: MemoryJob, world_size: int, device_bytes: float, *,
                    global_batch: int, margin: float = 0.1, limit: int = 5,
                    base: ParallelConfig | None = None, nproc_per_node: int | None = None
                    ) -> list[tuple[float, ParallelConfig, MemoryJob, int]]:
    """Layouts of ``world_size`` ranks (tp within a node, sequence parallelism with tp,
    cp, pp, dp; recompute and fsdp on or off) whose heaviest rank fits ``device_bytes``
    less ``margin``, cheapest ``step_cost`` first: (cost, config, job, peak bytes)."""
    budget = device_bytes * (1 - margin)
    mo = job.model
    node = nproc_per_node or 8
    out = []
    comm = base.cp_comm_type if base is not None and base.cp_comm_type != "a2a+p2p" else "p2p"
    for tp in _divisors(world_size):
        if tp > node or mo.heads % tp or mo.groups % tp or mo.ffn % tp or mo.vocab % tp:
            continue
        for cp in _divisors(world_size // tp):
            if job.seq_len % (2 * cp) or cp > 64:
                continue
            for pp in _divisors(world_size // (tp * cp)):
                if mo.layers % pp or (pp > 1 and job.packed):
                    continue
                dp = world_size // (tp * cp * pp)
                if global_batch % dp:
                    continue
                ep = base.ep if base is not None and base.ep > 1 and \
                    (tp * cp * dp) % base.ep == 0 and mo.experts % base.ep == 0 else 1
                try:
                    c = ParallelConfig(tp=tp, cp=cp, pp=pp, dp=dp, sequence_parallel=tp > 1,
                                       cp_comm_type=comm, ep=ep).validate(world_size)
                except ValueError:
                    continue
                for recompute in (False, True):
                    for fsdp in (("ddp", "fsdp") if pp == 1 else ("ddp",)):
                        m = max(job.microbatches, 2 * pp) if pp > 1 else job.microbatches
                        if global_batch // dp < m:
                            continue
                        j = dataclasses.replace(job, recompute=recompute, data_parallel=fsdp,
                                                microbatches=m,
                                                pp_schedule="1F1B" if pp > 1 else job.pp_schedule,
                                                micro_batch=max(1, global_batch // dp // m))
                        peak = max(_estimate(j, c, r, ranks="").peak
                                   for r in sorted({0, pp - 1, min(1, pp - 1)}))
                        if peak <= budget:
                            out.append((step_cost(j, c, node), c, j, peak))
    out.sort(key=lambda x: (x[0], x[1].cp, x[1].pp, x[1].tp))
    return out[:limit]
