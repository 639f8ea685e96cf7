"""GPU rows at the Llama-3-8B shape: tpkit's trainer (TE bf16, TE fp8 with current and
delayed scaling, the torch backend compiled) against the same model written by hand on
Transformer Engine, tokens/s, TFLOP/s and MFU, and the memory estimate next to the
measured memory per phase.

    python -m bench.gpu [--budget 400] [--json FILE] [--log FILE] [--only ROW ...]
    python -m bench.gpu --rehearse --json FILE     # CPU: the same rows at a tiny size

The shape: hidden 4096, ffn 14336 (SwiGLU), 32 heads, 8 KV groups, vocabulary 128,256,
sequence 8192, RoPE base 500,000 with Llama 3's scaling, untied head: Llama-3-8B's blocks,
``layers()`` of them: as many as tpkit.memory's estimate fits in 90 % of an 80 GiB GPU
with AdamW at every row's precision. ``GLOBAL_BATCH`` = 8 sequences per step, one per
micro-batch (gradient accumulation over 8, no gradient sync in between).

Every row is a process of its own with its own timeout (a row that fails, runs out of
memory or times out is recorded with its error and the next row runs), in ``ROWS``'
order, the most wanted first; a row is skipped once ``--budget`` cannot hold it. A row
that needs CUDA or Transformer Engine where this process has none is recorded as an
error without starting its process.
``--json`` is rewritten after every row. Each rate covers the same steps: ``window`` (4)
warm-up steps, then ``window`` timed steps (the trainer's second logging window,
``--log-every window``; the hand loop times the same steps the same way, from the end of
the warm-up to a synchronize after the last). Figures per row (tpkit.observe's):
``tokens_per_s``, ``tflops`` (model TFLOP/s per device, the peers' convention:
``flops_per_token``), ``mfu`` against the datasheet dense bf16 peak (H100 SXM 989.4;
fp8 rows also ``mfu_fp8`` against 1978.9), ``of_matmul``: TFLOP/s over the bf16 8192^3
matmul rate measured in the same run (row ``matmul``).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3_8B = dict(hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, seq=8192,
                 rope_theta=500000.0, layers=None, window=4)
TINY = dict(hidden=64, ffn=160, heads=4, kv_heads=2, vocab=512, seq=32, rope_theta=500000.0,
            layers=2, window=1)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
GLOBAL_BATCH = 8
DEVICE_GIB, HEADROOM = 80.0, 0.9
# name -> (kind, arguments, seconds it is given). "tpkit": launch/train.py's arguments
# beyond the size; "hand": the hand-written loop's model and precision; the order is the
# order they run in, the most wanted first
ROWS = {
    "matmul": ("matmul", [], 30),
    "tpkit te bf16": ("tpkit", ["--model.impl", "te", "--precision", "bf16-mixed"], 100),
    "hand te bf16": ("hand", ["te", "bf16"], 90),
    "tpkit te fp8 current": ("tpkit", ["--model.impl", "te", "--precision", "fp8",
                                       "--fp8-recipe", "current",
                                       "--fp8-compute-dtype", "bfloat16"], 100),
    "tpkit te fp8 delayed": ("tpkit", ["--model.impl", "te", "--precision", "fp8",
                                       "--fp8-recipe", "delayed",
                                       "--fp8-compute-dtype", "bfloat16"], 100),
    "tpkit torch compiled": ("tpkit", ["--model.impl", "torch", "--precision", "bf16-mixed",
                                       "--compile"], 150),
    "hand te fp8 delayed": ("hand", ["te", "fp8"], 90),
    # tpkit's Llama in the hand loop: splits tpkit's overhead between the model and Fabric
    "hand loop tpkit llama te bf16": ("hand", ["tpkit", "bf16"], 90),
    # issue 50 item 2: the fused AdamW's gain, against torch's multi-tensor one
    "tpkit te bf16 foreach adamw": ("tpkit", ["--model.impl", "te", "--precision",
                                              "bf16-mixed", "--optimizer-impl", "foreach"],
                                    100),
}
FP8 = ("fp8",)


def layers(device_gib: float = DEVICE_GIB, headroom: float = HEADROOM) -> int:
    """The most Llama-3-8B blocks whose tpkit.memory estimate (AdamW, micro-batch 1 of
    seq 8192, 8 micro-batches, bf16-mixed and fp8) fits ``headroom`` of the device."""
    from tpkit.layout.config import ParallelConfig
    from tpkit.memory import GiB, MemoryJob, ModelShape, estimate_memory
    s, best = LLAMA3_8B, 0
    for n in range(1, 64):
        shape = ModelShape(layers=n, hidden=s["hidden"], ffn=s["ffn"], heads=s["heads"],
                           kv_heads=s["kv_heads"], vocab=s["vocab"], activation="swiglu")
        peak = max(estimate_memory(MemoryJob(model=shape, micro_batch=1, seq_len=s["seq"],
                                             microbatches=GLOBAL_BATCH, precision=p),
                                   ParallelConfig(dp=1)).peak for p in ("bf16-mixed", "fp8"))
        if peak > headroom * device_gib * GiB:
            break
        best = n
    return best


def size(rehearse: bool) -> dict:
    s = dict(TINY if rehearse else LLAMA3_8B)
    if s["layers"] is None:
        s["layers"] = layers()
    return s


def hf_config(s: dict) -> dict:
    """The Hugging Face config.json of size ``s`` (what --hf-config reads)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": s["hidden"], "intermediate_size": s["ffn"],
            "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv_heads"], "vocab_size": s["vocab"],
            "rope_theta": s["rope_theta"], "rope_scaling": dict(LLAMA3_SCALING),
            "max_position_embeddings": max(s["seq"], 8192), "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "hidden_act": "silu"}


def flops_per_token(s: dict) -> float:
    from tpkit.observe import transformer_flops_per_token
    return transformer_flops_per_token(
        hidden_size=s["hidden"], num_layers=s["layers"], num_heads=s["heads"],
        kv_heads=s["kv_heads"], seq_len=s["seq"], vocab_size=s["vocab"],
        ffn_hidden_size=s["ffn"], gated=s.get("gated", True))


def figures(tokens_per_s: float, s: dict, device_name: str, *, fp8: bool,
            matmul_tflops: float | None) -> dict:
    """tflops (per device), mfu (bf16 peak), mfu_fp8 (fp8 rows), of_matmul."""
    from tpkit.observe import mfu, peak_tflops, tflops_per_device
    t = tflops_per_device(tokens_per_s, flops_per_token(s), 1)
    out = {"tflops": t, "mfu": mfu(t, peak_tflops(device_name, "bf16")),
           "of_matmul": t / matmul_tflops if matmul_tflops else None}
    if fp8:
        out["mfu_fp8"] = mfu(t, peak_tflops(device_name, "fp8"))
    return out


def memory_estimate(s: dict, precision: str) -> dict:
    """tpkit.memory's estimate for a row: the peak, its phase, and each phase's GiB."""
    from tpkit.layout.config import ParallelConfig
    from tpkit.memory import GiB, MemoryJob, ModelShape, estimate_memory
    shape = ModelShape(layers=s["layers"], hidden=s["hidden"], ffn=s["ffn"],
                       heads=s["heads"], kv_heads=s["kv_heads"], vocab=s["vocab"],
                       activation="swiglu")
    e = estimate_memory(MemoryJob(model=shape, micro_batch=1, seq_len=s["seq"],
                                  microbatches=GLOBAL_BATCH, precision=precision),
                        ParallelConfig(dp=1))
    return {"peak_gib": e.peak / GiB, "phase": e.phase,
            "phases_gib": {k: v / GiB for k, v in e.phases.items()}}


# --- the rows' parsers ------------------------------------------------------------------------
MEMORY_LINE = re.compile(r"memory after step (\d+): estimated peak ([\d.]+) (GiB|MiB) per "
                         r"rank(?:, measured ([\d.]+) (GiB|MiB) \((\d+)% of the estimate\))?")


def _gib(value: str, unit: str) -> float:
    return float(value) / (1024.0 if unit == "MiB" else 1.0)


def parse_memory_line(text: str) -> dict | None:
    """The trainer's "memory after step N: estimated peak X per rank, measured Y (Z% of
    the estimate)" line as GiB; None when absent."""
    m = MEMORY_LINE.search(text)
    if not m:
        return None
    out = {"after_step": int(m.group(1)), "estimate_gib": _gib(m.group(2), m.group(3))}
    if m.group(4):
        out["measured_gib"] = _gib(m.group(4), m.group(5))
    return out


def parse_metrics(path: str, step: int) -> dict:
    """The row of tpkit.observe's metrics.csv written at ``step`` steps done: tokens/s,
    step time, each phase's seconds, the measured peak; KeyError naming what is missing."""
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("step") and int(float(r["step"])) == step
                and r.get("tokens_per_s")]
    if not rows:
        raise KeyError(f"{path} has no row with tokens_per_s at step {step}")
    r = rows[-1]
    keys = ("tokens_per_s", "step_time_s", "time_data_s", "time_fwd_bwd_s",
            "time_optimizer_s", "loss", "memory_peak_allocated_gib", "memory_peak_rss_gib")
    return {k: float(r[k]) for k in keys if r.get(k) not in (None, "")}


# --- the rows ---------------------------------------------------------------------------------
def tpkit_row(extra: list[str], s: dict, work: str, log, timeout: float,
              rehearse: bool) -> dict:
    """launch/train.py under tpkit-launch at size ``s`` (--hf-config), 2 x window steps."""
    cfg = os.path.join(work, "config.json")
    with open(cfg, "w") as f:
        json.dump(hf_config(s), f)
    logdir = tempfile.mkdtemp(dir=work)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if rehearse and "--compile" in extra:   # inductor's C++ build is minutes on a CPU
        extra = extra + ["--compile-backend", "aot_eager"]
    cmd = [sys.executable, "-m", "tpkit.cli.launch", "--nproc-per-node", "1",
           os.path.join(ROOT, "launch", "train.py"), "--hf-config", cfg,
           "--seq-len", str(s["seq"]), "--global-batch", str(GLOBAL_BATCH),
           "--microbatches", str(GLOBAL_BATCH), "--steps", str(2 * s["window"]),
           "--log-every", str(s["window"]), "--lr", "1e-4", "--warmup", "2",
           "--log-dir", logdir] + extra
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        log.write(f"{e.stdout or ''}\n{(e.stderr or '')[-6000:]}\n[timed out]\n")
        return {"error": f"timed out after {timeout:.0f} s"}
    log.write(f"{out.stdout}\n{out.stderr[-6000:]}\n")
    if out.returncode != 0:
        tail = [ln for ln in out.stderr.strip().splitlines() if ln.strip()][-1:]
        return {"error": f"exit {out.returncode}: {tail}"}
    r = parse_metrics(os.path.join(logdir, "metrics.csv"), 2 * s["window"])
    r["memory"] = parse_memory_line(out.stdout)
    return r


def hand_model(s: dict, which: str):
    """The same Llama by hand on TE ("te": embedding, TE TransformerLayers with RMSNorm,
    SwiGLU, GQA and RoPE, TE RMSNorm, an untied linear head, cross entropy: what a user
    writes without tpkit), or tpkit.models.Llama ("tpkit", TE blocks) outside Fabric."""
    import torch
    import torch.nn.functional as F
    if which == "tpkit":
        import tpkit
        from tpkit.models import Llama
        from tpkit.models.hf import config_from_hf
        if not tpkit.layout.topology.is_initialized():
            tpkit.init_parallel(backend="nccl" if torch.cuda.is_available() else "gloo")
        cfg = config_from_hf(hf_config(s))
        cfg.backend = "te" if torch.cuda.is_available() else "torch"
        return Llama(cfg).to(_device())
    import transformer_engine.pytorch as te
    from tpkit.models.llama import rope_inv_freq
    from tpkit.models.hf import config_from_hf
    h, d = s["hidden"], s["hidden"] // s["heads"]

    class HandLlama(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(s["vocab"], h, device="cuda")
            self.layers = torch.nn.ModuleList(te.TransformerLayer(
                h, s["ffn"], s["heads"], num_gqa_groups=s["kv_heads"], normalization="RMSNorm",
                layernorm_epsilon=1e-5, bias=False, hidden_dropout=0.0, attention_dropout=0.0,
                activation="swiglu", self_attn_mask_type="causal", attn_input_format="sbhd")
                for _ in range(s["layers"]))
            self.norm = te.RMSNorm(h, eps=1e-5)
            self.head = torch.nn.Linear(h, s["vocab"], bias=False, device="cuda")
            inv = rope_inv_freq(config_from_hf(hf_config(s))).to("cuda")
            f = torch.outer(torch.arange(s["seq"], device="cuda").float(), inv)
            self.register_buffer("freqs", torch.cat([f, f], -1)[:, None, None, :])

        def forward(self, tokens, targets):
            x = self.emb(tokens.t())
            for layer in self.layers:
                x = layer(x, rotary_pos_emb=self.freqs)
            logits = self.head(self.norm(x)).float()
            return F.cross_entropy(logits.reshape(-1, s["vocab"]), targets.t().reshape(-1))

    return HandLlama()


def _device():
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _allocated_gib():
    import torch
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def hand_loop(s: dict, which: str, precision: str) -> dict:
    """train.py's step by hand: the corpus batch, GLOBAL_BATCH micro-batches of one
    sequence (bf16 autocast, TE fp8 autocast with delayed scaling for fp8), backward each,
    clip 1.0 with the non-finite check, AdamW (fused on CUDA, as the trainer's), the loss
    read back; 2 x window steps, the last window timed together. Measured peak memory per
    phase of the last step (forward of the first micro-batch, backward of all, optimizer)."""
    import torch
    from tpkit.train import corpus
    dev = _device()
    torch.manual_seed(0)
    model = hand_model(s, which)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=dev.type == "cuda")
    fp8 = precision == "fp8"
    if fp8:
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling
        recipe = DelayedScaling()
    data, _ = corpus.split(corpus.tokens())
    phases = {}

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    t0 = None
    for step in range(2 * s["window"]):
        if step == s["window"]:
            sync()
            t0 = time.perf_counter()
        last = step == 2 * s["window"] - 1
        if last and dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        x, y = corpus.batch(data, step, GLOBAL_BATCH, s["seq"], seed=1234)
        x, y = x.to(dev), y.to(dev)
        for i, (xi, yi) in enumerate(zip(x.chunk(GLOBAL_BATCH), y.chunk(GLOBAL_BATCH))):
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                if fp8:
                    with te.autocast(enabled=True, recipe=recipe):
                        loss = model(xi, yi) / GLOBAL_BATCH
                else:
                    loss = model(xi, yi) / GLOBAL_BATCH
            if last and i == 0:
                phases["forward"] = _allocated_gib()
            loss.backward()
        if last:
            phases["backward"] = _allocated_gib()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        if last:
            phases["optimizer"] = _allocated_gib()
    sync()
    wall = time.perf_counter() - t0
    return {"tokens_per_s": s["window"] * GLOBAL_BATCH * s["seq"] / wall,
            "step_time_s": wall / s["window"],
            "memory": {"measured_gib_by_phase": phases if dev.type == "cuda" else None}}


def matmul_tflops() -> float:
    """bf16 8192^3 matmul rate, median of 10 after 3 warm-ups (random data)."""
    import torch
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(13):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * 8192 ** 3 / times[len(times) // 2] / 1e12


def child(name: str, s: dict, out: str) -> None:
    """Run row ``name`` (a hand or matmul row) in this process; its dict to ``out``."""
    kind, args, _ = ROWS[name]
    import torch
    if not torch.cuda.is_available() and (kind == "matmul" or args[0] == "te"):
        raise RuntimeError(f"row {name!r} needs CUDA (torch.cuda.is_available() is False)")
    r = {"matmul_tflops": matmul_tflops()} if kind == "matmul" else \
        hand_loop(s, args[0], args[1])
    with open(out, "w") as f:
        json.dump(r, f)


def unavailable(kind: str, args: list[str], cuda: bool, te: str) -> str | None:
    """Why a row cannot run on this machine, recorded without starting its process (on a
    CPU a row's process would only import torch and Lightning to say the same); None when
    it can run. ``te``: the version, or why ``import transformer_engine`` failed here."""
    needs_te = (kind == "hand" and args[0] == "te") or (
        kind == "tpkit" and "--model.impl" in args and
        args[args.index("--model.impl") + 1] == "te")
    needs_cuda = kind == "matmul" or needs_te          # TE does not run on a CPU
    if needs_cuda and not cuda:
        return "needs CUDA (torch.cuda.is_available() is False)"
    if needs_te and te.startswith("unavailable"):
        return f"needs Transformer Engine ({te})"
    return None


def child_row(name: str, s: dict, work: str, log, timeout: float) -> dict:
    out = os.path.join(work, "row.json")
    if os.path.exists(out):
        os.remove(out)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "bench.gpu", "--child", name, "--size", json.dumps(s),
           "--child-out", out]
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        log.write(f"{e.stdout or ''}\n{(e.stderr or '')[-6000:]}\n[timed out]\n")
        return {"error": f"timed out after {timeout:.0f} s"}
    log.write(f"{p.stdout}\n{p.stderr[-6000:]}\n")
    if p.returncode != 0 or not os.path.exists(out):
        tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()][-1:]
        return {"error": f"exit {p.returncode}: {tail}"}
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=400.0, help="seconds for all rows")
    ap.add_argument("--json", default=None, help="rewritten after every row")
    ap.add_argument("--log", default=os.devnull, help="the rows' own output")
    ap.add_argument("--only", nargs="*", default=None, help="row names to run")
    ap.add_argument("--rehearse", action="store_true", help="CPU: a tiny Llama, same rows")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--size", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, json.loads(args.size), args.child_out)
        return {}
    t_start = time.monotonic()
    import torch
    s = size(args.rehearse)
    cuda = torch.cuda.is_available()
    res = {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()),
           "size": s, "global_batch": GLOBAL_BATCH, "micro_batch": 1,
           "timed_steps": f"{s['window'] + 1}..{2 * s['window']} after {s['window']} warm-up",
           "flops_per_token": flops_per_token(s), "budget_s": args.budget,
           "memory_estimate": {p: memory_estimate(s, p) for p in ("bf16-mixed", "fp8")},
           "rows": {}}
    try:
        import transformer_engine
        res["te"] = transformer_engine.__version__
    except Exception as exc:   # the torch rows still run
        res["te"] = f"unavailable: {type(exc).__name__}: {exc}"

    def save():
        res["elapsed_s"] = round(time.monotonic() - t_start, 1)
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(res, f, indent=1)
            os.replace(tmp, args.json)

    save()
    matmul = None
    with open(args.log, "a") as log, tempfile.TemporaryDirectory() as work:
        for name, (kind, extra, seconds) in ROWS.items():
            if args.only and name not in args.only:
                continue
            left = args.budget - (time.monotonic() - t_start)
            why = unavailable(kind, extra, cuda, res["te"])
            if why:
                r = {"error": why}
            elif left < min(seconds, 30):
                r = {"skipped": f"budget: {left:.0f} s left of {args.budget:.0f}"}
            else:
                t = time.monotonic()
                timeout = min(seconds, left) if cuda else left
                try:
                    r = tpkit_row(extra, s, work, log, timeout, args.rehearse) \
                        if kind == "tpkit" else child_row(name, s, work, log, timeout)
                except Exception as exc:   # a parser's: recorded, the next row runs
                    r = {"error": f"{type(exc).__name__}: {exc}"}
                r["wall_s"] = round(time.monotonic() - t, 1)
                if kind == "matmul" and "matmul_tflops" in r:
                    matmul = res["matmul_tflops"] = r["matmul_tflops"]
                if "tokens_per_s" in r:
                    fp8 = "fp8" in name
                    r.update(figures(r["tokens_per_s"], s, res["device"], fp8=fp8,
                                     matmul_tflops=matmul))
                    r.setdefault("memory", {})
                    if r["memory"] is not None:
                        r["memory"]["estimate"] = res["memory_estimate"][
                            "fp8" if fp8 else "bf16-mixed"]["peak_gib"]
            res["rows"][name] = r
            print(json.dumps({name: r}), flush=True)
            save()
    rows = res["rows"]

    def ratio(a, b):
        ta, tb = rows.get(a, {}).get("tokens_per_s"), rows.get(b, {}).get("tokens_per_s")
        return ta / tb if ta and tb else None

    res["ratios"] = {"tpkit torch compiled / tpkit te bf16 (goal >= 1.0)":
                     ratio("tpkit torch compiled", "tpkit te bf16"),
                     "tpkit te bf16 / hand te bf16 (goal >= 0.98)":
                     ratio("tpkit te bf16", "hand te bf16"),
                     "hand loop tpkit llama / hand te bf16":
                     ratio("hand loop tpkit llama te bf16", "hand te bf16"),
                     "fused / foreach AdamW (tpkit te bf16)":
                     ratio("tpkit te bf16", "tpkit te bf16 foreach adamw")}
    print(json.dumps(res["ratios"]), flush=True)
    save()
    return res


if __name__ == "__main__":
    main()
