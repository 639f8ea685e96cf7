"""Pipeline parallelism: a model's blocks split into ``pp`` stages, run by a schedule of
``torch.distributed.pipelining`` over ``state.pp_group``.

tpkit supplies the layout, the split and the glue; PyTorch supplies the stages
(``PipelineStage``), the stage-to-stage sends and the schedules. A model opts in with a
small protocol (docs/pipeline.md):

- ``pp_blocks``: the name of its ``nn.ModuleList`` of identical blocks;
- ``pp_stem_modules`` / ``pp_head_modules``: the names of the child modules only the first
  / the last stage holds (embedding; final norm and output layer). Any other child must
  hold no parameters (RoPE's angles): every stage keeps it;
- ``pp_stem(*inputs) -> hidden``, ``pp_block(block, hidden) -> hidden``,
  ``pp_head(hidden) -> output`` and ``pp_loss(output, target) -> scalar mean loss``;
- optionally ``pp_recompute``: True when ``pp_block`` recomputes activations (the
  zero-bubble schedules refuse it);
- optionally ``pp_offload(first, count, training) -> (context, synchronizer)``: TE's
  activation-offload pair (tpkit.te.offload) for one forward through the stage's blocks
  ``first .. first + count - 1``; each block runs inside the context and its output
  passes the synchronizer. Every forward (micro-batch) gets its own pair, so the
  micro-batches a schedule keeps in flight offload and reload independently;
- optionally ``pp_aux_loss(block) -> scalar or None``: an auxiliary loss the block's last
  forward produced (an MoE layer's router losses, tpkit.nn.MoE) that the model adds to
  its loss at pp=1. The stage attaches its gradient to the block's output activations
  (Megatron-Core's MoEAuxLossAutoScaler idea), scaled per micro-batch like the main loss,
  so that it reaches the router and everything before it in every stage although only
  the last stage calls ``pp_loss``; ``Pipeline.step``'s loss includes it.

Inside a stage the tpkit layers keep TP/SP/CP exactly as without pipelining: what travels
between stages is the stage's local activation (``[s/cp(/tp), b, h]``), sent between the
ranks with the same (tp, cp, dp) coordinates. Stage modules keep the model's parameter
names (block ``i`` of the whole model stays ``<pp_blocks>.i``), so checkpoints reshard
across ``pp`` like across tp/cp/dp.

Gradients: each micro-batch's loss is divided by the number of micro-batches before its
backward, so after a step the gradients are those of the batch mean, exactly as one
``loss.backward()`` of the whole batch at pp=1 (and gradient accumulation over several
steps stays a plain sum). ``Pipeline.step`` returns that batch-mean loss on every rank of
the pipeline (the last stage's main loss plus every stage's auxiliary losses, summed over
``pp_group``). Expert weights (tagged ``expert_parallel``) stay out of the dense
data-parallel average: what a step added to them is summed over ``edp_group`` and divided
by dp x cp (tpkit.grads.reduce_expert_grads), as at pp=1.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
import torch
from torch import nn

from ..comm.collectives import all_reduce_flat, all_reduce_sum
from ..grads import reduce_expert_grads, reduce_since, reduced_here, snapshot_grads
from ..layout.param_tags import is_expert
from ..layout.topology import resolve_state

__all__ = ["SCHEDULES", "PipelinePlan", "plan_pipeline", "Pipeline", "PipelineStageModule",
           "PipelineModule", "build_pipeline"]

# name -> (torch class, how stages map to ranks): "single" one stage per rank; "loop"
# virtual_stages per rank, rank r holding r, r+pp, ...; "v" two per rank, r and 2pp-1-r.
SCHEDULES = {
    "GPipe": ("ScheduleGPipe", "single"),
    "1F1B": ("Schedule1F1B", "single"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", "loop"),
    "LoopedBFS": ("ScheduleLoopedBFS", "loop"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", "v"),
    "DualPipeV": ("ScheduleDualPipeV", "v"),
}
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
DATA_PARALLEL = ("ddp", "allreduce", "fsdp", None)


@dataclass(frozen=True)
class PipelinePlan:
    """A checked pipeline layout: the schedule's canonical name, its stage style, and the
    stage counts. ``stages_of(pp_rank)`` are the global stage indices a rank runs and
    ``blocks_of(stage)`` the global block indices of a stage."""
    schedule: str
    style: str
    pp: int
    virtual_stages: int
    microbatches: int
    num_blocks: int

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def stages_of(self, pp_rank: int) -> list[int]:
        if self.style == "v":
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + k * self.pp for k in range(self.virtual_stages)]

    def blocks_of(self, stage: int) -> range:
        per = self.num_blocks // self.num_stages
        return range(stage * per, (stage + 1) * per)

    @property
    def last_stage_rank(self) -> int:
        """The pp rank that runs the last stage (it computes the loss)."""
        return 0 if self.style == "v" else self.pp - 1


def plan_pipeline(*, pp: int, num_blocks: int, microbatches: int, schedule: str = "1F1B",
                  virtual_stages: int | None = None, batch_size: int | None = None,
                  recompute: bool = False) -> PipelinePlan:
    """Check a pipeline layout before anything runs; every user error is a ValueError
    naming the value and the fix. ``virtual_stages=None`` means 1 for single-stage
    schedules and 2 for the others. ``batch_size``: the local batch the step will see.
    ``recompute``: the blocks recompute their activations (refused with the zero-bubble
    schedules: torch's split backward fails on checkpointed blocks)."""
    names = {k.lower(): k for k in SCHEDULES}
    if not isinstance(schedule, str) or schedule.lower() not in names:
        raise ValueError(f"pipeline schedule {schedule!r} is unknown; use one of "
                         f"{list(SCHEDULES)}")
    name = names[schedule.lower()]
    style = SCHEDULES[name][1]
    if recompute and name in ZERO_BUBBLE:
        raise ValueError(f"schedule {name!r} with recompute: torch's zero-bubble schedules "
                         "split the backward into input and weight gradients, which fails on "
                         "recomputed (checkpointed) blocks; use 1F1B or Interleaved1F1B with "
                         "recompute, or drop recompute")
    for label, v in (("pp", pp), ("microbatches", microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{label}={v!r} must be an integer >= 1")
    if virtual_stages is None:
        virtual_stages = 1 if style == "single" else 2
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) \
            or virtual_stages < 1:
        raise ValueError(f"virtual_stages={virtual_stages!r} must be an integer >= 1")
    if style == "single" and virtual_stages != 1:
        raise ValueError(f"schedule {name!r} runs one stage per rank but virtual_stages="
                         f"{virtual_stages}; use virtual_stages=1 or an interleaved schedule "
                         f"({', '.join(k for k, v in SCHEDULES.items() if v[1] != 'single')})")
    if style == "v" and virtual_stages != 2:
        raise ValueError(f"schedule {name!r} runs exactly two stages per rank (a V) but "
                         f"virtual_stages={virtual_stages}; use virtual_stages=2")
    stages = pp * virtual_stages
    if num_blocks < stages or num_blocks % stages:
        raise ValueError(f"{num_blocks} blocks do not split evenly into pp x virtual_stages = "
                         f"{pp} x {virtual_stages} = {stages} stages; use a number of blocks "
                         f"that is a multiple of {stages}, or change pp/virtual_stages")
    m = microbatches
    if name == "1F1B" and m < pp:
        raise ValueError(f"microbatches={m} is fewer than the {pp} pipeline stages; 1F1B "
                         f"needs microbatches >= pp: use at least {pp}")
    if name == "DualPipeV" and m < stages:
        raise ValueError(f"microbatches={m} is fewer than the {stages} stages; DualPipeV "
                         f"needs microbatches >= 2 x pp: use at least {stages}")
    if style == "loop":
        rounds = max(1, m // pp)
        if m % rounds:
            raise ValueError(f"microbatches={m} is not a multiple of the {rounds} rounds "
                             f"(microbatches // pp) that {name} runs; use a multiple of pp="
                             f"{pp}, e.g. {rounds * pp}")
    if batch_size is not None and batch_size % m:
        raise ValueError(f"the local batch of {batch_size} does not split into microbatches="
                         f"{m}; use a divisor of {batch_size} (or a larger batch)")
    return PipelinePlan(name, style, pp, virtual_stages, m, num_blocks)


def _protocol(model: nn.Module):
    """(blocks name, stem names, head names); ValueError when the model cannot be split."""
    kind = type(model).__name__
    name = getattr(model, "pp_blocks", None)
    blocks = getattr(model, name, None) if isinstance(name, str) else None
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"{kind} has no block list to split into pipeline stages: give it a "
                         "class attribute pp_blocks = '<name of its nn.ModuleList of blocks>' "
                         "and the methods pp_stem, pp_block, pp_head, pp_loss "
                         "(docs/pipeline.md), or run it with pp=1")
    missing = [m for m in ("pp_stem", "pp_block", "pp_head", "pp_loss")
               if not callable(getattr(model, m, None))]
    if missing:
        raise ValueError(f"{kind} has pp_blocks={name!r} but no {', '.join(missing)}; define "
                         "them (docs/pipeline.md)")
    stem = tuple(getattr(model, "pp_stem_modules", ()))
    head = tuple(getattr(model, "pp_head_modules", ()))
    children = dict(model.named_children())
    for n in stem + head:
        if n not in children:
            raise ValueError(f"{kind}.pp_stem_modules/pp_head_modules name {n!r}, which is "
                             f"not a child module; children: {sorted(children)}")
    for n, child in children.items():
        if n not in (name, *stem, *head) and any(True for _ in child.parameters()):
            raise ValueError(f"{kind}.{n} has parameters but is neither in pp_stem_modules "
                             "nor pp_head_modules; name the stage that owns it")
    return name, stem, head


class PipelineStageModule(nn.Module):
    """One stage: the stem (first stage), blocks ``blocks`` of the model's list under their
    global indices, the head (last stage). ``forward`` runs the model's pp_* methods."""

    def __init__(self, model: nn.Module, stage: int, num_stages: int, blocks: range,
                 aux_scale: float = 1.0, forward_context=None):
        super().__init__()
        # the precision's autocast (bf16/fp16) or fp8 autocast around every forward, as
        # Fabric's module wrapper enters it around model(...) at pp=1
        object.__setattr__(self, "_forward_context", forward_context or contextlib.nullcontext)
        name, stem, head = _protocol(model)
        self.stage_index, self.num_stages = stage, num_stages
        # pp_aux_loss: its gradient's scale (1 / micro-batches) and each forward's sum
        # (torch's first step runs one more forward for shape inference: Pipeline.step
        # counts the last micro-batches' entries)
        self.aux_scale, self.aux_values = float(aux_scale), []
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self._blocks_name = name
        self._stem_names = stem if self.is_first else ()
        self._head_names = head if self.is_last else ()
        # The model's pp_* methods run on a shallow copy holding only stem/head/shared
        # children, so that the stage does not keep other stages' modules alive.
        held = (stem if self.is_first else ()) + (head if self.is_last else ())
        shell = copy.copy(model)
        shell._modules = {n: (m if n in held or n not in (name, *stem, *head) else None)
                          for n, m in model._modules.items()}
        object.__setattr__(self, "_shell", shell)
        if self.is_first:
            for n in stem:
                setattr(self, n, getattr(model, n))
        every = getattr(model, name)
        setattr(self, name, nn.ModuleDict({str(i): every[i] for i in blocks}))
        if self.is_last:
            for n in head:
                setattr(self, n, getattr(model, n))

    def fsdp_parts(self):
        """(stem modules, blocks, head modules) of this stage: FSDP2's units
        (tpkit.distributed.fsdp)."""
        return ([getattr(self, n) for n in self._stem_names],
                list(getattr(self, self._blocks_name).values()),
                [getattr(self, n) for n in self._head_names])

    def forward(self, *args):
        with self._forward_context():
            return self._forward(*args)

    def _forward(self, *args):
        m = self._shell
        aux_of = getattr(m, "pp_aux_loss", None)
        h = m.pp_stem(*args) if self.is_first else args[0]
        total = None
        blocks = getattr(self, self._blocks_name)
        offload, sync = (contextlib.nullcontext(), lambda x: x)
        if callable(getattr(m, "pp_offload", None)):   # its own pair per micro-batch
            offload, sync = m.pp_offload(int(next(iter(blocks))), len(blocks), self.training)
        for block in blocks.values():
            with offload:
                h = m.pp_block(block, h)
            h = sync(h)
            aux = aux_of(block) if aux_of is not None and torch.is_grad_enabled() else None
            if aux is not None:
                h = _AttachAuxLoss.apply(h, aux, self.aux_scale)
                total = aux.detach() if total is None else total + aux.detach()
        if total is not None:
            self.aux_values.append(total)
        return m.pp_head(h) if self.is_last else h

    def extra_repr(self) -> str:
        return f"stage {self.stage_index} of {self.num_stages}"


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``hidden``; backward also gives ``aux`` the gradient ``scale`` (as if
    ``scale * aux`` had been added to the loss), so an auxiliary loss computed inside a
    stage is trained without travelling to the last stage's loss."""

    @staticmethod
    def forward(ctx, hidden, aux, scale):
        ctx.aux_shape, ctx.aux_dtype, ctx.scale = aux.shape, aux.dtype, scale
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


class PipelineModule(nn.Module):
    """This rank's part of the model, under the whole model's parameter names: the union of
    its stage modules (for optimizers, checkpoints, clipping). Run it with
    ``Pipeline.step``; calling it directly is an error."""

    def __init__(self, stages: list[PipelineStageModule]):
        super().__init__()
        for st in stages:
            for n, child in st.named_children():
                if n == st._blocks_name:
                    if n not in self._modules:
                        setattr(self, n, nn.ModuleDict())
                    getattr(self, n).update(child)
                else:
                    setattr(self, n, child)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs a whole step at once: call "
                           "Pipeline.step(inputs, target=...) (Fabric: "
                           "fabric.strategy.pipeline_step(...)) instead of model(...)")


def _drop_unused(model: nn.Module, keep: list[PipelineStageModule]) -> None:
    """Free the modules of other ranks' stages in the user's model object."""
    name, stem, head = _protocol(model)
    mine = {id(m) for st in keep for m in st.modules()}
    blocks = getattr(model, name)
    blocks._modules = {k: b for k, b in blocks._modules.items() if id(b) in mine}
    for n in stem + head:
        if id(model._modules[n]) not in mine:
            model._modules[n] = None


class Pipeline:
    """This rank's stages and the schedule that runs them; see :func:`build_pipeline`."""

    def __init__(self, plan: PipelinePlan, stage_modules, schedule, state, *, average: bool,
                 reduce_experts: bool = False, loss_scale=None):
        self._loss_scale = loss_scale
        self.plan, self.stage_modules, self.schedule, self.state = \
            plan, stage_modules, schedule, state
        self._average, self._reduce_experts = average, reduce_experts
        self.module = PipelineModule([_unwrap(m) for m in stage_modules])
        self.has_last_stage = any(_unwrap(m).is_last for m in stage_modules)
        # expert weights FSDP2 shards (DTensors) are reduced by FSDP2 over edp
        self._experts = [p for p in self.module.parameters() if reduced_here(p)]
        self._dense = [p for p in self.module.parameters() if not is_expert(p)]

    def step(self, *inputs, target: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch through every stage; gradients accumulate
        into ``.grad`` (the batch mean's). Returns the batch-mean loss (detached) on
        every rank of the pipeline. Every rank passes the same batch (the first stage
        reads ``inputs``, the last ``target``)."""
        losses: list[torch.Tensor] = []
        stages = [_unwrap(m) for m in self.stage_modules]
        for st in stages:
            st.aux_values = []
        s = self.state
        # Expert gradients: only what this step adds is reduced (the sum over edp is not
        # idempotent, unlike an average), so earlier steps' accumulated parts are set aside.
        reduce_experts = self._reduce_experts and (s.edp_size > 1 or s.dp_cp_size > 1)
        base = snapshot_grads(self._experts) if reduce_experts else []
        if self._loss_scale is not None:   # the scaler's scale exists on every stage, not
            # only on the last one, whose loss it scales (unscale_ refuses a scale never used)
            self._loss_scale.scale(torch.zeros((), device=inputs[0].device))
        self.schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        if self._average:
            grads = [p.grad for p in self._dense if p.grad is not None]
            all_reduce_flat(grads, s.dp_cp_group)
            torch._foreach_div_(grads, float(s.dp_cp_size))
        if reduce_experts:
            reduce_since(base, lambda: reduce_expert_grads(self._experts, s))
        device = next(iter(self.module.parameters())).device
        loss = torch.stack([x.detach().float() for x in losses]).sum() if losses \
            else torch.zeros((), dtype=torch.float32, device=device)
        if self._loss_scale is not None and losses:   # the loss the backward saw, scaled
            loss = loss / float(self._loss_scale.get_scale())
        m = self.plan.microbatches
        for st in stages:   # the micro-batches' auxiliary losses, scaled as the main loss
            for aux in st.aux_values[-m:]:
                loss = loss + aux.float().to(device) * st.aux_scale
            st.aux_values = []
        return all_reduce_sum(loss.contiguous(), s.pp_group)


def _unwrap(m: nn.Module) -> nn.Module:
    return m.module if isinstance(m, nn.parallel.DistributedDataParallel) else m


def build_pipeline(model: nn.Module, *, microbatches: int, schedule: str = "1F1B",
                   virtual_stages: int | None = None, data_parallel: str | None = "ddp",
                   state=None, device: torch.device | None = None, forward_context=None,
                   loss_scale=None, fsdp: dict | None = None) -> Pipeline:
    """Split ``model`` (the pp protocol above) into ``pp x virtual_stages`` stages, keep
    this rank's (``state.pp_rank``), and build the schedule ``schedule`` (a name of
    ``SCHEDULES``) over ``state.pp_group``. The model object is consumed: the modules of
    other ranks' stages are removed from it (use ``Pipeline.module``).

    ``data_parallel`` averages the dense gradients over ``state.dp_cp_group`` (and reduces
    expert weights' over ``edp_group``, see the module docstring): ``"ddp"`` wraps
    each stage module in DistributedDataParallel (reductions overlap the last
    micro-batch's backward; not with the zero-bubble schedules, whose split backward DDP
    does not follow), ``"allreduce"`` issues one flattened all-reduce per dtype after each
    step (any schedule), ``"fsdp"`` shards each stage module with FSDP2 over dp x cp
    (tpkit.distributed.fsdp.shard_model with ``pipelined=True`` and the keywords
    ``fsdp``: a unit per block, the stem and the head their own, the stage module the
    root; expert weights over edp): torch's schedules keep its gradient reduction off
    until the last micro-batch and reduce-scatter once per step (any schedule; the step
    adds no all-reduce of its own), ``None`` leaves it to the caller.

    ``forward_context``: a callable returning the context every stage forward and the
    loss run in (a precision's autocast or fp8 autocast: ``TPKitPrecision.forward_context``).
    ``loss_scale``: a ``torch.amp.GradScaler`` ("16-mixed") that scales each micro-batch's
    loss before its backward; ``step`` reports the loss divided by its scale again."""
    from torch.distributed import pipelining
    state = resolve_state(state)
    _protocol(model)
    plan = plan_pipeline(pp=state.pp_size, num_blocks=len(getattr(model, model.pp_blocks)),
                         microbatches=microbatches, schedule=schedule,
                         virtual_stages=virtual_stages,
                         recompute=bool(getattr(model, "pp_recompute", False)))
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel={data_parallel!r} is unknown; use one of "
                         f"{DATA_PARALLEL}")
    if data_parallel == "ddp" and plan.schedule in ZERO_BUBBLE and state.dp_cp_size > 1:
        raise ValueError(f"data_parallel='ddp' does not follow the split backward of the "
                         f"zero-bubble schedule {plan.schedule!r} (wrong gradients); use "
                         "data_parallel='allreduce' with it")
    if data_parallel == "ddp" and state.dp_cp_size > 1 and plan.microbatches <= plan.pp:
        raise ValueError(f"data_parallel='ddp' with microbatches={plan.microbatches} <= pp="
                         f"{plan.pp}: torch's DDP reducer fails on the second step (torch "
                         "2.13); use data_parallel='allreduce', or more micro-batches")
    if device is None:
        device = next(iter(model.parameters())).device
    mine = [PipelineStageModule(model, s, plan.num_stages, plan.blocks_of(s),
                                aux_scale=1.0 / plan.microbatches,
                                forward_context=forward_context)
            for s in plan.stages_of(state.pp_rank)]
    _drop_unused(model, mine)
    if data_parallel == "fsdp":   # each stage module its own FSDP2 root (a PipelineStage
        # whose submod is an FSDPModule: torch's schedules sync it once per step)
        from .fsdp import shard_model
        for m in mine:
            shard_model(m, state, pipelined=True, **(fsdp or {}))
    ddp = data_parallel == "ddp" and state.dp_cp_size > 1
    wrapped = [_ddp(m, state, device) if ddp else m for m in mine]
    stages = [pipelining.PipelineStage(w, m.stage_index, plan.num_stages, device,
                                       group=state.pp_group)
              for w, m in zip(wrapped, mine)]
    loss_fn = _mean_over_microbatches(mine[0]._shell.pp_loss, plan.microbatches,
                                      forward_context, loss_scale)
    cls = getattr(pipelining.schedules, SCHEDULES[plan.schedule][0])
    sched = cls(stages[0] if plan.style == "single" else stages, plan.microbatches,
                loss_fn=loss_fn, scale_grads=False)
    return Pipeline(plan, wrapped, sched, state,
                    average=data_parallel == "allreduce" and state.dp_cp_size > 1,
                    reduce_experts=data_parallel is not None, loss_scale=loss_scale)


def _ddp(module: nn.Module, state, device: torch.device) -> nn.Module:
    ids = None if device.type == "cpu" else [device.index]
    # expert weights are summed over edp by Pipeline.step, never averaged over dp x cp
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        module, [n for n, p in module.named_parameters() if is_expert(p)])
    return nn.parallel.DistributedDataParallel(module, device_ids=ids,
                                               process_group=state.dp_cp_group)


def _mean_over_microbatches(loss_fn, m: int, forward_context=None, loss_scale=None):
    enter = forward_context or contextlib.nullcontext

    def loss(output, target):
        with enter():
            out = loss_fn(output, target) / m
        return out if loss_scale is None else loss_scale.scale(out)
    return loss
