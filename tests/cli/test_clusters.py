"""tpkit-launch under Kubernetes (Kubeflow Trainer's PET_* variables) and SkyPilot
(SKYPILOT_*): the variables, set as those engines set them, give the layout and
rendezvous of the equivalent flags, in process and for real (two "nodes" on loopback).
The engines' semantics (tpkit/cli/clusters.py's docstring) are from Kubeflow Trainer's
Torch plugin (pkg/runtime/framework/plugins/torch/torch.go: PET_NNODES = numNodes,
PET_NPROC_PER_NODE = numProcPerNode, PET_NODE_RANK = the Job completion index,
PET_MASTER_ADDR = <trainjob>-node-0-0.<trainjob>, PET_MASTER_PORT = 29400) and SkyPilot's
distributed-jobs page (SKYPILOT_NODE_IPS one per line, head first). Conflicting flags
are rows of tests/test_bad_input.py."""
import os
import subprocess
import sys

import pytest

from test_launch import clean_env, plan_of  # noqa: F401
from test_launch_run import _free_port, finish, launch_env, ok_lines
from tpkit.cli import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "launch_scripts", "check_layout.py")


def kubeflow_env(*, nodes=2, nproc="2", rank=1, name="gpt", port="29400"):
    """What Kubeflow's Torch plugin puts in node ``rank``'s pod of TrainJob ``name``."""
    return {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": port}


def skypilot_env(*, ips=("10.0.0.7", "10.0.0.8"), rank=0, gpus="0", task="sky-2026_c_1"):
    return {"SKYPILOT_NODE_IPS": "\n".join(ips), "SKYPILOT_NUM_NODES": str(len(ips)),
            "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_GPUS_PER_NODE": gpus,
            "SKYPILOT_TASK_ID": task}


def resolved(plan):
    return (plan.config, plan.nproc_per_node, plan.min_nodes, plan.max_nodes, plan.node_rank,
            plan.rdzv_backend, plan.rdzv_endpoint, plan.rdzv_id, plan.exports)


def with_env(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_kubeflow_variables_equal_the_flags(monkeypatch):
    flags = plan_of(["--tp", "2", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2",
                     "--rdzv-backend", "static", "--rdzv-endpoint", "gpt-node-0-0.gpt:29400",
                     "--rdzv-id", "k8s-gpt-node-0-0", SCRIPT])
    with_env(monkeypatch, kubeflow_env())
    from_env = plan_of(["--tp", "2", SCRIPT])
    assert resolved(from_env) == resolved(flags)
    assert (from_env.max_nodes, from_env.node_rank, from_env.rdzv_backend,
            from_env.rdzv_endpoint, from_env.config.dp) == (2, 1, "static",
                                                            "gpt-node-0-0.gpt:29400", 2)
    # flags that agree with the engine are accepted
    assert resolved(plan_of(["--tp", "2", "--nnodes", "2", "--node-rank", "1",
                             "--nproc-per-node", "2", SCRIPT])) == resolved(flags)


def test_skypilot_variables_equal_the_flags(monkeypatch):
    flags = plan_of(["--tp", "2", "--dp", "2", "--nnodes", "2", "--node-rank", "0",
                     "--rdzv-backend", "static", "--rdzv-endpoint", "10.0.0.7:29400",
                     "--rdzv-id", "sky-2026_c_1", SCRIPT])
    with_env(monkeypatch, skypilot_env())
    from_env = plan_of(["--tp", "2", "--dp", "2", SCRIPT])
    assert resolved(from_env) == resolved(flags)
    assert (from_env.nproc_per_node, from_env.rdzv_endpoint) == (2, "10.0.0.7:29400")
    monkeypatch.setenv("MASTER_PORT", "12375")   # the port SkyPilot recipes pick
    assert plan_of(["--tp", "2", "--dp", "2", SCRIPT]).rdzv_endpoint == "10.0.0.7:12375"
    # GPUs per node is the engine's workers per node
    with_env(monkeypatch, skypilot_env(gpus="8"))
    plan = plan_of(["--tp", "8", "--dry-run", SCRIPT])   # dry run: nccl without GPUs is allowed
    assert (plan.nproc_per_node, plan.config.dp) == (8, 2)


@pytest.mark.slow
def test_two_nodes_on_loopback_from_engine_variables():
    """Two tpkit-launch processes per engine, each given only what the engine sets on its
    node: the ranks, groups and rendezvous are those of the static-rendezvous flags
    (node rank r holds ranks 2r, 2r+1)."""
    port, sky_port = str(_free_port()), str(_free_port())
    engines = {
        "kubeflow": [dict(kubeflow_env(rank=r, port=port), PET_MASTER_ADDR="127.0.0.1")
                     for r in (0, 1)],
        "skypilot": [dict(skypilot_env(ips=("127.0.0.1", "127.0.0.2"), rank=r),
                          MASTER_PORT=sky_port) for r in (0, 1)],
    }
    for name, envs in engines.items():
        procs = [subprocess.Popen(
            [sys.executable, "-m", "tpkit.cli.launch", "--tp", "2", SCRIPT, "2", "1"], cwd=ROOT,
            env={**launch_env(), **e}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True) for e in envs]
        results = [finish(p) for p in procs]
        run_id = "k8s-127" if name == "kubeflow" else "sky-2026_c_1"
        for node, (rc, out, err) in enumerate(results):
            assert rc == 0, (name, err[-3000:])
            oks = ok_lines(out)
            assert sorted(oks) == [2 * node, 2 * node + 1], (name, out)
            for rank, line in oks.items():
                assert f"world=4 local_rank={rank % 2} tp={rank % 2} cp=0 dp={rank // 2}" \
                    in line, (name, line)
                assert f"run_id={run_id}" in line, (name, line)


def test_torchrun_pet_variables_alone_still_default():
    """PET_NNODES without Kubeflow's PET_MASTER_ADDR is plain torchrun's convention: a
    default for --nnodes, as before."""
    env = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1"}
    args = launch.build_parser().parse_args(["--rdzv-endpoint", "h:1", SCRIPT])
    plan = launch.resolve(args, env)
    assert (plan.max_nodes, plan.nproc_per_node, plan.node_rank, plan.rdzv_backend) == \
        (2, 2, 1, "c10d")
