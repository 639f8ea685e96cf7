"""tpkit-train on Ray Train (tpkit/train/ray.py, tpkit/fabric/environment.py).

The acceptance run: a real local Ray cluster (``ray`` from PyPI, 4 CPU workers, gloo)
trains the reference GPT at tp=2 x dp=2; the worker of rank 1 SIGKILLs itself at step 4
of the first attempt, Ray restarts the worker group (FailureConfig(max_failures=1)) and
the new workers resume from the last complete checkpoint in the run's storage. The
reference is tpkit-launch running the same job (same flags, same layout; a script of
tests/shared.py's trainer launch): the Ray curve, both attempts together, must equal it
bit for bit. Bounded: 1 layer, 8 steps; ray is an
optional extra (tpkit[ray]) and the test is skipped where it is not installed."""
import json
import os
import subprocess
import sys

import pytest

from shared import register_trainer_script, script_dir
from test_launch_run import launch_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "launch_scripts", "ray_train.py")
JOB = ["--steps", "8", "--hidden", "64", "--layers", "1", "--heads", "4", "--gqa-groups", "2",
       "--ffn", "128", "--seq-len", "16", "--global-batch", "4", "--log-every", "1",
       "--save-every", "2", "--tp", "2"]
KILL_STEP = 4
# the reference: the same job under tpkit-launch, one script of tests/shared.py's trainer
# launch (4 ranks, with the TPKIT_* tpkit-launch's own resolve exports for --tp 2 --dp 2)
register_trainer_script("ray-reference", SCRIPT, "launch", "{dir}/ref.json", *JOB, "--save",
                        "{dir}/ref-ckpt", flags=("--tp", "2", "--dp", "2"))


def _run(cmd, timeout):
    env = dict(launch_env(), OMP_NUM_THREADS="1")   # the same threads in both engines
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow
@pytest.mark.timeout(600)   # Ray's start and two worker groups' imports: ~2 min on 2 idle cores
def test_ray_curve_equals_tpkit_launch_and_survives_a_killed_worker(tmp_path,
                                                                      tmp_path_factory):
    pytest.importorskip("ray.train.torch", reason="pip install 'tpkit[ray]'")
    with open(os.path.join(script_dir(tmp_path_factory, "ray-reference"), "ref.json")) as f:
        reference = json.load(f)
    assert len(reference) == 8

    out = tmp_path / "ray"
    out.mkdir()
    proc = _run([sys.executable, SCRIPT, "ray", str(out), str(KILL_STEP), *JOB], timeout=540)
    assert (out / "killed").exists()                      # the first attempt lost rank 1
    rows = [line.split() for line in (out / "losses.txt").read_text().splitlines()]
    attempts = list(dict.fromkeys(pid for pid, _, _ in rows))
    assert len(attempts) == 2, rows                       # Ray restarted the workers once
    first = [int(s) for pid, s, _ in rows if pid == attempts[0]]
    second = [int(s) for pid, s, _ in rows if pid == attempts[1]]
    assert first == list(range(KILL_STEP))                # killed before reporting step 4
    assert second == list(range(KILL_STEP, 8))            # resumed after the step-4 save
    assert "resuming from " in proc.stdout + proc.stderr
    curve = {int(s): float(loss) for _, s, loss in rows}
    assert [curve[s] for s in range(8)] == reference      # bit for bit
    # the run's last checkpoint, as Ray reports it, is tpkit's in the run's storage
    assert (out / "result.txt").read_text() == str(out / "storage" / "run" / "tpkit" /
                                                   "step000008")
    assert (out / "storage" / "run" / "tpkit" / "step000008" / ".metadata").is_file()


def test_layout_refused_before_ray_starts():
    """The job's layout against num_workers, before any Ray process: tpkit-launch's
    message for the same layout and world."""
    pytest.importorskip("ray.train.torch", reason="pip install 'tpkit[ray]'")
    import ray

    from tpkit.layout.config import ParallelConfig
    from tpkit.train.ray import ray_trainer
    with pytest.raises(ValueError) as e:
        ray_trainer(["--tp", "3"], num_workers=4)
    with pytest.raises(ValueError) as launch_e:
        ParallelConfig(tp=3).validate(4)
    assert str(e.value).startswith(str(launch_e.value))   # then where tp came from
    assert str(e.value).endswith("[tp=3 from --tp] [world = num_workers=4 Ray Train workers]")
    assert "use a world size that is a multiple of 3" in str(e.value)
    with pytest.raises(ValueError, match="num_workers=0 must be a positive integer"):
        ray_trainer([], num_workers=0)
    assert not ray.is_initialized()                       # nothing was started


class _Ctx:
    """What ray.train.get_context() answers in a worker (world rank 5 of 8, 2 nodes)."""

    def get_world_size(self):
        return 8

    def get_world_rank(self):
        return 5

    def get_local_rank(self):
        return 1

    def get_node_rank(self):
        return 1


def test_ray_environment_takes_ray_ranks():
    from tpkit.fabric.environment import RayEnvironment, ray_train_context
    env = RayEnvironment(_Ctx())
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == \
        (8, 5, 1, 1)
    assert env.creates_processes_externally
    env.set_global_rank(0)                                # Lightning's guess is ignored
    assert env.global_rank() == 5
    env.validate_settings(num_devices=4, num_nodes=2)
    with pytest.raises(ValueError, match="Fabric expects 6 processes .* Ray Train runs 8"):
        env.validate_settings(num_devices=3, num_nodes=2)
    assert ray_train_context() is None                    # not a Ray Train worker
    with pytest.raises(ValueError, match="outside a Ray Train worker"):
        RayEnvironment()
