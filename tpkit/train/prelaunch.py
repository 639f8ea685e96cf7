"""Before any worker starts: tpkit-launch calls the script's ``tpkit_preflight`` (``preflight``),
which checks the job at the launch's layout as the workers will build it."""
from __future__ import annotations

import dataclasses

import torch

from . import corpus
from .config import JobConfig, parse
from .build import (build_model, check_hf_dir, check_vocab, gpt_config, memory_job,
                    resolve_resume, steps_done)


# --- before any worker starts (tpkit-launch calls the script's tpkit_preflight) ------------
def pipeline_stages(job: JobConfig, state) -> list[str]:
    """The dry run's lines: which stages and blocks every pp rank (and its ranks) runs."""
    from tpkit.distributed.pipeline import plan_pipeline
    from tpkit.layout.planning import format_ranks
    from .arch import num_layers
    layers = num_layers(job)
    plan = plan_pipeline(pp=state.pp_size, num_blocks=layers,
                         microbatches=job.microbatches(state.pp_size),
                         schedule=job.pipeline.schedule,
                         virtual_stages=job.pipeline.virtual_stages)
    rows = state.rank_table(nproc_per_node=1)
    lines = [f"pipeline (tpkit-train): {plan.schedule}, {plan.microbatches} micro-batches, "
             f"{plan.num_stages} stages of {layers // plan.num_stages} block(s)"]
    for r in range(plan.pp):
        ranks = [row["rank"] for row in rows if row["pp"] == r]
        parts = []
        for st in plan.stages_of(r):
            blocks = plan.blocks_of(st)
            what = f"layers {blocks.start}-{blocks.stop - 1}" if len(blocks) > 1 \
                else f"layer {blocks.start}"
            if st == 0:
                what = "embedding + " + what
            if st == plan.num_stages - 1:
                what += " + final_norm, output, loss"
            parts.append(f"stage {st} ({what})")
        lines.append(f"  pp rank {r} (ranks {format_ranks(ranks)}): " + "; ".join(parts))
    return lines


def preflight(argv, launch):
    """tpkit-launch's pre-flight (docs/launch.md, "Pre-flight checks"): the JobConfig's
    checks, the layout it gives under this launch, the model built on the meta device of
    that planned layout (the layers' own checks) and checkpoint.resume against that model.
    Returns the job's layout (tpkit-launch launches, prints and exports that one: a size
    given to both tpkit-launch and the job with two values is refused) and its
    ``tpkit.memory.MemoryJob`` for tpkit-launch's memory estimate.
    ValueError (or argparse's exit 2) stops the launch; --print-config and --help answer
    instead of launching."""
    from tpkit.checkpoint import verify
    from tpkit.layout.planning import fake_state
    from tpkit.layout.random import get_rng_tracker, model_parallel_seed
    job, ns = parse(argv)
    if ns.print_config:
        print(job.to_toml(), end="")
        raise SystemExit(0)
    config = job.layout(launch.config)   # a size given twice with two values: refused
    try:
        config = config.validate(launch.world_size)
    except ValueError as e:
        raise ValueError(f"{e} [world size {launch.world_size} = {launch.nnodes} node(s) x "
                         f"{launch.nproc_per_node} processes: this launch]") from None
    if job.model.impl == "te" and not launch.dry_run:   # the workers run here: TE as here
        from tpkit.te import require_te
        try:
            require_te()
        except (ImportError, RuntimeError) as e:
            raise ValueError(f"{job.show('model.impl')}: {e}") from None
    # a dry run may plan a download: the directory is read only when workers will start
    hf_cfg = check_hf_dir(job) if job.model.init_from_hf and not launch.dry_run else None
    with fake_state(config, launch.world_size) as state:
        job.check_layout(state)
        check_vocab(job, state.tp_size)
        try:
            with torch.random.fork_rng(devices=[]):   # the layers: on the meta state.device
                model_parallel_seed(job.training.seed, state)   # the layers draw TP shards
                if hf_cfg is not None:   # its shapes at this layout, no weights read
                    dataclasses.replace(hf_cfg, vocab_multiple=job.model.vocab_multiple
                                        ).validate().check_tp(state.tp_size)
                from tpkit.models import GPT
                from .arch import is_llama, llama_config
                if is_llama(job):   # its shapes at this layout (RoPE's table needs data)
                    llama_config(job, impl="torch").check_tp(state.tp_size)
                # the layers create their tensors on state.device: meta here, so that
                # a 70B model's shapes cost no memory and no time
                model = None if job.model.init_from_hf or is_llama(job) else GPT(
                    gpt_config(job, impl="torch"),   # shapes: impl-independent
                    dataclasses.replace(state, device=torch.device("meta")))
        except ValueError as e:
            m = job.model
            what = (f"--init-from-hf {m.init_from_hf}" if m.init_from_hf else
                    f"--hidden {m.hidden} --heads {m.heads} --gqa-groups {m.gqa_groups} "
                    f"--ffn {m.ffn}")
            raise ValueError(f"the model ({what}) does not fit tp={config.tp}: {e}") from None
        finally:
            get_rng_tracker().reset()
        if launch.dry_run and state.pp_size > 1:
            print("\n".join(pipeline_stages(job, state)))
        if job.checkpoint.resume and not launch.dry_run:   # a dry run may plan a future save
            from tpkit.checkpoint import read
            path = resolve_resume(job)
            verify(path, None if model is None else {"model": model}, state=state,
                   strict=not job.checkpoint.resume_partial)
            steps_done(job, path, read(path, keys=["step"]))
    if job.training.verify and not launch.dry_run:
        report = verify_job(job, config)
        print(report, flush=True)
        if not report.ok:
            raise ValueError(f"--verify: the model differs from one process at layout "
                             f"{report.results[0].layout} (the report above names the first "
                             "module); fix it, or train without --verify")
    return config, memory_job(job, config)   # the layout, and the model and batch to estimate


def verify_job(job: JobConfig, config):
    """``--verify``: tpkit.verify on this job's model (build_model) and the corpus' batches
    at the job's layout (tp x cp x dp, sp), on CPU with gloo; a tpkit.verifier.Report."""
    from tpkit.verifier import Layout, verify
    if config.pp > 1 or config.ep > 1:
        raise ValueError(f"--verify at pp={config.pp}, ep={config.ep}: pipeline and expert "
                         "layouts are not verified yet; verify at pp=1, ep=1")
    if job.precision.mode not in ("32-true", "bf16-mixed"):
        raise ValueError(f"--verify with --precision {job.precision.mode}: verified in "
                         "32-true or bf16-mixed only")
    t = job.training
    train, _ = corpus.split(corpus.tokens())
    layout = Layout(config.tp, config.cp, config.dp, bool(config.sequence_parallel))
    return verify(lambda: build_model(job, None),
                  lambda step: corpus.batch(train, step, t.global_batch, t.seq_len, seed=t.seed),
                  layouts=[str(layout)], steps=min(3, t.steps), seed=t.seed,
                  precision="bf16-mixed" if job.precision.mode == "bf16-mixed" else "32")
