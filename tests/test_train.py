"""launch/train.py end to end: the same loss curve at every layout, with recompute, in
emulated fp8 (within a stated tolerance), and across a resume at another layout.

Pool (tests/dist.py): ``train.main`` runs inside the harness's processes, over its
default group and without TPKIT_*; the script itself under tpkit-launch (its __main__,
Lightning creating the group, a resume by new processes after a SIGKILL) is
test_userpath.test_train_save_kill_resume."""
import os
import sys

import pytest

from dist import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--steps", "20", "--hidden", "64", "--layers", "2", "--heads", "4",
         "--gqa-groups", "2", "--ffn", "128", "--seq-len", "32", "--global-batch", "4",
         "--warmup", "5", "--log-every", "100"]
REL = 1e-5
FP8_REL = 0.03  # emulated fp8 (E4M3 fwd, E5M2 grads) vs fp32, per step, relative


def _train(layout, extra=()):
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import train
    tp, cp = layout
    return train.main(SMALL + ["--tp", str(tp), "--cp", str(cp)] + list(extra))


def _check_same(a, b, rel=REL):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rel * abs(y), f"step {i}: {x} vs {y}"


@pytest.fixture(scope="module")
def reference():
    (losses,) = run(_train, 1, (1, 1))
    assert losses[-1] < losses[0] - 0.5, losses  # it learns
    return losses


# (tp, cp) on 4 ranks: (2,1) → dp 2, (2,2) → dp 1, (1,2) → dp 2
@pytest.mark.parametrize("layout,extra", [
    ((2, 1), ()), ((2, 2), ()), ((1, 2), ()), ((2, 2), ("--recompute",)),
    ((2, 1), ("--sequence-parallel", "--recompute")),
], ids=["tp2dp2", "tp2cp2", "cp2dp2", "tp2cp2-recompute", "tp2dp2-sp-recompute"])
def test_layout_parity(reference, layout, extra):
    results = run(_train, 4, layout, extra)
    for losses in results:  # every rank reports the same global loss
        _check_same(losses, results[0], rel=0.0)
    _check_same(results[0], reference)


def test_fp8_emulation_tracks_fp32(reference):
    results = run(_train, 4, (2, 1), ("--precision", "fp8"))
    for losses in results:  # every rank reports the same global loss
        _check_same(losses, results[0], rel=0.0)
    _check_same(results[0], reference, rel=FP8_REL)
    assert results[0] != reference  # fp8 really was applied


def test_resume_at_another_layout(reference, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = run(_train, 4, (2, 1), ("--steps", "20", "--save", ckpt, "--save-every", "10"))
    assert sorted(os.listdir(ckpt)) == ["step000010", "step000020"]
    # resume at tp=1, cp=2, dp=2 from the checkpoint written after 10 steps at tp=2, dp=2
    resumed = run(_train, 4, (1, 2), ("--resume", os.path.join(ckpt, "step000010")))
    for losses in first:  # every rank, not rank 0's only
        _check_same(losses, reference)
    for losses in resumed:
        _check_same(losses, reference[10:])
