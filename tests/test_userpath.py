"""The user's road: real scripts started by ``tpkit-launch`` (and torchrun, and plain
python), not the tests/dist.py worker pool. The pool creates the default process group
itself, sets the environment and reuses processes; here each script starts from a bare
process exactly as a user's job does, so the default group is tpkit's (or Lightning's),
the layout comes from tpkit-launch's TPKIT_* variables, and every process runs once.
Each script checks many things (process start costs ~1.5 s a rank here) and rank 0
writes a JSON summary the test reads.

- tests/launch_scripts/reinit.py: init_parallel -> destroy_parallel cycles over many
  layouts, 2 rounds in one launch (18 re-inits per rank at 4 ranks, 18 at 8), with group,
  all-reduce, TP-MLP and float64 CP-attention checks each time;
- tests/launch_scripts/fabric_layouts.py: three Fabric layouts in one process, one of them
  resuming the checkpoint another wrote; then, in the same launch,
  tests/launch_scripts/ds_train.py: DeepSpeed ZeRO at two layouts in one process;
- launch/train.py: a run at cp=2 x dp=2 SIGKILLed after a checkpoint, resumed at
  tp=2 x cp=2 to the end, on the single-process loss curve.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import paths
from test_launch_run import launch_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "launch_scripts")
LAUNCH = [sys.executable, "-m", "tpkit.cli.launch"]  # what the tpkit-launch script runs
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
TIMEOUT = 300

pytestmark = pytest.mark.slow


def _env(**extra) -> dict:
    env = launch_env()
    env["PYTHONPATH"] = paths.PYTHONPATH
    # a hang (the re-created default group of issue 14) fails in a minute, naming the rank
    env["TPKIT_PG_TIMEOUT"] = "60"
    env.update(extra)
    return env


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts workers in their own sessions, so a
    process-group kill would miss them)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(cmd, **env_extra) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(**env_extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} did not finish in {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


def launched(*argv, **env_extra) -> tuple[str, str]:
    rc, out, err = finish(start([*LAUNCH, *argv], **env_extra))
    assert rc == 0, f"exit {rc}\n{out[-3000:]}\n{err[-5000:]}"
    return out, err


# --- init -> destroy -> init ----------------------------------------------------------------
def check_reinit(summary: dict, world: int, rounds: int) -> None:
    from launch_scripts.reinit import LAYOUTS
    distinct = {lay[:3] + (tuple(sorted(lay[3].items())),) for lay in LAYOUTS[world] if lay}
    assert len(distinct) >= (5 if world > 1 else 1), distinct
    assert summary["world"] == world and summary["cycles"] == rounds * len(LAYOUTS[world])
    assert summary["float64_attention_max_err"] <= 1e-10
    # on gloo, every CP ring group (the cp group, and a2a+p2p's p2p group) had its
    # shared-memory transport
    rings = sum(1 + (lay[3].get("cp_comm_type") == "a2a+p2p"
                     and lay[1] // lay[3]["cp_a2a_size"] > 1)
                for lay in LAYOUTS[world] if lay and lay[1] > 1)
    assert summary["shm_p2p_groups"] == rounds * rings, (summary, rings)
    if world > 1:  # launched: a hand-destroyed default group is refused, not re-created
        assert "cannot be created again on the same rendezvous store" in summary["recreate_error"]


def test_exit_right_after_collectives():
    """A launched script whose last lines are gloo collectives, ending without destroying
    its groups (half the ranks keep the default group in a global): every rank exits 0,
    none aborts at interpreter exit (tpkit-launch's worker frees the groups first,
    tpkit.layout.parallel_state.release_default_group). Planted (the worker not freeing them):
    a rank aborted with "terminate called without an active exception" in 4 of 5 runs."""
    out, err = launched("--nproc-per-node", "4",
                        os.path.join(SCRIPTS, "exit_after_collectives.py"))
    assert sorted(re.findall(r"rank (\d) done", out)) == ["0", "1", "2", "3"], out
    assert "terminate called" not in err, err[-3000:]


@pytest.mark.parametrize("world", [4, 8])
def test_reinit_loop_under_tpkit_launch(world, tmp_path):
    """Issue 14: the second init_parallel hung under tpkit-launch (tpkit destroyed the
    default group and re-created it on the same rendezvous store). 2 rounds of >= 8
    layouts per launch (the second round's threads must be the first's); the first one
    from TPKIT_* (--tp 2), the rest explicit."""
    out_file = tmp_path / "summary.json"
    cmd = ["--nproc-per-node", str(world), "--tp", "2", os.path.join(SCRIPTS, "reinit.py"),
           "2", "--out", str(out_file)]
    if world == 4:  # once through the installed console script itself
        script = os.path.join(os.path.dirname(sys.executable), "tpkit-launch")
        if not os.path.exists(script):
            if IN_CI:
                pytest.fail(f"CI=true and {script} is missing: pip install -e . installs it")
            pytest.skip(f"{script} is not installed (pip install -e .)")
        rc, out, err = finish(start([script, *cmd]))
        assert rc == 0, f"exit {rc}\n{out[-3000:]}\n{err[-5000:]}"
    else:
        out, err = launched(*cmd)
    assert "REINIT OK" in out and "still alive at exit" not in err
    check_reinit(json.loads(out_file.read_text()), world, 2)


def test_reinit_loop_under_torchrun_and_plain_python(tmp_path):
    """The same script under plain torchrun (no TPKIT_*: env:// only) and as a plain
    ``python script.py`` (a world of one on a private store)."""
    out_file = tmp_path / "torchrun.json"
    rc, out, err = finish(start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node", "2", os.path.join(SCRIPTS, "reinit.py"),
                                 "2", "--out", str(out_file)]))
    assert rc == 0 and "REINIT OK" in out, err[-5000:]
    check_reinit(json.loads(out_file.read_text()), 2, 2)
    out_file = tmp_path / "plain.json"
    rc, out, err = finish(start([sys.executable, os.path.join(SCRIPTS, "reinit.py"), "3",
                                 "--out", str(out_file)]))
    assert rc == 0 and "REINIT OK" in out, err[-5000:]
    check_reinit(json.loads(out_file.read_text()), 1, 3)


# --- Fabric and DeepSpeed scripts -------------------------------------------------------------
@pytest.fixture(scope="module")
def fabric_then_deepspeed(tmp_path_factory):
    """One launch for the two tests below (fabric_then_deepspeed.py: fabric_layouts.py's
    main, then ds_train.py's, in the same 4 processes): a rank's start costs ~5 CPU-s with
    Lightning, a second launch 4 more of them. Returns the directory of the summaries."""
    d = tmp_path_factory.mktemp("fabric_ds")
    launched("--nproc-per-node", "4", "--tp", "2", "--sequence-parallel",
             os.path.join(SCRIPTS, "fabric_then_deepspeed.py"), str(d / "ckpt"),
             str(d / "fabric.json"), str(d / "ds.json"), DS_ACCELERATOR="cpu")
    return d


def test_fabric_three_layouts_in_one_process(fabric_then_deepspeed):
    res = json.loads((fabric_then_deepspeed / "fabric.json").read_text())
    # losses were checked inside against the reference
    assert {k: v["layout"] for k, v in res.items()} == {
        "A": [2, 1, 2, True], "B": [1, 2, 2, False], "C": [2, 1, 2, True]}


def test_deepspeed_two_layouts_in_one_process(fabric_then_deepspeed):
    pytest.importorskip("deepspeed", reason="needs deepspeed (pip install tpkit[deepspeed])")
    from test_deepspeed import CLIP, reference_run
    res = json.loads((fabric_then_deepspeed / "ds.json").read_text())
    assert res["tp2dp2_zero2_clip"] == pytest.approx(reference_run(clip=CLIP)[0], rel=1e-5)
    assert res["cp2dp2_zero1"] == pytest.approx(reference_run()[0], rel=1e-5)


# --- launch/train.py, then -m tpkit.train: save -> kill -> resume --------------------------
TRAIN = os.path.join(ROOT, "launch", "train.py")
SMALL = ["--steps", "30", "--hidden", "64", "--layers", "2", "--heads", "4", "--gqa-groups",
         "2", "--ffn", "128", "--seq-len", "32", "--global-batch", "4", "--warmup", "5",
         "--log-every", "1"]


def _reference_run(argv):
    from tpkit.train import trainer as train
    return train.main(argv)


# tpkit.observe's progress line of tpkit-train: "step N/TOTAL  eta ...  loss X.XXXXXX  ..."
PROGRESS = re.compile(r"^step (\d+)/\d+ .*?\bloss ([0-9.]+)", re.M)


def printed_losses(out: str) -> list[tuple[int, float]]:
    """(0-based step, loss) of every progress line the trainer printed (N steps done is
    step N - 1)."""
    return [(int(m.group(1)) - 1, float(m.group(2))) for m in PROGRESS.finditer(out)]


def _printed_losses(out: str) -> dict[int, float]:
    return dict(printed_losses(out))


def test_train_save_kill_resume(tmp_path):
    """A cp=2 x dp=2 job saving every 5 steps is SIGKILLed (launcher and every rank at
    once, as a node loss would) after its step-10 checkpoint; tpkit-launch --tp 2 --cp 2
    -m tpkit.train resumes the latest complete checkpoint (a half-written one is never picked) and
    finishes. Every printed loss is the single-process run's (printed to 4 decimals)."""
    from dist import run
    (reference,) = run(_reference_run, 1, SMALL + ["--tp", "1", "--cp", "1"])
    ckpt = tmp_path / "ckpt"
    first = start([*LAUNCH, "--nproc-per-node", "4", "--cp", "2", TRAIN, *SMALL,
                   "--save", str(ckpt), "--save-every", "5"])
    deadline = time.monotonic() + TIMEOUT
    while not (ckpt / "step000010").is_dir():
        if first.poll() is not None or time.monotonic() > deadline:
            _kill_tree(first)
            pytest.fail(f"no step-10 checkpoint (exit {first.poll()}):\n"
                        f"{first.communicate()[1][-5000:]}")
        time.sleep(0.02)
    _kill_tree(first)
    out1, err1 = first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL, (first.returncode, err1[-3000:])
    killed_at = max(_printed_losses(out1))
    assert killed_at < 29, "the job finished before it was killed"
    done = sorted(d.name for d in ckpt.iterdir() if re.fullmatch(r"step\d{6}", d.name))
    latest = int(done[-1][4:])

    # resumed through the package's entry point (python -m tpkit.train, what tpkit-train runs)
    out2, _ = launched("--tp", "2", "--cp", "2", "-m", "tpkit.train", *SMALL, "--resume",
                       str(ckpt))
    resumed = _printed_losses(out2)
    assert sorted(resumed) == list(range(latest, 30)), (latest, sorted(resumed))
    batch = int(SMALL[SMALL.index("--global-batch") + 1])   # issue 51: what it restores
    assert (f"resumed from {ckpt / f'step{latest:06d}'}: {latest} steps done; training steps "
            f"{latest + 1}..30 from the data stream's sample {latest * batch} (step "
            f"{latest + 1}'s batch of {batch})") in out2, out2[:3000]
    assert "done:" in out2
    for curve in (_printed_losses(out1), resumed):
        for step, loss in curve.items():
            assert abs(loss - reference[step]) <= 2e-4, (step, loss, reference[step])
