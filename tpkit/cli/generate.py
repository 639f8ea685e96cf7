"""tpkit-generate: sample from a checkpoint at any layout.

    tpkit-launch --tp 2 -m tpkit.cli.generate --hf DIR --prompt "Once upon" --max-new-tokens 32
    tpkit-generate --hf DIR --ids 1,2,3 --ids 4,5 --do-sample --top-p 0.9 --seed 1

The model is a Hugging Face checkpoint directory (``--hf``: Llama, Qwen2, Mistral, read
by ``tpkit.models.hf.from_hf``, each rank its own shard) or a checkpoint of
``tpkit-train`` (``--checkpoint``: a ``--save`` step directory, with the job's
``--config`` TOML that built it; read with ``tpkit.checkpoint.load``, resharded to this
layout). Prompts are text (``--prompt``, encoded by ``--tokenizer``, a local Hugging Face
tokenizer.json or directory; with ``--checkpoint``, the job's own data.tokenizer; without
one, UTF-8 bytes: the trainer's built-in corpus)
or token ids (``--ids 1,2,3``, each below the model's vocabulary size); several prompts of different lengths are left-padded with
``--pad-token-id`` and an attention mask, as Hugging Face does. Rank 0 prints one JSON
line per prompt: ``{"prompt": [...ids], "ids": [...new ids], "text": ...}``.

Layouts: any tp and dp (every DP rank generates every prompt), cp=1, no sequence
parallelism (``model.generate``'s rules: a ValueError says why otherwise).
"""
from __future__ import annotations

import argparse
import json
import sys

PROG = "tpkit-generate"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[2].replace(
        "\n", " "))
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", metavar="DIR", help="a Hugging Face checkpoint directory")
    src.add_argument("--checkpoint", metavar="DIR",
                     help="a tpkit-train checkpoint (SAVE/stepNNNNNN); needs --config")
    p.add_argument("--config", metavar="TOML", help="the tpkit-train job that wrote --checkpoint")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a text prompt (repeat for a batch)")
    p.add_argument("--ids", action="append", default=[], metavar="I,J,...",
                   help="a prompt as comma-separated token ids (repeat for a batch)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="a local Hugging Face tokenizer (tokenizer.json or its directory); "
                        "default: UTF-8 bytes")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    p.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--eos-token-id", type=int, action="append", default=None, metavar="ID")
    p.add_argument("--pad-token-id", type=int, default=None, metavar="ID",
                   help="left padding of shorter prompts (default: the eos id, else 0)")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32")
    return p


def _ids(text: str, flag: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: pass comma-separated integer token ids, e.g. "
                         "--ids 1,2,3") from None
    if not ids or min(ids) < 0:
        raise ValueError(f"{flag} {text!r}: pass at least one token id, each >= 0")
    return ids


def _check(args) -> None:
    if args.checkpoint and not args.config:
        raise ValueError("--checkpoint needs --config, the tpkit-train job TOML that wrote it "
                         "(it says which model to build)")
    if args.config and not args.checkpoint:
        raise ValueError("--config is for --checkpoint; a --hf directory has its config.json")
    if not args.prompt and not args.ids:
        raise ValueError("no prompt: pass --prompt TEXT or --ids 1,2,3 (repeat for a batch)")


def _check_source(args, tp: int, cp: int, sp: bool, files: bool = True) -> None:
    """The layout can generate and (``files``) the checkpoint exists: ValueError naming
    the flag."""
    import os
    if cp > 1:
        raise ValueError(f"cp={cp}: a decode step's one new token cannot be split over "
                         "context-parallel ranks; generate on a layout with cp=1 (--tp and "
                         "--dp as you like: the checkpoint is resharded)")
    if sp and tp > 1:
        raise ValueError("--sequence-parallel: a decode step's one new token cannot be split "
                         "over tensor-parallel ranks; launch without sequence parallelism")
    if not files:
        return
    if args.hf:
        from tpkit.models.hf import read_config
        cfg, _ = read_config(args.hf)
        cfg.check_tp(tp)
    else:
        if not os.path.isdir(args.checkpoint):
            raise ValueError(f"--checkpoint {args.checkpoint!r} is not a directory; pass a "
                             "checkpoint tpkit-train wrote (SAVE/stepNNNNNN)")
        if not os.path.isfile(args.config):
            raise ValueError(f"--config {args.config!r} does not exist; pass the job TOML "
                             "that wrote the checkpoint (tpkit-train --print-config)")


def _job(args):
    """The tpkit-train job of ``--config`` (None with ``--hf``)."""
    if not args.checkpoint:
        return None
    from tpkit.train import parse
    return parse(["--config", args.config], env={})[0]


def _vocab(args, job) -> tuple[int, str]:
    """The model's vocabulary size and where it comes from."""
    if args.hf:
        from tpkit.models.hf import read_config
        return read_config(args.hf)[0].vocab_size, f"{args.hf}/config.json"
    from tpkit.train.arch import vocab_size
    return vocab_size(job), f"the job {args.config}"


def _tokenizer(args, job) -> str | None:
    """The tokenizer of ``--prompt``: ``--tokenizer``, or with ``--checkpoint`` the job's
    own (data.tokenizer; none: the built-in corpus' UTF-8 bytes). ValueError when they
    disagree."""
    if job is None:
        return args.tokenizer
    own = job.data.tokenizer
    if args.tokenizer and own is None:
        raise ValueError(f"--tokenizer {args.tokenizer}: the job {args.config} trained on the "
                         "built-in corpus' UTF-8 bytes, not a tokenizer; drop --tokenizer")
    import os
    if args.tokenizer and os.path.realpath(args.tokenizer) != os.path.realpath(own):
        raise ValueError(f"--tokenizer {args.tokenizer} is not the tokenizer the job "
                         f"{args.config} trained with (data.tokenizer={own!r}); drop "
                         "--tokenizer (the job's is used)")
    return own


def _check_ids(args, prompts, vocab: int, where: str) -> None:
    """Every id of ``--ids``, ``--pad-token-id``, ``--eos-token-id`` in the vocabulary."""
    for p in prompts:
        bad = [i for i in p if i >= vocab]
        if bad:
            raise ValueError(f"--ids {','.join(map(str, p))!r}: token id {bad[0]} is outside "
                             f"the model's vocabulary of {vocab} (ids 0..{vocab - 1}, from "
                             f"{where}); pass ids below {vocab}")
    for flag, ids in (("--pad-token-id", [args.pad_token_id]),
                      ("--eos-token-id", args.eos_token_id or [])):
        for i in ids:
            if i is not None and not 0 <= i < vocab:
                raise ValueError(f"{flag} {i} is outside the model's vocabulary of {vocab} "
                                 f"(ids 0..{vocab - 1}, from {where}); pass an id below "
                                 f"{vocab}")


def tpkit_preflight(argv, launch):
    """tpkit-launch's pre-flight hook (tpkit.cli.preflight): the flags, the layout and
    (unless a dry run, which may plan for files not there yet) the checkpoint, checked
    before any worker starts."""
    args = _parser().parse_args(argv)
    _check(args)
    for t in args.ids:
        _ids(t, "--ids")
    c = launch.config
    _check_source(args, c.tp, c.cp, c.sequence_parallel, files=not launch.dry_run)
    if not launch.dry_run:
        job = _job(args)
        _tokenizer(args, job)
        _check_ids(args, [_ids(t, "--ids") for t in args.ids], *_vocab(args, job))


def _model(args, state, dtype):
    import torch
    if args.hf:
        from tpkit.models import hf
        return hf.from_hf(args.hf, state, dtype=dtype)
    from tpkit.checkpoint import load
    from tpkit.train.trainer import build_model
    model = build_model(_job(args), state)
    load(args.checkpoint, {"model": model})
    return model.to(dtype) if dtype != torch.float32 else model


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check(args)
        prompts = [_ids(t, "--ids") for t in args.ids]
        job = _job(args)
        tokenizer = _tokenizer(args, job)
        vocab = _vocab(args, job)
        _check_ids(args, prompts, *vocab)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    import torch
    import tpkit
    tok = None
    if tokenizer:
        from tpkit.data import Tokenizer
        tok = Tokenizer(tokenizer)
    for t in args.prompt:
        prompts.append(list(tok.encode(t)) if tok is not None else list(t.encode("utf-8")))
    dtype = getattr(torch, args.dtype)
    state = tpkit.init_parallel()
    try:
        _check_source(args, state.tp_size, state.cp_size, state.sequence_parallel)
        model = _model(args, state, dtype).eval()
        eos = args.eos_token_id
        pad = args.pad_token_id if args.pad_token_id is not None else (eos[0] if eos else 0)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        gen = torch.Generator(device=state.device).manual_seed(args.seed)
        out = model.generate(ids, mask, max_new_tokens=args.max_new_tokens,
                             do_sample=args.do_sample, temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p,
                             eos_token_id=eos[0] if eos and len(eos) == 1 else eos,
                             pad_token_id=pad, generator=gen)
        if state.rank == 0:
            for p, row in zip(prompts, out[:, width:].tolist()):
                if tok is not None:
                    text = tok.decode(row)
                elif args.hf is None:
                    text = bytes(t for t in row if t < 256).decode("utf-8", "replace")
                else:
                    text = None
                print(json.dumps({"prompt": p, "ids": row, "text": text}), flush=True)
    finally:
        tpkit.destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
