"""Which pairs of the trainer's options are refused, and why: every pair of ``OPTIONS``
checked as ``tpkit-launch``'s pre-flight checks a job (``parse``, then ``check_layout`` at
the job's layout on ``WORLD`` ranks), without starting anything.

``python tools/train_pairs.py`` writes the list into docs/train.md ("Refused pairs");
tests/train/test_pairs.py fails while the page and ``refused_pairs()`` differ.
"""
from __future__ import annotations

import itertools
import types

from .config import parse

WORLD = 8
BASE = ["--steps", "2", "--seq-len", "32", "--global-batch", "16"]

# option -> its flags (at the model's default sizes: 2 layers, 8 heads, 4 kv heads)
OPTIONS: dict[str, list[str]] = {
    "tp": ["--tp", "2"],
    "sp": ["--tp", "2", "--sequence-parallel"],
    "cp": ["--cp", "2"],
    "pp": ["--pp", "2", "--microbatches", "2"],
    "fsdp": ["--data-parallel", "fsdp"],
    "hsdp": ["--data-parallel", "fsdp", "--dp-replicate", "2"],
    "fsdp-bf16": ["--data-parallel", "fsdp", "--fsdp-mixed-precision", "bf16"],
    "bf16-mixed": ["--precision", "bf16-mixed"],
    "16-mixed": ["--precision", "16-mixed"],
    "fp8": ["--precision", "fp8"],
    "recompute": ["--recompute"],
    "compile": ["--compile"],
    "offload": ["--cpu-offload-layers", "1"],
    "grad-accum": ["--microbatches", "2"],
    "init-from-hf": ["--init-from-hf", "HF_DIR"],
    "pack": ["--pack"],
    "experts": ["--moe-experts", "4"],
    "ep": ["--moe-experts", "4", "--ep", "2"],
    "dropout": ["--dropout", "0.1"],
    "impl-te": ["--model.impl", "te"],
}


def _flags(argv: list[str]) -> set[str]:
    return {a for a in argv if a.startswith("--")}


def _layout_state(job):
    """The sizes check_layout reads, of the job's layout on WORLD ranks (no process
    group: the pairs are many)."""
    c = job.layout({}).validate(WORLD)   # an empty environment: no launch
    return types.SimpleNamespace(tp_size=c.tp, cp_size=c.cp, pp_size=c.pp, dp_size=c.dp,
                                 dp_cp_size=c.dp * c.cp, ep_size=c.ep,
                                 sequence_parallel=bool(c.sequence_parallel))


def refusal(argv: list[str]) -> str | None:
    """The pre-flight's message for BASE + ``argv`` on WORLD ranks, or None (accepted)."""
    try:
        job, _ = parse(BASE + argv, env={})
        job.check_layout(_layout_state(job))
    except ValueError as e:
        return str(e)
    return None


def refused_pairs() -> list[tuple[str, str, str]]:
    """(option, option, message) of every pair of OPTIONS refused together although each
    alone is accepted; pairs that set the same flag are not pairs."""
    alone = {name: refusal(argv) for name, argv in OPTIONS.items()}
    bad = [n for n, why in alone.items() if why is not None]
    if bad:
        raise AssertionError(f"options refused alone: {[(n, alone[n]) for n in bad]}")
    out = []
    for (a, fa), (b, fb) in itertools.combinations(OPTIONS.items(), 2):
        if _flags(fa) & _flags(fb):
            continue
        why = refusal(fa + fb)
        if why is not None:
            out.append((a, b, why))
    return out


def markdown_list() -> str:
    """docs/train.md's list of refused pairs."""
    lines = [f"- `{a}` + `{b}`: {why}" for a, b, why in refused_pairs()]
    return "\n".join(lines) + "\n"


__all__ = ["OPTIONS", "WORLD", "BASE", "refusal", "refused_pairs", "markdown_list"]
