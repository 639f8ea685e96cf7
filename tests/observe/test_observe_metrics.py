"""tpkit.observe in one process: MetricsLogger's rows (MFU against an overridden peak, the
fp8 pair, a restarted run's CSV kept), the progress line on a terminal and off it, the
profile-steps range, measured memory, and the bad-input errors. The launched tp 2 x cp 2
run is tests/observe/test_observe_launch.py."""
import csv
import io
import os

import pytest


class _Tty(io.StringIO):
    def isatty(self):
        return True


def _loop(log, steps, tokens=None):
    import torch
    rows = []
    for step in range(steps):
        with log.phase("data"):
            x = torch.ones(8, 8)
        with log.phase("fwd_bwd"):
            y = (x @ x).sum()
        with log.phase("optimizer"):
            pass
        if step == 1:
            with log.phase("checkpoint"):
                pass
        rows.append(log.step(step, tokens=tokens, loss=y / 100, lr=None))
    return rows


def test_rows_mfu_and_fp8_against_overridden_peaks(tmp_path):
    from tpkit.observe import MetricsLogger
    log = MetricsLogger(str(tmp_path), tokens_per_step=64, flops_per_token=1e9, total_steps=4,
                        every=2, precision="fp8", peak_tflops=0.5, peak_tflops_fp8=1.0,
                        stream=io.StringIO())
    rows = _loop(log, 4)
    log.close()
    assert rows[0] is None and rows[2] is None and rows[1] and rows[3]
    for r in rows[1::2]:
        assert r["loss"] == pytest.approx(5.12) and "lr" not in r      # None is left out
        assert r["tflops_per_device"] == pytest.approx(r["tokens_per_s"] * 1e9 / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.5)   # bf16 peak for fp8
        assert r["mfu_fp8"] == pytest.approx(r["tflops_per_device"] / 1.0)
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(64)
        assert r["slowest_rank"] == 0 and r["stragglers"] == 0 and r["memory_rss_gib"] > 0
    with open(tmp_path / "metrics.csv") as f:
        table = list(csv.DictReader(f))
    assert [int(t["step"]) for t in table] == [2, 4]
    assert float(table[1]["mfu"]) == rows[3]["mfu"]


def test_cpu_has_no_mfu_and_a_restart_keeps_the_csv(tmp_path):
    from tpkit.observe import MetricsLogger
    for run in range(2):
        log = MetricsLogger(str(tmp_path), tokens_per_step=8, flops_per_token=1e6, every=1,
                            progress=False)
        row = _loop(log, 1)[0]
        log.close()
        assert "tflops_per_device" in row and "mfu" not in row and "mfu_fp8" not in row
    assert {"metrics.csv", "metrics-1.csv"} <= set(os.listdir(tmp_path))
    for name in ("metrics.csv", "metrics-1.csv"):      # each run's one row
        with open(tmp_path / name) as f:
            assert [int(r["step"]) for r in csv.DictReader(f)] == [1], name


def test_progress_line_tty_and_plain():
    from tpkit.observe import ProgressLine
    row = {"loss": 2.5, "tokens_per_s": 1234.0, "step_time_s": 2.0, "tflops_per_device": 1.5,
           "mfu": 0.4, "time_data_s": 0.1, "time_fwd_bwd_s": 1.5, "time_optimizer_s": 0.3,
           "time_checkpoint_s": 0.0, "slowest_rank": 3, "slowest_ratio": 1.25,
           "memory_peak_allocated_gib": 7.5, "memory_max_rank": 1}
    plain = io.StringIO()
    p = ProgressLine(100, stream=plain)
    p.update(9, row)
    p.update(99, row)
    lines = plain.getvalue().splitlines()
    assert lines[0].startswith("step 10/100  eta 3m00s  loss 2.500000") and "\r" not in lines[0]
    for words in ("1,234 tokens/s", "1.5 TFLOP/s/device", "MFU 0.400", "slowest rank 3 (1.25x)",
                  "fwd+bwd 1.500", "mem 7.50 GiB (rank 1)"):
        assert words in lines[0], (words, lines[0])
    assert lines[1].startswith("step 100/100  eta 0s")
    tty = _Tty()
    p = ProgressLine(4, stream=tty)
    p.update(1, row)
    p.note(1, {"val_loss": 2.0})
    p.update(3, row)
    out = tty.getvalue()
    assert out.startswith("\r\x1b[2K[##########..........]  50% step 2/4")
    assert "\nstep 2  val_loss 2.000000\n" in out and out.endswith("\n")
    assert "[####################] 100% step 4/4" in out


def test_profile_steps_range(tmp_path):
    import json
    import torch
    from tpkit.observe import StepProfiler, parse_profile_steps
    assert parse_profile_steps("3:5") == (3, 5) and parse_profile_steps((0, 1)) == (0, 1)
    seen = []
    p = StepProfiler("1:3", str(tmp_path), rank=0)
    for step in range(5):
        with torch.profiler.record_function(f"work{step}"):
            torch.ones(4) + step
        p.step_done(step)
        seen.append(p.done)
    assert seen == [False, False, True, True, True]
    names = {e.get("name") for e in json.load(open(p.trace_path))["traceEvents"]}
    assert {"work1", "work2"} <= names and not names & {"work0", "work3", "work4"}
    late = StepProfiler("0:2", str(tmp_path / "late"), start_step=5)   # resumed past B
    assert late.done


def test_measured_memory_cpu():
    import torch
    from tpkit.observe import measured_memory
    before = measured_memory(torch.device("cpu"))
    block = torch.ones(64 * 2**20 // 4)          # 64 MiB touched
    after = measured_memory(torch.device("cpu"))
    assert after["memory_rss_gib"] - before["memory_rss_gib"] > 50 / 1024, (before, after)
    assert after["memory_peak_rss_gib"] >= after["memory_rss_gib"]
    del block


@pytest.mark.parametrize("kw, words", [
    (dict(every=0), ["every=0", "positive"]),
    (dict(tokens_per_step=0), ["tokens_per_step=0"]),
    (dict(precision="int4"), ["int4", "bf16"]),
    (dict(peak_tflops=-1.0), ["peak_tflops=-1.0"]),
    (dict(straggler_threshold=1.0), ["straggler_threshold=1.0"]),
    (dict(profile_steps="5"), ["profile-steps='5'", "A:B"]),
    (dict(profile_steps="4:2"), ["profile-steps='4:2'", "0 <= A < B"]),
    (dict(wandb=True), ["wandb", "pip install wandb"]),
])
def test_bad_input(tmp_path, kw, words):
    from tpkit.observe import MetricsLogger
    if kw.get("wandb"):
        pytest.importorskip("lightning.pytorch")
        try:
            import wandb  # noqa: F401
            pytest.skip("wandb is installed here")
        except ImportError:
            pass
    args = dict(tokens_per_step=8, progress=False)
    args.update(kw)
    with pytest.raises(ValueError) as e:
        MetricsLogger(str(tmp_path), **args)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_unknown_phase(tmp_path):
    from tpkit.observe import MetricsLogger
    log = MetricsLogger(str(tmp_path), tokens_per_step=8, progress=False)
    with pytest.raises(ValueError, match="'backward' is not one of"):
        with log.phase("backward"):
            pass
    log.close()


def test_wandb_when_asked_gets_the_same_rows(tmp_path, monkeypatch):
    """wandb=dict: Lightning's WandbLogger is built with those arguments (save_dir
    defaulting to the log directory) and receives every row; wandb itself is stubbed
    (offline W&B needs the package, not the network)."""
    import sys
    import types
    import lightning.pytorch.loggers as pl_loggers
    from tpkit.observe import MetricsLogger
    made = []

    class FakeWandb:
        def __init__(self, **kw):
            self.kw, self.rows, self.final = kw, [], None
            made.append(self)

        def log_metrics(self, metrics, step):
            self.rows.append((step, dict(metrics)))

        def save(self):
            pass

        def finalize(self, status):
            self.final = status

    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
    monkeypatch.setattr(pl_loggers, "WandbLogger", FakeWandb)
    log = MetricsLogger(str(tmp_path), tokens_per_step=8, every=1, progress=False,
                        wandb={"offline": True, "project": "p"})
    rows = _loop(log, 2)
    log.log(1, val_loss=3.0)
    log.close()
    (w,) = made
    assert w.kw == {"offline": True, "project": "p", "save_dir": str(tmp_path)}
    assert w.rows == [(1, rows[0]), (2, rows[1]), (2, {"val_loss": 3.0})]
    assert w.final == "success"
