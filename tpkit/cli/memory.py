"""tpkit-launch's memory check: the per-rank estimate of tpkit.memory for every distinct
role of the layout, printed by ``--dry-run`` and compared with the device memory before
any worker starts (exit 2 with layouts that fit when it does not).

The model comes from the script's ``tpkit_preflight`` hook, when it returns a
``tpkit.memory.MemoryJob`` (launch/train.py's does), or from ``--model-config FILE`` (a
Hugging Face config.json) with ``--memory-job KEY=VALUE,...`` for the training settings.
See docs/launch.md, "Memory".
"""
from __future__ import annotations

import dataclasses

__all__ = ["add_memory_options", "job_from_flags", "check_memory", "MemoryError_"]

DEFAULT_MARGIN = 0.1


class MemoryError_(ValueError):
    """The estimate exceeds the device memory (exit 2), or a memory flag is bad.
    ``report``: the memory lines to print before the one-line error."""

    def __init__(self, message: str, report: list[str] | None = None):
        super().__init__(message)
        self.report = report or []


def add_memory_options(parser) -> None:
    g = parser.add_argument_group("memory estimate (docs/launch.md, Memory)")
    g.add_argument("--device-memory", "--device_memory", type=float, default=None,
                   metavar="GiB", help="memory of one device in GiB (default: detected on "
                   "this node's first GPU; none on CPU)")
    g.add_argument("--memory-margin", "--memory_margin", type=float, default=None,
                   metavar="F", help="fraction of the device memory kept free for the "
                   f"allocator, CUDA context and communication buffers (default "
                   f"{DEFAULT_MARGIN})")
    g.add_argument("--model-config", "--model_config", default=None, metavar="FILE",
                   help="a Hugging Face config.json to estimate, when the script does not "
                   "say its model (its tpkit_preflight returns no tpkit.memory.MemoryJob)")
    g.add_argument("--memory-job", "--memory_job", default=None, metavar="K=V,...",
                   help="with --model-config: the training settings, fields of "
                   "tpkit.memory.MemoryJob, e.g. micro_batch=1,seq_len=8192,recompute=1,"
                   "data_parallel=fsdp,microbatches=16")


def _flag_values(args) -> tuple[float | None, float]:
    dev = args.device_memory
    if dev is not None and not dev > 0:
        raise MemoryError_(f"--device-memory={dev} must be > 0 GiB (the memory of one "
                           "device, e.g. 80)")
    margin = DEFAULT_MARGIN if args.memory_margin is None else args.memory_margin
    if not 0 <= margin < 1:
        raise MemoryError_(f"--memory-margin={margin} must be in [0, 1) (the fraction of "
                           f"the device memory kept free, e.g. {DEFAULT_MARGIN})")
    return dev, margin


def job_from_flags(args):
    """The MemoryJob of ``--model-config`` and ``--memory-job``, or None."""
    from tpkit.memory import MemoryJob, ModelShape
    if args.memory_job and not args.model_config:
        raise MemoryError_(f"--memory-job={args.memory_job!r} needs --model-config FILE "
                           "(the model it trains)")
    if not args.model_config:
        return None
    try:
        model = ModelShape.from_hf_config(args.model_config)
    except ValueError as e:
        raise MemoryError_(f"--model-config: {e}") from None
    fields = {f.name: f for f in dataclasses.fields(MemoryJob) if f.name != "model"}
    kw: dict = {}
    for item in filter(None, (args.memory_job or "").split(",")):
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise MemoryError_(f"--memory-job item {item!r} is not KEY=VALUE with KEY one of "
                               f"{sorted(fields)}")
        default = fields[key].default
        try:
            if isinstance(default, bool):
                if raw.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError
                kw[key] = raw.lower() in ("1", "true", "yes", "on")
            elif isinstance(default, int) or key == "virtual_stages":
                kw[key] = int(raw)
            elif isinstance(default, float):
                kw[key] = float(raw)
            else:
                kw[key] = raw
        except ValueError:
            raise MemoryError_(f"--memory-job {key}={raw!r} is not a valid "
                               f"{type(default).__name__ if default is not None else 'int'}"
                               f"; e.g. {key}={default if default is not None else 2}") from None
    try:
        return MemoryJob(model=model, **kw)
    except ValueError as e:
        raise MemoryError_(f"--memory-job: {e}") from None


def _size(n: float) -> str:
    """Bytes as GiB, or MiB below 0.1 GiB (small models, tiny devices)."""
    from tpkit.memory import GiB
    return f"{n / GiB:.2f} GiB" if n >= 0.1 * GiB else f"{n / 2 ** 20:.2f} MiB"


def _detected_device_bytes() -> float | None:
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return None


def check_memory(args, plan, jobs: list) -> list[str]:
    """The dry run's memory lines; MemoryError_ (exit 2) when the heaviest role's estimate
    exceeds the device memory less the margin. ``jobs``: the MemoryJob the script's hook
    returned per node count (the largest world's is used)."""
    from tpkit.memory import GiB, estimate_roles, format_layout, format_roles, suggest_layouts
    dev, margin = _flag_values(args)
    flag_job = job_from_flags(args)
    job = flag_job or (jobs[-1] if jobs else None)
    if job is None:
        if dev is not None or args.memory_margin is not None:
            raise MemoryError_("--device-memory/--memory-margin need the model: the "
                               "script's tpkit_preflight returns none (a tpkit.memory."
                               "MemoryJob); pass --model-config FILE (a Hugging Face "
                               "config.json)")
        return ["memory: not estimated (the script's tpkit_preflight returns no tpkit."
                "memory.MemoryJob; pass --model-config FILE)"] if args.dry_run else []
    world = plan.max_nodes * plan.nproc_per_node
    config = plan.config.validate(world)
    device = dev * GiB if dev is not None else _detected_device_bytes()
    try:
        ests = estimate_roles(job, config, world)
    except ValueError as e:
        raise MemoryError_(f"memory estimate: {e}") from None
    where = "--device-memory" if dev is not None else "detected"
    lines = [f"memory (tpkit.memory; {job.precision}, micro-batch {job.micro_batch} x "
             f"{job.seq_len} tokens, {job.microbatches} micro-batch(es) per step, "
             f"recompute={job.recompute}, {job.data_parallel}), heaviest rank of each role:"]
    lines += format_roles(ests, device)
    if device is None:
        lines.append("device memory: unknown (no GPU here); pass --device-memory GiB to "
                     "check the estimate")
        return lines if args.dry_run else []
    budget = device * (1 - margin)
    worst = max(ests, key=lambda e: e.peak)
    lines.append(f"device memory: {device / GiB:.2f} GiB ({where}), margin {margin:.0%}: "
                 f"{budget / GiB:.2f} GiB usable; heaviest: {worst.peak / GiB:.2f} GiB "
                 + ("fits" if worst.peak <= budget else "DOES NOT FIT"))
    if worst.peak <= budget:
        return lines if args.dry_run else []
    name, size = worst.biggest
    global_batch = job.micro_batch * config.dp * job.microbatches
    fits = suggest_layouts(job, world, device, global_batch=global_batch, margin=margin,
                           base=config, nproc_per_node=plan.nproc_per_node)
    if fits:
        best = fits[0][0]
        lines.append(f"layouts of {world} ranks that fit, cheapest estimated step first "
                     "(ranking: tpkit.memory.step_cost, an idealised step time: FLOPs with the "
                     "pipeline bubble and recompute, plus tp/cp/dp/pp traffic over NVLink or "
                     "the network):")
        for cost, c, j, peak in fits:
            lines.append(f"  suggest: {format_layout(c, j)}: {peak / GiB:.2f} GiB per rank, "
                         f"step cost {cost / best:.2f} x the first")
        hint = (f"the cheapest layout that fits is {format_layout(*fits[0][1:3])} "
                f"({_size(fits[0][3])} per rank)"
                + ("; --dry-run lists it and the others" if not args.dry_run else
                   "; the lines above list it and the others"))
    else:
        hint = (f"no layout of {world} ranks fits (tp, cp, pp, dp, recompute and fsdp "
                "searched): use more ranks or a smaller micro-batch")
        lines.append(hint)
    raise MemoryError_(
        f"the estimated peak of {worst.role} is {_size(worst.peak)} per rank, over the "
        f"{_size(device)} device memory less the {margin:.0%} margin ({_size(budget)}); its "
        f"biggest term is {name} ({_size(size)}); {hint}; or check "
        "--device-memory/--memory-margin", lines if args.dry_run else [])
