"""One rank's memory, term by term (``estimate_memory``), and one estimate per role of a layout
(``role_ranks``, ``estimate_roles``): the model's pieces per rank and the pipeline schedules'
in-flight micro-batches."""
from __future__ import annotations

import math

from ..layout.config import ParallelConfig
from .job import AUTOCAST, MemoryEstimate, MemoryJob, _ACT


# --- the model's pieces, per rank ------------------------------------------------------
# an input-gradient step (I) of the zero-bubble schedules keeps the stage's activations
# and the gradients of the linears' outputs until its weight-gradient step (W)
_SPLIT_BACKWARD_HOLD = 1.75


def _torch_order(schedule: str, pp: int, v: int, m: int, r: int):
    """torch.distributed.pipelining's own action list of pp rank ``r`` for the multi-stage
    schedules (its _calculate_single_rank_operations, on an object given only the sizes
    it reads), or None where that is not possible."""
    try:
        from torch.distributed.pipelining import schedules
        cls = getattr(schedules, "Schedule" + schedule)
        o = cls.__new__(cls)
        o.pp_group_size, o.n_local_stages, o._n_microbatches = pp, v, m
        o.number_of_rounds = max(1, m // pp)
        o.microbatches_per_round = m // o.number_of_rounds
        o.num_stages, o.rank, o.pipeline_order = pp * v, r, {}
        return [str(a) for a in o._calculate_single_rank_operations(r) if a is not None]
    except Exception:   # another torch: the closed forms below
        return None


def _in_flight(schedule: str, pp: int, v: int, m: int, r: int) -> float:
    """Stage-micro-batches whose activations pp rank ``r`` holds at once under
    ``schedule``: torch.distributed.pipelining's own order for the multi-stage schedules
    (forwards not yet released by a full or weight backward; one whose input gradient is
    done holds _SPLIT_BACKWARD_HOLD), the closed forms of 1F1B (pp - r) and GPipe (m)."""
    import re
    if pp == 1:
        return 1
    name = schedule.lower()
    if name in ("gpipe", "loopedbfs"):
        return m * v
    if name == "1f1b":
        return min(m, pp - r)
    ops = _torch_order(schedule, pp, v, m, r)
    if ops is not None:
        live, split, peak = 0, 0, 0.0
        for op in ops:
            kind = re.fullmatch(r"\d+([A-Z_]+)\d+", op)
            kind = kind.group(1) if kind else ""
            if kind == "F":
                live += 1
            elif kind == "I":
                split += 1
            elif kind == "W":
                live, split = live - 1, split - 1
            elif kind in ("B", "BW"):
                live -= 1
            peak = max(peak, live + split * (_SPLIT_BACKWARD_HOLD - 1))
        return peak
    rounds = max(1, m // pp)
    per_round = m // rounds
    if name == "interleaved1f1b":
        return min((v - 1) * per_round + 2 * (pp - 1 - r) + 1, m * v)
    return min(2 * (pp - r) + 1, 2 * m)


def _dtype_bytes(precision: str) -> int:
    return _ACT[precision][1]


class _Rank:
    """The shapes one rank computes with (micro-batch tokens, local heads, ...)."""

    def __init__(self, job: MemoryJob, c: ParallelConfig):
        mo = job.model
        self.job, self.c, self.m = job, c, mo
        self.tp, self.cp = c.tp, c.cp
        self.sp = c.sequence_parallel
        self.r, self.a = _ACT[job.precision]          # residual / compute bytes per element
        self.s = job.seq_len // c.cp                  # local sequence
        self.b = job.micro_batch
        self.t = self.b * self.s                      # tokens of one micro-batch here
        self.t_sp = self.t // c.tp if self.sp else self.t
        self.hl = mo.heads // c.tp
        self.gl = max(1, mo.groups // c.tp)
        self.d = mo.head_dim
        self.f = mo.ffn // c.tp

    # parameters (elements) -------------------------------------------------------------
    def dense_block_params(self) -> int:
        mo, tp = self.m, self.tp
        h, d = mo.hidden, mo.head_dim
        norm = h * (2 if mo.norm == "LayerNorm" else 1)
        qkv_out = (mo.heads + 2 * mo.groups) * d // tp
        qkv_bias = mo.bias if mo.qkv_bias is None else mo.qkv_bias
        n = 2 * norm + h * qkv_out + (qkv_out if qkv_bias else 0)
        n += mo.heads * d // tp * h + (h if mo.bias else 0)
        return n + self.mlp_params()

    def mlp_params(self) -> int:
        mo = self.m
        w1 = mo.ffn * (2 if mo.gated else 1) // self.tp
        return mo.hidden * w1 + self.f * mo.hidden + ((w1 + mo.hidden) if mo.bias else 0)

    def expert_params(self) -> int:
        mo, c = self.m, self.c
        local = mo.experts // c.ep
        f = mo.ffn // c.expert_tp
        return local * mo.hidden * f * (3 if mo.gated else 2)

    def block_params(self, i: int) -> tuple[int, int]:
        """(dense, expert) parameter elements of block ``i`` on this rank."""
        if not self.m.is_moe(i):
            return self.dense_block_params(), 0
        mo = self.m
        dense = self.dense_block_params() - self.mlp_params() + mo.experts * mo.hidden
        return dense, self.expert_params()

    # activations (bytes) of one block and one micro-batch --------------------------------
    def block_acts(self, i: int) -> dict:
        j, mo = self.job, self.m
        a, r, t, tsp, h, d = self.a, self.r, self.t, self.t_sp, mo.hidden, self.d
        hl, gl, f = self.hl, self.gl, self.f
        fp8 = j.precision == "fp8"
        # norms: input, x*rstd and rstd (residual stream), and what the next linear keeps
        # of the output: the output itself, under SP the all-gathered [s, b, h], under
        # autocast its low-precision copy, with fp8 its 1-byte copy
        norm = 2 * tsp * h * r + tsp * 4 + t * h * (1 if fp8 else a)
        if j.device == "cuda" and mo.norm == "RMSNorm":
            norm -= tsp * h * r                        # the fused kernel: input and rstd
        norm_total = 2 * norm - tsp * h * r           # the block's input counted once
        qkv, rope, attn = self.attention_parts()
        resid = tsp * h * r                           # x + attention (the MLP's input)
        acts = {"norms": norm_total + resid, "qkv": qkv, "rope": rope, "attention": attn}
        if mo.is_moe(i):
            acts["moe"] = self.moe_bytes()
        else:
            w1 = (2 if mo.gated else 1) * f
            keep = t * w1 * a + t * f * a * (2 if mo.gated else 1)
            if fp8:
                keep += t * f                          # fc2's fp8 input copy
                keep -= t * f * a                      # ... instead of the activation's output
            acts["mlp"] = keep
        if j.dropout > 0:
            acts["dropout masks"] = 2 * tsp * h        # bool masks of both hidden dropouts
        return acts

    def attention_parts(self) -> tuple[int, int, int]:
        """(QKV's output, RoPE's outputs, the core's) kept per kernel path, as each path's
        code keeps them: the plain path keeps QKV's output (V is a view of it), RoPE'd
        q and k, the core's out and log-sum-exp (the projection's input is a view of
        out); the ring (p2p) adds the projection's input copy; all_gather keeps RoPE'd q,
        the gathered K and V, out and the copy, but not QKV's output nor RoPE'd k; the
        a2a kinds keep only the exchanged q/k/v, out and the copy."""
        j, c = self.job, self.c
        a, t, d, hl, gl = self.a, self.t, self.d, self.hl, self.gl
        q, kv = t * hl * d * a, t * gl * d * a
        lse = self.b * hl * self.s * 4
        trig = 4 * self.s * d * a * (self.b if j.packed else 1)   # RoPE's cos/sin
        qkv, rope = q + 2 * kv, q + kv + trig
        if j.packed:
            return qkv, rope, q + lse + q + 2 * kv      # the packed kernel's [1, h, t, d] copies
        if j.attention_dropout > 0:      # reference kernel: the probabilities and the mask
            return qkv, rope, q + lse + q + self.b * hl * self.s * (self.s * c.cp) * (a + 1)
        if c.cp == 1:
            if j.device == "cuda" and a == 4 and gl < hl:
                # fp32 + GQA: neither flash (half types) nor efficient attention (no GQA)
                # runs it, SDPA's math kernel keeps the probabilities and K/V repeated
                return qkv, rope, q + lse + self.b * hl * self.s * self.s * a + 2 * q
            return qkv, rope, q + lse
        comm = c.cp_comm_type
        if comm == "p2p":
            return qkv, rope, 2 * q + lse
        if comm == "all_gather":
            return 0, q + trig, 2 * q + 2 * kv * c.cp + lse
        return 0, trig, 3 * q + 2 * kv + lse     # a2a, a2a+p2p

    def moe_bytes(self) -> int:
        """Router (logits, probabilities), dispatched tokens at the capacity factor (or
        dropless: top-k of every token), the experts' fc1/activation outputs, the combine."""
        mo, c, a, t = self.m, self.c, self.a, self.t
        E, k, h = mo.experts, mo.topk, mo.hidden
        tokens = t // c.tp if (c.tp > 1 and not c.sequence_parallel) else self.t_sp
        routed = tokens * k
        if mo.capacity_factor is not None:
            routed = min(routed, math.ceil(k * tokens * mo.capacity_factor / E) * E)
        recv = routed * c.expert_tp                   # etp gathers its ranks' tokens
        f = mo.ffn // c.expert_tp
        w1 = (2 if mo.gated else 1) * f
        router = self.t_sp * E * 4 * 3
        experts = recv * h * a + recv * w1 * a + recv * f * a * (2 if mo.gated else 1)
        combine = self.t_sp * k * h * a * 2
        return router + experts + combine

    def head_bytes(self) -> tuple[int, int]:
        """(kept, transient) of final norm + output layer + loss on the last stage."""
        mo, a, r, t, tsp, h = self.m, self.a, self.r, self.t, self.t_sp, self.m.hidden
        v = mo.vocab // self.tp
        kept = 2 * tsp * h * r + tsp * 4 + t * h * a   # final norm (as a block's norm)
        kept += t * v * 4 + t * (8 + 2) + 2 * t * 8   # softmax, target ids and masks
        transient = 2 * t * v * 4 + (t * v * a if a != 4 else 0)
        return kept, transient

    def stem_bytes(self) -> tuple[int, int]:
        mo, a, t = self.m, self.a, self.t
        kept = 2 * t * 8                               # token ids (+ their shard copy)
        transient = t * mo.hidden * a if self.sp else 0   # before the reduce-scatter
        return kept, transient


def _stage_blocks(plan_style: str, pp: int, v: int, layers: int, r: int) -> list[tuple[int, range]]:
    stages = [r, 2 * pp - 1 - r] if plan_style == "v" else [r + k * pp for k in range(v)]
    per = layers // (pp * v)
    return [(st, range(st * per, (st + 1) * per)) for st in stages]


def _style(schedule: str) -> tuple[str, int]:
    from ..distributed.pipeline import SCHEDULES
    names = {k.lower(): k for k in SCHEDULES}
    key = names.get(schedule.lower())
    if key is None:
        raise ValueError(f"pp_schedule={schedule!r} is unknown; use one of {list(SCHEDULES)}")
    return key, SCHEDULES[key][1]


def estimate_memory(job: MemoryJob, config: ParallelConfig, *, rank: int = 0,
                    world_size: int | None = None) -> MemoryEstimate:
    """Bytes rank ``rank`` holds at the peak of a training step of ``job`` on the layout
    ``config`` (validated against ``world_size`` if dp is unresolved). Every rank of one
    pipeline stage holds the same (experts are spread evenly), so only the rank's pp
    coordinate matters: ``rank // (tp * cp * dp)`` (tpkit's rank order, pp outermost)."""
    if config.dp is None:
        if world_size is None:
            raise ValueError("estimate_memory needs world_size when config.dp is unresolved")
        config = config.validate(world_size)
    per_stage = config.tp * config.cp * config.dp
    return _estimate(job, config, rank // per_stage, ranks=str(rank))


def _estimate(job: MemoryJob, c: ParallelConfig, r: int, *, ranks: str,
              role: str | None = None) -> MemoryEstimate:
    mo = job.model
    R = _Rank(job, c)
    pp = c.pp
    schedule, style = _style(job.pp_schedule) if pp > 1 else ("1F1B", "single")
    v = 1 if style == "single" else (2 if style == "v" else (job.virtual_stages or 2))
    if mo.layers % (pp * v):
        raise ValueError(f"{mo.layers} layers do not split into pp x virtual stages = "
                         f"{pp} x {v}; use a multiple of {pp * v} layers or change pp")
    mine = _stage_blocks(style, pp, v, mo.layers, r)
    first = any(st == 0 for st, _ in mine)
    last = any(st == pp * v - 1 for st, _ in mine)
    p_bytes = 2 if job.precision == "bf16-true" else 4
    # --- parameters -----------------------------------------------------------------
    dense = expert = 0
    for _, blocks in mine:
        for i in blocks:
            dn, ex = R.block_params(i)
            dense, expert = dense + dn, expert + ex
    emb = mo.vocab // c.tp * mo.hidden
    if first:
        dense += emb
    if last:
        dense += mo.hidden * (2 if mo.norm == "LayerNorm" else 1)
        if not (mo.tied_embeddings and first):
            dense += emb
    n_params = dense + expert
    params = n_params * p_bytes
    fsdp = job.data_parallel == "fsdp" and c.dp * c.cp > 1
    # HSDP: the data ranks are dp_replicate replicas of a shard group; FSDP2 shards over it
    shard = c.dp * c.cp // job.dp_replicate if fsdp else 1
    terms: dict[str, int] = {}
    notes: list[str] = []
    terms["parameters"] = params // shard
    gathered = 0
    if fsdp:   # FSDP2's unsharded parameters and its all-gather buffer
        if job.fsdp_units == "blocks":   # the running unit and the next, prefetched
            blocks_ = [R.block_params(i) for _, b in mine for i in b]
            units_ = [dn + ex for dn, ex in blocks_]
            stem_head = dense - sum(dn for dn, _ in blocks_)   # embedding, norm, output
            units_.append(stem_head)
            gathered = 2 * max(units_) * p_bytes
        else:                            # one unit: the whole model (the root)
            gathered = 2 * params
        terms["fsdp gathered parameters"] = gathered
    grads = n_params * p_bytes
    terms["gradients"] = grads // shard
    buckets = 0
    if pp == 1 and c.dp * c.cp > 1 and not fsdp:
        buckets = dense * p_bytes                        # DDP's reduction buckets
        terms["ddp buckets"] = buckets
    opt_per = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}[job.optimizer]
    master = 4 if p_bytes == 2 and job.optimizer != "none" else 0
    opt = n_params * (opt_per * 4 + master) // shard
    terms["optimizer states"] = opt
    # --- activations ----------------------------------------------------------------
    stage_acts = []          # (stage, bytes one micro-batch keeps there)
    detail: dict[str, int] = {}
    layer_full = 0
    for st, blocks in mine:
        kept = 0
        for i in blocks:
            acts = R.block_acts(i)
            full = sum(acts.values())
            layer_full = max(layer_full, full)
            if job.recompute:
                kept += R.t_sp * mo.hidden * R.r + 4 * R.s * R.d * R.a
            else:
                kept += full
                for k, val in acts.items():
                    detail[k] = detail.get(k, 0) + val
        if st == 0:
            kept += R.stem_bytes()[0]
        if pp > 1 and st < pp * v - 1:
            kept += R.t_sp * mo.hidden * R.r         # the stage's output, until its backward
        stage_acts.append((st, kept))
    units = _in_flight(schedule, pp, v, job.microbatches, r)
    per_unit = sum(k for _, k in stage_acts) / len(stage_acts)
    acts = int(per_unit * units)
    units_shown = round(units, 2) if units != int(units) else int(units)
    head_kept, head_tmp = R.head_bytes() if last else (0, 0)
    if schedule.lower() in ("gpipe", "loopedbfs"):   # every micro-batch's loss, then backward
        head_kept *= job.microbatches
    stem_tmp = R.stem_bytes()[1] if first else 0
    scale = units / max(1, len(mine))
    for k, val in detail.items():
        terms[f"activations: {k}"] = int(val * scale)
    if job.recompute:
        terms["activations: recompute checkpoints"] = acts - sum(
            R.stem_bytes()[0] for st, _ in mine if st == 0)
        notes.append("recompute: one block's activations are rebuilt in backward")
    if first:
        terms["activations: embedding"] = R.stem_bytes()[0] * units // len(mine)
    if last:
        terms["activations: loss (softmax)"] = head_kept
    p2p = 0
    if pp > 1:
        terms["pipeline in-flight micro-batches"] = units_shown
        # torch's PipelineStage allocates a receive buffer per micro-batch: activations
        # into every stage but the first, their gradients into every stage but the last
        p2p = sum(job.microbatches * ((st > 0) + (st < pp * v - 1)) for st, _ in mine) \
            * R.t_sp * mo.hidden * R.r
        terms["pipeline receive buffers"] = p2p
    # fp8: weight copies (1 byte per linear weight element, per in-flight forward) and
    # amax histories (3 per linear: input, weight, grad)
    fp8 = 0
    if job.precision == "fp8":
        linears = sum(1 for _, b in mine for _ in b) * 4
        w_linear = dense - (emb if first else 0) - (emb if last else 0)
        fp8 = w_linear * units // len(mine) + linears * 3 * 4 * (
            job.amax_history if job.fp8_recipe == "delayed" else 1)
        terms["fp8 weight copies and amax histories"] = fp8
    wcopies = 0
    if job.precision in AUTOCAST:   # autocast's low-precision weight copies, kept by the
        # linears for their backward (the embedding is not autocast)
        wcopies = (dense - (emb if first else 0) + expert) * R.a
        terms["autocast weight copies"] = wcopies
    save = 0
    if job.async_save:
        save = (params + opt) // shard
        terms["async-save staging copy (host)"] = save
        notes.append("the async-save copy is in host memory, not on the device")
    # --- the peak: what is alive together ---------------------------------------------
    static = terms["parameters"] + buckets + opt + fp8 + p2p
    act_total = acts + head_kept
    recompute_tmp = layer_full if job.recompute else 0
    grads_alive = grads if (job.microbatches > 1 or pp > 1) else 0   # accumulation
    fwd = static + gathered + act_total + max(head_tmp, stem_tmp) + grads_alive // shard \
        + wcopies
    bwd = static + gathered + act_total - head_kept + recompute_tmp + grads_alive // shard \
        + wcopies \
        + R.t * R.f * R.a * 2
    if fsdp and job.fsdp_units == "blocks":   # a unit's unsharded grads, then sharded
        end = static + gathered + grads // shard
    elif fsdp:
        end = static + gathered + grads + grads // shard     # unsharded grads + RS output
    else:
        end = static + grads + (grads if pp > 1 else 0)          # pp: the flat all-reduce copy
    if job.device == "cuda" and job.optimizer in ("adamw", "adam"):
        opt_tmp = n_params * 4 // shard      # foreach: one fp32 temporary of every parameter
    else:
        opt_tmp = max(R.block_params(0)) * p_bytes   # one parameter at a time
    opt_step = static + grads // shard + opt_tmp
    phases = {"forward": fwd, "backward": bwd, "end of backward": end, "optimizer": opt_step}
    phase = max(phases, key=phases.get)
    first_step = max([v - opt for k, v in phases.items() if k != "optimizer"] + [opt_step])
    what = role or _role_name(first, last, pp, r)
    count = "pipeline in-flight micro-batches"
    return MemoryEstimate(what, ranks, {k: v if k == count else int(v)
                                        for k, v in terms.items() if v},
                          int(phases[phase]), phase, notes,
                          {k: int(v) for k, v in phases.items()}, int(first_step))


def _role_name(first: bool, last: bool, pp: int, r: int) -> str:
    if pp == 1:
        return "every rank"
    if first and last:
        return f"pp rank {r} (first and last stage)"
    return f"pp rank {r} ({'first stage' if first else 'last stage' if last else 'middle stage'})"


def role_ranks(config: ParallelConfig) -> list[int]:
    """The pp ranks whose estimates differ in kind: the first (embedding), the last (head)
    and, with pp > 2, one middle rank standing for all (estimate_roles takes the heaviest
    of them)."""
    pp = config.pp
    return sorted({0, pp - 1} | ({1} if pp > 2 else set()))


def estimate_roles(job: MemoryJob, config: ParallelConfig, world_size: int | None = None
                   ) -> list[MemoryEstimate]:
    """One estimate per distinct role (first, middle, last pipeline rank; the expert ranks
    hold the same as their stage's others), each named with its ranks."""
    from ..layout.planning import format_ranks
    if config.dp is None:
        config = config.validate(world_size)
    per_stage = config.tp * config.cp * config.dp
    out = []
    pp = config.pp
    middles = list(range(1, pp - 1))
    for r in role_ranks(config):
        if pp > 2 and r == 1:   # the middle ranks: the heaviest of them
            cands = [_estimate(job, config, m, ranks="") for m in middles]
            est = max(cands, key=lambda e: e.peak)
            r = middles[cands.index(est)]
            ranks = format_ranks(range(middles[0] * per_stage, (middles[-1] + 1) * per_stage))
            est = _estimate(job, config, r, ranks=ranks,
                            role=f"pp ranks {middles[0]}-{middles[-1]} (middle stages; "
                                 f"heaviest: pp rank {r})" if len(middles) > 1 else None)
        else:
            ranks = format_ranks(range(r * per_stage, (r + 1) * per_stage))
            est = _estimate(job, config, r, ranks=ranks)
        if config.has_experts and job.model.experts:
            est.role += f", experts over ep={config.ep} etp={config.expert_tp}"
        out.append(est)
    return out
