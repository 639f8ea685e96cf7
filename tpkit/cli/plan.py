"""The dry-run report of tpkit-launch: what would run, and the rank table and group
summary computed by the same ParallelState code the workers run, on a fake process
group in this process (no workers, no GPUs; about 2 s for 65,536 ranks)."""
from __future__ import annotations

import shlex

GROUPS = ("tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "mp", "amax", "cp_a2a", "cp_p2p")


def _fmt_ranks(ranks: list[int]) -> str:
    """``0-7``, ``0..56/8`` (first..last/step) or ``0,3,5`` for short irregular groups."""
    if len(ranks) == 1:
        return str(ranks[0])
    step = ranks[1] - ranks[0]
    if all(b - a == step for a, b in zip(ranks, ranks[1:])):
        if len(ranks) <= 4 and step != 1:
            return ",".join(map(str, ranks))
        return f"{ranks[0]}-{ranks[-1]}" if step == 1 else f"{ranks[0]}..{ranks[-1]}/{step}"
    head = ",".join(map(str, ranks[:8]))
    return head + (",..." if len(ranks) > 8 else "")


def planned_state(config, world_size: int):
    """The ParallelState rank 0 would build, on PyTorch's fake process group."""
    from tpkit.topology import build_fake_state
    return build_fake_state(config, world_size, rank=0)


def planned_rank_table(config, world_size: int, nproc_per_node: int) -> list[dict]:
    """``ParallelState.rank_table()`` of the planned layout (what workers will see)."""
    from tpkit.topology import destroy_fake_state
    state = planned_state(config, world_size)
    try:
        return state.rank_table(nproc_per_node=nproc_per_node)
    finally:
        destroy_fake_state(state)


def group_summary(state) -> list[str]:
    """One line per group kind: size, how many groups, and rank 0's members."""
    lines = []
    for name in GROUPS:
        if getattr(state, f"{name}_mesh") is None:
            continue
        ranks = state.group_ranks(name)
        lines.append(f"  {name:<7} size {len(ranks):>6} x {state.world_size // len(ranks):>6} "
                     f"groups   rank 0's: {_fmt_ranks(ranks)}")
    return lines


def report(plan, *, limit: int) -> str:
    """The whole dry-run text for a resolved launch ``plan`` (tpkit.cli.launch.Plan)."""
    from tpkit.topology import destroy_fake_state, format_rank_table
    c = plan.config
    nodes = str(plan.max_nodes) if plan.min_nodes == plan.max_nodes \
        else f"{plan.min_nodes}:{plan.max_nodes} (table for {plan.max_nodes})"
    world = plan.max_nodes * plan.nproc_per_node
    head = [
        "tpkit-launch --dry-run: nothing was started",
        f"layout      tp={c.tp} cp={c.cp} pp={c.pp} dp={world // c.model_size} "
        f"sequence_parallel={c.sequence_parallel} cp_comm_type={c.cp_comm_type}"
        + (f" cp_a2a_size={c.cp_a2a_size}" if c.cp_a2a_size else ""),
        f"world       {world} = {nodes} node(s) x {plan.nproc_per_node} processes",
        f"backend     {plan.backend}",
        f"rendezvous  {plan.rdzv_backend} {plan.rdzv_endpoint or '<not set>'} "
        f"id={plan.rdzv_id} node_rank={'-' if plan.node_rank is None else plan.node_rank}"
        + (f" (Slurm job {plan.slurm.job_id})" if plan.slurm else ""),
        "command     " + shlex.join(plan.command),
        "environment " + " ".join(f"{k}={v}" for k, v in sorted(plan.exports.items())),
    ]
    state = planned_state(c, world)
    try:
        summary = group_summary(state)
        table = format_rank_table(state.rank_table(nproc_per_node=plan.nproc_per_node),
                                  limit=limit)
    finally:
        destroy_fake_state(state)
    return "\n".join(head + ["groups (size x count, rank 0's members):"] + summary
                     + ["rank table:", table])
