"""tpkit.memory (issue 38): the per-rank estimate against independent measurements, and
tpkit-launch's dry run / refusal with it.

References: the live tensor bytes of launched training steps counted by
tests/memcount.py (storages only, no knowledge of the estimator) at 18 layouts; the
parameter count of the model built on the meta device; torch.cuda.max_memory_allocated
on a GPU.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import paths
from tpkit.cli import launch
from tpkit.layout.config import ParallelConfig
from tpkit.memory import (GiB, MemoryJob, ModelShape, estimate_memory, estimate_roles,
                          format_measured, measured_peak_bytes, suggest_layouts)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "tests", "launch_scripts")
PEAK = re.compile(r"^  estimated peak: (\d+\.\d\d) GiB per rank$", re.M)
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
             "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}


@pytest.mark.slow
def test_estimate_within_10_percent_of_measured_live_bytes_at_18_launched_layouts():
    """One tpkit-launch of 4 gloo ranks loops over the layouts of memory_layouts.py (tp,
    sp, cp with each comm type, pp 1F1B, Interleaved1F1B, InterleavedZeroBubble and GPipe,
    dp with DDP and FSDP2, recompute, fp8, bf16 autocast, experts, packed documents);
    every rank's estimate is within 10 % of the peak of live tensor bytes it measured
    during a training step."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPKIT_", "PET_"))}
    env["PYTHONPATH"] = paths.PYTHONPATH
    proc = subprocess.run([sys.executable, "-m", "tpkit.cli.launch", "--nproc-per-node", "4",
                           os.path.join(SCRIPTS, "memory_layouts.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^MEM (\S+) (\d+) (\d+) ([\d.]+)", proc.stdout, re.M)
    assert "DONE" in proc.stdout and len(rows) == 18, proc.stdout
    bad = [r for r in rows if not 0.9 <= int(r[1]) / int(r[2]) <= 1.1]
    assert not bad, f"estimate/measured outside 10 %: {bad}"


def _meta_params(cfg, layout, world, rank=0):
    """Parameter elements rank ``rank`` holds, counted on the model built on the meta
    device at the planned layout (the pipeline split keeps this rank's stages)."""
    from tpkit.layout.planning import fake_state
    from tpkit.layout.random import get_rng_tracker, model_parallel_seed
    from tpkit.models.gpt import GPT
    with fake_state(layout, world, rank) as state, torch.device("meta"):
        model_parallel_seed(1, state)
        try:
            model = GPT(cfg, state)
            if state.pp_size > 1:
                from tpkit.distributed.pipeline import PipelineStageModule, plan_pipeline
                plan = plan_pipeline(pp=state.pp_size, num_blocks=cfg.num_layers,
                                     microbatches=state.pp_size)
                st = plan.stages_of(state.pp_rank)[0]
                model = PipelineStageModule(model, st, plan.num_stages, plan.blocks_of(st))
            return sum(p.numel() for p in model.parameters())
        finally:
            get_rng_tracker().reset()


@pytest.mark.parametrize("layout,world,rank,experts", [
    (ParallelConfig(tp=2), 4, 0, 0),
    (ParallelConfig(tp=2, sequence_parallel=True), 2, 1, 0),
    (ParallelConfig(pp=2, tp=2), 4, 0, 0),
    (ParallelConfig(pp=2, tp=2), 4, 3, 0),
    (ParallelConfig(tp=2, ep=2), 4, 0, 4),
])
def test_parameters_term_equals_the_built_models_parameters(layout, world, rank, experts):
    from tpkit.models.gpt import GPTConfig
    cfg = GPTConfig(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4,
                    num_gqa_groups=2, ffn_hidden_size=256, moe_experts=experts)
    shape = ModelShape(layers=4, hidden=64, ffn=256, heads=4, kv_heads=2, vocab=256,
                       experts=experts)
    est = estimate_memory(MemoryJob(model=shape, seq_len=128, microbatches=2), layout,
                          rank=rank, world_size=world)
    assert est.terms["parameters"] == 4 * _meta_params(cfg, layout, world, rank)


def _write_70b(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_70B))
    return str(path)


LAYOUT_70B = ["--nnodes", "1024", "--nproc-per-node", "8", "--tp", "8", "--pp", "8",
              "--sequence-parallel", "--dry-run"]
JOB_70B = "micro_batch=1,seq_len=8192,microbatches=16,precision=bf16-mixed"


def test_dry_run_of_a_70b_llama_at_8192_ranks(tmp_path, capsys):
    """Every role's estimate (first, middle, last pipeline rank), each ending in the stable
    line; a device that holds it: exit 0."""
    argv = LAYOUT_70B + ["--model-config", _write_70b(tmp_path), "--memory-job", JOB_70B,
                         "--device-memory", "141", os.path.join(ROOT, "launch", "smoke.py")]
    assert launch.main(argv) == 0
    out = capsys.readouterr().out
    assert "pp rank 0 (first stage)" in out and "middle stages" in out \
        and "pp rank 7 (last stage)" in out, out
    peaks = [float(p) for p in PEAK.findall(out)]
    assert len(peaks) == 3 and all(20 < p < 126 for p in peaks), out
    assert "fits" in out and "DOES NOT FIT" not in out


def test_too_small_device_memory_exits_2_with_layouts_that_fit(tmp_path, capsys):
    argv = LAYOUT_70B + ["--model-config", _write_70b(tmp_path), "--memory-job", JOB_70B,
                         "--device-memory", "40", os.path.join(ROOT, "launch", "smoke.py")]
    assert launch.main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("tpkit-launch: error: "), err
    assert "its biggest term is activations" in err and "40.00 GiB" in err, err
    suggested = re.findall(r"^  suggest: (--tp .*): (\d+\.\d\d) GiB per rank", out, re.M)
    assert suggested, out
    assert all(float(gib) <= 36.0 for _, gib in suggested)
    # each suggestion, estimated on its own, fits (the dry run of the first one passes)
    first = suggested[0][0].replace(" (recompute)", "").replace(" (fsdp)", "").split()
    job = JOB_70B + (",recompute=1" if "(recompute)" in suggested[0][0] else "")
    dp = int(first[first.index("--dp") + 1])
    micro = 1 * 128 * 16 // dp // 16
    job = job.replace("micro_batch=1", f"micro_batch={micro}")
    assert launch.main(["--nnodes", "1024", "--nproc-per-node", "8", *first, "--dry-run",
                        "--model-config", str(tmp_path / "config.json"), "--memory-job", job,
                        "--device-memory", "40", os.path.join(ROOT, "launch", "smoke.py")]) == 0


def test_train_py_dry_run_prints_its_estimate(capsys):
    """launch/train.py's tpkit_preflight returns its MemoryJob: the dry run estimates the
    reference GPT at the launched layout without --model-config."""
    assert launch.main(["--nproc-per-node", "4", "--tp", "2", "--dry-run", "--device-memory",
                        "1", os.path.join(ROOT, "launch", "train.py"), "--seq-len", "256"]) == 0
    out = capsys.readouterr().out
    assert len(PEAK.findall(out)) == 1 and "micro-batch 4 x 256 tokens" in out, out


def test_suggestions_fit_and_come_cheapest_first():
    shape = ModelShape(layers=8, hidden=1024, ffn=4096, heads=16, kv_heads=4, vocab=32000)
    job = MemoryJob(model=shape, micro_batch=4, seq_len=4096, microbatches=1)
    fits = suggest_layouts(job, 16, 8 * GiB, global_batch=64, margin=0.1)
    assert fits
    costs = [f[0] for f in fits]
    assert costs == sorted(costs)
    for cost, c, j, peak in fits:
        worst = max(e.peak for e in estimate_roles(j, c, 16))
        assert worst == peak <= 0.9 * 8 * GiB


# The trainer's step-1 line as a script reads it (docs/train.md): the steps done, the
# estimate, then the measured peak and its ratio, or the note that the device has no
# allocator statistics.
MEASURED_LINE = re.compile(
    r"^memory(?: after step (\d+))?: estimated peak ([0-9.]+) (GiB|MiB) per rank"
    r"(?:, measured ([0-9.]+) (GiB|MiB) \((\d+)% of the estimate\)"
    r"| \(no allocator statistics on this device\))$")


def read_measured_line(line: str) -> tuple[int | None, float, float | None, int | None]:
    """(steps done or None, estimate bytes, measured bytes or None, percent or None)."""
    m = MEASURED_LINE.match(line)
    assert m, line
    unit = {"GiB": 2.0 ** 30, "MiB": 2.0 ** 20}
    step = None if m.group(1) is None else int(m.group(1))
    est = float(m.group(2)) * unit[m.group(3)]
    if m.group(4) is None:
        return step, est, None, None
    return step, est, float(m.group(4)) * unit[m.group(5)], int(m.group(6))


def test_measured_line_on_cpu():
    shape = ModelShape(layers=2, hidden=64, ffn=256, heads=4)
    est = estimate_memory(MemoryJob(model=shape, seq_len=128), ParallelConfig(), world_size=1)
    assert measured_peak_bytes("cpu") is None
    step, got, measured, pct = read_measured_line(format_measured(est, None, step=1))
    # after step 1: that step's peak (no optimizer states before its optimizer step)
    assert est.first_step < est.peak and est.first_step == max(
        [v - est.terms["optimizer states"] for k, v in est.phases.items() if k != "optimizer"]
        + [est.phases["optimizer"]])
    assert step == 1 and measured is None and abs(got - est.first_step) <= 0.005 * 2 ** 20, \
        (step, got, est.first_step)
    for m in (est.peak, 1.37 * est.peak, 3 * GiB):   # MiB and GiB; a ratio the line rounds
        step, got, measured, pct = read_measured_line(format_measured(est, m))
        unit = 2 ** 30 if m >= 0.1 * GiB else 2 ** 20
        assert step is None and abs(measured - m) <= 0.005 * unit \
            and pct == round(100 * m / est.peak), (m, measured, pct)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (run `python -m pytest -m gpu` on one)")
def test_estimate_within_10_percent_of_cuda_max_memory_allocated():
    """One GPU: a GPT (h=1024, 4 layers, 4 x 1024 tokens, fp32 with GQA: SDPA's math
    fallback, AdamW: foreach), third step's torch.cuda.max_memory_allocated against the
    estimate of the CUDA kernels (``device="cuda"``); the peak of each phase (the allocator's
    peak reset between forward, backward and optimizer step) is logged next to the
    estimate's phases."""
    import torch.distributed as dist
    import tpkit
    from tpkit.models.gpt import GPT, GPTConfig
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29577", RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group("nccl")
    state = tpkit.init_parallel()
    try:
        h, L, heads, groups, ffn, V, s, b = 1024, 4, 16, 4, 4096, 32000, 1024, 4
        cfg = GPTConfig(vocab_size=V, hidden_size=h, num_layers=L, num_heads=heads,
                        num_gqa_groups=groups, ffn_hidden_size=ffn)
        model = GPT(cfg, state).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, V, (b, s), device="cuda")
        y = torch.randint(0, V, (b, s), device="cuda")
        phases = {}

        def mark(name):   # the peak since the last mark, then a fresh count
            torch.cuda.synchronize()
            phases[name] = max(phases.get(name, 0), measured_peak_bytes())
            torch.cuda.reset_peak_memory_stats()
        for step in range(3):
            if step == 2:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                overall = 0
            loss = model(x, y)
            if step == 2:
                overall = max(overall, measured_peak_bytes())
                mark("forward")
            loss.backward()
            del loss
            if step == 2:
                overall = max(overall, measured_peak_bytes())
                mark("backward")
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == 2:
                overall = max(overall, measured_peak_bytes())
                mark("optimizer")
        measured = overall
        shape = ModelShape(layers=L, hidden=h, ffn=ffn, heads=heads, kv_heads=groups, vocab=V)
        est = estimate_memory(MemoryJob(model=shape, micro_batch=b, seq_len=s, device="cuda"),
                              ParallelConfig(), world_size=1)
        print(format_measured(est, measured))
        print("measured per phase (GiB):", {k: round(v / GiB, 3) for k, v in phases.items()},
              "estimated:", {k: round(v / GiB, 3) for k, v in est.phases.items()})
        assert 0.9 <= est.peak / measured <= 1.1, (est, measured, phases)
    finally:
        tpkit.destroy_parallel()


def test_docs_memory_output_is_the_commands(capsys):
    """docs/launch.md's "Memory" example: its text block is the dry run's output (lines in
    order; "..." stands for omitted ones) and the command exits 2."""
    text = open(os.path.join(ROOT, "docs", "launch.md")).read()
    section = text[text.index("## Memory"):]
    command = re.search(r"```bash\ntpkit-launch (.*)\n```", section).group(1).split()
    shown = re.search(r"```text\n(.*?)\n```", section, re.S).group(1).splitlines()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert launch.main(command) == 2
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out.splitlines()
    i = 0
    for line in shown:
        if line.strip() == "...":
            continue
        while i < len(out) and out[i] != line:
            i += 1
        assert i < len(out), f"docs/launch.md shows {line!r}, which the command does not print"


@pytest.mark.parametrize("hf", [
    dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
], ids=["llama", "qwen2-tied"])
def test_hf_config_parameters_equal_the_built_llamas(hf):
    """ModelShape.from_hf_config (through tpkit.models.hf) counts what tpkit.models.Llama
    builds at tp=2 on a planned state (SwiGLU's two fc1 halves, Qwen2's q/k/v biases, tied
    embeddings)."""
    from tpkit.models import Llama
    from tpkit.models.hf import config_from_hf
    from tpkit.layout.planning import fake_state
    from tpkit.layout.random import get_rng_tracker, model_parallel_seed
    raw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=300, **hf)
    shape = ModelShape.from_hf_config(raw)
    est = estimate_memory(MemoryJob(model=shape, seq_len=64), ParallelConfig(tp=2),
                          world_size=2)
    with fake_state(ParallelConfig(tp=2), 2) as state:
        model_parallel_seed(1, state)
        try:
            model = Llama(config_from_hf(raw), state)
            n = sum(p.numel() for p in model.parameters())
        finally:
            get_rng_tracker().reset()
    assert est.terms["parameters"] == 4 * n


def test_trainer_llama_job_is_estimated_as_its_model(tmp_path):
    """issue 50: MemoryJob.from_job of a Llama from scratch (--arch llama sizes, or
    --hf-config) has the shape of the LlamaConfig the trainer builds (SwiGLU, its GQA,
    the config.json's vocabulary), read through tpkit.models' own config path."""
    import json

    from tpkit.memory import MemoryJob, ModelShape
    from tpkit.train import parse
    from tpkit.train.arch import llama_config
    from tpkit.train.trainer import model_shape
    sizes = ["--arch", "llama", "--hidden", "64", "--layers", "3", "--heads", "4",
             "--gqa-groups", "2", "--ffn", "96"]
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                               "intermediate_size": 96, "num_hidden_layers": 3,
                               "num_attention_heads": 4, "num_key_value_heads": 2,
                               "vocab_size": 300}))
    for argv in (sizes, ["--hf-config", str(cfg)]):
        job, _ = parse(argv)
        got = model_shape(job)
        assert got == ModelShape.from_llama_config(llama_config(job)), argv
        assert got.gated and got.kv_heads == 2
