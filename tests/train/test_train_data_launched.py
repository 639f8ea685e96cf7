"""Issue 36's acceptance line as a user runs it: raw jsonl -> ``tpkit-data`` (a subprocess,
2 worker processes) -> ``tpkit-launch -m tpkit.train`` with --pack and --eval-every.

Two launches in one test (process starts dominate its time), and a reference:
  A. (1,1,1), one rank: the reference loss and val_loss curves (tpkit.train's Trainer in
     the reused one-rank worker pool, tests/dist.py: the same trainer and flags, no
     process start of its own);
  C. dp=2 with --save --save-every --auto-resume, SIGKILLed (launcher and ranks) once a
     checkpoint exists;
  D. relaunched at tp=2 x cp=2 with --auto-resume: from the newest complete checkpoint (the
     model resharded from dp=2 over tp and cp) to the end, on A's curves within 1e-5 (the
     global batch and the sample order are layout-free, so A is the uninterrupted dp=2
     run's curve too).
The pool's tests/train/test_train_data.py checks what a launch each used to: the whole
tp=2 x cp=2 curves from step 0 (test_own_data_packed_same_curves_at_tp2_cp2) and a dp=2
run resumed at dp=4 (test_own_data_saved_at_dp2_resumed_at_dp4), against (1,1,1).
The launched curves are rank 0's printed lines (--log-every 1: every step's loss, and
val_loss at each evaluation, with 6 decimals: a rounding of at most 5e-7, well inside 1e-5
relative); A's are the values fit() returned and evaluate() kept.
"""
import json
import re
import signal
import sys
import time

import pytest

from dist import run
from test_datasets import _texts, make_tokenizer
from test_userpath import LAUNCH, TIMEOUT, _kill_tree, finish, launched, start

pytestmark = pytest.mark.slow

STEPS, EVAL = 12, 4
JOB = ["-m", "tpkit.train", "--steps", str(STEPS), "--hidden", "32", "--layers", "2",
       "--heads", "4", "--gqa-groups", "2", "--ffn", "64", "--seq-len", "32",
       "--global-batch", "4", "--warmup", "2", "--log-every", "1", "--pack",
       "--split", "80,20", "--eval-every", str(EVAL), "--eval-batches", "2"]
EVALS = [3, 7, 11]   # 0-based steps after which val_loss is computed
REL = 1e-5


def _curves(out: str) -> tuple[dict[int, float], dict[int, float]]:
    """{0-based step: loss}, {0-based step: val_loss} from rank 0's progress lines
    'step N/TOTAL ... loss X ...' and 'step N  val_loss X' (tpkit.observe's ProgressLine,
    N steps done: step N - 1; six decimals)."""
    from test_userpath import printed_losses
    loss = dict(printed_losses(out))
    val = {int(m.group(1)) - 1: float(m.group(2))
           for m in re.finditer(r"^step (\d+)  val_loss ([0-9.]+)$", out, re.M)}
    return loss, val


def _reference(argv: list[str]) -> tuple[dict[int, float], dict[int, float]]:
    """A: ``argv`` trained by one rank of the pool: {step: loss}, {step: val_loss}."""
    from tpkit.train import Trainer, parse
    trainer = Trainer(parse(argv)[0])
    losses = trainer.fit()
    return dict(enumerate(losses)), dict(trainer.val_losses)


def _same(got: dict, ref: dict, what: str) -> None:
    for step, x in got.items():
        assert abs(x - ref[step]) <= REL * abs(ref[step]), (what, step, x, ref[step])


@pytest.mark.timeout(600)  # tpkit-data and two launches (6 ranks) on a loaded machine
def test_jsonl_to_launched_training_layouts_and_kill_resume(tmp_path):
    # raw jsonl and a tiny BPE of its words, then tpkit-data with 2 worker processes
    tok = make_tokenizer(tmp_path)
    with open(tmp_path / "c.jsonl", "w") as f:
        for t in _texts(200, seed=3):
            f.write(json.dumps({"text": t}) + "\n")
    rc, out, err = finish(start([sys.executable, "-m", "tpkit.data", "--input",
                                 str(tmp_path / "c.jsonl"), "--output-prefix",
                                 str(tmp_path / "c"), "--tokenizer", tok, "--append-eod",
                                 "--workers", "2"]))
    assert rc == 0 and "200 documents" in out and "with 2 worker(s)" in out, (out, err)
    job = JOB + ["--data-path", str(tmp_path / "c_text_document"), "--tokenizer", tok]

    # A: (1,1,1) in the pool
    [(loss_a, val_a)] = run(_reference, 1, job[2:])
    assert sorted(loss_a) == list(range(STEPS)) and sorted(val_a) == EVALS, (loss_a, val_a)
    assert loss_a[STEPS - 1] < loss_a[0] and val_a[11] < val_a[3], (loss_a, val_a)  # learns

    # C: dp=2 saving every 2 steps, SIGKILLed once a checkpoint is there
    ckpt = tmp_path / "ckpt"
    save = ["--save", str(ckpt), "--save-every", "2", "--auto-resume"]
    first = start([*LAUNCH, "--nproc-per-node", "2", *job, *save])
    deadline = time.monotonic() + TIMEOUT
    while not (ckpt.is_dir() and any(re.fullmatch(r"step\d{6}", d.name)
                                     for d in ckpt.iterdir())):
        if first.poll() is not None or time.monotonic() > deadline:
            _kill_tree(first)
            pytest.fail(f"no checkpoint (exit {first.poll()}):\n{first.communicate()[1][-5000:]}")
        time.sleep(0.02)
    _kill_tree(first)
    _, err_c = first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL, (first.returncode, err_c[-3000:])
    done = sorted(int(d.name[4:]) for d in ckpt.iterdir() if re.fullmatch(r"step\d{6}", d.name))
    assert done[-1] < STEPS, f"the job finished before it was killed: {done}"

    # D: relaunched at tp=2 x cp=2 with --auto-resume: from the newest complete checkpoint
    out_d, err_d = launched("--nproc-per-node", "4", "--tp", "2", "--cp", "2", *job, *save)
    loss_d, val_d = _curves(out_d)
    first_step = min(loss_d)
    assert first_step >= 2 and first_step % 2 == 0, (first_step, done)  # after a checkpoint
    assert f"resuming from {ckpt / f'step{first_step:06d}'}" in out_d + err_d
    assert sorted(loss_d) == list(range(first_step, STEPS)), sorted(loss_d)
    assert sorted(val_d) == [s for s in EVALS if s >= first_step]
    _same(loss_d, loss_a, "loss resumed at tp2 x cp2")
    _same(val_d, val_a, "val_loss resumed at tp2 x cp2")
