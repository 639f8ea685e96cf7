"""How many nodes and processes per node a launch has: the flags against a cluster's variables
(Slurm, Kubeflow Trainer, SkyPilot) and the layout's world size."""
from __future__ import annotations

from typing import Mapping

from .errors import LaunchError


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"{name}={env[name]!r} is not an integer; unset it or pass "
                          "--node-rank") from None


def _from_cluster(args, cluster) -> tuple[int, int, int, str | None]:
    """Nodes, node rank and workers per node from Kubernetes or SkyPilot: flags that agree
    are accepted, flags that conflict are errors (as inside Slurm)."""
    where = f"drop {{}} under {cluster.engine}"
    if args.nnodes is not None and _nnodes(args.nnodes) != (cluster.nnodes, cluster.nnodes):
        raise LaunchError(f"--nnodes={args.nnodes} conflicts with {cluster.nnodes_var}="
                          f"{cluster.nnodes}; " + where.format("--nnodes"))
    if args.node_rank is not None and args.node_rank != cluster.node_rank:
        raise LaunchError(f"--node-rank={args.node_rank} conflicts with "
                          f"{cluster.node_rank_var}={cluster.node_rank}; "
                          + where.format("--node-rank"))
    if args.nproc_per_node is not None and cluster.nproc_per_node is not None \
            and args.nproc_per_node != cluster.nproc_per_node:
        raise LaunchError(f"--nproc-per-node={args.nproc_per_node} conflicts with "
                          f"{cluster.nproc_var}={cluster.nproc_per_node}; "
                          + where.format("--nproc-per-node"))
    if not 0 <= cluster.node_rank < cluster.nnodes:
        raise LaunchError(f"{cluster.node_rank_var}={cluster.node_rank} is out of range for "
                          f"{cluster.nnodes_var}={cluster.nnodes}; the {cluster.engine} job's "
                          "node ranks are 0..nnodes-1: run tpkit-launch in the job's own pods/nodes")
    return cluster.nnodes, cluster.nnodes, cluster.node_rank, \
        args.nproc_per_node or cluster.nproc_per_node


def _nproc(value: str, config, *, gpus: int, nnodes: int,
           given_as: str = "--nproc-per-node") -> int:
    if value == "auto":
        if gpus:
            return gpus
        if config.dp is None:  # CPU: one model copy per node
            return config.model_size
        world = config.model_size * config.dp  # CPU with --dp: the whole layout
        if world % nnodes:
            raise LaunchError(f"--dp={config.dp} gives {world} ranks, which do not split "
                              f"evenly over {nnodes} node(s); pass --nproc-per-node")
        return world // nnodes
    try:
        n = int(value)
    except ValueError:
        if value == "gpu" and gpus:
            return gpus
        raise LaunchError(f"{given_as}={value!r} is not a number; pass N or auto") from None
    if n < 1:
        raise LaunchError(f"{given_as}={n} must be >= 1")
    return n


def _nnodes(value: str) -> tuple[int, int]:
    parts = value.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise LaunchError(f"--nnodes={value!r} is not N or MIN:MAX with 1 <= MIN <= MAX")
    return lo, hi
