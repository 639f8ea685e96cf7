"""Fabric conformance (issue 24): the Fabric user API, as Lightning documents it, under
TPKitStrategy at tp=2 x dp=2 with sequence parallelism on and off, each call against a
single-process reference, launched the way users launch: ``tpkit-launch`` and Fabric's own
launcher (``python script.py``), and at an expert layout (ep=2, etp=1, tp=2, SP: a model
with a tpkit.nn.MoE; in the tpkit-launch run, after the other layouts: a process start
costs more than a layout's checks; that run is one script of tests/shared.py's trainer
launch). The checks are tests/fabric_conformance.py's; here each
becomes one test item, so a failing call is named."""
import json
import os
import socket
import subprocess
import sys

import pytest

import paths
from shared import register_trainer_script, script_dir

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "fabric_conformance.py")
LAYOUTS = ("sp", "nosp")
CHECKS = [
    "setup",                        # setup, setup_dataloaders (sampler over DP only), forward
    "backward",                     # .grad complete (SP sums included) after fabric.backward
    "clip_gradients_norm",
    "clip_gradients_value",
    "clip_gradients_nonfinite",     # error_if_nonfinite, as torch's clip_grad_norm_
    "no_backward_sync",             # gradient accumulation, the sync skipped then done
    "accumulate_without_no_backward_sync",
    "collectives",                  # all_reduce/all_gather(sync_grads)/broadcast/barrier/...
    "init_module",
    "init_module_empty_init",       # tpkit layers + a plain module; real weights kept
    "load_raw_model",               # a torch.save'd full state dict into the shards; strict
    "save",
    "load_without_state",           # the whole checkpoint, nested, full tensors
    "load_remainder",               # nested entries and a loadable optimizer state
    "load_into_state",              # resume: model + optimizer + plain values, next step
    "load_strict",                  # KeyError, as Fabric's own strategies
    "load_raw_optimizer",
    "refused",                      # load_raw(directory), storage_options, pp options at pp=1
    "load_full_file",               # fabric.load of a single-file full checkpoint
    "fsdp_optimizer_order",         # data_parallel="fsdp": optimizer built too early
    "fsdp_load_raw_and_resume",
    "save_filter",
    "autocast[bf16-mixed]", "autocast[16-mixed]", "autocast[fp8]",
]
# the pipeline layout (pp=2 x dp=2), in the same launch as "sp"/"nosp": the calls that
# apply with TPKitStrategy(pp=2), strategy.pipeline_step in place of model(x) + backward
PP_CHECKS = ["setup", "pipeline_step", "clip_gradients_norm", "clip_gradients_value",
             "collectives", "save", "load_without_state", "load_remainder", "load_into_state",
             "load_strict", "load_raw_model", "refused"]
# At the expert layout: FSDP shards the experts over edp (checked); bf16/fp16/fp8 autocast
# run against the reference under the same autocast (fp8: the expert GEMMs quantized too).
EP_CHECKS = [c for c in CHECKS if not c.startswith("fsdp_")] + ["fsdp_experts"]


def _env(**extra):
    env = {**os.environ, "PYTHONPATH": paths.PYTHONPATH,
           "OMP_NUM_THREADS": "1", "TPKIT_PG_TIMEOUT": "120", **extra}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(var, None)
    return env


def _run(cmd, env, tmp, cwd=None) -> dict:
    out, ckpts = tmp / "report.json", tmp / "ckpts"
    ckpts.mkdir()
    proc = subprocess.run([*cmd, SCRIPT, str(out), str(ckpts)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return _complete(json.loads(out.read_text()))


def _complete(report, experts=False) -> dict:
    """``report``, after checking that it holds every check of every layout it ran."""
    want = [f"{lay}/{c}" for lay in LAYOUTS for c in CHECKS]
    want += [f"pp/{c}" for c in PP_CHECKS]   # the pipeline layout runs in the same launch
    if experts:                              # and the expert layout, asked for
        want += [f"ep/{c}" for c in EP_CHECKS]
    assert sorted(report) == sorted(want)
    return report


def _failures(report, check, layouts=LAYOUTS):
    return "\n".join(f"{key} rank {rank}: {err}" for key in (f"{lay}/{check}" for lay in layouts)
                     for rank, err in report[key].items())


# In tests/shared.py's trainer launch (tpkit-launch --nproc-per-node 4), with the TPKIT_*
# variables tpkit-launch's own resolve exports for --tp 2 --sequence-parallel at 4 ranks
register_trainer_script("fabric-conformance", SCRIPT, "{dir}/report.json", "{dir}",
                        flags=("--tp", "2", "--sequence-parallel"),
                        env={"CONFORMANCE_EXPERTS": "1"})


@pytest.fixture(scope="module")
def tpkit_launch_report(tmp_path_factory):
    """Layouts sp (TPKIT_* from tpkit-launch's flags), nosp, pp and ep (ep=2 x etp=1 given
    to TPKitStrategy beside the launch's tp=2 and SP) in one run of the script, under
    tpkit-launch (the shared trainer launch). tpkit-launch exporting --ep/--etp as
    TPKIT_EP/TPKIT_ETP and their reading back are tests/nn/test_moe.py's
    test_launcher_checks_ep and tests/layout/test_config.py's test_has_experts_and_expert_env;
    the strategy reads every TPKIT_* size alike (layout sp here)."""
    where = script_dir(tmp_path_factory, "fabric-conformance")   # the launch exited 0
    with open(os.path.join(where, "report.json")) as f:
        return _complete(json.load(f), experts=True)


@pytest.mark.parametrize("check", CHECKS)
def test_fabric_call_under_tpkit_launch(tpkit_launch_report, check):
    assert not _failures(tpkit_launch_report, check), _failures(tpkit_launch_report, check)


@pytest.mark.parametrize("check", PP_CHECKS)
def test_fabric_call_at_pp2(tpkit_launch_report, check):
    """The same launch at pp=2 x dp=2: strategy.pipeline_step where pp=1 calls the model
    and backward; clipping, checkpoints and collectives against a single-process model."""
    err = _failures(tpkit_launch_report, check, ("pp",))
    assert not err, err


def test_every_fabric_call_under_fabrics_own_launcher(tmp_path):
    """``python script.py``: Fabric's subprocess launcher starts ranks 1-3; the layout of
    ``Fabric(strategy="tpkit")`` comes from TPKIT_*."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _env(TPKIT_TP="2", TPKIT_SEQUENCE_PARALLEL="1", MASTER_PORT=str(port))
    report = _run([sys.executable], env, tmp_path, cwd=tmp_path)
    failed = "\n".join([_failures(report, c) for c in CHECKS if _failures(report, c)]
                       + [_failures(report, c, ("pp",)) for c in PP_CHECKS
                          if _failures(report, c, ("pp",))])
    assert not failed, failed


@pytest.mark.parametrize("check", EP_CHECKS)
def test_fabric_call_at_expert_layout(tpkit_launch_report, check):
    """ep=2 x etp=1 (edp=2) with tp=2 and SP: the same calls on a model with an MoE block."""
    failed = _failures(tpkit_launch_report, check, ("ep",))
    assert not failed, failed
