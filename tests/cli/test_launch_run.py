"""tpkit-launch for real (gloo, subprocesses): a 2x2 layout, two "nodes" on loopback,
a failing rank, and signals reaching the workers."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "launch_scripts", "check_layout.py")
TIMEOUT = 120

pytestmark = pytest.mark.slow


def launch_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PET_", "TPKIT_", "TORCHELASTIC_", "SKYPILOT_"))
           and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = ROOT  # run this checkout's tpkit, launcher and workers alike
    return env


def launch(*argv, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tpkit.cli.launch", *argv], cwd=ROOT,
                            env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"tpkit-launch did not finish in {TIMEOUT} s:\n{out}\n{err}")
    return proc.returncode, out, err


def ok_lines(out: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(0)
            for m in re.finditer(r"OK rank=(\d+) .*?args=\[.*?\]", out)}


def test_2x2_layout_reaches_init_parallel():
    rc, out, err = finish(launch("--tp", "2", "--cp", "2", SCRIPT, "2", "2", "--tp", "9"))
    assert rc == 0, err[-3000:]
    oks = ok_lines(out)
    assert sorted(oks) == [0, 1, 2, 3], out
    for rank, line in oks.items():  # checks inside: groups, all-reduces, TPKIT_BACKEND
        assert f"world=4 local_rank={rank} tp={rank % 2} cp={rank // 2} dp=0" in line
        assert "args=['2', '2', '--tp', '9']" in line  # script args pass through untouched
        assert "omp=1" in line  # 2 cores / 4 processes, at least 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_c10d():
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--tp", "2",
              "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "loopback-test",
              SCRIPT, "2", "1"]
    nodes = [launch(*common) for _ in range(2)]
    results = [finish(p) for p in nodes]
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
    oks = [ok_lines(out) for _, out, _ in results]
    assert sorted(oks[0]) + sorted(oks[1]) in ([0, 1, 2, 3], [2, 3, 0, 1])
    merged = {**oks[0], **oks[1]}
    for rank, line in merged.items():
        assert f"world=4 local_rank={rank % 2} tp={rank % 2} cp=0 dp={rank // 2}" in line
        assert "run_id=loopback-test" in line


def test_failing_rank_is_named_with_its_error():
    rc, out, err = finish(launch("--tp", "2", "--nproc-per-node", "2", SCRIPT, "2", "1",
                                 "--fail-rank", "1"))
    assert rc == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("tpkit-launch: rank 1 (local rank 1, exit code 1) failed: "
                           "RuntimeError: boom on rank 1"), err[-3000:]
    assert "check_layout.py FAILED" in err  # torchrun's summary, naming the user's script
    assert 1 in ok_lines(out)  # rank 0 may be stopped before it prints


# SIGHUP (a closed terminal or ssh session) with --no-python: the command runs as given,
# without tpkit's wrapper. --run-path is test_user_features' (torchrun's runpy workers wait
# 30 s for its agent when stopped by a signal, so a signal test there costs a minute).
@pytest.mark.parametrize("sig,no_python", [(signal.SIGTERM, False), (signal.SIGINT, False),
                                           (signal.SIGHUP, True), (signal.SIGQUIT, False)],
                         ids=["TERM", "INT", "HUP-no-python", "QUIT"])
def test_signal_reaches_workers(sig, no_python, tmp_path):
    cmd = ["--no-python", sys.executable, "-u", SCRIPT] if no_python else [SCRIPT]
    proc = launch("--nproc-per-node", "2", "--tp", "2", *cmd, "2", "1", "--wait-signal",
                  str(tmp_path))
    deadline = time.monotonic() + TIMEOUT
    while not all((tmp_path / f"ready.{r}").exists() for r in (0, 1)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"workers did not start: {proc.communicate()}")
        time.sleep(0.05)
    for r in (0, 1):   # the rank variables and the layout reached the script, its args too
        assert (tmp_path / f"ready.{r}").read_text() == (
            f"RANK={r} WORLD_SIZE=2 TPKIT_TP=2 TPKIT_CP=1 TPKIT_BACKEND=gloo "
            f"argv=['2', '1', '--wait-signal', '{tmp_path}']")
    proc.send_signal(sig)
    rc, out, err = finish(proc)
    assert rc == 128 + sig, err[-3000:]
    assert f"stopped by {sig.name}" in err
    # torchrun's agent forwards the signal it received to every worker
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        sorted(["ready.0", "ready.1", f"{sig.name}.0", f"{sig.name}.1"])


def test_memory_check_imports_no_model_family():
    """tpkit-launch's memory check (every launch) reads tpkit.models.shape, which imports no
    torch; the model families (torch, tpkit.nn, DTensor: ~0.6 CPU-s a launch) are imported
    only when a script's pre-flight builds its model."""
    code = ("import sys, tpkit.cli.memory, tpkit.memory\n"
            "from tpkit.models.shape import ModelShape\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('tpkit.nn')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=launch_env(),
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout
