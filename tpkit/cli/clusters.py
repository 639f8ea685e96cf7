"""What tpkit-launch reads from Kubernetes (Kubeflow Trainer) and SkyPilot: node count,
node rank, workers per node and the rendezvous host, each checked (never guessed), read
as tpkit.cli.slurm reads a Slurm allocation.

- **Kubeflow Trainer v2** (a ``TrainJob`` on the ``torch-distributed`` runtime; its Torch
  plugin, ``pkg/runtime/framework/plugins/torch/torch.go``) sets in every node's pod
  ``PET_NNODES`` (the TrainJob's ``numNodes``), ``PET_NPROC_PER_NODE`` (``numProcPerNode``:
  a number, or ``auto``/``gpu``/``cpu``), ``PET_NODE_RANK`` (the pod's Job completion
  index), ``PET_MASTER_ADDR`` (``<trainjob>-node-0-0.<trainjob>``, the first pod's DNS
  name) and ``PET_MASTER_PORT`` (29400). Read when ``PET_NNODES`` and ``PET_MASTER_ADDR``
  are set.
- **SkyPilot** sets on every node ``SKYPILOT_NODE_IPS`` (one IP per line, the head node
  first), ``SKYPILOT_NUM_NODES``, ``SKYPILOT_NODE_RANK`` and
  ``SKYPILOT_NUM_GPUS_PER_NODE`` (0 without GPUs); ``SKYPILOT_TASK_ID`` names the task.
  Read when ``SKYPILOT_NODE_RANK`` is set. The port is ``$MASTER_PORT``, else 29400.

Both engines give every node its rank, so the rendezvous is torchrun's ``static`` one
(node rank 0 hosts the store at the first node's address), as the engines' own torchrun
recipes use it.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

DEFAULT_PORT = 29400   # Kubeflow's ContainerTrainerPort; SkyPilot has none of its own


class ClusterError(ValueError):
    """The engine's environment cannot give a consistent launch; the message says the fix."""


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    engine: str              # "Kubernetes" or "SkyPilot"
    nnodes: int
    node_rank: int
    nproc_per_node: str | None   # the engine's workers per node; None: tpkit's auto
    master_addr: str
    master_port: int
    rdzv_id: str
    nnodes_var: str
    node_rank_var: str
    nproc_var: str

    @property
    def endpoint(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    @property
    def rdzv_backend(self) -> str:
        return "static"


def _int(env: Mapping[str, str], name: str, engine: str, unset: str) -> int:
    raw = env.get(name, "").strip()
    try:
        return int(raw)
    except ValueError:
        missing = "is not set" if not raw else f"={raw!r} is not an integer"
        raise ClusterError(f"{name} {missing}: {engine} sets it on every node; run "
                           f"tpkit-launch in the {engine} job, or unset {unset} to launch "
                           "outside it") from None


def _port(env: Mapping[str, str], name: str, engine: str) -> int:
    raw = env.get(name) or str(DEFAULT_PORT)
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 < port <= 65535:
        raise ClusterError(f"{name}={raw!r} is not a port for the {engine} rendezvous; "
                           "set it to 1..65535")
    return port


def _kubernetes(env: Mapping[str, str]) -> ClusterInfo:
    engine, unset = "Kubernetes", "PET_NNODES"
    nnodes = _int(env, "PET_NNODES", engine, unset)
    node_rank = _int(env, "PET_NODE_RANK", engine, unset)
    return ClusterInfo(
        engine=engine, nnodes=nnodes, node_rank=node_rank,
        nproc_per_node=env.get("PET_NPROC_PER_NODE") or None,
        master_addr=env["PET_MASTER_ADDR"], master_port=_port(env, "PET_MASTER_PORT", engine),
        rdzv_id=f"k8s-{env['PET_MASTER_ADDR'].split('.')[0]}",
        nnodes_var="PET_NNODES", node_rank_var="PET_NODE_RANK", nproc_var="PET_NPROC_PER_NODE")


def _skypilot(env: Mapping[str, str]) -> ClusterInfo:
    engine, unset = "SkyPilot", "SKYPILOT_NODE_RANK"
    node_rank = _int(env, "SKYPILOT_NODE_RANK", engine, unset)
    nnodes = _int(env, "SKYPILOT_NUM_NODES", engine, unset)
    ips = env.get("SKYPILOT_NODE_IPS", "").split()
    if len(ips) != nnodes:
        raise ClusterError(f"SKYPILOT_NODE_IPS lists {len(ips)} address(es) but "
                           f"SKYPILOT_NUM_NODES={nnodes}: they must agree (one IP per node, "
                           "the head node first); run tpkit-launch in the task's run section")
    gpus = env.get("SKYPILOT_NUM_GPUS_PER_NODE", "").strip()
    if gpus:
        try:
            gpus = int(gpus)
        except ValueError:
            raise ClusterError(f"SKYPILOT_NUM_GPUS_PER_NODE={gpus!r} is not an integer; "
                               "unset it or set the number of GPUs per node") from None
    return ClusterInfo(
        engine=engine, nnodes=nnodes, node_rank=node_rank,
        nproc_per_node=str(gpus) if gpus else None,     # 0 GPUs: tpkit's CPU auto
        master_addr=ips[0], master_port=_port(env, "MASTER_PORT", engine),
        rdzv_id=env.get("SKYPILOT_TASK_ID") or f"sky-{ips[0]}",
        nnodes_var="SKYPILOT_NUM_NODES", node_rank_var="SKYPILOT_NODE_RANK",
        nproc_var="SKYPILOT_NUM_GPUS_PER_NODE")


def cluster_info(env: Mapping[str, str]) -> ClusterInfo | None:
    """The Kubernetes (Kubeflow) or SkyPilot job this process runs in, or None."""
    if env.get("PET_NNODES") and env.get("PET_MASTER_ADDR"):
        return _kubernetes(env)
    if env.get("SKYPILOT_NODE_RANK"):
        return _skypilot(env)
    return None
