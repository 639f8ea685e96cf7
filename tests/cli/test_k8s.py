"""k8s/: the Kubeflow TrainJob and the JobSet validate against their APIs' OpenAPI
schemas and use only fields those APIs define; the SkyPilot task and the TorchX component
run tpkit-launch as their engines would.

The schemas are the models PyPI's ``kubeflow-trainer-api`` generates from Kubeflow
Trainer's OpenAPI spec (``trainer.kubeflow.org/v1alpha1`` TrainJob, and the
``jobset.x-k8s.io/v1alpha2`` JobSet it builds on, with Kubernetes' core and batch types):
a test dependency, nothing vendored. Its ``from_dict`` checks types (strict ints, strings,
required fields) but drops unknown keys, so ``unknown_fields`` walks each manifest along
the models' fields (by their JSON names) and names every key the API does not define."""
import os
import shlex
import subprocess
import sys
import typing

import pytest
import yaml

from test_launch_run import _free_port, finish, launch_env, ok_lines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(ROOT, "k8s")
SCRIPT = os.path.join(ROOT, "tests", "launch_scripts", "check_layout.py")


def _load(name):
    with open(os.path.join(K8S, name)) as f:
        return yaml.safe_load(f)


def unknown_fields(model, obj, path="") -> list[str]:
    """Paths in ``obj`` that the pydantic model ``model`` (or a type around it: Optional,
    List, Dict) does not define."""
    origin, args = typing.get_origin(model), typing.get_args(model)
    if origin is typing.Union:
        out = None
        for arg in (a for a in args if a is not type(None)):
            found = unknown_fields(arg, obj, path)
            out = found if out is None or len(found) < len(out) else out
        return out or []
    if origin in (list, typing.List) and isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in unknown_fields(args[0], v, f"{path}[{i}]")]
    if origin in (dict, typing.Dict) and isinstance(obj, dict):
        return [p for k, v in obj.items() for p in unknown_fields(args[1], v, f"{path}.{k}")]
    fields = getattr(model, "model_fields", None)
    if fields is None or not isinstance(obj, dict):
        return []
    by_name = {(f.alias or name): f for name, f in fields.items()}
    out = []
    for key, value in obj.items():
        if key not in by_name:
            out.append(f"{path}.{key}")
        else:
            out += unknown_fields(by_name[key].annotation, value, f"{path}.{key}")
    return out


@pytest.fixture(scope="module")
def api():
    return pytest.importorskip("kubeflow_trainer_api.models",
                               reason="the test extra's kubeflow-trainer-api")


def test_trainjob_validates_against_the_trainjob_api(api):
    doc = _load("trainjob.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    job = api.TrainerV1alpha1TrainJob.from_dict(doc)     # types, required fields
    assert unknown_fields(api.TrainerV1alpha1TrainJob, doc) == []
    assert job.spec.runtime_ref.name == "torch-distributed"
    assert job.spec.trainer.command[0] == "tpkit-launch"
    # what the runtime will set (PET_*) is the runtime's: a TrainJob must not set it
    assert not {e.name for e in job.spec.trainer.env or []} & {
        "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
        "PET_MASTER_PORT"}
    # the checker finds a field the API does not have, and a misspelt one
    bad = {**doc, "spec": {**doc["spec"], "trainer": {**doc["spec"]["trainer"],
                                                      "numProcsPerNode": 8}}}
    assert unknown_fields(api.TrainerV1alpha1TrainJob, bad) == [".spec.trainer.numProcsPerNode"]
    with pytest.raises(Exception, match="numNodes|num_nodes"):
        api.TrainerV1alpha1TrainJob.from_dict(
            {**doc, "spec": {**doc["spec"], "trainer": {**doc["spec"]["trainer"],
                                                        "numNodes": "two"}}})


def test_jobset_validates_against_the_jobset_api(api):
    doc = _load("jobset.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    js = api.JobsetV1alpha2JobSet.from_dict(doc)
    assert unknown_fields(api.JobsetV1alpha2JobSet, doc) == []
    job = js.spec.replicated_jobs[0]
    pods = job.template.spec
    assert pods.completion_mode == "Indexed" and pods.parallelism == pods.completions
    env = {e.name: e for e in pods.template.spec.containers[0].env}
    # as Kubeflow's Torch plugin sets them: rank 0's pod DNS name, the completion index
    assert env["PET_MASTER_ADDR"].value == f"{js.metadata.name}-{job.name}-0-0.{js.metadata.name}"
    assert env["PET_NODE_RANK"].value_from.field_ref.field_path == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert int(env["PET_NNODES"].value) == pods.parallelism
    bad = {**doc, "spec": {**doc["spec"], "replicatedJob": doc["spec"]["replicatedJobs"]}}
    assert unknown_fields(api.JobsetV1alpha2JobSet, bad) == [".spec.replicatedJob"]


def _pet_env(doc) -> dict:
    """The JobSet's PET_* for node rank 0 on this machine (its DNS name is loopback)."""
    c = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    return dict(env, PET_NODE_RANK="0", PET_MASTER_ADDR="127.0.0.1")


def test_manifests_commands_resolve_the_layout_they_say(monkeypatch):
    """tpkit-launch --dry-run of each manifest's command, given the variables its engine
    sets: the layout (tp=8 x dp=2 on 2 nodes x 8) is checked before anything starts."""
    from tpkit.cli import launch
    jobset = _load("jobset.yaml")
    cmd = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]["command"]
    sky = _load("sky.yaml")
    sky_cmd = shlex.split(sky["run"].replace("\\\n", " "))
    sky_env = {"SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2", "SKYPILOT_NUM_NODES": str(sky["num_nodes"]),
               "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_GPUS_PER_NODE": "8"}
    trainjob = _load("trainjob.yaml")["spec"]["trainer"]
    tj_env = {"PET_NNODES": str(trainjob["numNodes"]),
              "PET_NPROC_PER_NODE": str(trainjob["numProcPerNode"]), "PET_NODE_RANK": "1",
              "PET_MASTER_ADDR": "tpkit-gpt-node-0-0.tpkit-gpt", "PET_MASTER_PORT": "29400"}
    for command, env in ((cmd, _pet_env(jobset)), (sky_cmd, sky_env),
                         (trainjob["command"], tj_env)):
        assert command[0] == "tpkit-launch"
        for var in [v for v in os.environ if v.startswith(("PET_", "SKYPILOT_", "SLURM_"))]:
            monkeypatch.delenv(var)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        args = launch.build_parser().parse_args(["--dry-run", *command[1:]])
        plan = launch.resolve(args, os.environ)
        assert (plan.config.tp, plan.config.dp, plan.max_nodes, plan.nproc_per_node) == \
            (8, 2, 2, 8), command
        assert plan.rdzv_backend == "static"


@pytest.mark.slow
def test_torchx_component_runs_tpkit_launch_on_two_replicas():
    """k8s/torchx_tpkit.py's AppDef, its macros filled as TorchX fills them, run as two
    replicas on loopback: the layout reaches every rank."""
    specs = pytest.importorskip("torchx.specs", reason="the test extra's torchx")
    sys.path.insert(0, K8S)
    try:
        from torchx_tpkit import tpkit
    finally:
        sys.path.remove(K8S)
    app = tpkit("2", "1", script=SCRIPT, j="2x2", tp=2, rdzv_port=_free_port())
    role = specs.macros.Values(img_root="", app_id="torchx-test", replica_id="0",
                               rank0_env="RANK0_HOST").apply(app.roles[0])
    assert role.entrypoint == "bash" and role.num_replicas == 2
    env = dict(launch_env(), RANK0_HOST="127.0.0.1")
    procs = [subprocess.Popen(["bash", *role.args], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [finish(p) for p in procs]
    merged = {}
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
        merged.update(ok_lines(out))
    assert sorted(merged) == [0, 1, 2, 3]
    for rank, line in merged.items():
        assert f"world=4 local_rank={rank % 2} tp={rank % 2} cp=0 dp={rank // 2}" in line
        assert "run_id=torchx-test" in line
