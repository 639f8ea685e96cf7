"""tpkit.observe the user's way: a launched tp 2 x cp 2 loop (tests/launch_scripts/
observe_run.py, as under ``tpkit-launch --nproc-per-node 4 --tp 2 --cp 2``, in
tests/shared.py's trainer launch with the variables those flags export) logs with
MetricsLogger; the TensorBoard event files, read back with
tensorboard's EventAccumulator, hold exactly the rows rank 0 printed, metrics.csv holds
the same rows, the phase times are the ranks' mean (a checkpoint's stall in its window),
and each rank's profiler trace of steps 2..3 loads as a Chrome trace."""
import csv
import json
import math
import os

import pytest

from paths import SCRIPTS
from shared import register_trainer_script, script_dir, script_output

pytestmark = pytest.mark.slow
# as under tpkit-launch --nproc-per-node 4 --tp 2 --cp 2, in tests/shared.py's launch
register_trainer_script("observe-run", os.path.join(SCRIPTS, "observe_run.py"), "{dir}",
                        flags=("--tp", "2", "--cp", "2"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = script_dir(tmp_path_factory, "observe-run")
    out = script_output(tmp_path_factory, "observe-run")   # the launch exited 0
    rows = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
    ranks = [json.loads(line[6:]) for line in out.splitlines() if line.startswith("RANKS ")]
    return work, rows, out, ranks


def test_tensorboard_and_csv_hold_the_printed_rows(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    work, rows, out, ranks = run
    assert [r["step"] for r in rows] == [2, 4, 6, 6], rows
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "step_time_s",
                "time_data_s", "time_fwd_bwd_s", "time_optimizer_s", "time_checkpoint_s",
                "slowest_rank", "slowest_ratio", "stragglers", "memory_rss_gib",
                "memory_peak_rss_gib", "memory_max_rank", "moe_aux_loss", "moe_load_min",
                "moe_load_max", "moe_load_imbalance"):
        assert all(key in r for r in rows[:3]), key
    assert rows[3].keys() == {"step", "val_loss"}
    assert not any("mfu" in r for r in rows), "MFU on a CPU (no honest peak)"
    for r, by_rank in zip(rows[:3], ranks):      # the rows' phase times: the ranks' mean
        assert len(by_rank) == 4
        for phase in ("data", "fwd_bwd", "optimizer", "checkpoint"):
            key = f"time_{phase}_s"
            assert math.isclose(r[key], sum(t[key] for t in by_rank) / 4, rel_tol=1e-9), key
    assert rows[0]["time_checkpoint_s"] == 0 < rows[1]["time_checkpoint_s"]   # saved in step 3
    for r in rows[:3]:
        assert r["time_fwd_bwd_s"] > 0 and 0 <= r["slowest_rank"] < 4, r
        assert r["moe_load_max"] >= r["moe_load_min"] > 0, r
        # routed slots per expert, summed over the 2 MoE layers: 2 x 32 tokens x top-2 over
        # 4 experts is a mean of 32 (dropless), so max / imbalance must be 32
        assert math.isclose(r["moe_load_max"] / r["moe_load_imbalance"], 32.0), r
        # 2 steps x 2 sequences x 16 tokens, 4 devices: the rate and TFLOP/s per device
        assert math.isclose(r["tokens_per_s"] * r["step_time_s"], 32, rel_tol=1e-9), r

    acc = EventAccumulator(os.path.join(work, "run"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    expected = {}
    for r in rows:
        for k, v in r.items():
            if k != "step":
                expected.setdefault(k, []).append((r["step"], v))
    assert sorted(tags) == sorted(expected)
    for tag, want in expected.items():
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want], tag
        for (_, g), (_, w) in zip(got, want):    # TensorBoard stores float32
            assert math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-30), (tag, g, w)

    with open(os.path.join(work, "run", "metrics.csv")) as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    for line, r in zip(table, rows):
        filled = {k: float(v) for k, v in line.items() if v != ""}
        assert filled == {k: float(v) for k, v in r.items()}, (line, r)

    progress = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in progress] == ["2/6", "4/6", "6/6", "6"], progress
    assert "\r" not in out                   # not a terminal: plain lines, no bar


def test_profile_trace_per_rank(run):
    work, _, _, _ = run
    for rank in range(4):
        path = os.path.join(work, "run", "profile", f"rank{rank}.pt.trace.json")
        with open(path) as f:
            trace = json.load(f)                    # Chrome trace format
        names = {e.get("name", "") for e in trace["traceEvents"]}
        steps = sorted(n for n in names if n.startswith("ProfilerStep#"))
        assert steps == ["ProfilerStep#0", "ProfilerStep#1"], steps   # steps 2 and 3
        assert any(n.startswith("aten::") for n in names), rank
        assert any("all_reduce" in n or "allreduce" in n for n in names), rank
    assert not os.path.exists(os.path.join(work, "run", "profile", "rank0.memory.pickle"))
