"""tpkit-train (tpkit.train.main) end to end: the same loss curve at every layout of one
table of overrides, with recompute, in emulated fp8 (within a stated tolerance), across a
resume at another layout, and bit-identical from flags, a TOML file and the printed config.

Pool (tests/dist.py): ``main`` runs inside the harness's processes, over its default group
and without TPKIT_*; the entry point under tpkit-launch (its __main__, Lightning creating
the group, a resume by new processes after a SIGKILL) is
test_userpath.test_train_save_kill_resume."""
import os

import pytest

from dist import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--steps", "20", "--hidden", "64", "--layers", "2", "--heads", "4",
         "--gqa-groups", "2", "--ffn", "128", "--seq-len", "32", "--global-batch", "4",
         "--warmup", "5", "--log-every", "100"]
REL = 1e-5
FP8_REL = 0.03  # emulated fp8 (E4M3 fwd, E5M2 grads) vs fp32, per step, relative


def _train(layout, extra=()):
    from tpkit.train import main
    tp, cp = layout
    return main(SMALL + ["--tp", str(tp), "--cp", str(cp)] + list(extra))


def _check_same(a, b, rel=REL):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rel * abs(y), f"step {i}: {x} vs {y}"


@pytest.fixture(scope="module")
def reference():
    (losses,) = run(_train, 1, (1, 1))
    assert losses[-1] < losses[0] - 0.5, losses  # it learns
    return losses


# The layouts, as overrides of SMALL: (tp, cp) on 4 ranks, (2,1) → dp 2, (1,2) → dp 2.
# tp2 x cp2 (dp 1) is test_file_flags_and_printed_config_give_one_curve's.
@pytest.mark.parametrize("layout,extra", [
    ((2, 1), ()), ((1, 2), ()), ((2, 2), ("--recompute",)),
    ((2, 1), ("--sequence-parallel", "--recompute")),
], ids=["tp2dp2", "cp2dp2", "tp2cp2-recompute", "tp2dp2-sp-recompute"])
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


JOB_TOML = """# SMALL at tp=2 x cp=2, written by hand
[parallelism]
tp = 2
cp = 2

[model]
hidden = 64
layers = 2
heads = 4
gqa_groups = 2
ffn = 128

[training]
steps = 20
seq_len = 32
global_batch = 4

[optimizer]
warmup = 5

[logging]
log_every = 100
"""


def _three_ways(flags, files):
    import tpkit
    from tpkit.train import main
    out = []
    for argv in [flags] + [["--config", f] for f in files]:
        out.append(main(argv))
        tpkit.destroy_parallel()
    return out


def test_file_flags_and_printed_config_give_one_curve(reference, tmp_path, capsys):
    """At tp=2 x cp=2: the flags, a hand-written TOML file saying the same, and the flags'
    --print-config output given back as --config train bit-identical loss curves on every
    rank, and the same curve as one process (the layout-parity row of tp2 x cp2)."""
    from tpkit.train import main
    flags = SMALL + ["--tp", "2", "--cp", "2"]
    (tmp_path / "job.toml").write_text(JOB_TOML)
    assert main(flags + ["--print-config"]) == []
    (tmp_path / "printed.toml").write_text(capsys.readouterr().out)
    results = run(_three_ways, 4, flags, [str(tmp_path / "job.toml"),
                                          str(tmp_path / "printed.toml")])
    for by_rank in results:
        assert by_rank[1] == by_rank[0] and by_rank[2] == by_rank[0]   # bit-identical
        assert by_rank[0] == results[0][0]
    _check_same(results[0][0], reference)
