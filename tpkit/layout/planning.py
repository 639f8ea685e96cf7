"""A layout planned without workers, and the rank table as text.

``build_fake_state`` builds the ParallelState rank ``rank`` of a ``world_size`` world
would build, with the same tpkit.layout.topology code, on PyTorch's fake process group in this
process (no workers, no GPUs; about 2 s for 65,536 ranks). ``tpkit-launch --dry-run``
prints its rank table and group summary (tpkit.cli.plan), and tests check layouts of
any size with it. ``format_rank_table`` also formats a live state's
``ParallelState.rank_table()``.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch.distributed as dist

from .config import ParallelConfig
from .topology import GROUP_NAMES, ParallelState, build_state

__all__ = ["build_fake_state", "destroy_fake_state", "fake_state", "planned_rank_table",
           "format_ranks", "format_rank_table", "group_summary"]


def build_fake_state(config: ParallelConfig, world_size: int, rank: int = 0) -> ParallelState:
    """The state rank ``rank`` would build in a world of ``world_size``, on the fake process
    group. Requires that no default process group exists; free it with
    destroy_fake_state() (or use ``fake_state``)."""
    if dist.is_initialized():
        raise RuntimeError("build_fake_state needs a process without a default process group")
    config = config.validate(world_size)
    # Importing this module registers the "fake" backend (no public home in torch yet).
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        return build_state(config, device_type="cpu")
    except Exception:
        dist.destroy_process_group()
        raise


def destroy_fake_state(state: ParallelState) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_state(config: ParallelConfig, world_size: int, rank: int = 0):
    """``with fake_state(config, world) as state:`` build_fake_state, destroyed after."""
    state = build_fake_state(config, world_size, rank)
    try:
        yield state
    finally:
        destroy_fake_state(state)


def planned_rank_table(config: ParallelConfig, world_size: int,
                       nproc_per_node: int) -> list[dict]:
    """``ParallelState.rank_table()`` of the planned layout (what workers will see)."""
    with fake_state(config, world_size) as state:
        return state.rank_table(nproc_per_node=nproc_per_node)


# --- text ------------------------------------------------------------------------------
def format_ranks(ranks: Sequence[int]) -> str:
    """``0-7`` (consecutive), ``0..56/8`` (first..last/step), ``0,2`` for short strided
    groups, or the first 8 of an irregular group followed by ``,...``."""
    ranks = list(ranks)
    if len(ranks) == 1:
        return str(ranks[0])
    step = ranks[1] - ranks[0]
    if all(b - a == step for a, b in zip(ranks, ranks[1:])):
        if len(ranks) <= 4 and step != 1:
            return ",".join(map(str, ranks))
        return f"{ranks[0]}-{ranks[-1]}" if step == 1 else f"{ranks[0]}..{ranks[-1]}/{step}"
    return ",".join(map(str, ranks[:8])) + (",..." if len(ranks) > 8 else "")


def format_rank_table(rows: list[dict], *, limit: int | None = None) -> str:
    """A fixed-width text table of ``rank_table()`` rows; ``limit`` keeps the first and
    last rows of huge tables."""
    cols = ["rank", "node", "local_rank", "tp", "cp", "dp", "pp",
            "tp_group", "cp_group", "dp_group", "pp_group"]
    if rows and "ep" in rows[0]:   # a layout with an expert decomposition
        cols += ["etp", "ep", "edp"]
    shown = rows
    if limit is not None and len(rows) > limit:
        shown = rows[: limit // 2] + [None] + rows[-(limit - limit // 2):]
    text_rows = [list(cols)]
    for row in shown:
        if row is None:
            text_rows.append(["..."] + [""] * (len(cols) - 1))
            continue
        text_rows.append([format_ranks(row[c]) if c.endswith("_group") else str(row[c])
                          for c in cols])
    widths = [max(len(r[i]) for r in text_rows) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)).rstrip()
                     for r in text_rows)


def group_summary(state: ParallelState) -> list[str]:
    """One line per group kind: size, how many groups, and this rank's members."""
    lines = []
    for name in GROUP_NAMES:
        if getattr(state, f"{name}_mesh") is None:
            continue
        ranks = state.group_ranks(name)
        lines.append(f"  {name:<7} size {len(ranks):>6} x {state.world_size // len(ranks):>6} "
                     f"groups   rank {state.rank}'s: {format_ranks(ranks)}")
    return lines
