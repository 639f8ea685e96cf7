"""tpkit-launch, in process: parsing, Slurm derivation, and --dry-run against a real
8-rank gloo run. Bad invocations (exit 2, one line on stderr, nothing started) are in the
bad-input table, tests/test_bad_input.py."""
import os
import stat

import pytest

from dist import run
from tpkit.cli import launch
from tpkit.layout.config import ParallelConfig
from tpkit.layout.planning import format_rank_table, planned_rank_table

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/
SCRIPT = os.path.join(HERE, "launch_scripts", "check_layout.py")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No Slurm, torchrun (PET_*), SkyPilot or port variables from the surrounding shell."""
    for var in list(os.environ):
        if var.startswith(("SLURM_", "PET_", "TPKIT_", "SKYPILOT_")) or var in ("MASTER_PORT", "OMP_NUM_THREADS"):
            monkeypatch.delenv(var)


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if anything tries to start workers."""
    def boom(*a, **k):
        raise AssertionError("workers were started")
    monkeypatch.setattr(launch, "_launch", boom)


def fake_scontrol(tmp_path, monkeypatch, hosts=None):
    """Put a fake `scontrol` first on PATH: prints ``hosts``, or fails when None."""
    path = tmp_path / "scontrol"
    body = "printf '%s\\n' " + " ".join(hosts) if hosts else "echo 'scontrol: error: Invalid node name' >&2; exit 1"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def slurm_env(monkeypatch, *, nodes=2, nodeid=1, step="0", tasks=None, job="4242"):
    env = {"SLURM_JOB_ID": job, "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes),
           "SLURM_NODEID": str(nodeid), "SLURM_JOB_NODELIST": "node[07-08]"}
    if step is not None:
        env.update(SLURM_STEP_ID=step, SLURM_STEP_NUM_NODES=str(nodes),
                   SLURM_STEP_NUM_TASKS=str(tasks or nodes), SLURM_STEP_NODELIST="node[07-08]")
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def plan_of(argv):
    return launch.resolve(launch.build_parser().parse_args(argv), os.environ)


# Bad invocations (exit 2, one line, nothing started) are rows of the bad-input table,
# tests/test_bad_input.py, which uses the fixtures above.


# --- what a good invocation resolves to -------------------------------------------------
def test_defaults_single_node_cpu():
    plan = plan_of(["--tp", "2", "--cp", "2", SCRIPT, "--lr", "3"])
    assert plan.nproc_per_node == 4  # auto without GPUs = tp*cp*pp
    assert (plan.min_nodes, plan.max_nodes, plan.backend) == (1, 1, "gloo")
    assert (plan.rdzv_backend, plan.rdzv_endpoint) == ("c10d", "localhost:0")
    assert plan.exports == {"TPKIT_TP": "2", "TPKIT_CP": "2", "TPKIT_PP": "1", "TPKIT_DP": "1",
                            "TPKIT_SEQUENCE_PARALLEL": "0", "TPKIT_CP_COMM_TYPE": "p2p",
                            "TPKIT_BACKEND": "gloo", "TPKIT_LAUNCH_GIVEN": "tp,cp",
                            "OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // 4))}
    assert ParallelConfig.from_env(plan.exports) == plan.config
    assert plan.command[1:] == ["-u", launch.WORKER, SCRIPT, "--lr", "3"]


def test_auto_nproc_with_dp_on_cpu():
    assert plan_of(["--tp", "2", "--dp", "2", SCRIPT]).nproc_per_node == 4
    assert plan_of(["--tp", "2", "--dp", "4", "--nnodes", "2", "--rdzv-endpoint",
                    "127.0.0.1:29500", SCRIPT]).nproc_per_node == 4


def test_layout_flags_and_env(monkeypatch):
    monkeypatch.setenv("TPKIT_CP", "2")  # a TPKIT_* default from the environment ...
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # ... and the user's thread count are kept
    plan = plan_of(["--tp", "2", "--sequence-parallel", "--cp-comm-type", "a2a",
                    "--nproc-per-node", "8", "--dp", "2", "--backend", "gloo", SCRIPT])
    c = plan.config
    assert (c.tp, c.cp, c.dp, c.sequence_parallel, c.cp_comm_type) == (2, 2, 2, True, "a2a")
    assert "OMP_NUM_THREADS" not in plan.exports
    plan = plan_of(["--cp", "4", "--cp-comm-type", "a2a+p2p", "--cp-a2a-size", "2", SCRIPT])
    assert plan.exports["TPKIT_CP_A2A_SIZE"] == "2" and plan.nproc_per_node == 4


def test_multi_node_and_passthrough_flags():
    plan = plan_of(["--nnodes", "2:4", "--nproc-per-node", "4", "--tp", "2",
                    "--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-id", "exp1",
                    "--max-restarts", "3", "--monitor-interval", "0.5", SCRIPT])
    assert (plan.min_nodes, plan.max_nodes) == (2, 4)
    assert plan.config.dp is None and "TPKIT_DP" not in plan.exports  # elastic: dp varies
    assert (plan.rdzv_backend, plan.rdzv_endpoint, plan.rdzv_id) == ("c10d", "10.0.0.1:29400", "exp1")
    args = launch.build_parser().parse_args(["--max-restarts", "3", "--monitor-interval", "0.5",
                                             "--redirects", "3", SCRIPT, "--tp", "9"])
    assert (args.max_restarts, args.monitor_interval, args.redirects) == (3, 0.5, "3")
    assert args.tp is None and args.training_script_args == ["--tp", "9"]  # script's own flags
    plan = plan_of(["-m", "json.tool", "--tp", "1"])  # modules run under the wrapper too
    assert plan.command[1:] == ["-u", launch.WORKER, "-m", "json.tool", "--tp", "1"]


def test_slurm_derivation(monkeypatch, tmp_path):
    slurm_env(monkeypatch, nodes=2, nodeid=1, job="4242")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "16")
    fake_scontrol(tmp_path, monkeypatch, ["node07", "node08"])
    plan = plan_of(["--tp", "2", "--nproc-per-node", "4", SCRIPT])
    assert (plan.min_nodes, plan.max_nodes, plan.node_rank) == (2, 2, 1)
    assert (plan.rdzv_backend, plan.rdzv_endpoint, plan.rdzv_id) == \
        ("c10d", "node07:24242", "slurm-4242.0")
    assert plan.exports["OMP_NUM_THREADS"] == "4" and plan.config.dp == 4
    # explicit flags that agree with Slurm, and an explicit endpoint, are accepted
    monkeypatch.setenv("MASTER_PORT", "31000")
    assert plan_of(["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "4", SCRIPT]
                   ).rdzv_endpoint == "node07:31000"
    fake_scontrol(tmp_path, monkeypatch, None)  # not consulted when the endpoint is given
    assert plan_of(["--rdzv-endpoint", "10.1.1.1:5", "--nproc-per-node", "4", SCRIPT]
                   ).rdzv_endpoint == "10.1.1.1:5"


def test_help_lists_tpkit_and_torchrun_flags(capsys):
    for argv, flags in (
            (["--help"], ("--tp", "--cp-comm-type", "--dry-run", "--backend", "--nnodes",
                          "--rdzv-endpoint", "--nproc-per-node", "--help-all")),
            (["--help-all"], ("--tp", "--cp-comm-type", "--dry-run", "--backend", "--nnodes",
                              "--max-restarts", "--rdzv-endpoint", "--log-dir",
                              "--monitor-interval"))):
        with pytest.raises(SystemExit) as e:
            launch.main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        for flag in flags:
            assert flag in out, (argv, flag)


def test_help_does_not_import_torch():
    """``tpkit-launch --help`` answers without importing torch (the full parser is
    torchrun's, which does); a script's own --help still goes to the script."""
    import subprocess
    import sys
    code = ("import sys\nfrom tpkit.cli import launch\n"
            "try:\n    launch.main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=dict(os.environ, PYTHONPATH=os.path.dirname(HERE)))
    assert out.stdout.strip().endswith("False"), out.stdout[-300:]
    assert launch._asks_for_help(["-h"]) and launch._asks_for_help(["--tp", "--help"])
    assert not launch._asks_for_help(["--tp", "2", "--help"])   # full parser: same help
    assert not launch._asks_for_help(["train.py", "--help"])     # the script's flag


# --- dry run ------------------------------------------------------------------------------
def _real_tables(layouts):
    import tpkit
    tables = []
    for kw in layouts:
        state = tpkit.init_parallel(**kw)
        tables.append(state.rank_table(nproc_per_node=4))
        tpkit.destroy_parallel()
    return tables


LAYOUTS = [dict(tp=2, cp=2), dict(tp=2, pp=2, sequence_parallel=True)]


def test_dry_run_table_equals_real_8_rank_run(capsys, no_workers):
    real = run(_real_tables, 8, LAYOUTS)[0]
    for kw, table in zip(LAYOUTS, real):
        flags = [f"--{k}" for k, v in kw.items() if v is True] + \
            [x for k, v in kw.items() if v is not True for x in (f"--{k}", str(v))]
        argv = ["--nnodes", "2", "--nproc-per-node", "4", *flags, "--dry-run", SCRIPT]
        assert launch.main(argv) == 0
        out = capsys.readouterr().out
        assert out.rstrip("\n").endswith(format_rank_table(table))
        assert "nothing was started" in out and "world       8 = 2 node(s) x 4" in out
        assert planned_rank_table(ParallelConfig(**kw), 8, 4) == table
    assert [r["node"] for r in real[0]] == [0] * 4 + [1] * 4


def test_dry_run_65536_ranks_summarises(capsys, no_workers):
    argv = ["--nnodes", "8192", "--nproc-per-node", "8", "--tp", "8", "--cp", "4", "--pp", "4",
            "--cp-comm-type", "a2a+p2p", "--cp-a2a-size", "2", "--dry-run", SCRIPT]
    assert launch.main(argv) == 0
    out = capsys.readouterr().out
    assert "world       65536 = 8192 node(s) x 8 processes" in out
    assert "tp      size      8 x   8192 groups   rank 0's: 0-7" in out
    assert "dp      size    512 x    128 groups   rank 0's: 0..16352/32" in out
    assert "cp_a2a  size      2 x  32768 groups" in out
    lines = out.splitlines()
    table = lines[lines.index("rank table:") + 1:]
    assert len(table) == 1 + launch.DRY_RUN_ROWS + 1 and table[-1].split()[0] == "65535"


def test_failure_line_names_the_cause_not_the_peer_that_lost_it():
    """Error files carry whole-second timestamps: when the crashing rank and the rank whose
    gloo connection it closed record the same second, the line names the crash."""
    from types import SimpleNamespace as NS

    def failure(rank, message, ts=100):
        return NS(exitcode=1, timestamp=ts, local_rank=rank, message=message,
                  error_file_data={"message": message})
    gone = ("RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:3498")
    e = NS(failures={0: failure(0, gone), 1: failure(1, "RuntimeError: boom on rank 1"),
                     2: failure(2, gone, ts=99)},
           get_first_failure=lambda: (0, None))
    line = launch.describe_failure(e)
    assert line.startswith("rank 1 (local rank 1, exit code 1) failed: RuntimeError: boom"), line
    assert line.endswith("(2 other ranks failed or were stopped)"), line
    # only peers' errors: the earliest is named
    e.failures.pop(1)
    assert launch.describe_failure(e).startswith("rank 2 "), launch.describe_failure(e)


def test_signal_hidden_by_torchs_metrics_wrapper_is_still_the_signal(monkeypatch, capsys):
    """A signal that lands just before torch's elastic metrics wrapper sets ``start``
    (torch/distributed/elastic/metrics/api.py) makes its ``finally`` raise
    UnboundLocalError with the SignalException as its context: tpkit-launch still exits
    128 + the signal with its one line, as when the signal lands anywhere else; an
    UnboundLocalError of any other origin is not swallowed."""
    import signal

    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing import api
    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)
    monkeypatch.setattr(signal, "signal", lambda *a: None)   # _signal_once: no real handler

    def racing_run(args):   # the wrapper's shape: ``start`` is local, set inside the try
        try:
            raise api.SignalException("Process got signal: 2", sigval=signal.SIGINT)
            start = 0
        finally:
            print(start)

    args = launch.build_parser().parse_args(["--nproc-per-node", "2", SCRIPT])
    plan = launch.resolve(args, {})
    for var in plan.exports:   # _launch exports the layout into os.environ: undone after
        monkeypatch.setenv(var, "")
    monkeypatch.setattr(torch_run, "run", racing_run)
    assert launch._launch(args, plan) == 128 + signal.SIGINT
    assert "stopped by SIGINT; the workers were sent it too" in capsys.readouterr().err

    def broken_run(args):
        print(start)
        start = 0

    monkeypatch.setattr(torch_run, "run", broken_run)
    with pytest.raises(UnboundLocalError):
        launch._launch(args, plan)
