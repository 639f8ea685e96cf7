"""tpkit.recovery: killed ranks, preemption, hangs and stragglers (issue 21).

Launched, the way a job meets them (launch/train.py under tpkit-launch, faults injected
by tests/launch_scripts/recovery_faults.py):
- a job's life: SIGTERM to tpkit-launch (and a second one, to it and to the workers,
  during the save) -> exit 143 with a complete checkpoint of the step; the same command
  resumes, and a worker SIGKILLed at a random step while an --async-save is in flight
  leaves nothing at the save's final path (--max-restarts 1 restarts the workers,
  --auto-resume continues from the previous save) and the job completes. Every printed
  loss equals an uninterrupted run's (the pool's, same layout); nothing is left running;
  --keep held.
- a rank sleeping forever in a collective under --hang-timeout: the job exits within
  the timeout + 30 s and tpkit-launch's last line names the rank and its frame; a slow
  rank is flagged by the straggler report first.
Pool and in-process: async_save against the live shards it copied, resume picking the
newest complete checkpoint, keep, the verdict and straggler arithmetic. Bad input (the
recovery options of train.py and Recovery) is in tests/test_bad_input.py's table.
"""
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import threading
import time

import pytest

from dist import run
from test_userpath import LAUNCH, ROOT, _descendants, _env, _kill_tree, printed_losses

FAULTS = os.path.join(ROOT, "tests", "launch_scripts", "recovery_faults.py")
TRAIN_ARGS = ["--hidden", "64", "--layers", "2", "--heads", "4", "--gqa-groups", "2",
              "--ffn", "128", "--seq-len", "32", "--global-batch", "4", "--warmup", "5",
              "--log-every", "1"]
STEPS = 30
TIMEOUT = 300


JOBS: list = []


@pytest.fixture(autouse=True)
def _no_job_left():
    """A failing test leaves nothing running."""
    yield
    while JOBS:
        JOBS.pop().kill()


class Job:
    """tpkit-launch in the background, its output read line by line as it comes."""

    def __init__(self, argv, **env):
        JOBS.append(self)
        self.proc = subprocess.Popen([*LAUNCH, *argv], cwd=ROOT, env=_env(**env),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.out, self.err, self._q = [], [], queue.Queue()
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._read, args=(stream, sink), daemon=True).start()
        self._seen = 0

    def _read(self, stream, sink):
        for line in stream:
            sink.append(line)
            self._q.put(line)

    def wait_for(self, pattern: str, timeout: float = TIMEOUT) -> re.Match:
        """The next output line (either stream) matching ``pattern``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None and self._q.empty():
                    break
                continue
            m = re.search(pattern, line)
            if m:
                return m
        self.kill()
        pytest.fail(f"no line matching {pattern!r} (exit {self.proc.poll()}):\n"
                    f"{''.join(self.out)[-3000:]}\n{''.join(self.err)[-5000:]}")

    def wait_for_each(self, *patterns: str, timeout: float = TIMEOUT) -> None:
        """The next lines until each pattern has matched one, in any order (lines of
        different processes, printed at about the same time, arrive in either order)."""
        left = list(patterns)
        deadline = time.monotonic() + timeout
        while left:
            line = self.wait_for("|".join(f"(?:{p})" for p in left),
                                 timeout=max(0.0, deadline - time.monotonic())).string
            left = [p for p in left if not re.search(p, line)]

    def finish(self, timeout: float = TIMEOUT) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"did not finish in {timeout} s:\n{''.join(self.err)[-5000:]}")
        time.sleep(0.2)  # let the readers drain
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            _kill_tree(self.proc)

    def workers(self) -> list[int]:
        pids = []
        for pid in _descendants(self.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"_worker.py" in f.read():
                        pids.append(pid)
            except OSError:
                pass
        return pids

    def text(self) -> str:
        return "".join(self.out) + "".join(self.err)


def _losses(text: str) -> list[tuple[int, float]]:
    return printed_losses(text)


def _check_curve(text: str, reference: list[float]) -> None:
    """Every printed loss (6 decimals) is the uninterrupted run's, 1e-6 relative."""
    got = _losses(text)
    assert got, text[-3000:]
    for step, loss in got:
        assert abs(loss - reference[step]) <= 1e-6 * reference[step] + 5e-7, \
            (step, loss, reference[step])


def _reference(argv):
    from tpkit.train import trainer as train
    return train.main(argv)


def _orphans(marker: str) -> list[str]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd:
                found.append(f"{d}: {cmd}")
    return found


def _wait_until(predicate, what: str, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    pytest.fail(f"waited {timeout} s for {what}")


def _step_dirs(ckpt) -> list[str]:
    return sorted(d for d in os.listdir(ckpt) if re.fullmatch(r"step\d{6}", d))


# --- launched: a job's life --------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)  # three worker starts and the pool's reference run
def test_sigterm_then_resume_then_kill_during_async_save(tmp_path):
    """Acceptance of issue 21 for preemption, killed ranks and --async-save (module
    docstring), in three worker starts. Checkpoint writes are held (``--hold-writes``)
    while the test needs a save in flight, and the ranks inside the step it signals
    (``--pause-at``): no timing depends on the machine's speed. The reference is
    train.main in the pool."""
    from tpkit.recovery import is_complete, unfinished_saves
    (reference, _) = run(_reference, 2, TRAIN_ARGS + ["--steps", str(STEPS), "--tp", "2"])
    ckpt, hold, pause = tmp_path / "ckpt", tmp_path / "hold", tmp_path / "pause"
    rng = random.Random()
    term_at, kill_at = rng.randint(2, 6), rng.randint(20, 25)
    cmd = ["--nproc-per-node", "2", "--tp", "2", "--max-restarts", "1", "--shutdown-timeout",
           "120", FAULTS, "--hold-writes", str(hold), "--pause-at", str(term_at + 1),
           "--pause-file", str(pause), "--", *TRAIN_ARGS, "--steps", str(STEPS),
           "--save", str(ckpt), "--save-every", "10", "--keep", "2", "--async-save",
           "--auto-resume"]

    # 1. SIGTERM to tpkit-launch while every rank is held inside step term_at (however
    # slow the machine, the signal arrives in that step); during the save it causes,
    # again to it and to the workers: exit 143 with a complete checkpoint of that step
    pause.touch()
    job = Job(cmd)
    job.wait_for(r"starting fresh")
    job.wait_for_each(r"rank 0: paused in optimizer step", r"rank 1: paused in optimizer step")
    hold.touch()
    job.proc.send_signal(signal.SIGTERM)
    job.wait_for_each(r"rank 0: SIGTERM: finishing this step",
                      r"rank 1: SIGTERM: finishing this step")
    pause.unlink()
    _wait_until(lambda: ckpt.is_dir() and unfinished_saves(ckpt),
                "the staging directory of the save SIGTERM caused")
    for pid in [job.proc.pid, *job.workers()]:
        os.kill(pid, signal.SIGTERM)
    job.wait_for_each(r"SIGTERM again: still waiting",   # tpkit-launch's
                      r"rank \d: SIGTERM again: ignored")  # a worker's
    hold.unlink()
    saved = int(job.wait_for(r"recovery: SIGTERM: saved after step (\d+)").group(1))
    assert job.finish() == 143, job.text()[-5000:]
    assert saved == term_at and _step_dirs(ckpt) == [f"step{saved + 1:06d}"]
    assert is_complete(ckpt / f"step{saved + 1:06d}")
    _check_curve(job.text(), reference)
    assert not _orphans(str(ckpt))

    # 2. the same command resumes from it; kill -9 of one worker at a random step while
    # the async save of step000020 is in flight: nothing at its final path; the agent
    # restarts both workers, they resume from step000010 and the job completes
    hold.write_text("step000020")                      # the save after step 19 will stall
    job = Job(cmd)
    job.wait_for(rf"recovery: resuming from \S+step{saved + 1:06d} ")
    job.wait_for(r"recovery: saved \S+step000010")
    job.wait_for(rf"^step {kill_at + 1}/")
    staging = unfinished_saves(ckpt)
    assert [os.path.basename(p)[:15] for p in staging] == ["step000020.tmp-"], staging
    os.kill(rng.choice(job.workers()), signal.SIGKILL)
    time.sleep(0.5)
    assert not (ckpt / "step000020").exists()          # never a partial one at the final path
    assert _step_dirs(ckpt) == [f"step{saved + 1:06d}", "step000010"]
    assert all(is_complete(ckpt / d) for d in _step_dirs(ckpt))
    hold.unlink()
    job.wait_for(r"recovery: resuming from \S+step000010 ")
    assert job.finish() == 0, job.text()[-5000:]
    text = job.text()
    _check_curve(text, reference)
    steps = [s for s, _ in _losses(text)]
    assert steps[0] == saved + 1 and steps[-1] == STEPS - 1
    assert steps.count(15) == 2 and steps.count(kill_at) == 2  # before the kill and after
    assert not _orphans(str(ckpt))
    # --keep 2: the newest two, plus the one the restart resumed from; no staging leftovers
    assert _step_dirs(ckpt) == ["step000010", "step000020", "step000030"]
    assert unfinished_saves(ckpt) == []


# --- launched: a hang and a straggler ------------------------------------------------------
@pytest.mark.slow
def test_hang_names_the_stuck_rank_and_its_frame(tmp_path):
    hang_timeout = 5
    logs = tmp_path / "logs"
    job = Job(["--nproc-per-node", "2", "--log-dir", str(logs), FAULTS, "--slow-rank", "1",
               "--slow-s", "0.3", "--hang-rank", "1", "--hang-after", "6", "--",
               *TRAIN_ARGS, "--steps", "50", "--log-every", "3", "--hang-timeout",
               str(hang_timeout)], TORCH_FR_BUFFER_SIZE="64")
    flagged = job.wait_for(r"recovery: stragglers: slowest rank (\d).*SLOW \(> 1.2x\): "
                           r"ranks (\S+)")
    assert flagged.groups() == ("1", "1")
    job.wait_for(r"rank 1: sleeping forever in all_reduce")
    assert job.finish(timeout=hang_timeout + 30) == 1, job.text()[-5000:]
    last = "".join(job.err).strip().splitlines()[-1]
    line = next(i for i, text in enumerate(open(FAULTS), 1) if "HANG HERE" in text)
    where = f"tests/launch_scripts/recovery_faults.py:{line} in stuck_all_reduce"
    assert last.startswith(f"tpkit-launch: hang: no progress for {hang_timeout} s after "
                           f"step 4; stuck: rank 1 at {where}; waiting for them in "
                           "collectives: rank 0 at "), last
    dumps = {p.name: p for p in logs.rglob("*") if p.is_file()}
    assert {"hang-rank0.txt", "hang-rank1.txt", "flight-recorder-rank0.pkl",
            "flight-recorder-rank1.pkl"} <= set(dumps), sorted(dumps)
    assert f'recovery_faults.py", line {line}, in stuck_all_reduce' in \
        dumps["hang-rank1.txt"].read_text()
    for r in (0, 1):  # torchrun's error files hold the verdict and the main thread's stack
        err = json.loads((dumps["hang-rank1.txt"].parent.parent / str(r) / "error.json")
                         .read_text())["message"]
        assert err["message"].startswith("HangError: no progress") and \
            "stuck_all_reduce" in err["extraInfo"]["py_callstack"]
    assert not _orphans(str(logs))


# --- pool: async save, resume, keep, signals, stragglers ------------------------------------
def _model():
    import torch
    from tpkit.nn import ColumnParallelLinear, RowParallelLinear
    torch.manual_seed(0)
    model = torch.nn.Sequential(ColumnParallelLinear(8, 16), RowParallelLinear(16, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _async_save_copies_the_step(path):
    """async_save, then training changes every tensor in place at once: the checkpoint
    holds the values of the save, reaches ``path`` only in wait(), and loads back; a
    second save reusing the first one's CPU buffers holds its own values, the first
    checkpoint still the first's."""
    import torch
    import torch.distributed as dist
    import tpkit
    from tpkit.checkpoint import async_save, load
    tpkit.init_parallel(tp=2)
    model, opt = _model()
    model(torch.ones(3, 1, 8)).pow(2).sum().backward()
    opt.step()
    live = [*model.parameters(), *(t for st in opt.state.values() for t in st.values())]
    group, buffers, saved, early = dist.new_group(backend="gloo"), {}, [], []
    for k, where in enumerate((path, path + "-2")):
        saved.append([t.detach().clone() for t in live])  # this rank's shards and moments
        pending = async_save(where, {"model": model, "optimizer": opt, "n": 7 + k},
                             process_group=group, buffers=buffers)
        with torch.no_grad():
            for t in live:
                t.add_(1.0)                                  # the next step, in place
        early.append(os.path.exists(where))
        pending.wait()
    dist.barrier()
    same, ns = [], []
    for k, where in enumerate((path, path + "-2")):
        model2, opt2 = _model()
        ns.append(load(where, {"model": model2, "optimizer": opt2, "n": None})["n"])
        back = [*model2.parameters(), *(t for st in opt2.state.values() for t in st.values())]
        same.append(len(back) == len(live) and
                    all(torch.equal(a, b) for a, b in zip(saved[k], back)))
    # filter= as save's: only the weights (DCP's own record of what was written)
    import torch.distributed.checkpoint as dcp
    async_save(path + "-w", {"model": model}, process_group=group,
               filter={"model": lambda name, value: name.endswith("weight")}).wait()
    dist.barrier()
    written = sorted(dcp.FileSystemReader(path + "-w").read_metadata().state_dict_metadata)
    dist.destroy_process_group(group)
    return early, ns, same, len(live), len(buffers), written


def test_async_save_holds_the_step_it_was_called_at(tmp_path):
    for early, ns, same, count, buffers, written in run(_async_save_copies_the_step, 2,
                                                        str(tmp_path / "ck")):
        assert (early, ns, same) == ([False] * 2, [7, 8], [True] * 2)
        assert written == ["model.0.weight", "model.1.weight"]
        assert count == 4 + 4 * 3   # weights and biases, and per parameter Adam's step,
        assert buffers >= count     # exp_avg, exp_avg_sq; each copied into a kept buffer


def _resume_and_keep(save_dir):
    import torch
    import torch.distributed as dist
    import tpkit
    from tpkit.recovery import Recovery
    tpkit.init_parallel(tp=2)
    model, _ = _model()
    rec = Recovery(save_dir, save_every=2, keep=2, signals=())
    first = rec.resume({"model": model})
    for step in range(5):
        with torch.no_grad():
            model[0].weight.fill_(step)
        rec.step_end(step, {"model": model}, last=step == 4)
    rec.close()                                    # saved after 2, 4, 5 steps; keeps 4, 5
    dist.barrier()
    kept = sorted(os.listdir(save_dir))
    dist.barrier()                                 # every rank listed before the changes
    if dist.get_rank() == 0:   # an unfinished save, a directory that is no checkpoint,
        from tpkit.checkpoint._dcp_verify import staging_path   # (this job's: prune removes it)
        os.makedirs(staging_path(os.path.join(save_dir, "step000006")))  # and a newer one
        os.makedirs(os.path.join(save_dir, "step000099"))   # with a shard cut short since
        damaged = os.path.join(save_dir, "step000050")
        shutil.copytree(os.path.join(save_dir, "step000005"), damaged)
        shard = next(f for f in sorted(os.listdir(damaged)) if f.endswith(".distcp"))
        os.truncate(os.path.join(damaged, shard), os.path.getsize(
            os.path.join(damaged, shard)) - 1)
    dist.barrier()
    model2, _ = _model()
    rec = Recovery(save_dir, keep=1, signals=())
    start = rec.resume({"model": model2})          # step000005: after step 4
    weight = model2[0].weight.unique().tolist()
    rec.save(start, {"model": model2})             # step000006; keep=1 spares step000005
    rec.close()
    dist.barrier()
    return first, kept, start, weight, sorted(os.listdir(save_dir))


def test_resume_newest_complete_and_keep(tmp_path):
    res = run(_resume_and_keep, 2, str(tmp_path / "ck"))
    assert res[0] == res[1]
    first, kept, start, weight, final = res[0]
    assert (first, kept, start, weight) == (0, ["step000004", "step000005"], 5, [4.0])
    # keep=1 spares the one resumed from, removes the staging leftover, leaves alone what
    # it cannot read (a later save at that step replaces it)
    assert final == ["step000005", "step000006", "step000050", "step000099"]


def _signal_and_stragglers():
    import time
    import torch.distributed as dist
    from tpkit.recovery import SignalStop, StragglerMonitor
    rank = dist.get_rank()
    stop = SignalStop().install()
    try:
        agreed = [stop.agree()]
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.1)                        # the handler runs on the main thread
        agreed.append(stop.agree())
    finally:
        stop.uninstall()
    mon = StragglerMonitor(2)
    reports = [mon.step(0.1 * (rank + 1) * k) for k in (1, 2, 3, 4)]
    return agreed, reports


def test_signal_agreement_and_straggler_gather():
    (a0, r0), (a1, r1) = run(_signal_and_stragglers, 2)
    assert a0 == a1 == [None, signal.SIGUSR1]     # rank 1's signal stops both
    assert r1 == [None] * 4 and r0[0] is None and r0[2] is None
    # means over 2 steps: rank 0 (0.1+0.2)/2, rank 1 (0.2+0.4)/2; median = their mean
    assert r0[1]["slowest"] == 1 and r0[1]["flagged"] == [1]
    assert r0[1]["ratio"] == pytest.approx(0.3 / 0.225)
    assert r0[3]["time"] == pytest.approx(0.7) and r0[3]["median"] == pytest.approx(0.525)


# --- in process: the verdict, the report, bad input ------------------------------------------
def test_hang_verdict():
    import traceback
    import torch
    from tpkit.recovery import hang_verdict
    from tpkit.recovery.hang import describe_stack
    c10d = os.path.join(os.path.dirname(torch.__file__), "distributed", "distributed_c10d.py")
    user = os.path.join(ROOT, "train.py")
    fs = traceback.FrameSummary
    waiting = describe_stack([fs(user, 10, "step"), fs(c10d, 99, "all_reduce")])
    stuck = describe_stack([fs(user, 10, "step"), fs(user, 42, "load_batch")])
    assert waiting == {"frame": f"{os.path.relpath(c10d)}:99 in all_reduce"
                       if not os.path.relpath(c10d).startswith("..")
                       else f"{c10d}:99 in all_reduce", "waiting": True,
                       "caller": "train.py:10 in step"}
    assert stuck == {"frame": "train.py:42 in load_batch", "waiting": False,
                     "caller": "train.py:42 in load_batch"}
    reports = {0: {**waiting, "step": 4}, 1: {**stuck, "step": 4, "dump": "d/hang-rank1.txt"},
               2: {**waiting, "step": 4}}
    assert hang_verdict(reports, 4, 5) == (
        "no progress for 5 s after step 4; stuck: rank 1 at train.py:42 in load_batch; "
        "rank 3 did not report (dead, or holding the GIL); waiting for them in collectives: "
        "ranks 0,2 at train.py:10 in step; stacks: d/hang-rank1.txt (each rank's beside its "
        "log)")
    assert hang_verdict({0: {**waiting, "step": 3}, 1: {**waiting, "step": 3}}, 2, 60) == (
        "no progress for 60 s after step 3; every rank waits in a collective (mismatched "
        "collectives or a network fault: compare the flight recorder dumps): ranks 0-1 at "
        "train.py:10 in step")


def test_straggler_report_arithmetic():
    from tpkit.recovery import format_report, straggler_report
    rep = straggler_report([1.0, 1.0, 1.0, 2.0, 1.3])
    assert (rep["slowest"], rep["median"], rep["ratio"], rep["flagged"]) == (3, 1.0, 2.0, [3, 4])
    assert format_report(rep).endswith("SLOW (> 1.2x): ranks 3-4")
    assert straggler_report([1.0, 1.2])["flagged"] == []  # 1.2 / median 1.1 < 1.2
    from tpkit.recovery import Recovery                    # 0 steps: no report, no error
    assert Recovery(None, signals=(), straggler_every=0).stragglers is None


def test_launcher_environment_for_recovery(monkeypatch):
    """tpkit-launch gives each rendezvous round its own store when workers may restart
    (torch shares the agent's store across rounds, and the restarted ranks then read
    their peers' old addresses: the kill test above fails without it), and turns nccl's
    flight recorder on, leaving the user's own settings alone."""
    from tpkit.cli import launch
    for var in [v for v in os.environ if v.startswith(("TORCH_", "SLURM_", "TPKIT_"))]:
        monkeypatch.delenv(var)

    def exports(*argv):
        return launch.resolve(launch.build_parser().parse_args([*argv, FAULTS]),
                              os.environ).exports
    key = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    assert key not in exports("--nproc-per-node", "2")
    assert exports("--nproc-per-node", "2", "--max-restarts", "1")[key] == "1"
    assert exports("--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-endpoint", "h:1")[key] \
        == "1"                                                    # elastic: new rounds too
    monkeypatch.setenv(key, "0")
    assert key not in exports("--nproc-per-node", "2", "--max-restarts", "1")
    monkeypatch.setattr(launch, "_visible_gpus", lambda: 2)
    env = exports("--nproc-per-node", "2", "--backend", "nccl", "--log-dir", "logs")
    assert (env["TORCH_NCCL_TRACE_BUFFER_SIZE"], env["TORCH_NCCL_DUMP_ON_TIMEOUT"]) == ("2000", "1")
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == os.path.abspath("logs/nccl_trace_rank_")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in exports("--nproc-per-node", "2", "--backend",
                                                         "nccl")
