"""A TorchX component: tpkit-launch on ``-j NODESxPROCS`` (TorchX's ``dist.ddp`` runs
torchrun the same way: c10d rendezvous at the first replica, port 29500).

    torchx run -s kubernetes k8s/torchx_tpkit.py:tpkit -j 2x8 --tp 8 \\
        --script launch/train.py -- --gqa-groups 8 --steps 10000 --save s3://my-bucket/tpkit-gpt --auto-resume

``--max_retries`` (TorchX) restarts the job; ``--auto-resume`` resumes it.
"""
from __future__ import annotations

import shlex

import torchx.specs as specs


def tpkit(*script_args: str, script: str = "launch/train.py", j: str = "1x1", tp: int = 1,
          cp: int = 1, pp: int = 1, image: str = "ghcr.io/example/tpkit:latest",
          gpu: int = 0, cpu: int = 8, memMB: int = 65536, max_retries: int = 0,
          rdzv_port: int = 29500, name: str = "tpkit") -> specs.AppDef:
    """tpkit-launch --tp/--cp/--pp SCRIPT ARGS on NODESxPROCS replicas.

    Args:
        script_args: the script's own arguments
        script: the training script (in the image's working directory)
        j: NODESxPROCS_PER_NODE, as dist.ddp's
        tp: tensor-parallel size
        cp: context-parallel size
        pp: pipeline-parallel size
        image: a container image with tpkit installed
        gpu: GPUs per node
        cpu: CPUs per node
        memMB: memory per node, MB
        max_retries: TorchX restarts of the job
        rdzv_port: the c10d rendezvous port on the first replica
        name: the job's name
    """
    nnodes, nproc = (int(x) for x in j.split("x"))
    # as dist.ddp: bash expands the variable TorchX names rank 0's host in (one node: a
    # free local port)
    endpoint = f"$${{{specs.macros.rank0_env}:=localhost}}:{rdzv_port}" if nnodes > 1 \
        else "localhost:0"
    cmd = ["tpkit-launch", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
           "--rdzv-id", specs.macros.app_id,
           "--tp", str(tp), "--cp", str(cp), "--pp", str(pp), script, *script_args]
    line = " ".join(a if a is endpoint else shlex.quote(a) for a in cmd)
    return specs.AppDef(name=name, roles=[specs.Role(
        name=name, image=image, entrypoint="bash", args=["-c", line],
        num_replicas=nnodes, max_retries=max_retries,
        resource=specs.Resource(cpu=cpu, gpu=gpu, memMB=memMB),
        port_map={"c10d": rdzv_port})])
