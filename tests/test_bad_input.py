"""The bad-input table (issue 15): every mistake a user makes on the way to a worker gets
one clear error that names the bad value and the fix, before any worker starts wherever
the information is there, and none hangs.

Rows, by where the mistake is caught (docs/testing.md, "The bad-input table", says how to
add one):

- ``LAUNCH``: a ``tpkit-launch`` command line (layout, torchrun flags, environment,
  Slurm, the script or module, and a script's own arguments through its pre-flight hook:
  launch/train.py's). Run in this process through ``tpkit.cli.launch.main``, the console
  script's function, with worker starts forbidden: exit 2, nothing on stdout, exactly one
  line on stderr (``tpkit-launch: error: ...``), no traceback.
- ``API``: a call of the public API that raises ValueError before any process group or
  collective (layouts, ``init_parallel``, layers, Fabric, checkpoints' paths).
- ``FAILURES``: what tpkit-launch's last line says about a worker that failed (torch's
  own failure records, built here).
- ``CHECKPOINTS``: damaged checkpoints refused on 2 ranks (tests/dist.py pool) by
  ``tpkit.checkpoint.load``, Fabric's ``load`` and ``launch/train.py --resume``, with the
  file named, the checkpoint to use instead, and the model and optimizer unchanged.
- ``test_worker_side_value_error_is_one_line``: a mistake only the workers see, launched:
  one line for the job, no traceback per rank.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import sys
from typing import Callable

import pytest
import torch

from dist import run
from test_launch import clean_env, fake_scontrol, no_workers, slurm_env  # noqa: F401
from test_launch_run import finish, launch as start_launch
from tpkit.cli import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "launch_scripts")
SCRIPT = os.path.join(SCRIPTS, "check_layout.py")
TRAIN = os.path.join(ROOT, "launch", "train.py")
SMALL = ["--steps", "2", "--hidden", "64", "--layers", "1", "--heads", "4", "--gqa-groups",
         "2", "--ffn", "128", "--seq-len", "16", "--global-batch", "2", "--log-every", "1"]


@dataclasses.dataclass
class Row:
    id: str
    value: str                          # the bad value, as the message must name it
    fix: str                            # what the message must say to do
    argv: list | None = None            # LAUNCH: tpkit-launch's arguments
    call: Callable | None = None        # API: call(tmp_path) must raise ValueError
    env: dict = dataclasses.field(default_factory=dict)
    slurm: dict | None = None           # LAUNCH inside a fake Slurm step: slurm_env kwargs
    hosts: list | None = None           # ... and what the fake scontrol prints (None: fails)
    setup: Callable | None = None       # setup(tmp_path) before the command
    absent: str | None = None           # a text the message must not contain
    skip: str | None = None             # "te": only where TE cannot run (no TE or no CUDA)


TINY_LLAMA = ('{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, '
              '"intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 256}')


def T(*args):   # a launch/train.py (tpkit.train) command line on 2 ranks
    return ["--nproc-per-node", "2", TRAIN, *SMALL, *args]


def _write(name: str, text: str):
    def setup(tmp):
        (tmp / name).write_text(text)
    return setup


# --- tpkit-launch command lines ------------------------------------------------------------
_K8S = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "gpt-node-0-0.gpt", "PET_MASTER_PORT": "29400"}
_SKY = {"SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.8", "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_GPUS_PER_NODE": "0"}
LAUNCH = [
    # the layout, checked against the world
    Row("tp-vs-world", "tp*cp*pp = 3*1*1", "use a world size that is a multiple of 3",
        ["--tp", "3", "--nproc-per-node", "4", SCRIPT]),
    Row("dp-vs-world", "dp=3", "pass dp=2 or leave dp unset",
        ["--tp", "2", "--dp", "3", "--nproc-per-node", "4", SCRIPT]),
    Row("sp-without-tp", "sequence_parallel=True", "set tp >= 2 or sequence_parallel=False",
        ["--sequence-parallel", SCRIPT]),
    Row("cp-comm-type", "cp_comm_type='ring'", "use one of", ["--cp", "2", "--cp-comm-type",
                                                             "ring", SCRIPT]),
    Row("a2a-size-without-a2a", "cp_a2a_size=2", "drop it or change the comm type",
        ["--cp", "4", "--cp-a2a-size", "2", SCRIPT]),
    Row("a2a-without-size", "cp_comm_type='a2a+p2p'", "a divisor of cp=4",
        ["--cp", "4", "--cp-comm-type", "a2a+p2p", SCRIPT]),
    Row("tp-zero", "tp=0", "use tp=1", ["--tp", "0", SCRIPT]),
    Row("tp-not-int", "invalid int value: 'two'", "see tpkit-launch --help",
        ["--tp", "two", SCRIPT]),
    Row("backend-choice", "invalid choice: 'mpi'", "choose from", ["--backend", "mpi", SCRIPT]),
    # issue 35: no abbreviations (--nproc-per would have been read as --nproc-per-node)
    Row("abbreviated-flag", "unrecognized arguments: --nproc-per", "see tpkit-launch --help",
        ["--nproc-per", "2", SCRIPT]),
    Row("nccl-without-gpu", "--backend nccl", "use --backend gloo",
        ["--backend", "nccl", SCRIPT]),
    Row("unknown-flag", "--bogus", "see tpkit-launch --help", ["--bogus", "1", SCRIPT]),
    Row("no-script", "training_script", "see tpkit-launch --help", ["--tp", "2"]),
    Row("nproc-zero", "--nproc-per-node=0", "must be >= 1",
        ["--nproc-per-node", "0", SCRIPT]),
    Row("nproc-word", "--nproc-per-node='many'", "pass N or auto",
        ["--nproc-per-node", "many", SCRIPT]),
    Row("nnodes-no-endpoint", "--nnodes=2", "needs --rdzv-endpoint HOST:PORT",
        ["--nnodes", "2", "--nproc-per-node", "2", SCRIPT]),
    Row("nnodes-range", "--nnodes='3:2'", "1 <= MIN <= MAX", ["--nnodes", "3:2", SCRIPT]),
    Row("tp-across-nodes", "tp=4", "choose tp dividing --nproc-per-node=6",
        ["--nnodes", "2", "--nproc-per-node", "6", "--tp", "4", "--rdzv-endpoint", "h:1",
         SCRIPT]),
    Row("dp-elastic", "--dp=2", "drop --dp for elastic launches",
        ["--nnodes", "1:4", "--dp", "2", "--rdzv-endpoint", "h:1", SCRIPT]),
    Row("elastic-world", "world size 3", "multiple of 2",
        ["--nnodes", "1:3", "--tp", "2", "--nproc-per-node", "3", "--rdzv-endpoint", "h:1",
         SCRIPT]),
    # torchrun's flags (issue 15, defects 1 and 6: a hang, raw tracebacks)
    Row("node-rank-static", "--node-rank=5", "0..1",
        ["--nnodes", "2", "--node-rank", "5", "--rdzv-backend", "static", "--master-addr",
         "localhost", "--nproc-per-node", "1", SCRIPT]),
    Row("node-rank-negative", "--node-rank=-1", "0..1",
        ["--nnodes", "2", "--node-rank", "-1", "--rdzv-endpoint", "h:1", SCRIPT]),
    Row("rdzv-endpoint-port", "--rdzv-endpoint='localhost:notaport'", "pass HOST:PORT",
        ["--rdzv-endpoint", "localhost:notaport", SCRIPT]),
    Row("rdzv-backend", "--rdzv-backend='etcdx'", "use one of",
        ["--rdzv-backend", "etcdx", SCRIPT]),
    Row("max-restarts", "--max-restarts=-1", "must be >= 0", ["--max-restarts", "-1", SCRIPT]),
    Row("redirects", "--redirects='9'", "pass 0 (none)", ["--redirects", "9", SCRIPT]),
    Row("tee", "--tee='7'", "pass 0 (none)", ["--tee", "7", SCRIPT]),
    Row("monitor-interval", "--monitor-interval=0.0", "must be > 0",
        ["--monitor-interval", "0", SCRIPT]),
    Row("log-dir", "--log-dir=", "pass a writable directory",
        ["--log-dir", "{tmp}/file/logs", SCRIPT], setup=_write("file", "")),
    Row("local-ranks-filter", "--local-ranks-filter='x'", "pass e.g. 0,1",
        ["--local-ranks-filter", "x", SCRIPT]),
    Row("master-port", "--master-port=70000", "pass 0..65535",
        ["--master-port", "70000", SCRIPT]),
    Row("no-python-and-m", "--no-python and -m", "drop one of them",
        ["--no-python", "-m", "json.tool"]),
    # the memory check (tpkit.cli.memory, issue 38)
    Row("device-memory-zero", "--device-memory=0.0", "must be > 0 GiB",
        ["--device-memory", "0", SCRIPT]),
    Row("memory-margin-range", "--memory-margin=1.5", "must be in [0, 1)",
        ["--memory-margin", "1.5", "--model-config", "{tmp}/config.json", SCRIPT],
        setup=_write("config.json", TINY_LLAMA)),
    Row("device-memory-without-model", "--device-memory/--memory-margin need the model",
        "pass --model-config FILE", ["--device-memory", "80", SCRIPT]),
    Row("memory-job-without-model", "--memory-job='seq_len=8'", "needs --model-config FILE",
        ["--memory-job", "seq_len=8", SCRIPT]),
    Row("model-config-missing", "config.json' cannot be read", "pass a Hugging Face config.json",
        ["--model-config", "{tmp}/config.json", SCRIPT]),
    Row("model-config-keys", "model_type=None", "tpkit.models.llama reads",
        ["--model-config", "{tmp}/config.json", SCRIPT], setup=_write("config.json", "{}")),
    Row("memory-job-key", "--memory-job item 'seqlen=8'", "KEY one of",
        ["--model-config", "{tmp}/config.json", "--memory-job", "seqlen=8", SCRIPT],
        setup=_write("config.json", TINY_LLAMA)),
    Row("memory-job-value", "--memory-job seq_len='long'", "e.g. seq_len=2048",
        ["--model-config", "{tmp}/config.json", "--memory-job", "seq_len=long", SCRIPT],
        setup=_write("config.json", TINY_LLAMA)),
    Row("memory-too-small", "over the 10.24 MiB device memory", "use more ranks",
        ["--device-memory", "0.01", "--model-config", "{tmp}/config.json", SCRIPT],
        setup=_write("config.json", TINY_LLAMA)),
    Row("train-memory-too-small", "over the 1.02 MiB device memory",
        "the cheapest layout that fits is --tp 2",
        ["--nproc-per-node", "2", "--device-memory", "0.001", TRAIN, *SMALL]),
    Row("preflight-returns-other", "tpkit_preflight returned int",
        "returns None, a tpkit.layout.config.Layout", ["{tmp}/hook.py"],
        setup=_write("hook.py", "def tpkit_preflight(argv, launch):\n    return 5\n")),
    # the script or module
    Row("missing-script", "'missing_script.py' does not exist", "pass the path of a .py file",
        ["--tp", "2", "missing_script.py"]),
    Row("script-is-directory", "is a directory without __main__.py",
        "pass the .py file inside it", [SCRIPTS]),
    Row("script-syntax-error", "broken.py line 2: SyntaxError", "fix the script",
        ["{tmp}/broken.py"], setup=_write("broken.py", "x = 1\nif x\n")),
    Row("no-such-module", "no module named 'no_such_module'", "add that directory to PYTHONPATH",
        ["-m", "no_such_module"]),
    Row("no-such-submodule", "no module named 'tpkit.no_such'", "check the name",
        ["-m", "tpkit.no_such"]),
    Row("package-without-main", "'tpkit' is a package without __main__.py",
        "pass the module inside it", ["-m", "tpkit"]),
    # the environment
    Row("env-shm-switch", "TPKIT_SHM_ALLREDUCE='sometimes'", "use 0", ["--tp", "2", SCRIPT],
        env={"TPKIT_SHM_ALLREDUCE": "sometimes"}),
    Row("env-shm-p2p-switch", "TPKIT_SHM_P2P='often'", "use 0", ["--cp", "2", SCRIPT],
        env={"TPKIT_SHM_P2P": "often"}),
    Row("env-fused-attn-switch", "TPKIT_FUSED_ATTN='sometimes'", "or 0 (reference kernels)",
        ["--tp", "2", SCRIPT],
        env={"TPKIT_FUSED_ATTN": "sometimes"}),
    Row("env-traceback-switch", "TPKIT_TRACEBACK='maybe'", "use 1", [SCRIPT],
        env={"TPKIT_TRACEBACK": "maybe"}),
    Row("env-tp-not-int", "TPKIT_TP='x'", "set e.g. TPKIT_TP=1", [SCRIPT],
        env={"TPKIT_TP": "x"}),
    Row("env-tp-vs-world", "tp=3 from $TPKIT_TP", "multiple of 3",
        ["--nproc-per-node", "4", SCRIPT], env={"TPKIT_TP": "3"}),
    # Slurm
    Row("slurm-nnodes", "--nnodes=3", "drop --nnodes inside Slurm",
        ["--nnodes", "3", "--nproc-per-node", "2", SCRIPT], slurm={}, hosts=["node07", "node08"]),
    Row("slurm-node-rank", "--node-rank=0", "drop --node-rank inside Slurm",
        ["--node-rank", "0", "--nproc-per-node", "2", SCRIPT], slurm={},
        hosts=["node07", "node08"]),
    Row("slurm-batch-script", "2-node job", "srun --ntasks-per-node=1",
        ["--nproc-per-node", "2", SCRIPT], slurm={"step": None}, hosts=["node07", "node08"]),
    Row("slurm-tasks", "runs 4 tasks on 2 node(s)", "--ntasks-per-node=1",
        ["--nproc-per-node", "2", SCRIPT], slurm={"tasks": 4}, hosts=["node07", "node08"]),
    Row("slurm-nodelist", "'node[07-08]'", "pass --rdzv-endpoint HOST:PORT",
        ["--nproc-per-node", "2", SCRIPT], slurm={}, hosts=None, absent="localhost"),
    # Kubernetes (Kubeflow Trainer's PET_*) and SkyPilot, as tests/cli/test_clusters.py sets them
    Row("k8s-nnodes", "--nnodes=3 conflicts with PET_NNODES=2", "drop --nnodes under Kubernetes",
        ["--nnodes", "3", SCRIPT], env=_K8S),
    Row("k8s-node-rank", "PET_NODE_RANK=1", "drop --node-rank under Kubernetes",
        ["--node-rank", "0", SCRIPT], env=_K8S),
    Row("k8s-nproc", "PET_NPROC_PER_NODE=2", "drop --nproc-per-node under Kubernetes",
        ["--nproc-per-node", "4", SCRIPT], env=_K8S),
    Row("k8s-tp-vs-world", "tp*cp*pp = 3*1*1", "use a world size that is a multiple of 3",
        ["--tp", "3", SCRIPT], env=_K8S),
    Row("k8s-rank-range", "PET_NODE_RANK=2 is out of range for PET_NNODES=2",
        "run tpkit-launch in the job's own pods", [SCRIPT], env={**_K8S, "PET_NODE_RANK": "2"}),
    Row("sky-ips", "SKYPILOT_NODE_IPS lists 1 address(es) but SKYPILOT_NUM_NODES=2",
        "one IP per node", [SCRIPT], env={**_SKY, "SKYPILOT_NODE_IPS": "10.0.0.7"}),
    Row("sky-node-rank", "SKYPILOT_NODE_RANK=1", "drop --node-rank under SkyPilot",
        ["--node-rank", "0", SCRIPT], env=_SKY),
    # launch/train.py's arguments, checked by its tpkit_preflight (issue 15, defect 4)
    Row("train-tp-vs-world", "tp=4 from --tp", "smaller tp/cp/pp", T("--tp", "4")),
    Row("train-batch-vs-dp", "--global-batch=3", "use a multiple of 2",
        T("--global-batch", "3")),
    Row("train-seq-vs-cp", "--seq-len=6", "multiple of 4", T("--cp", "2", "--seq-len", "6")),
    Row("train-seq-vs-sp", "--seq-len=15", "multiple of 2",
        T("--tp", "2", "--sequence-parallel", "--seq-len", "15")),
    Row("train-resume-missing", "--resume='{tmp}/nope'", "pass a checkpoint written by --save",
        T("--resume", "{tmp}/nope")),
    # issue 49: one run has one layout (the dry run said tp=2, the workers built tp=4)
    Row("train-tp-vs-launch", "--tp=4 (parallelism.tp) conflicts with tp=2 from tpkit-launch "
        "--tp", "give tp in one place", ["--tp", "2", TRAIN, *SMALL, "--tp", "4"]),
    Row("train-log-every", "--log-every=0", "must be >= 1", T("--log-every", "0")),
    Row("train-steps", "--steps=0", "must be >= 1", T("--steps", "0")),
    Row("train-lr", "--lr=-1.0", "must be > 0", T("--lr", "-1")),
    Row("train-heads-vs-tp", "num_attention_heads=6", "use num_attention_heads=4 or 8",
        ["--nproc-per-node", "4", TRAIN, *SMALL, "--tp", "4", "--heads", "6",
         "--gqa-groups", "6", "--hidden", "48"]),
    Row("train-hidden-vs-heads", "hidden_size=10", "use hidden_size=8 or 12",
        T("--hidden", "10", "--heads", "4")),
    Row("train-precision", "invalid choice: 'bf16'", "see " + TRAIN + " --help",
        T("--precision", "bf16")),
    Row("train-save-every", "--save-every=5", "needs --save DIR", T("--save-every", "5")),
    # pipeline options (issue 16), checked before any worker starts
    Row("train-pp-vs-layers", "3 blocks do not split evenly into pp x virtual_stages = 2 x 1",
        "use a number of blocks that is a multiple of 2",
        T("--pp", "2", "--layers", "3", "--microbatches", "2")),
    Row("train-pp-virtual-stages", "pp x virtual_stages = 2 x 3", "a multiple of 6",
        T("--pp", "2", "--layers", "4", "--pp-schedule", "Interleaved1F1B",
          "--virtual-stages", "3", "--microbatches", "2")),
    Row("train-pp-microbatches", "microbatches=1 is fewer than the 2 pipeline stages",
        "use at least 2", T("--pp", "2", "--layers", "2", "--microbatches", "1")),
    Row("train-pp-batch", "--global-batch=2 (training.global_batch) does not split into dp x "
        "microbatches = 1 x 4",
        "use a multiple of 4", T("--pp", "2", "--layers", "2", "--microbatches", "4")),
    Row("train-virtual-stages-no-pp", "--virtual-stages=2", "add --pp N",
        T("--virtual-stages", "2")),
    Row("train-microbatches-batch", "--global-batch=2 (training.global_batch) does not split "
        "into dp x microbatches = 2 x 4", "use a multiple of 8", T("--microbatches", "4")),
    Row("train-pp-zero-bubble-recompute", "'ZBVZeroBubble' with recompute",
        "use 1F1B or Interleaved1F1B with recompute",
        T("--pp", "2", "--layers", "4", "--pp-schedule", "ZBVZeroBubble", "--recompute",
          "--microbatches", "2")),
    Row("train-compile-dropout", "--compile (training.compile) with --dropout=0.1",
        "or drop --compile", T("--compile", "--dropout", "0.1")),
    Row("train-compile-fp8", "--compile (training.compile) with --precision='fp8'",
        "or drop --compile", T("--compile", "--precision", "fp8")),
    # issue 54: HSDP's replicas, checked before launch like every other axis
    Row("train-dp-replicate", "--dp-replicate=3 (parallelism.dp_replicate) does not divide "
        "the data ranks dp x cp = 2 x 1 = 2", "use a divisor of 2",
        T("--data-parallel", "fsdp", "--dp-replicate", "3")),
    Row("train-dp-replicate-ddp", "--dp-replicate=2 (parallelism.dp_replicate) needs "
        "--data-parallel fsdp", "add --data-parallel fsdp or drop it", T("--dp-replicate", "2")),
    Row("train-fp8-dtype", "--fp8-compute-dtype='bfloat16' (precision.fp8_compute_dtype)",
        "needs --precision fp8 (precision.mode='32-true' (default) here); add --precision fp8 "
        "or drop it",
        T("--fp8-compute-dtype", "bfloat16")),
    Row("train-save-file", "--save='{tmp}/file'", "pass a directory", T("--save", "{tmp}/file"),
        setup=_write("file", "")),
    # launch/train.py's recovery options (issue 21)
    Row("train-keep-zero", "--keep=0", "must be >= 1", T("--save", "{tmp}/ck", "--keep", "0")),
    Row("train-keep-without-save", "--keep=2 (checkpoint.keep) needs", "--save DIR",
        T("--keep", "2")),
    Row("train-auto-resume-without-save", "--auto-resume (recovery.auto_resume) needs",
        "--save DIR", T("--auto-resume")),
    Row("train-async-save-without-save", "--async-save (checkpoint.async_save) needs",
        "--save DIR", T("--async-save")),
    Row("train-auto-resume-and-resume", "--resume='{tmp}/ck' (checkpoint.resume)", "pass one",
        T("--save", "{tmp}/ck", "--auto-resume", "--resume", "{tmp}/ck")),
    Row("train-hang-timeout", "--hang-timeout=0.0", "must be > 0 seconds",
        T("--hang-timeout", "0")),
    Row("train-hang-timeout-env", "TPKIT_HANG_TIMEOUT='soon'", "unset it", T(),
        env={"TPKIT_HANG_TIMEOUT": "soon"}),
    Row("train-impl-te", "--model.impl='te' (model.impl)", "use backend='torch'",
        T("--model.impl", "te"), skip="te"),
    # issue 34: the job config (TOML file and flags)
    Row("train-old-backend-flag", "--backend te", "use --model.impl te", T("--backend", "te")),
    Row("train-toml-unknown-section", "{tmp}/job.toml:1: unknown section [trainig]",
        "did you mean 'training'?", T("--config", "{tmp}/job.toml"),
        setup=_write("job.toml", "[trainig]\nsteps = 5\n")),
    Row("train-toml-unknown-key", "{tmp}/job.toml:3: unknown key 'step' in [training]",
        "did you mean 'steps'?", T("--config", "{tmp}/job.toml"),
        setup=_write("job.toml", "[training]\nsteps = 5\nstep = 3\n")),
    Row("train-toml-wrong-type", "training.steps='many' ({tmp}/job.toml:2)",
        "must be an integer", T("--config", "{tmp}/job.toml"),
        setup=_write("job.toml", "[training]\nsteps = \"many\"\n")),
    Row("train-toml-bad-value", "optimizer.lr=-1.0 ({tmp}/job.toml:3)", "must be > 0",
        ["--nproc-per-node", "2", TRAIN, "--config", "{tmp}/job.toml"],
        setup=_write("job.toml", "[optimizer]\n# the peak\nlr = -1\n")),
    Row("train-toml-syntax", "--config {tmp}/job.toml: not valid TOML", "fix that line",
        T("--config", "{tmp}/job.toml"), setup=_write("job.toml", "[training\n")),
    Row("train-toml-outside-section", "{tmp}/job.toml:1: steps = 5 is outside any section",
        "put it under [training]", T("--config", "{tmp}/job.toml"),
        setup=_write("job.toml", "steps = 5\n")),
    Row("train-module-hook", "--steps=0 (training.steps)", "must be >= 1",   # a package's
        ["--nproc-per-node", "2", "-m", "tpkit.train", *SMALL, "--steps", "0"]),   # __main__
    Row("train-long-flag-value", "--training.steps=0 (training.steps)", "must be >= 1",
        T("--training.steps", "0")),
    Row("train-unknown-flag", "unrecognized arguments: --trainig.steps", "--help",
        T("--trainig.steps", "3")),
    # issue 37: the trainer's logging section (tpkit.observe)
    Row("train-profile-steps", "--profile-steps='4' (logging.profile_steps)", "is not A:B",
        T("--log-dir", "{tmp}/run", "--profile-steps", "4")),
    Row("train-profile-steps-order", "--profile-steps='3:1'", "0 <= A < B",
        T("--log-dir", "{tmp}/run", "--profile-steps", "3:1")),
    Row("train-profile-steps-late", "--profile-steps='5:7'", "choose A < training.steps",
        T("--log-dir", "{tmp}/run", "--profile-steps", "5:7")),
    Row("train-profile-without-log-dir", "--profile-steps='0:1' (logging.profile_steps)",
        "needs --log-dir DIR", T("--profile-steps", "0:1")),
    Row("train-log-dir-file", "--log-dir='{tmp}/file' (logging.log_dir)", "pass a directory",
        T("--log-dir", "{tmp}/file"), setup=_write("file", "")),
    Row("train-peak-tflops", "--peak-tflops=0.0 (logging.peak_tflops)", "must be > 0",
        T("--peak-tflops", "0")),
    Row("train-wandb-choice", "invalid choice: 'yes'", "choose from",
        T("--log-dir", "{tmp}/run", "--wandb", "yes")),
    # issue 44 item 2: tpkit-generate's pre-flight hook
    Row("generate-cli-cp", "cp=2: a decode step's one new token", "generate on a layout "
        "with cp=1", ["--nproc-per-node", "2", "--cp", "2", "-m", "tpkit.cli.generate",
                      "--hf", "{tmp}", "--ids", "1,2"]),
    Row("generate-cli-no-config", "--checkpoint needs --config", "the tpkit-train job TOML",
        ["--nproc-per-node", "2", "-m", "tpkit.cli.generate", "--checkpoint", "{tmp}",
         "--ids", "1,2"]),
    Row("generate-cli-ids", "--ids '1,x'", "comma-separated integer token ids",
        ["--nproc-per-node", "2", "-m", "tpkit.cli.generate", "--hf", "{tmp}",
         "--ids", "1,x"]),
    Row("generate-cli-hf-dir", "has no config.json", "pass a Hugging Face model directory",
        ["--nproc-per-node", "2", "-m", "tpkit.cli.generate", "--hf", "{tmp}",
         "--ids", "1,2"]),
    # issue 51: ids beyond the vocabulary (a sharded embedding read them as zeros), a
    # tokenizer other than the job's
    Row("generate-cli-id-vocab", "--ids '1,300': token id 300 is outside the model's "
        "vocabulary of 256 (ids 0..255, from {tmp}/config.json)", "pass ids below 256",
        ["--nproc-per-node", "2", "-m", "tpkit.cli.generate", "--hf", "{tmp}",
         "--ids", "1,300"], setup=_write("config.json", TINY_LLAMA)),
    Row("generate-cli-eos-vocab", "--eos-token-id 256 is outside the model's vocabulary of "
        "256", "pass an id below 256",
        ["--nproc-per-node", "2", "-m", "tpkit.cli.generate", "--hf", "{tmp}",
         "--ids", "1,2", "--eos-token-id", "256"], setup=_write("config.json", TINY_LLAMA)),
    Row("generate-cli-tokenizer-vs-job", "--tokenizer {tmp}/tok.json: the job "
        "{tmp}/job.toml trained on the built-in corpus' UTF-8 bytes", "drop --tokenizer",
        ["--nproc-per-node", "2", "-m", "tpkit.cli.generate", "--checkpoint", "{tmp}",
         "--config", "{tmp}/job.toml", "--tokenizer", "{tmp}/tok.json", "--prompt", "hi"],
        setup=_write("job.toml", "[training]\nsteps = 5\n")),
    # issue 22: mixture of experts
    Row("ep-vs-stage", "etp*ep = 2*4 = 8 does not divide tp*cp*dp = 2*1*3 = 6",
        "choose ep and etp whose product divides 6",
        ["--nproc-per-node", "6", "--tp", "2", "--ep", "4", SCRIPT]),
    Row("train-moe-topk", "top_k=5", "choose top_k <= num_experts",
        T("--moe-experts", "4", "--moe-topk", "5")),
    Row("train-moe-experts-vs-ep", "--moe-experts=6 (experts.num) is not divisible by ep=4",
        "use a multiple of 4", T("--moe-experts", "6", "--ep", "4")),
    Row("train-moe-capacity", "capacity_factor=0.0", "must be > 0",
        T("--moe-experts", "4", "--moe-capacity-factor", "0")),
    Row("train-pack-te", "--pack (data.pack) needs --model.impl torch or auto",
        "drop --pack or set --model.impl torch", T("--pack", "--model.impl", "te")),
    Row("train-pack-hf", "--pack (data.pack) trains the reference GPT",
        "drop --init-from-hf or --pack",
        T("--pack", "--init-from-hf", "{tmp}")),
    # issue 50: a Llama from scratch (tpkit.train.arch)
    Row("train-hf-config-missing", "--hf-config='{tmp}/none.json' (model.hf_config)",
        "pass a Hugging Face config.json", T("--hf-config", "{tmp}/none.json")),
    Row("train-hf-config-sizes", "--ffn=128 (model.ffn) cannot be combined with "
        "--hf-config", "drop them", T("--hf-config", "{tmp}/c.json", "--hidden", "32"),
        setup=_write("c.json", '{"model_type": "llama", "hidden_size": 64, '
                               '"intermediate_size": 96, "num_hidden_layers": 2, '
                               '"num_attention_heads": 4, "vocab_size": 300}')),
    Row("train-rope-theta-gpt", "--rope-theta=500000.0 (model.rope_theta)",
        "add --arch llama or drop it", T("--rope-theta", "500000")),
    Row("train-llama-moe", "--moe-experts=4 (experts.num) with a Llama", "use --arch gpt",
        T("--arch", "llama", "--moe-experts", "4")),
    Row("train-resume-damaged", "{train_ckpt}/step000002/__1_0.distcp",
        "resume from the previous checkpoint: {train_ckpt}/step000001",
        ["--tp", "2", TRAIN, *SMALL, "--resume", "{train_ckpt}"]),
    Row("train-resume-other-model", "'model.embedding.weight'", "load a checkpoint of this model",
        ["--tp", "2", TRAIN, *SMALL, "--hidden", "32", "--resume",
         "{train_ckpt}/step000001"]),
    # issue 51: a deeper model's checkpoint (its extra layers were dropped), one already
    # past --steps (exit 0, nothing printed)
    Row("train-resume-deeper-model", "holds 6 tensors this model does not have, first "
        "'model.layers.1.input_layernorm.weight'", "or load only the shared tensors with "
        "strict=False (tpkit-train: --resume-partial)",
        ["--tp", "2", TRAIN, *SMALL, "--steps", "3", "--resume", "{deep_ckpt}"]),
    Row("train-resume-past-steps", "--resume='{train_ckpt}/step000001' (checkpoint.resume) -> "
        "{train_ckpt}/step000001 has 1 steps done, which reaches --steps=1 (training.steps)",
        "nothing to train; raise --steps above 1 to train on",
        ["--tp", "2", TRAIN, *SMALL, "--steps", "1", "--resume", "{train_ckpt}/step000001"]),
    # issue 51: a repeated option (argparse keeps the last silently)
    Row("tp-twice", "--tp given twice (--tp 2, then --tp 4)", "pass it once",
        ["--tp", "2", "--nproc-per-node", "4", "--tp=4", SCRIPT]),
    Row("train-config-twice", "--config given 2 times ({tmp}/a.toml, {tmp}/b.toml)",
        "pass one job file", T("--config", "{tmp}/a.toml", "--config", "{tmp}/b.toml"),
        setup=lambda tmp: [_write(n, "[training]\nsteps = 5\n")(tmp)
                           for n in ("a.toml", "b.toml")]),
    # issue 51: output paths, before any worker starts (not at the first save)
    Row("train-save-under-file", "--save='{tmp}/file/ck' (checkpoint.save) is under {tmp}/file,"
        " which is a file", "pass a directory", T("--save", "{tmp}/file/ck"),
        setup=_write("file", "")),
    Row("train-log-dir-under-file", "--log-dir='{tmp}/file/run' (logging.log_dir) is under "
        "{tmp}/file, which is a file", "pass a directory", T("--log-dir", "{tmp}/file/run"),
        setup=_write("file", "")),
    Row("train-save-read-only", "cannot be written: /proc/1 is not writable by this user",
        "pass a directory", T("--save", "/proc/1/tpkit-ck")),
    Row("env-stale-dp", "dp=4 from $TPKIT_DP", "unset TPKIT_DP (a value left from another "
        "job?) or set TPKIT_DP=2", ["--nproc-per-node", "2", SCRIPT], env={"TPKIT_DP": "4"}),
    # issue 51: a vocabulary that does not split over tp (it blamed --hidden/--heads)
    Row("train-vocab-vs-tp", "the built-in corpus' vocabulary of 256, padded to a multiple of "
        "model.vocab_multiple=128 (default), is 256, which tp=3 does not divide",
        "use --vocab-multiple 384 or a multiple of it",
        ["--nproc-per-node", "3", TRAIN, *SMALL, "--tp", "3", "--heads", "3", "--gqa-groups",
         "3", "--hidden", "48"]),
    Row("train-vocab-vs-tp-hf-config", "--hf-config='{tmp}/c.json' (model.hf_config)'s "
        "vocabulary of 301, padded to a multiple of --vocab-multiple=1 (model.vocab_multiple),"
        " is 301, which tp=2 does not divide", "use --vocab-multiple 2 or a multiple of it",
        ["--nproc-per-node", "2", TRAIN, "--steps", "2", "--seq-len", "16", "--global-batch",
         "2", "--hf-config", "{tmp}/c.json", "--vocab-multiple", "1", "--tp", "2"],
        setup=_write("c.json", '{"model_type": "llama", "hidden_size": 64, '
                               '"intermediate_size": 96, "num_hidden_layers": 2, '
                               '"num_attention_heads": 4, "vocab_size": 301}')),
    Row("train-resume-partial-alone", "--resume-partial (checkpoint.resume_partial)",
        "needs --resume CKPT or --auto-resume", T("--resume-partial")),
]


@pytest.mark.parametrize("row", LAUNCH, ids=lambda r: r.id)
def test_launch_mistake_is_one_line_exit_2(row, capsys, no_workers, monkeypatch,  # noqa: F811
                                           tmp_path, request):
    if row.skip == "te":
        from tpkit.te import te_available
        if te_available():
            pytest.skip("TE runs here: --backend te is valid")
    paths = {"tmp": str(tmp_path)}
    if any("{train_ckpt}" in a or "{deep_ckpt}" in a for a in row.argv):
        fixture = request.getfixturevalue("damaged")
        paths["train_ckpt"] = fixture["train_ckpt"]
        paths["deep_ckpt"] = os.path.join(fixture["base"], "deep")
    if row.setup:
        row.setup(tmp_path)
    for k, v in row.env.items():
        monkeypatch.setenv(k, v)
    if row.slurm is not None:
        slurm_env(monkeypatch, **row.slurm)
        fake_scontrol(tmp_path, monkeypatch, row.hosts)
    assert launch.main([a.format(**paths) for a in row.argv]) == 2
    out, err = capsys.readouterr()
    assert out == "", out
    assert err.count("\n") == 1 and err.startswith("tpkit-launch: error: "), err
    assert "Traceback" not in err
    assert row.value.format(**paths) in err, err
    assert row.fix.format(**paths) in err, err
    if row.absent:
        assert row.absent not in err, err


# --- the public API -----------------------------------------------------------------------
def _at(tp: int, build, *, cp: int = 1, sp: bool = False):
    """``build(state)`` on the state rank 0 of a tp*cp world would build (fake group)."""
    from tpkit.layout.config import ParallelConfig
    from tpkit.layout.planning import fake_state

    def call(tmp):
        with fake_state(ParallelConfig(tp=tp, cp=cp, sequence_parallel=sp), tp * cp) as state:
            build(state)
    return call


def _cfg(**kw):
    from tpkit.layout.config import ParallelConfig
    return lambda tmp: ParallelConfig(**kw)


def _te(build):
    """``build(state)`` on a tp=2 SP state (fake group), with the fake TE (tests/fake_te)
    and tpkit.te believing CUDA is there."""
    def call(tmp):
        import te_fake
        import tpkit.te
        from tpkit.layout.config import ParallelConfig
        from tpkit.layout.planning import fake_state
        from tpkit.layout.random import model_parallel_seed
        te_fake.install()
        was, tpkit.te._cuda_available = tpkit.te._cuda_available, lambda: True
        try:
            with fake_state(ParallelConfig(tp=2, sequence_parallel=True), 2) as state:
                model_parallel_seed(1, state)
                build(state)
        finally:
            tpkit.te._cuda_available = was
            te_fake.uninstall()
    return call


def _te_graphs(state):
    import tpkit.te
    attn = tpkit.te.make("attention", state, num_attention_heads=2, kv_channels=2)
    q = torch.zeros(2, 1, 1, 2)
    tpkit.te.make_graphed_callables(attn, (q, q, q))


def _nn(name):
    import tpkit.nn
    return getattr(tpkit.nn, name)


def _plans():
    import tpkit.plans
    return tpkit.plans


def _fabric(name):
    import tpkit.fabric
    return getattr(tpkit.fabric, name)


def _recovery(*args, **kw):
    from tpkit.recovery import Recovery
    return Recovery(*args, **kw)


def _observe(name):
    import tpkit.observe
    return getattr(tpkit.observe, name)


def _te_api(name):
    import tpkit.te_api
    return getattr(tpkit.te_api, name)


def _fp8_weight_sgd_step(tmp):
    from tpkit.fp8 import FP8Weight
    p = torch.nn.Parameter(FP8Weight.quantize(torch.ones(2, 2)), requires_grad=True)
    p.grad = torch.ones(2, 2)
    torch.optim.SGD([p], lr=0.1).step()


def _llama(state):
    from tpkit.models import Llama, LlamaConfig
    from tpkit.layout.random import model_parallel_seed
    model_parallel_seed(1, state)
    return Llama(LlamaConfig(vocab_size=16, hidden_size=16, ffn_hidden_size=32, num_layers=1,
                             num_heads=2), state)


def _onnx_tp2_layer(state):
    """A layer of a tp=2 state run inside onnx_export: refused at its collective."""
    from tpkit.layout.random import model_parallel_seed
    model_parallel_seed(1, state)
    layer = _nn("ColumnParallelLinear")(8, 8, state=state)
    with _te_api("onnx_export")(True):
        layer(torch.zeros(2, 8))


def _onnx_moe(state):
    from tpkit.layout.random import model_parallel_seed
    model_parallel_seed(1, state)
    moe = _nn("MoE")(8, 16, 2, 1, state=state)
    with _te_api("onnx_export")(True):
        moe(torch.zeros(4, 1, 8))


def _onnx_legacy(tmp):
    def build(state):
        from tpkit.layout.random import model_parallel_seed
        model_parallel_seed(1, state)
        layer = _nn("ColumnParallelLinear")(8, 8, state=state)
        with _te_api("onnx_export")(True):
            torch.onnx.export(layer, (torch.zeros(2, 8),), str(tmp / "x.onnx"), dynamo=False)
    _at(1, build)(tmp)


def _onnx_in_fp8():
    with _te_api("fp8_autocast")(fp8_recipe="current"):
        with _te_api("onnx_export")(True):
            pass


def _touch(path):
    path.write_text("")
    return path


def _load(path_of):
    def call(tmp):
        from tpkit.checkpoint import load
        load(path_of(tmp), {"model": torch.nn.Linear(2, 2)})
    return call


API = [
    Row("config-tp-zero", "tp=0", "use tp=1", call=_cfg(tp=0)),
    Row("config-ep-zero", "ep=0", "use ep=1", call=_cfg(ep=0)),
    Row("moe-topk", "top_k=3", "choose top_k <= num_experts",
        call=lambda tmp: __import__("tpkit.nn.moe").nn.moe.check_moe_args(2, 3, None)),
    Row("config-dp-zero", "dp=0", "use dp=1", call=_cfg(dp=0)),
    Row("config-sp", "sequence_parallel=True", "set tp >= 2", call=_cfg(sequence_parallel=True)),
    Row("config-comm-type", "cp_comm_type='ring'", "use one of",
        call=_cfg(cp=2, cp_comm_type="ring")),
    Row("config-world", "3*1*1", "multiple of 3",
        call=lambda tmp: _cfg(tp=3)(tmp).validate(8)),
    Row("config-env-int", "TPKIT_TP='x'", "set e.g. TPKIT_TP=1",
        call=lambda tmp: __import__("tpkit.layout.config").layout.config.ParallelConfig.from_env(
            {"TPKIT_TP": "x"})),
    # issue 15, defect 2: the message says where a value came from
    Row("config-env-dp", "dp=2 from $TPKIT_DP", "unset TPKIT_DP (a value left from another "
        "job?) or set TPKIT_DP=1",
        call=lambda tmp: __import__("tpkit.layout.config").layout.config.ParallelConfig.from_env(
            {"TPKIT_TP": "1", "TPKIT_DP": "2"}).validate(1)),
    # issue 51: init_parallel(tp=2) in a script launched with tpkit-launch --tp 4
    Row("init-tp-vs-launch", "tp=2 from init_parallel's tp argument contradicts tp=4 from "
        "tpkit-launch --tp", "give the layout once",
        call=lambda tmp: __import__("tpkit.layout.config").layout.config.ParallelConfig.from_env(
            {"TPKIT_TP": "4", "TPKIT_LAUNCH_GIVEN": "tp"},
            given_as="init_parallel's {name} argument", tp=2)),
    Row("init-tp-vs-world", "tp=3 from init_parallel's tp argument", "smaller tp/cp/pp",
        call=lambda tmp: __import__("tpkit").init_parallel(tp=3)),
    Row("init-backend", "backend='mpi'", "use 'nccl' or 'gloo'",
        call=lambda tmp: __import__("tpkit").init_parallel(backend="mpi")),
    Row("init-config-and-sizes", "config=", "not both",
        call=lambda tmp: __import__("tpkit").init_parallel(
            tp=1, config=__import__("tpkit.layout.config").layout.config.ParallelConfig())),
    # issue 15, defect 7: the layers say what to use instead
    Row("attention-hidden-vs-heads", "hidden_size=10", "use hidden_size=8 or 12",
        call=_at(1, lambda s: _nn("ParallelSelfAttention")(10, 4, state=s))),
    Row("attention-heads-vs-tp", "num_attention_heads=6", "or a tp that divides 6",
        call=_at(4, lambda s: _nn("ParallelSelfAttention")(48, 6, state=s))),
    Row("column-vs-tp", "out_features=6", "use out_features=4 or 8",
        call=_at(4, lambda s: _nn("ColumnParallelLinear")(16, 6, state=s))),
    Row("row-vs-tp", "in_features=6", "use in_features=4 or 8",
        call=_at(4, lambda s: _nn("RowParallelLinear")(6, 16, state=s))),
    # issue 35: bring your own model (tpkit.parallelize), batch-first layers, timeouts
    Row("parallelize-no-plan", "no ready plan for Linear", "ready plans exist for",
        call=_at(2, lambda s: _plans().parallelize(torch.nn.Linear(4, 4), state=s))),
    Row("parallelize-unmatched-pattern", "patterns ['nope']", "fix them",
        call=_at(2, lambda s: _plans().parallelize(
            torch.nn.Sequential(torch.nn.Linear(4, 4)),
            {"0": _plans().Column(), "nope": _plans().Row()}, s))),
    Row("parallelize-uncovered", "['1 (Linear)']", "add a style for each",
        call=_at(2, lambda s: _plans().parallelize(
            torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)),
            {"0": _plans().Column()}, s))),
    # issue 51: a fused gate/up given Column() without segments= trained wrong, silently
    Row("parallelize-fused-column", "plan style Column() for 'gate_up_proj' (nn.Linear 4 -> 8):"
        " the name says it is a fused projection ('gate_up')",
        "pass Column(segments=...) with the part sizes, e.g. (4, 4) for gate/up, or "
        "Column(segments=(8,)) if it is one projection",
        call=_at(2, lambda s: _plans().parallelize(
            torch.nn.ModuleDict({"gate_up_proj": torch.nn.Linear(4, 8)}),
            {"gate_up_proj": _plans().Column()}, s))),
    Row("save-hf-other-model", "save_hf(Linear): writes a tpkit.models.Llama or a Hugging Face",
        "tpkit.checkpoint.full_state_dict(model) gives its full tensors",
        call=lambda tmp: __import__("tpkit.models.hf").models.hf.save_hf(
            torch.nn.Linear(2, 2), str(tmp / "out"))),
    Row("parallelize-cp-no-shard-inputs", "has no shard_inputs", "give the plan a shard_inputs",
        call=_at(1, lambda s: _plans().parallelize(
            torch.nn.Sequential(torch.nn.Linear(4, 4)), {"0": _plans().Replicate()}, s),
            cp=2)),
    Row("attn-input-format", "attn_input_format='bhsd'", "use 'sbhd'",
        call=_at(1, lambda s: _nn("TransformerLayer")(8, 16, 2, attn_input_format="bhsd",
                                                     state=s))),
    Row("pg-timeout-env", "TPKIT_PG_TIMEOUT='soon'", "positive number of seconds",
        call=lambda tmp: __import__("tpkit.layout.parallel_state").layout.parallel_state.pg_timeout(
            {"TPKIT_PG_TIMEOUT": "soon"})),
    Row("embedding-vs-tp", "num_embeddings (vocab size)=10", "use num_embeddings (vocab size)=8",
        call=_at(4, lambda s: _nn("VocabParallelEmbedding")(10, 8, state=s))),
    Row("mlp-vs-tp", "ffn_hidden_size=6", "use ffn_hidden_size=4 or 8",
        call=_at(4, lambda s: _nn("ParallelMLP")(16, 6, state=s))),
    Row("layer-backend", "backend='tpu'", "use one of",
        call=_at(1, lambda s: _nn("TransformerLayer")(16, 32, 2, state=s, backend="tpu"))),
    Row("attention-mask", "attn_mask_type='arbitrary'", "use one of",
        call=_at(1, lambda s: _nn("DotProductAttention")(2, 8, attn_mask_type="arbitrary",
                                                         state=s))),
    # issue 51 (from issue 15's list): a padding mask type without the mask
    Row("attention-padding-without-mask", "attention_mask is missing with "
        "attn_mask_type='padding'", "pass TE's padding mask [b, 1, 1, s] (True: padding)",
        call=_at(1, lambda s: _nn("DotProductAttention")(2, 8, attn_mask_type="padding",
                                                         state=s)(*[torch.zeros(4, 2, 2, 8)] * 3))),
    # issue 18: packed sequences
    Row("thd-dropout", "attention_dropout=0.1", "use attention_dropout=0 or backend='te'",
        call=_at(1, lambda s: _nn("DotProductAttention")(
            2, 8, qkv_format="thd", attn_mask_type="padding", attention_dropout=0.1, state=s))),
    Row("pack-document-length", "document 1 has padded length 6",
        "pad every document with tpkit.data.pack_sequences",
        call=lambda tmp: __import__("tpkit.cp").cp.packed_cp_indices([0, 4, 10], 0, 2)),
    Row("pack-empty-document", "document 1 has shape (0,)", "non-empty 1-D integer sequence",
        call=lambda tmp: __import__("tpkit.data").data.pack_sequences([[1], []], multiple=2)),
    Row("sequence-vs-cp", "sequence length 12", "pad the sequence to a multiple of 8",
        call=_at(1, lambda s: __import__("tpkit.data").data.check_sequence_length(12, s),
                 cp=4)),
    # pipeline parallelism (issue 16): TPKitStrategy's pipeline arguments
    Row("strategy-pp-microbatches", "microbatches=1 is fewer than the 2 pipeline stages",
        "use at least 2", call=lambda tmp: _fabric("TPKitStrategy")(pp=2, microbatches=1)),
    Row("strategy-pp-schedule", "'Zigzag' is unknown", "use one of",
        call=lambda tmp: _fabric("TPKitStrategy")(pp=2, pp_schedule="Zigzag")),
    Row("strategy-microbatches-no-pp", "microbatches=4", "only apply with pp > 1",
        call=lambda tmp: _fabric("TPKitStrategy")(pp=1, microbatches=4)),
    Row("pipeline-zero-bubble-recompute", "'ZBVZeroBubble' with recompute",
        "use 1F1B or Interleaved1F1B with recompute",
        call=lambda tmp: __import__("tpkit.distributed.pipeline").distributed.pipeline.plan_pipeline(
            pp=2, num_blocks=4, microbatches=4, schedule="ZBVZeroBubble", recompute=True)),
    Row("compile-fullgraph-false", "compile_blocks(fullgraph=False)", "drop fullgraph",
        call=lambda tmp: __import__("tpkit").compile_blocks(torch.nn.Linear(2, 2),
                                                            fullgraph=False)),
    Row("compile-no-blocks", "Linear has no transformer blocks",
        "torch.compile(block, fullgraph=True)",
        call=lambda tmp: __import__("tpkit").compile_blocks(torch.nn.Linear(2, 2))),
    Row("strategy-data-parallel", "data_parallel='zero'", "use one of",
        call=lambda tmp: _fabric("TPKitStrategy")(data_parallel="zero")),
    Row("precision", "precision='fp4'", "use one of",
        call=lambda tmp: _fabric("TPKitPrecision")("fp4")),
    Row("recovery-keep-zero", "keep=0", "must be >= 1",
        call=lambda tmp: _recovery(tmp, keep=0, signals=())),
    Row("recovery-save-every", "save_every=-1", "must be >= 0",
        call=lambda tmp: _recovery(tmp, save_every=-1)),
    Row("recovery-no-dir", "need a save directory", "pass save_dir",
        call=lambda tmp: _recovery(None, save_every=5)),
    Row("recovery-hang-timeout", "hang timeout 0", "must be > 0 seconds",
        call=lambda tmp: _recovery(None, signals=(), hang_timeout=0)),
    Row("load-missing-path", "{tmp}/nope", "pass the directory tpkit.checkpoint.save",
        call=_load(lambda tmp: tmp / "nope")),
    Row("load-file", "{tmp}/x.pt is a file", "pass the directory tpkit.checkpoint.save",
        call=_load(lambda tmp: _touch(tmp / "x.pt"))),
    Row("save-under-file", "{tmp}/x.pt is a file, not a directory",
        "pass a path in a writable directory",
        call=lambda tmp: __import__("tpkit.checkpoint").checkpoint.save(
            _touch(tmp / "x.pt") / "ck", {"model": torch.nn.Linear(2, 2)})),
    Row("async-save-under-file", "{tmp}/x.pt is a file, not a directory",
        "pass a path in a writable directory",
        call=lambda tmp: __import__("tpkit.checkpoint").checkpoint.async_save(
            _touch(tmp / "x.pt") / "ck", {"model": torch.nn.Linear(2, 2)})),
    Row("load-empty-dir", "{tmp}/.metadata is missing", "load another checkpoint",
        call=_load(lambda tmp: tmp)),
    # checkpoints at fsspec URLs (tests/checkpoint/test_checkpoint_fsspec.py: the marker, the checks)
    Row("load-url-missing", "no checkpoint at memory://tpkit-bad/nope", "pass the directory "
        "tpkit.checkpoint.save", call=_load(lambda tmp: "memory://tpkit-bad/nope")),
    Row("load-url-unknown-scheme", "checkpoint path nosuchfs://b/ck", "install the file "
        "system's package", call=_load(lambda tmp: "nosuchfs://b/ck")),
    Row("save-url-mode", "mode=0o600 sets local files' modes", "drop mode",
        call=lambda tmp: __import__("tpkit.checkpoint").checkpoint.save(
            "memory://tpkit-bad/ck", {"model": torch.nn.Linear(2, 2)}, mode=0o600)),
    Row("save-mode", "mode=0o444", "pass e.g. 0o600",
        call=lambda tmp: __import__("tpkit.checkpoint").checkpoint.save(
            tmp / "ck", {"model": torch.nn.Linear(2, 2)}, mode=0o444)),
    Row("recovery-mode", "mode='600'", "pass e.g. 0o600",
        call=lambda tmp: _recovery(str(tmp), signals=(), mode="600")),
    Row("observe-profile-steps", "--profile-steps='4:2'", "need 0 <= A < B",
        call=lambda tmp: _observe("parse_profile_steps")("4:2")),
    Row("observe-every", "every=0", "must be a positive number of steps",
        call=lambda tmp: _observe("MetricsLogger")(tmp, tokens_per_step=8, every=0)),
    Row("observe-peak", "peak_tflops=0", "must be a positive TFLOP/s",
        call=lambda tmp: _observe("MetricsLogger")(tmp, tokens_per_step=8, peak_tflops=0)),
    Row("observe-flops-model", "does not know object", "transformer_flops_per_token(",
        call=lambda tmp: _observe("model_flops_per_token")(object(), 8)),
    # issue 40: TE combinations tpkit cannot make TE run correctly
    Row("te-layer-sp-dropout", "sequence_parallel=True, tp=2 and attention_dropout=0.1",
        "Pass attention_dropout=0.0", call=_te(lambda st: __import__("tpkit.te").te.make(
            "transformer_layer", st, hidden_size=8, ffn_hidden_size=16,
            num_attention_heads=2))),
    Row("te-graphs-tpkit-tracker", "make_graphed_callables with tpkit's RNG tracker",
        "Run without CUDA graphs", call=_te(_te_graphs)),
    # issue 44: TE's documented items tpkit.te_api does not do yet, and TE's modes
    Row("te-api-cpu-offload", "get_cpu_offload_context(num_layers=1, model_layers=1)",
        "at most model_layers - 1 = 0", call=lambda tmp: _te_api("get_cpu_offload_context")(
            True, num_layers=1, model_layers=1)),
    Row("te-api-cpu-offload-positional", "model_layers=True", "pass keywords",
        call=lambda tmp: _te_api("get_cpu_offload_context")(True, 1, True)),
    Row("te-api-calibrating-block", "fp8_autocast(calibrating=True) with the 'mxfp8' recipe",
        "calibrate with 'delayed' or 'current'",
        call=lambda tmp: _te_api("fp8_autocast")(False, True, "mxfp8").__enter__()),
    Row("fp8-weight-written-in-place", "writes into an fp8 parameter",
        "tpkit.fp8.with_master_weights(optimizer)", call=_fp8_weight_sgd_step),
    Row("fp8-master-weights-none", "the optimizer holds no fp8 parameter",
        "build the model inside tpkit.fp8.fp8_model_init()", call=lambda tmp: __import__(
            "tpkit.fp8").fp8.with_master_weights(torch.optim.SGD(
                [torch.nn.Parameter(torch.ones(2))], lr=0.1))),
    # issue 44 item 2: KV-cache inference and model.generate
    Row("inference-params-length", "sequence_len_offset=0 + 8 new tokens exceeds "
        "InferenceParams(max_sequence_length=6)", "max_sequence_length of at least prompt",
        call=_at(1, lambda st: _nn("DotProductAttention")(2, 4, state=st)(
            *[torch.zeros(8, 1, 2, 4)] * 3,
            inference_params=_te_api("InferenceParams")(1, 6)))),
    Row("inference-params-batch", "batch 3 exceeds InferenceParams(max_batch_size=2)",
        "max_batch_size of at least the batch",
        call=_at(1, lambda st: _nn("DotProductAttention")(2, 4, state=st)(
            *[torch.zeros(4, 3, 2, 4)] * 3,
            inference_params=_te_api("InferenceParams")(2, 8)))),
    Row("inference-params-cp", "under context parallelism (cp=2)", "generate on a layout "
        "with cp=1", call=_at(1, lambda st: _nn("DotProductAttention")(2, 4, state=st)(
            *[torch.zeros(4, 1, 2, 4)] * 3,
            inference_params=_te_api("InferenceParams")(1, 8)), cp=2)),
    Row("generate-cp", "generate at cp=2", "generate on a layout with cp=1",
        call=_at(1, lambda st: _llama(st).generate(torch.zeros(1, 4, dtype=torch.long),
                                                   max_new_tokens=2), cp=2)),
    Row("generate-sp", "sequence_parallel=True (tp=2)", "without sequence parallelism",
        call=_at(2, lambda st: _llama(st).generate(torch.zeros(1, 4, dtype=torch.long),
                                                   max_new_tokens=2), sp=True)),
    Row("generate-right-padding", "rows [0] are padded on the right",
        "tokenizer.padding_side = 'left'",
        call=_at(1, lambda st: _llama(st).generate(
            torch.zeros(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [1, 1, 1]]),
            max_new_tokens=2))),
    Row("generate-top-p", "generate(top_p=1.5)", "must be in (0, 1]",
        call=_at(1, lambda st: _llama(st).generate(torch.zeros(1, 3, dtype=torch.long),
                                                   max_new_tokens=2, do_sample=True,
                                                   top_p=1.5))),
    Row("generate-temperature", "generate(temperature=0) with do_sample=True",
        "pass do_sample=False", call=_at(1, lambda st: _llama(st).generate(
            torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2, do_sample=True,
            temperature=0))),
    Row("generate-id-vocab", "token id 16 is outside the model's vocabulary (vocab_size=16: "
        "ids 0..15)", "encode the prompt with the tokenizer the model was trained with",
        call=_at(2, lambda st: _llama(st).generate(torch.tensor([[1, 16]]),
                                                   max_new_tokens=1))),
    Row("generate-max-new-tokens", "generate(max_new_tokens=0)", "a positive integer",
        call=_at(1, lambda st: _llama(st).generate(torch.zeros(1, 3, dtype=torch.long),
                                                   max_new_tokens=0))),
    Row("te-api-onnx-collective", "copy_to_tp_region runs a collective over 2 ranks",
        "export at tp=cp=pp=ep=1", call=_at(2, _onnx_tp2_layer)),
    Row("te-api-onnx-fp8", "onnx_export(enabled=True) inside fp8_autocast",
        "export outside fp8_autocast", call=lambda tmp: _onnx_in_fp8()),
    Row("te-api-onnx-moe", "onnx_export(enabled=True) with a MoE layer",
        "export a dense model (moe_experts=0)", call=_at(1, _onnx_moe)),
    Row("te-api-onnx-legacy", "torch.onnx.export(..., dynamo=False)",
        "use dynamo=True", call=_onnx_legacy),
    Row("te-api-onnx-enabled", "onnx_export(enabled='yes')", "takes True or False",
        call=lambda tmp: _te_api("onnx_export")("yes").__enter__()),
    Row("te-api-parallel-mode", "parallel_mode='rows'", "None, 'column' or 'row'",
        call=lambda tmp: _te_api("Linear")(8, 8, parallel_mode="rows")),
    Row("precision-weights-dtype", "weights_dtype=torch.int8", "a floating torch.dtype",
        call=lambda tmp: _fabric("TPKitPrecision")(weights_dtype=torch.int8)),
    Row("precision-te-args-not-fp8", "precision='bf16-mixed'", "drop them or use 'fp8'",
        call=lambda tmp: _fabric("TPKitPrecision")("bf16-mixed", weights_dtype=torch.bfloat16)),
    Row("precision-replace-layers", "replace_layers='yes'", "None (Lightning's default",
        call=lambda tmp: _fabric("TPKitPrecision")("fp8", replace_layers="yes")),
    Row("precision-device", "device='cuda'", "drop the argument",
        call=lambda tmp: _fabric("TPKitPrecision")("bf16-mixed", "cuda")),
    Row("precision-scaler", "only applies to precision='16-mixed'", "drop the scaler",
        call=lambda tmp: _fabric("TPKitPrecision")("bf16-mixed", scaler=object())),
    # issue 43: tpkit.verify (refused before any process starts)
    Row("verify-layout", "'2x1'", "write TPxCPxDP", call=lambda tmp: _verify(layouts="2x1")),
    Row("verify-sp-at-tp1", "'1x2x1+sp'", "use tp >= 2 with +sp",
        call=lambda tmp: _verify(layouts="1x2x1+sp")),
    Row("verify-precision", "precision='fp8'", "use one of",
        call=lambda tmp: _verify(precision="fp8")),
    Row("verify-steps", "steps=0", "a positive integer", call=lambda tmp: _verify(steps=0)),
    Row("verify-batch-rows", "3 rows", "a multiple of 2",
        call=lambda tmp: _verify(layouts="1x1x2", rows=3)),
    Row("verify-no-tokens", "[batch, sequence]", "make_batch(step) must return",
        call=lambda tmp: _verify(batch=lambda step: (torch.zeros(2, 8),))),
]


def _verify(rows=2, batch=None, **kw):
    import tpkit
    tokens = (lambda step: (torch.zeros(rows, 8, dtype=torch.long),))
    return tpkit.verify(lambda: torch.nn.Embedding(4, 4), batch or tokens, **kw)


@pytest.mark.parametrize("row", API, ids=lambda r: r.id)
def test_api_mistake_names_value_and_fix(row, tmp_path):
    import torch.distributed as dist
    with pytest.raises(ValueError) as e:
        row.call(tmp_path)
    msg = str(e.value)
    assert row.value.format(tmp=tmp_path) in msg, msg
    assert row.fix.format(tmp=tmp_path) in msg, msg
    assert not dist.is_initialized()   # refused before any process group existed


# --- what tpkit-launch says about a failed worker -------------------------------------------
def _failure(tmp, exitcode: int, error=None, name="error.json"):
    """tpkit-launch's last line for a rank that exited with ``exitcode`` after raising
    ``error`` (recorded the way the worker wrapper records it) or without an exception."""
    from torch.distributed.elastic.multiprocessing.errors import (ChildFailedError,
                                                                  ProcessFailure,
                                                                  get_error_handler)
    error_file = str(tmp / name)
    if error is not None:
        os.environ["TORCHELASTIC_ERROR_FILE"] = error_file
        try:
            get_error_handler().record_exception(error)
        finally:
            del os.environ["TORCHELASTIC_ERROR_FILE"]
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=exitcode, error_file=error_file)
    return launch.describe_failure(ChildFailedError("script.py", {1: failure}))


def test_failed_worker_line(tmp_path):
    # issue 15, defect 5: sys.exit(3) / a crash leaves no error file, and torch's
    # placeholder record {"message": "<NONE>"} must not read as a message
    line = _failure(tmp_path, 3)
    assert line == ("rank 1 (local rank 1, exit code 3) failed: exited without a Python "
                    "exception (sys.exit or a crash); see its output above"), line
    assert not launch.user_error(line)
    line = _failure(tmp_path, 1, ValueError("x=3 is odd; use x=4"), "value.json")
    assert line.endswith("failed: ValueError: x=3 is odd; use x=4") and launch.user_error(line)
    line = _failure(tmp_path, 1, RuntimeError("boom"), "runtime.json")
    assert "failed: RuntimeError: boom" in line and not launch.user_error(line)
    # torch's CheckpointException (a BaseException) carries every rank's traceback: one
    # line, naming each rank's error once
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException
    try:
        raise NotADirectoryError(20, "Not a directory", "/x/s.py/step2.tmp")
    except OSError as e:
        trace = traceback.extract_tb(e.__traceback__)
        error = CheckpointException("save", {0: (e, trace), 1: (e, trace)})
    line = _failure(tmp_path, 1, error, "checkpoint.json")
    assert "\n" not in line and line.endswith(
        "failed: CheckpointException: CheckpointException ranks:dict_keys([0, 1]); "
        "NotADirectoryError: [Errno 20] Not a directory: '/x/s.py/step2.tmp'"), line


# --- damaged checkpoints, on 2 ranks ----------------------------------------------------------
DAMAGES = {   # name -> what is done to the newest checkpoint (step000020)
    "metadata-missing": lambda d: os.remove(d / ".metadata"),
    "metadata-truncated": lambda d: os.truncate(d / ".metadata", 40),
    "shard-missing": lambda d: os.remove(d / "__1_0.distcp"),
    "shard-truncated": lambda d: os.truncate(d / "__1_0.distcp",
                                             os.path.getsize(d / "__1_0.distcp") // 2),
    "shard-size": lambda d: open(d / "__0_0.distcp", "ab").write(b"\0" * 16),
    "empty-dir": lambda d: [os.remove(d / f) for f in os.listdir(d)],
}
CHECKPOINTS = [   # (id, value the message names, fix), results from _damage_on_2_ranks
    Row("metadata-missing", "step000020/.metadata is missing", "{prev}"),
    Row("metadata-truncated", "step000020/.metadata cannot be read", "{prev}"),
    Row("shard-missing", "step000020/__1_0.distcp is missing", "{prev}"),
    Row("shard-truncated", "step000020/__1_0.distcp has", "{prev}"),
    Row("shard-size", "step000020/__0_0.distcp has", "{prev}"),
    Row("empty-dir", "step000020/.metadata is missing", "{prev}"),
    Row("other-model-shape", "'model.0.weight' has global shape (16, 8) but the target "
        "expects (32, 8)",
        "load a checkpoint of this model"),
    Row("other-model-keys", "key 'net' that does not exist in the loaded checkpoint",
        "strict=False"),
    Row("fabric-shard-truncated", "step000020/__1_0.distcp has", "{prev}"),
    Row("train-resume-shard-truncated", "step000002/__1_0.distcp has",
        "resume from the previous checkpoint: {train_ckpt}/step000001"),
    # issue 51: a deeper model's checkpoint would drop its extra layers and their state
    Row("deeper-model", "holds 16 tensors this model does not have, first 'model.1.0.bias'",
        "load only the shared tensors with strict=False"),
    Row("train-resume-deeper", "holds 24 tensors this model does not have, first "
        "'model.layers.1.input_layernorm.weight'", "tpkit-train: --resume-partial"),
]


def _snapshot(model, opt):
    return (copy.deepcopy({k: v.detach().clone() for k, v in model.state_dict().items()}),
            copy.deepcopy(opt.state_dict()))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _refused(load, model, opt) -> tuple[str, bool]:
    """load()'s ValueError and whether model and optimizer are as before the call."""
    before = _snapshot(model, opt)
    try:
        load()
    except ValueError as e:
        return str(e), _same(before, _snapshot(model, opt))
    return "LOADED", False


def _damage_on_2_ranks(base: str) -> dict:
    """On 2 ranks at tp=2: each damage of DAMAGES refused by tpkit.checkpoint.load (an
    optimizer with state and a fresh one), checkpoints of other models, Fabric's load and
    launch/train.py --resume. Returns {case: (message, unchanged)}."""
    import pathlib

    import torch.distributed as dist

    import tpkit
    from tpkit.checkpoint import load, save
    from tpkit.nn import ColumnParallelLinear, RowParallelLinear
    base = pathlib.Path(base)
    rank, out = dist.get_rank(), {}

    def build(h=16, seed=0):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(ColumnParallelLinear(8, h), RowParallelLinear(h, 8))
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    def trained(seed):
        model, opt = build(seed=seed)
        model(torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(seed))
              ).pow(2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return model, opt

    def damage(path, how):
        if rank == 0:
            how(path)
        dist.barrier()

    tpkit.init_parallel(tp=2)
    model, opt = trained(1)
    ck = base / "ckpt"
    save(ck / "step000010", {"model": model, "optimizer": opt})
    for name, how in DAMAGES.items():
        save(ck / "step000020", {"model": model, "optimizer": opt})
        damage(ck / "step000020", how)
        for fresh in (False, True):   # an optimizer with state, and one without
            m2, o2 = build(seed=2) if fresh else trained(2)
            res = _refused(lambda: load(ck / "step000020", {"model": m2, "optimizer": o2}),
                           m2, o2)
            out[name] = out.get(name, ()) + res if fresh else res
        dist.barrier()
    m3, o3 = trained(3)
    big = build(h=32)
    out["other-model-shape"] = _refused(
        lambda: load(ck / "step000010", {"model": big[0], "optimizer": big[1]}), *big)
    out["other-model-keys"] = _refused(lambda: load(ck / "step000010", {"net": m3}), m3, o3)
    torch.manual_seed(0)   # one block more: its tensors (and their Adam state) in the file
    deep = torch.nn.Sequential(build()[0], build()[0])
    deep_opt = torch.optim.AdamW(deep.parameters(), lr=0.1)
    deep(torch.randn(4, 2, 8)).pow(2).sum().backward()
    deep_opt.step()
    save(ck / "deep", {"model": deep, "optimizer": deep_opt})
    shallow = torch.nn.Sequential(trained(4)[0])
    shallow_opt = torch.optim.AdamW(shallow.parameters(), lr=0.1)
    out["deeper-model"] = _refused(
        lambda: load(ck / "deep", {"model": shallow, "optimizer": shallow_opt}),
        shallow, shallow_opt)
    tpkit.destroy_parallel()

    from fabric_helpers import Block, full_model, launch_fabric, shard_into
    fabric, state = launch_fabric(tp=2)
    model = fabric.setup_module(shard_into(Block(state), full_model(0), state))
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
    x = torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(0))
    fabric.backward(model(x).pow(2).mean())
    opt.step()
    fck = base / "fabric"
    fabric.save(fck / "step000010", {"model": model, "optimizer": opt})
    fabric.save(fck / "step000020", {"model": model, "optimizer": opt})
    damage(fck / "step000020", DAMAGES["shard-truncated"])
    out["fabric-shard-truncated"] = _refused(
        lambda: fabric.load(fck / "step000020", {"model": model, "optimizer": opt}), model, opt)
    fabric.strategy.teardown()

    from tpkit.train import trainer as train
    tck = base / "train"
    train.main(SMALL + ["--tp", "2", "--save", str(tck), "--save-every", "1"])
    tpkit.destroy_parallel()
    train.main(SMALL + ["--tp", "2", "--layers", "2", "--save", str(base / "deep")])
    tpkit.destroy_parallel()
    try:   # the deeper job's checkpoint into SMALL's one layer
        train.main(SMALL + ["--tp", "2", "--steps", "3", "--resume", str(base / "deep")])
        out["train-resume-deeper"] = ("LOADED", False)
    except ValueError as e:
        out["train-resume-deeper"] = (str(e), True)
    tpkit.destroy_parallel()
    # ... and explicitly partial: the shared tensors load, the job trains its last step
    out["partial-losses"] = train.main(SMALL + ["--tp", "2", "--steps", "3", "--resume",
                                                str(base / "deep"), "--resume-partial"])
    tpkit.destroy_parallel()
    damage(tck / "step000002", DAMAGES["shard-truncated"])
    try:
        train.main(SMALL + ["--tp", "2", "--resume", str(tck)])
        out["train-resume-shard-truncated"] = ("LOADED", False)
    except ValueError as e:   # the model is built inside; nothing to compare it with
        out["train-resume-shard-truncated"] = (str(e), True)
    return out


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    base = tmp_path_factory.mktemp("damaged")
    results = run(_damage_on_2_ranks, 2, str(base))
    return {"results": results, "base": str(base), "train_ckpt": str(base / "train")}


@pytest.mark.parametrize("row", CHECKPOINTS, ids=lambda r: r.id)
def test_damaged_checkpoint_is_refused_unchanged(row, damaged):
    base = damaged["base"]
    series = "fabric" if row.id.startswith("fabric") else "ckpt"
    fix = row.fix.format(prev=f"resume from the previous checkpoint: {base}/{series}/step000010",
                         train_ckpt=damaged["train_ckpt"])
    per_rank = [r[row.id] for r in damaged["results"]]
    for res in per_rank:
        assert res[0] == per_rank[0][0], per_rank   # every rank raises the same message
        for msg, unchanged in zip(res[::2], res[1::2]):
            assert row.value in msg and fix in msg, msg
            assert unchanged, f"{row.id}: the model or optimizer changed before the error"


def test_partial_resume_trains_on(damaged):
    """--resume-partial of the deeper job's checkpoint (2 steps done) trains step 3."""
    for r in damaged["results"]:
        assert len(r["partial-losses"]) == 1 and 0 < r["partial-losses"][0] < 10, r


# --- launched: a mistake only the workers can see ------------------------------------------
@pytest.mark.slow
def test_worker_side_value_error_is_one_line():
    """init_parallel(tp=4) in a world of 2 (no pre-flight can know the script's sizes):
    every rank raises; the job reports one line, rank 0's or the first failing rank's,
    and no traceback. Before it, init_parallel(tp=2) under tpkit-launch's exported
    TPKIT_DP=2 builds tp=2 x dp=1 (issue 15, defect 2)."""
    rc, out, err = finish(start_launch("--nproc-per-node", "2",
                                       os.path.join(SCRIPTS, "worker_errors.py")))
    assert rc == 1, err[-3000:]
    assert out.count("TP2 OK") == 2, out
    assert "Traceback" not in err, err[-3000:]
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, err[-3000:]
    msg = "world size 2 is not divisible by tp*cp*pp = 4*1*1 = 4"
    assert err.count(msg) == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("tpkit-launch: rank ") and msg in last, err[-3000:]
    assert "tp=4 from init_parallel's tp argument" in last and "smaller tp/cp/pp" in last
    assert "TPKIT_TRACEBACK=1" in last


def test_worker_wrapper_records_every_exception(tmp_path, monkeypatch):
    """tpkit-launch's worker wrapper writes torchrun's error file for what the script
    raises: a ValueError (exit 1, no traceback printed) and torch's CheckpointException,
    which is a BaseException (else the launcher's line reads "exited without a Python
    exception")."""
    import json

    from torch.distributed.checkpoint.api import CheckpointException

    from tpkit.cli import _worker
    script = tmp_path / "s.py"
    for raise_, expect in (("ValueError('x=3 is odd; use x=4')", SystemExit),
                           ("CheckpointException('save', {})", CheckpointException)):
        script.write_text("from torch.distributed.checkpoint.api import CheckpointException\n"
                          f"raise {raise_}\n")
        error_file = tmp_path / f"{expect.__name__}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        monkeypatch.delenv("TPKIT_TRACEBACK", raising=False)
        monkeypatch.setattr(sys, "argv", [_worker.__file__, str(script)])
        with pytest.raises(expect):
            _worker.main()
        message = json.loads(error_file.read_text())["message"]["message"]
        assert message.startswith(raise_.split("(")[0] + ": "), message
