"""Train the reference GPT (launch/gpt.py) with Fabric + TPKitStrategy + TPKitPrecision.

    tpkit-launch --tp 2 --cp 2 launch/train.py                 # CPU, 4 gloo ranks
    tpkit-launch --nproc-per-node auto --tp 2 launch/train.py --precision bf16-mixed
    tpkit-launch --tp 2 --cp 2 launch/train.py --precision fp8 --fp8-recipe current

The layout comes from tpkit-launch (TPKIT_* variables) or from --tp/--cp here. Weights are
initialised at full size from --seed and sharded onto the layout, and the global batch of
step k is the same at every layout, so runs at different layouts follow the same loss
curve (tests/test_train.py proves it). Rank 0 prints one progress line per --log-every.
Under tpkit-launch, ``tpkit_preflight`` checks the arguments, the layout, the model's
sizes and --resume's checkpoint once, before any worker starts (docs/launch.md).
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import corpus  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from tpkit.config import CP_COMM_TYPES, FP8_RECIPES  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    lay = ap.add_argument_group("layout (default: from tpkit-launch's TPKIT_* variables)")
    lay.add_argument("--tp", type=int, default=None)
    lay.add_argument("--cp", type=int, default=None)
    lay.add_argument("--sequence-parallel", action="store_true", default=None)
    lay.add_argument("--cp-comm-type", default=None,
                     choices=CP_COMM_TYPES)
    lay.add_argument("--data-parallel", default="ddp", choices=["ddp", "fsdp"])
    m = ap.add_argument_group("model")
    m.add_argument("--hidden", type=int, default=128)
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--heads", type=int, default=8)
    m.add_argument("--gqa-groups", type=int, default=4)
    m.add_argument("--ffn", type=int, default=512)
    m.add_argument("--dropout", type=float, default=0.0)
    m.add_argument("--backend", default="torch", choices=["torch", "te", "auto"],
                   help="the transformer blocks' implementation: tpkit's torch layers, "
                        "Transformer Engine's (GPUs), or TE where it can run")
    t = ap.add_argument_group("training")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--global-batch", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=128)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup", type=int, default=10)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--precision", default="32-true",
                   choices=["32-true", "bf16-mixed", "16-mixed", "fp8"])
    t.add_argument("--fp8-compute-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="with --precision fp8: the dtype of what fp8 does not cover "
                        "(TPKitPrecision's fallback_compute_dtype)")
    t.add_argument("--fp8-recipe", default=None, choices=sorted(FP8_RECIPES),
                   help="with --precision fp8: TE's recipe (default: delayed on the torch "
                        "backend, TE's own default on backend te)")
    t.add_argument("--recompute", action="store_true")
    t.add_argument("--log-every", type=int, default=10)
    c = ap.add_argument_group("checkpoints")
    c.add_argument("--save", default=None,
                   help="directory for sharded checkpoints, written as SAVE/stepNNNNNN")
    c.add_argument("--save-every", type=int, default=0, help="0: only at the end")
    c.add_argument("--resume", default=None,
                   help="a checkpoint (SAVE/stepNNNNNN) or a --save directory (its latest); "
                        "it may have been written at any layout")
    add_hf_args(ap)
    add_moe_args(ap)
    add_pack_args(ap)
    add_recovery_args(ap)
    add_pipeline_args(ap)
    args = ap.parse_args(argv)
    check_moe_args(args, ap)
    for name in ("steps", "global_batch", "seq_len", "hidden", "layers", "heads", "gqa_groups",
                 "ffn", "log_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    for name in ("warmup", "save_every", "clip"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 0 (0: off)")
    if not args.lr > 0:
        ap.error(f"--lr={args.lr} must be > 0, e.g. 3e-3")
    if not 0.0 <= args.dropout < 1.0:
        ap.error(f"--dropout={args.dropout} must be in [0, 1)")
    check_pack_args(ap, args)
    check_hf_args(ap, args)
    check_recovery_args(ap, args)
    if args.fp8_recipe is not None and args.precision != "fp8":
        ap.error(f"--fp8-recipe={args.fp8_recipe} needs --precision fp8 (got --precision "
                 f"{args.precision}); add --precision fp8 or drop --fp8-recipe")
    if args.save and os.path.exists(args.save) and not os.path.isdir(args.save):
        ap.error(f"--save={args.save!r} is a file; pass a directory (checkpoints go in "
                 "SAVE/stepNNNNNN)")
    if args.save_every and not args.save:
        ap.error(f"--save-every={args.save_every} needs --save DIR (where to write them)")
    if args.precision != "fp8" and args.fp8_compute_dtype != "float32":
        ap.error(f"--fp8-compute-dtype={args.fp8_compute_dtype} needs --precision fp8 (got "
                 f"--precision {args.precision}); drop it")
    return args


# --- pipeline parallelism (tpkit.pipeline; docs/pipeline.md) -----------------------------
def add_pipeline_args(ap: argparse.ArgumentParser) -> None:
    from tpkit.pipeline import SCHEDULES
    p = ap.add_argument_group("pipeline parallelism (docs/pipeline.md)")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline stages (default: tpkit-launch's --pp, else 1)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per step and dp rank (default 2 x pp); the local "
                        "batch (global batch / dp) must split into them")
    p.add_argument("--pp-schedule", default="1F1B", choices=list(SCHEDULES),
                   help="torch.distributed.pipelining schedule")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="stages per rank for the interleaved schedules (default 2)")


def check_pipeline(args, state) -> None:
    """The pipeline options against the layout ``state``: ValueError naming the flag and
    the fix (tpkit.pipeline.plan_pipeline's checks, in train.py's words). At pp=1,
    --microbatches is gradient accumulation over that many micro-batches."""
    from tpkit.pipeline import plan_pipeline
    pp, m = state.pp_size, microbatches(args, state)
    if pp == 1:
        given = [f"--virtual-stages={args.virtual_stages}"] \
            if args.virtual_stages is not None else []
        if args.pp_schedule != "1F1B":
            given.append(f"--pp-schedule={args.pp_schedule}")
        if given:
            raise ValueError(f"{', '.join(given)} only apply with pipeline stages (pp=1 here); "
                             "add --pp N (N > 1) or drop them")
        if args.microbatches is not None and (args.pack or args.init_from_hf):
            raise ValueError(f"--microbatches={m} (gradient accumulation at pp=1) runs the "
                             "reference GPT on token batches; drop --pack/--init-from-hf or "
                             "--microbatches")
    else:
        for flag, bad in (("--init-from-hf", args.init_from_hf), ("--pack", args.pack),
                          ("--data-parallel fsdp", args.data_parallel == "fsdp"),
                          (f"--precision {args.precision}", args.precision != "32-true")):
            if bad:
                raise ValueError(f"{flag} with --pp {pp}: pipelined training runs the "
                                 "reference GPT in float32 with DDP so far; drop it or use "
                                 "--pp 1")
        try:
            plan_pipeline(pp=pp, num_blocks=args.layers, microbatches=m,
                          schedule=args.pp_schedule, virtual_stages=args.virtual_stages,
                          recompute=args.recompute)
        except ValueError as e:
            raise ValueError(f"--pp {pp} --layers {args.layers} --microbatches {m} "
                             f"--pp-schedule {args.pp_schedule}: {e}") from None
    if m < 1:
        raise ValueError(f"--microbatches={m} must be >= 1")
    if (args.global_batch // state.dp_size) % m:
        raise ValueError(f"--global-batch={args.global_batch} does not split into dp x "
                         f"microbatches = {state.dp_size} x {m}; use a multiple of "
                         f"{state.dp_size * m} (or change --microbatches)")


def microbatches(args, state) -> int:
    if args.microbatches is not None:
        return args.microbatches
    return 2 * state.pp_size if state.pp_size > 1 else 1


def local_rows(args, state) -> torch.Tensor:
    """The global batch's rows this dp rank trains on. With m micro-batches, micro-batch
    i of the step is the same global rows [i*G/m, (i+1)*G/m) at every layout, each dp rank
    taking its contiguous share of it (the MoE load-balancing loss, computed per
    micro-batch over the dp ranks, is then the same at every layout)."""
    m, dp = microbatches(args, state), state.dp_size
    per = args.global_batch // (m * dp)
    return torch.cat([torch.arange(per) + i * per * dp + state.dp_rank * per
                      for i in range(m)])


def pipeline_stages(args, state) -> list[str]:
    """The dry run's lines: which stages and blocks every pp rank (and its ranks) runs."""
    from tpkit.pipeline import plan_pipeline
    from tpkit.planning import format_ranks
    plan = plan_pipeline(pp=state.pp_size, num_blocks=args.layers,
                         microbatches=microbatches(args, state), schedule=args.pp_schedule,
                         virtual_stages=args.virtual_stages)
    rows = state.rank_table(nproc_per_node=1)
    lines = [f"pipeline (train.py): {plan.schedule}, {plan.microbatches} micro-batches, "
             f"{plan.num_stages} stages of {args.layers // plan.num_stages} block(s)"]
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


def setup_model(fabric, model, args):
    """(model, optimizer) set up by Fabric, the optimizer over the set-up module's
    parameters (FSDP2's shards; with pipeline stages, this rank's stages only)."""
    def adamw(params):
        return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    # Set the module up first, then build the optimizer from what it holds: FSDP2
    # replaces the parameters by sharded ones, and pipeline stages keep only theirs.
    model = fabric.setup_module(model)
    return model, fabric.setup_optimizers(adamw(model.parameters()))


def forward_backward(fabric, model, x, y, args) -> torch.Tensor:
    """One batch's forward and backward; the loss of this rank's tokens (pp > 1: every
    stage gets it from the last, tpkit.pipeline)."""
    state = fabric.strategy.parallel_state
    if state.pp_size > 1:
        return fabric.strategy.pipeline_step(x, target=y)
    m = microbatches(args, state)
    total = 0.0
    for i, (xi, yi) in enumerate(zip(x.chunk(m), y.chunk(m))):   # gradient accumulation
        with fabric.no_backward_sync(model, enabled=i < m - 1):
            loss = model(xi, yi) / m
            fabric.backward(loss)
        total = total + loss.detach()
    return total


# --- packed documents (tpkit.data.pack_sequences, THD attention) ---------------------------
def add_pack_args(ap: argparse.ArgumentParser) -> None:
    p = ap.add_argument_group("packed documents")
    p.add_argument("--pack", action="store_true",
                   help="train on whole corpus documents packed into one row per rank "
                        "(--global-batch documents of at most --seq-len tokens per step); "
                        "attention stays inside each document, positions restart per "
                        "document, the loss is the mean over the global batch's tokens")


def check_pack_args(ap: argparse.ArgumentParser, args) -> None:
    if args.pack and args.backend == "te":
        ap.error("--pack needs --backend torch or auto (TE's TransformerLayer is built with "
                 "attn_input_format='sbhd'); drop --pack or --backend te")
    if args.pack and args.init_from_hf:
        ap.error("--pack trains the reference GPT; drop --init-from-hf or --pack")


def packed_loss(model, data, docs, step: int, args, state, device) -> torch.Tensor:
    """This rank's share of the global token-mean loss of packed step ``step``: its DP slice
    of the documents packed into one row, its CP shard of that row; the summed loss is
    scaled so that DDP's average over dp x cp is the global mean over labelled tokens."""
    from tpkit.data import pack_sequences
    batch = corpus.doc_batch(data, docs, step, args.global_batch, args.seq_len, args.seed)
    labelled = sum(len(d) - 1 for d in batch)          # the same number on every rank
    per = args.global_batch // state.dp_size
    row = pack_sequences(batch[state.dp_rank * per:(state.dp_rank + 1) * per], state=state)
    local = row.shard(state)
    kw = {k: v.to(device) if torch.is_tensor(v) else v
          for k, v in local.attention_kwargs().items()}
    loss_sum = model(local.tokens.to(device), local.labels.to(device),
                     local.position_ids.to(device), **kw)
    return loss_sum * (state.dp_cp_size / max(1, labelled))


# --- recovery (tpkit.recovery; docs/launch.md#recovery) -----------------------------------
def add_recovery_args(ap: argparse.ArgumentParser) -> None:
    r = ap.add_argument_group("recovery (with --save: SIGTERM/SIGUSR1 save a checkpoint after "
                              "the current step and exit with 128 + the signal)")
    r.add_argument("--auto-resume", action="store_true",
                   help="resume from the newest complete checkpoint in --save (written at any "
                        "layout), else start fresh and say so")
    r.add_argument("--keep", type=int, default=None, metavar="N",
                   help="keep the newest N checkpoints in --save (never the one resumed from)")
    r.add_argument("--hang-timeout", type=float, metavar="S", default=None,
                   help="no progress for S seconds: dump stacks, name the stuck ranks, exit "
                        "124 (default $TPKIT_HANG_TIMEOUT, which the Slurm templates set; "
                        "else off)")
    r.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background (the next save waits for it)")


def check_recovery_args(ap: argparse.ArgumentParser, args) -> None:
    for flag, on in (("--auto-resume", args.auto_resume), ("--keep", args.keep is not None),
                     ("--async-save", args.async_save)):
        if on and not args.save:
            ap.error(f"{flag} needs --save DIR (the checkpoint directory)")
    if args.auto_resume and args.resume:
        ap.error(f"--auto-resume and --resume={args.resume} both choose the checkpoint to "
                 "start from; pass one")
    if args.keep is not None and args.keep < 1:
        ap.error(f"--keep={args.keep} must be >= 1 (how many checkpoints to keep); leave "
                 "--keep out to keep them all")
    if args.hang_timeout is not None and not args.hang_timeout > 0:
        ap.error(f"--hang-timeout={args.hang_timeout} must be > 0 seconds (longer than the "
                 "slowest step or save); leave it out for no watchdog")
    env = os.environ.get("TPKIT_HANG_TIMEOUT", "").strip()
    if args.hang_timeout is None and env:
        try:
            args.hang_timeout = float(env)
        except ValueError:
            args.hang_timeout = -1.0
        if not args.hang_timeout > 0:
            ap.error(f"TPKIT_HANG_TIMEOUT={env!r} must be a number of seconds > 0 (e.g. "
                     "900); unset it to turn the hang watchdog off")


def make_recovery(args, world: int):
    from tpkit.recovery import Recovery
    return Recovery(args.save, save_every=args.save_every, keep=args.keep,
                    hang_timeout=args.hang_timeout, async_save=args.async_save,
                    signals=() if not args.save else (signal.SIGTERM, signal.SIGUSR1),
                    straggler_every=args.log_every if world > 1 else None)


# --- Hugging Face checkpoints (tpkit.models.llama) -----------------------------------------
_MODEL_ARGS = ("hidden", "layers", "heads", "gqa_groups", "ffn")


def add_hf_args(ap: argparse.ArgumentParser) -> None:
    h = ap.add_argument_group("Hugging Face checkpoints (Llama, Qwen2, Mistral)")
    h.add_argument("--init-from-hf", default=None, metavar="DIR",
                   help="fine-tune the model of this Hugging Face directory (config.json + "
                        "*.safetensors) instead of the reference GPT; corpus bytes are its "
                        "token ids, so its vocabulary must hold 256")
    h.add_argument("--export-hf", default=None, metavar="DIR",
                   help="write the trained model there as a Hugging Face checkpoint "
                        "(needs --init-from-hf)")


def check_hf_args(ap: argparse.ArgumentParser, args) -> None:
    """Refuse option combinations that cannot work (exit 2, one line). The directory itself
    is read by hf_model's caller before any process group exists (a dry run need not
    have it)."""
    if args.export_hf and not args.init_from_hf:
        ap.error("--export-hf needs --init-from-hf (the reference GPT has no Hugging Face "
                 "architecture)")
    given = [f"--{a.replace('_', '-')}" for a in _MODEL_ARGS
             if args.init_from_hf and getattr(args, a) != ap.get_default(a)]
    if given:
        ap.error(f"{', '.join(given)} cannot be combined with --init-from-hf (the sizes come "
                 f"from {args.init_from_hf}/config.json); drop them")


def check_hf_dir(path: str):
    """``path``'s LlamaConfig; ValueError unless it is a model tpkit reads whose vocabulary
    holds the corpus' byte ids."""
    from tpkit.models.hf import read_config
    cfg, _ = read_config(path)
    if cfg.vocab_size < corpus.VOCAB_SIZE:
        raise ValueError(f"--init-from-hf={path}: vocab_size={cfg.vocab_size} cannot hold "
                         f"the corpus' {corpus.VOCAB_SIZE} byte ids; use a model with a "
                         "larger vocabulary")
    return cfg


def hf_model(args, state) -> torch.nn.Module:
    from tpkit.models import Llama
    return Llama.from_hf(args.init_from_hf, state, backend=args.backend,
                         recompute=args.recompute, hidden_dropout=args.dropout,
                         attention_dropout=args.dropout)



# --- checks before the workers start (tpkit-launch runs tpkit_preflight) ----------------
def check_job(args, state) -> None:
    """The argument checks that need the layout ``state`` (a ParallelState): ValueError
    naming the flag and the fix. The workers run them too (under plain torchrun)."""
    from tpkit.data import check_sequence_length
    if args.global_batch % state.dp_size:
        raise ValueError(f"--global-batch={args.global_batch} is not divisible by dp="
                         f"{state.dp_size}; use a multiple of {state.dp_size}")
    if getattr(args, "pack", False):
        return   # --pack pads every document to the layout's multiple itself
    try:
        check_sequence_length(args.seq_len, state)
    except ValueError as e:
        raise ValueError(f"--seq-len={args.seq_len}: {e}") from None
    check_pipeline(args, state)


def model_config(args, backend=None) -> GPTConfig:
    return GPTConfig(vocab_size=corpus.VOCAB_SIZE, hidden_size=args.hidden,
                     num_layers=args.layers, num_heads=args.heads,
                     num_gqa_groups=args.gqa_groups, ffn_hidden_size=args.ffn,
                     dropout=args.dropout, recompute=args.recompute,
                     backend=backend or args.backend, **moe_config(args))


def tpkit_preflight(argv, launch) -> None:
    """Run by tpkit-launch before any worker starts (docs/launch.md, "Pre-flight checks"):
    the arguments, the layout they give under this launch, the model at that layout (on
    the meta device of a planned state: the layers' own checks) and --resume's checkpoint
    against that model. A ValueError or argparse error stops the launch (exit 2)."""
    from tpkit.checkpoint import verify
    from tpkit.config import ParallelConfig
    from tpkit.planning import fake_state
    from tpkit.random import get_rng_tracker, model_parallel_seed
    args = parse_args(argv)
    config = ParallelConfig.from_env(
        launch.env, tp=args.tp, cp=args.cp, pp=args.pp,
        sequence_parallel=args.sequence_parallel, cp_comm_type=args.cp_comm_type,
        ep=args.ep, etp=args.etp, given_as="train.py --{flag}")
    try:
        config = config.validate(launch.world_size)
    except ValueError as e:
        raise ValueError(f"{e} [world size {launch.world_size} = {launch.nnodes} node(s) x "
                         f"{launch.nproc_per_node} processes: this launch]") from None
    if args.backend == "te" and not launch.dry_run:   # the workers run here: TE, CUDA as here
        from tpkit.te import require_te
        try:
            require_te()
        except (ImportError, RuntimeError) as e:
            raise ValueError(f"--backend te: {e}") from None
    # a dry run may plan a download: the directory is read only when workers will start
    hf_cfg = check_hf_dir(args.init_from_hf) if args.init_from_hf and not launch.dry_run \
        else None
    with fake_state(config, launch.world_size) as state:
        check_job(args, state)
        cfg = model_config(args, backend="torch")   # shapes are backend-independent
        try:
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                model_parallel_seed(args.seed, state)   # the layers draw TP shards from it
                if hf_cfg is not None:   # its shapes at this layout, no weights read
                    hf_cfg.validate().check_tp(state.tp_size)
                model = None if args.init_from_hf else GPT(cfg, state)
        except ValueError as e:
            what = (f"--init-from-hf {args.init_from_hf}" if args.init_from_hf else
                    f"--hidden {args.hidden} --heads {args.heads} --gqa-groups "
                    f"{args.gqa_groups} --ffn {args.ffn}")
            raise ValueError(f"the model ({what}) does not fit tp={config.tp}: {e}") from None
        finally:
            get_rng_tracker().reset()
        if launch.dry_run and state.pp_size > 1:
            print("\n".join(pipeline_stages(args, state)))
        if args.resume and not launch.dry_run:   # a dry run may plan a resume of a future save
            verify(resolve_resume(args.resume), None if model is None else {"model": model},
                   state=state)
    from tpkit.memory import MemoryJob   # the model and batch, for tpkit-launch's estimate
    return MemoryJob.from_train_args(args, dp=config.dp, pp=config.pp)


def full_init(model: torch.nn.Module, seed: int) -> None:
    """Layout-independent initialisation: draw every parameter at its full (unsharded)
    shape from a generator seeded by (seed, parameter index), then shard it in."""
    from tpkit.checkpoint import full_shapes, load_full_state_dict
    new = {}
    own = model.state_dict()
    for i, (name, shape) in enumerate(sorted(full_shapes(model).items())):
        g = torch.Generator().manual_seed(seed * 10_007 + i)
        if name.endswith("_extra_state"):                  # TE's fp8 metadata
            new[name] = own[name]
        elif name.endswith("weight") and len(shape) == 1:   # norm scales
            new[name] = torch.ones(shape)
        elif len(shape) == 1:                              # biases
            new[name] = torch.zeros(shape)
        else:
            std = 0.02 / math.sqrt(2 * model.cfg.num_layers) if "proj" in name or "fc2" in name \
                else 0.02
            new[name] = torch.randn(shape, generator=g, dtype=torch.float32).mul_(std)
    load_full_state_dict(model, new)


def resolve_resume(path: str) -> str:
    """``path`` itself if it is a checkpoint, else the latest SAVE/stepNNNNNN inside it."""
    if not os.path.isdir(path):
        raise ValueError(f"--resume={path!r} is not a directory; pass a checkpoint written by "
                         "--save (SAVE/stepNNNNNN) or the --save directory (its latest)")
    steps = sorted(d for d in os.listdir(path) if d.startswith("step") and d[4:].isdigit())
    return os.path.join(path, steps[-1]) if steps else path


def add_moe_args(ap) -> None:
    """Mixture of experts (docs/moe.md): the option group, checked by check_moe_args."""
    g = ap.add_argument_group("mixture of experts (docs/moe.md)")
    g.add_argument("--moe-experts", type=int, default=0,
                   help="experts per MoE layer (0: dense MLPs)")
    g.add_argument("--moe-topk", type=int, default=2, help="experts per token")
    g.add_argument("--moe-every", type=int, default=1, help="every k-th block is MoE")
    g.add_argument("--moe-aux-coeff", type=float, default=1e-2,
                   help="load-balancing loss coefficient")
    g.add_argument("--moe-capacity-factor", type=float, default=None,
                   help="drop tokens beyond this capacity (default: dropless)")
    g.add_argument("--ep", type=int, default=None, help="expert-parallel size")
    g.add_argument("--etp", type=int, default=None, help="expert-tensor-parallel size")


def check_moe_args(args, ap) -> None:
    """The MoE options against each other and the layout, before any process group."""
    if not args.moe_experts:
        for name in ("ep", "etp", "moe_capacity_factor"):
            if getattr(args, name) is not None:
                ap.error(f"--{name.replace('_', '-')} needs --moe-experts > 0")
        return
    if getattr(args, "pack", False):
        ap.error("--moe-experts with --pack is not supported yet (packed rows hold unequal "
                 "token counts, which the aux loss's share assumes equal); drop one of them")
    from tpkit.config import ParallelConfig
    from tpkit.nn.moe import check_moe_args as check
    try:
        check(args.moe_experts, args.moe_topk, args.moe_capacity_factor)
        ep = ParallelConfig.from_env(ep=args.ep, etp=args.etp).ep
    except ValueError as e:
        ap.error(f"--moe-*/--ep: {e}")
    if args.moe_experts % ep:
        ap.error(f"--moe-experts={args.moe_experts} is not divisible by ep={ep}; use a "
                 f"multiple of {ep}")
    if not 1 <= args.moe_every <= args.layers:
        ap.error(f"--moe-every={args.moe_every} must be between 1 and --layers={args.layers}")


def moe_config(args) -> dict:
    """GPTConfig's MoE fields from the options."""
    return dict(moe_experts=args.moe_experts, moe_topk=args.moe_topk,
                moe_every=args.moe_every, moe_aux_coeff=args.moe_aux_coeff,
                moe_capacity_factor=args.moe_capacity_factor)


def moe_report(model, args, state) -> str:
    """The aux loss and per-expert token load (min / max over experts, summed over the
    MoE layers) of the last step's last micro-batch on this rank's data-parallel replica,
    over every pipeline stage's MoE layers (collective over pp_group at pp > 1)."""
    if not args.moe_experts:
        return ""
    layers = model.moe_layers()   # this rank's stages' own at pp > 1
    stats = torch.zeros(1 + args.moe_experts, dtype=torch.float64)
    for m in layers:
        stats[0] += float(m.aux_loss.detach())
        stats[1:] += m.last_routing.tokens_per_expert.detach().cpu().double()
    if state.pp_size > 1:
        from tpkit.collectives import all_reduce_sum
        stats = all_reduce_sum(stats.to(state.device), state.pp_group).cpu()
    aux, load = float(stats[0]), stats[1:]
    return f"  aux {aux:.4f}  load {int(load.min())}-{int(load.max())}"


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _precision(args, fallback):
    """TPKitPrecision from --precision, --fp8-compute-dtype and --fp8-recipe."""
    from tpkit.fabric import TPKitPrecision
    if args.precision != "fp8":
        return TPKitPrecision(args.precision)
    return TPKitPrecision("fp8", fallback_compute_dtype=fallback, recipe=args.fp8_recipe)


def make_fabric(args):
    from lightning.fabric import Fabric
    from tpkit.fabric import TPKitStrategy
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    nodes = max(1, int(os.environ.get("WORLD_SIZE", local)) // local)
    from tpkit.config import ParallelConfig
    pipelined = ParallelConfig.from_env(pp=args.pp).pp > 1   # else --microbatches accumulates
    strategy = TPKitStrategy(tp=args.tp, cp=args.cp, pp=args.pp,
                             sequence_parallel=args.sequence_parallel,
                             cp_comm_type=args.cp_comm_type, data_parallel=args.data_parallel,
                             seed=args.seed,
                             microbatches=args.microbatches if pipelined else None,
                             pp_schedule=args.pp_schedule, virtual_stages=args.virtual_stages,
                             ep=args.ep, etp=args.etp)
    # Lightning takes precision plugin objects through plugins=, not precision=.
    fallback = {"float32": None, "bfloat16": torch.bfloat16}[args.fp8_compute_dtype]
    precision = _precision(args, fallback)
    return Fabric(accelerator=accelerator, devices=local, num_nodes=nodes, strategy=strategy,
                  plugins=[precision])


def train(args) -> list[float]:
    """Run the training loop; returns the global mean loss of every step run here."""
    if args.init_from_hf:
        check_hf_dir(args.init_from_hf)
    fabric = make_fabric(args)
    fabric.launch()
    state = fabric.strategy.parallel_state
    check_job(args, state)
    if args.init_from_hf:
        model = hf_model(args, state)
    else:
        model = GPT(model_config(args), state)
        full_init(model, args.seed)
    raw_model = model
    model, optimizer = setup_model(fabric, model, args)
    start = 0
    if args.resume:
        extra = fabric.load(resolve_resume(args.resume), {"model": model, "optimizer": optimizer})
        start = int(extra["step"]) + 1
    rec, saved = make_recovery(args, state.world_size), {"model": model, "optimizer": optimizer}
    if args.auto_resume:
        start = rec.resume(saved)
    data, _ = corpus.split(corpus.tokens())
    docs = corpus.documents(data) if args.pack else None
    losses, t_last, tokens_since = [], time.perf_counter(), 0
    for step in range(start, args.steps):
        t_step = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        if args.pack:
            loss = packed_loss(model, data, docs, step, args, state, fabric.device)
            fabric.backward(loss)
        else:
            x, y = corpus.batch(data, step, args.global_batch, args.seq_len, seed=args.seed)
            rows = local_rows(args, state)
            x, y = x[rows].to(fabric.device), y[rows].to(fabric.device)
            loss = forward_backward(fabric, model, x, y, args)
        if args.clip > 0:
            fabric.clip_gradients(model, optimizer, max_norm=args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        own_time = time.perf_counter() - t_step  # before the step's last wait (stragglers)
        report = loss.detach().float().clone()
        dist.all_reduce(report, group=state.dp_cp_group)
        losses.append(report.item() / state.dp_cp_size)
        tokens_since += args.global_batch * args.seq_len
        last = step == args.steps - 1
        if step % args.log_every == 0 or last:
            moe = moe_report(raw_model, args, state)   # every stage joins at pp > 1
        if state.rank == 0 and (step % args.log_every == 0 or last):
            dt = time.perf_counter() - t_last
            print(f"step {step:5d}  loss {losses[-1]:.6f}  lr {lr_at(step, args):.2e}  "
                  f"{tokens_since / dt:,.0f} tokens/s" + moe, flush=True)
            t_last, tokens_since = time.perf_counter(), 0
        if rec.step_end(step, saved, last=last, seconds=own_time):
            break
    rec.close()
    if rec.stopped_by:
        raise SystemExit(rec.exit_code)
    if args.export_hf:
        raw_model.save_hf(args.export_hf)
    return losses


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    losses = train(args)
    if losses and int(os.environ.get("RANK", 0)) == 0:
        k = max(1, len(losses) // 10)
        first, final = sum(losses[:k]) / k, sum(losses[-k:]) / k
        print(f"done: mean loss of first {k} steps {first:.4f} -> last {k} steps {final:.4f}",
              flush=True)
    return losses


if __name__ == "__main__":
    main()
    import tpkit
    tpkit.destroy_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
