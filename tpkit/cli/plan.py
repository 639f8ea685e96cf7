"""The dry-run report of tpkit-launch: what would run, then the group summary and rank
table of the planned layout (tpkit.layout.planning: the same ParallelState code the workers
run, on a fake process group in this process)."""
from __future__ import annotations

import shlex

__all__ = ["report"]


def report(plan, *, limit: int, memory=()) -> str:
    """The whole dry-run text for a resolved launch ``plan`` (tpkit.cli.launch.Plan);
    ``memory``: the memory estimate's lines (tpkit.cli.memory), before the rank table."""
    from tpkit.layout.planning import fake_state, format_rank_table, group_summary
    c = plan.config
    nodes = str(plan.max_nodes) if plan.min_nodes == plan.max_nodes \
        else f"{plan.min_nodes}:{plan.max_nodes} (table for {plan.max_nodes})"
    world = plan.max_nodes * plan.nproc_per_node
    head = [
        "tpkit-launch --dry-run: nothing was started",
        f"layout      tp={c.tp} cp={c.cp} pp={c.pp} dp={world // c.model_size} "
        f"sequence_parallel={c.sequence_parallel} cp_comm_type={c.cp_comm_type}"
        + (f" cp_a2a_size={c.cp_a2a_size}" if c.cp_a2a_size else "")
        + (f" ep={c.ep} etp={c.expert_tp} edp={c.validate(world).edp}"
           if c.has_experts else ""),
        f"world       {world} = {nodes} node(s) x {plan.nproc_per_node} processes",
        f"backend     {plan.backend}",
        f"rendezvous  {plan.rdzv_backend} {plan.rdzv_endpoint or '<not set>'} "
        f"id={plan.rdzv_id} node_rank={'-' if plan.node_rank is None else plan.node_rank}"
        + (f" (Slurm job {plan.slurm.job_id})" if plan.slurm else ""),
        "command     " + shlex.join(plan.command),
        "environment " + " ".join(f"{k}={v}" for k, v in sorted(plan.exports.items())),
    ]
    with fake_state(c, world) as state:
        summary = group_summary(state)
        table = format_rank_table(state.rank_table(nproc_per_node=plan.nproc_per_node),
                                  limit=limit)
    return "\n".join(head + ["groups (size x count, rank 0's members):"] + summary
                     + list(memory) + ["rank table:", table])
