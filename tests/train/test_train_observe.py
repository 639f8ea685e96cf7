"""tpkit-train's metrics the user's way: ONE launch of

    tpkit-launch --nproc-per-node 4 --tp 2 --cp 2 -m tpkit.train ... --log-dir DIR
                 --profile-steps 2:4

(a tiny GPT with MoE layers, 6 steps, a row every 2). The TensorBoard event files (read
back with tensorboard's EventAccumulator) hold the values of the progress lines rank 0
printed, metrics.csv the same rows; the printed loss is a single process's loss curve
(the pool's run of the same job), the learning rate the warmup's formula, the token
rate the global batch's tokens; every rank wrote a profiler trace of steps 2 and 3 that
json loads as a Chrome trace; and rank 0 printed the memory estimate once, after step 1
(tpkit.memory's figure for rank 0 of this layout)."""
import csv
import json
import math
import os
import re

import pytest

from shared import register_trainer_script, script_dir, script_output

pytestmark = pytest.mark.slow

ARGS = ["--training.steps", "6", "--hidden", "32", "--layers", "2", "--heads", "4",
        "--gqa-groups", "2", "--ffn", "64", "--seq-len", "16", "--global-batch", "2",
        "--warmup", "10", "--log-every", "2", "--moe-experts", "4", "--moe-topk", "2"]
LR, WARMUP, TOKENS = 3e-3, 10, 2 * 16           # the default peak lr; global batch x seq


def _reference(argv):
    from tpkit.train import main
    return main(argv)


# as under tpkit-launch --nproc-per-node 4 --tp 2 --cp 2, in tests/shared.py's launch
register_trainer_script("train-observe", "-m tpkit.train", *ARGS, "--log-dir", "{dir}/run",
                        "--profile-steps", "2:4", flags=("--tp", "2", "--cp", "2"))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from dist import run
    log_dir = os.path.join(script_dir(tmp_path_factory, "train-observe"), "run")
    out = script_output(tmp_path_factory, "train-observe")   # the launch exited 0
    (reference,) = run(_reference, 1, ARGS)      # one process, no logging files
    return log_dir, out, reference


# the progress line's figures as printed: (scalar, pattern, printed decimals' half-unit)
PRINTED = [("loss", r"\bloss ([0-9.]+)", 5e-7), ("lr", r"\blr ([0-9.e+-]+)", None),
           ("grad_norm", r"grad_norm ([0-9.]+)", 5e-4),
           ("tokens_per_s", r"([0-9,]+) tokens/s", 0.5),
           ("step_time_s", r"step ([0-9.]+) s\b", 5e-4)]


def _printed(line: str) -> dict:
    out = {}
    for key, pattern, _ in PRINTED:
        m = re.search(pattern, line)
        assert m, (key, line)
        out[key] = float(m.group(1).replace(",", ""))
    return out


def test_event_files_and_csv_hold_the_printed_values(job):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    log_dir, out, reference = job
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["2/6", "4/6", "6/6"], lines
    printed = [_printed(ln) for ln in lines]

    acc = EventAccumulator(log_dir)
    acc.Reload()
    tags = sorted(acc.Tags()["scalars"])
    board = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags}
    for tag in tags:
        assert [s for s, _ in board[tag]] == [2, 4, 6], tag
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tflops_per_device",
                "time_data_s", "time_fwd_bwd_s", "time_optimizer_s", "time_checkpoint_s",
                "slowest_rank", "memory_rss_gib", "moe_aux_loss", "moe_load_imbalance"):
        assert key in board, key
    assert not any(t.startswith("mfu") for t in tags), "MFU on a CPU (no honest peak)"

    for i, (steps_done, shown) in enumerate(zip((2, 4, 6), printed)):
        row = {tag: board[tag][i][1] for tag in tags}
        for key, _, half in PRINTED:                 # TensorBoard's value, as printed
            if key == "lr":                          # printed with 3 significant digits
                assert f"{row['lr']:.2e}" == f"{shown['lr']:.2e}", (row["lr"], shown)
            else:
                assert abs(row[key] - shown[key]) <= half + 1e-6 * abs(row[key]), \
                    (key, row[key], shown[key])
        # against references of their own: one process's loss curve, the warmup formula,
        # the global batch's tokens, the MoE layers' routed slots
        assert abs(shown["loss"] - reference[steps_done - 1]) <= \
            1e-5 * reference[steps_done - 1] + 5e-7, (steps_done, shown, reference)
        assert math.isclose(row["lr"], LR * steps_done / WARMUP, rel_tol=1e-6), row["lr"]
        assert math.isclose(row["tokens_per_s"] * row["step_time_s"], TOKENS, rel_tol=1e-5)
        # 2 MoE layers x 32 tokens x top-2 over 4 experts: a mean of 32 slots per expert
        assert math.isclose(row["moe_load_max"] / row["moe_load_imbalance"], 32.0,
                            rel_tol=1e-6), row
        assert row["time_fwd_bwd_s"] > 0 and 0 <= row["slowest_rank"] < 4, row

    with open(os.path.join(log_dir, "metrics.csv")) as f:
        table = list(csv.DictReader(f))
    assert [int(r["step"]) for r in table] == [2, 4, 6]
    assert sorted(k for k in table[0] if k != "step") == tags
    for i, r in enumerate(table):                    # TensorBoard stores float32
        for tag in tags:
            assert math.isclose(float(r[tag]), board[tag][i][1], rel_tol=1e-6,
                                abs_tol=1e-30), (tag, r[tag], board[tag][i])
    assert "\r" not in out and "done:" in out        # not a terminal: plain lines


def test_profile_trace_per_rank(job):
    log_dir, _, _ = job
    for rank in range(4):
        with open(os.path.join(log_dir, "profile", f"rank{rank}.pt.trace.json")) as f:
            trace = json.load(f)                     # Chrome trace format
        names = {e.get("name", "") for e in trace["traceEvents"]}
        steps = sorted(n for n in names if n.startswith("ProfilerStep#"))
        assert steps == ["ProfilerStep#0", "ProfilerStep#1"], (rank, steps)   # steps 2, 3
        assert any(n.startswith("aten::") for n in names), rank
    assert sorted(os.listdir(os.path.join(log_dir, "profile"))) == \
        [f"rank{r}.pt.trace.json" for r in range(4)]


def test_memory_estimate_line_after_step_one(job):
    from tpkit.layout.config import ParallelConfig
    from tpkit.memory import estimate_memory, format_measured
    from tpkit.train import parse
    from tpkit.train.trainer import memory_job
    _, out, _ = job
    lines = [ln for ln in out.splitlines() if ln.startswith("memory")]
    assert len(lines) == 1, lines                    # rank 0 only, once
    text = out.splitlines()
    assert text.index(lines[0]) < text.index(next(ln for ln in text if ln.startswith("step ")))
    layout = ParallelConfig(tp=2, cp=2).validate(4)
    est = estimate_memory(memory_job(parse(ARGS)[0], layout), layout, rank=0)
    assert lines[0] == format_measured(est, None, step=1), lines[0]   # CPU: no allocator peak
    from test_memory import read_measured_line
    step, printed, measured, _ = read_measured_line(lines[0])   # the line scripts read
    assert step == 1 and measured is None, lines[0]             # after the first step
    assert abs(printed - est.first_step) <= 0.005 * 2 ** 20, (printed, est.first_step)


@pytest.mark.gpu
def test_gpu_run_logs_mfu_and_the_measured_peak(tmp_path):
    """On one GPU (``-m gpu``; not run on CPU machines): a bf16 run logs MFU as TFLOP/s
    over the device's dense bf16 peak, and the step-1 line has the allocator's peak."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from tpkit.observe import peak_tflops
    log_dir = str(tmp_path / "run")
    out, _ = launched("--nproc-per-node", "1", "-m", "tpkit.train", *ARGS,
                      "--precision", "bf16-mixed", "--log-dir", log_dir)
    (line,) = [ln for ln in out.splitlines() if ln.startswith("memory")]
    from test_memory import read_measured_line
    step, est, measured, pct = read_measured_line(line)
    assert step == 1 and measured is not None and pct > 0, line
    with open(os.path.join(log_dir, "metrics.csv")) as f:
        table = list(csv.DictReader(f))
    peak = peak_tflops(torch.cuda.get_device_name(0), "bf16")
    assert peak, torch.cuda.get_device_name(0)
    for r in table:
        assert math.isclose(float(r["mfu"]), float(r["tflops_per_device"]) / peak,
                            rel_tol=1e-6), r
