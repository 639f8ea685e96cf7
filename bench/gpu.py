"""GPU runs: launch/train.py at a GPU-sized config with the torch and TE backends, MFU, TE fp8
vs bf16, and tpkit's overhead against the same TE model written by hand.

    python -m bench.gpu [--steps 30] [--json FILE]     # on a machine with a GPU and TE

Every tpkit figure comes from ``tpkit-launch --nproc-per-node 1 launch/train.py ...`` (the
road users take; tokens/s of the last logged interval, after warm-up). The peer for the
overhead row is a hand-written loop over ``transformer_engine.pytorch.TransformerLayer``
with the same sizes, data, optimizer, clipping, autocast and fp8 recipe, timed in the same
run; the same loop over tpkit/models/gpt.py's GPT (TE blocks) splits the overhead between the
model's own layers and the Fabric path.
Rates are over steps 10..30 (after 10 warm-up steps) in both. The figures are the ones
tpkit's logs report (tpkit.observe): model TFLOP/s per device (model FLOPs per token in the
peers' convention, attention over the full S x S: ``transformer_flops_per_token``) and MFU
against the device's datasheet dense peak (``peak_tflops``: 989.4 TFLOP/s bf16 on an H100
SXM; fp8 runs against the bf16 peak as ``mfu`` and the fp8 peak as ``mfu_fp8``), plus
``of_matmul``: the same TFLOP/s over the bf16 8192^3 matmul rate measured in the same run
(the physical limit of this card as measured, not MFU).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = dict(hidden=2048, layers=16, heads=16, gqa=4, ffn=8192, seq=4096, batch=4, vocab=256)
VARIANTS = {  # name -> train.py arguments beyond the size
    "torch bf16": ["--model.impl", "torch", "--precision", "bf16-mixed"],
    # issue 41's goal: the torch backend compiled (inductor, Triton) >= 1.0x "te bf16"
    "torch bf16 compiled": ["--model.impl", "torch", "--precision", "bf16-mixed",
                            "--compile"],
    "te bf16": ["--model.impl", "te", "--precision", "bf16-mixed"],
    "te fp8": ["--model.impl", "te", "--precision", "fp8", "--fp8-compute-dtype", "bfloat16"],
}


def flops_per_token(s=SIZE) -> float:
    """Model FLOPs per token of SIZE's GPT (GELU MLPs), tpkit.observe's convention."""
    from tpkit.observe import transformer_flops_per_token
    return transformer_flops_per_token(
        hidden_size=s["hidden"], num_layers=s["layers"], num_heads=s["heads"],
        kv_heads=s["gqa"], seq_len=s["seq"], vocab_size=s["vocab"], ffn_hidden_size=s["ffn"])


def figures(tokens_per_s: float, device_name: str, *, fp8: bool, matmul_tflops: float,
            devices: int = 1) -> dict:
    """What the trainer logs for a run at ``tokens_per_s`` on ``devices`` devices named
    ``device_name`` (tflops_per_device, mfu, and mfu_fp8 for fp8 runs), and ``of_matmul``:
    TFLOP/s over the measured matmul rate."""
    from tpkit.observe import mfu, peak_tflops, tflops_per_device
    t = tflops_per_device(tokens_per_s, flops_per_token(), devices)
    out = {"tflops_per_device": t, "mfu": mfu(t, peak_tflops(device_name, "bf16")),
           "of_matmul": t / matmul_tflops}
    if fp8:
        out["mfu_fp8"] = mfu(t, peak_tflops(device_name, "fp8"))
    return out


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


def train_args(steps: int) -> list[str]:
    s = SIZE
    return ["--hidden", str(s["hidden"]), "--layers", str(s["layers"]), "--heads",
            str(s["heads"]), "--gqa-groups", str(s["gqa"]), "--ffn", str(s["ffn"]),
            "--seq-len", str(s["seq"]), "--global-batch", str(s["batch"]), "--steps",
            str(steps), "--log-every", "10", "--lr", "1e-4", "--warmup", "5"]


def run_train(extra: list[str], steps: int, log) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "tpkit.cli.launch", "--nproc-per-node", "1",
           os.path.join(ROOT, "launch", "train.py")] + train_args(steps) + extra
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env)
    log.write(f"$ {' '.join(cmd)}\n{out.stdout}\n{out.stderr[-6000:]}\n")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("step ")]
    if out.returncode != 0 or not lines:
        return {"error": f"exit {out.returncode}: {out.stderr.strip().splitlines()[-1:]}"}
    # progress lines after steps 10, 20, 30, ...: those after the second are 10 warm steps each
    rates = [float(re.search(r"([\d,]+) tokens/s", ln).group(1).replace(",", ""))
             for ln in lines[2:]]
    tps = len(rates) / sum(1.0 / r for r in rates)   # tokens/s over those steps
    losses = [float(re.search(r"loss ([\d.]+)", ln).group(1)) for ln in lines]
    return {"tokens_per_s": tps, "losses": losses, "wall_s": time.perf_counter() - t0}


def hand_model():
    """The same GPT in TE by hand: embedding, TE TransformerLayers, TE RMSNorm, a linear
    head, cross entropy (what a user writes without tpkit)."""
    import torch
    import torch.nn.functional as F
    import transformer_engine.pytorch as te
    s = SIZE
    h, d = s["hidden"], s["hidden"] // s["heads"]

    class HandGPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(s["vocab"], h, device="cuda")
            self.layers = torch.nn.ModuleList(te.TransformerLayer(
                h, s["ffn"], s["heads"], num_gqa_groups=s["gqa"], normalization="RMSNorm",
                bias=False, hidden_dropout=0.0, attention_dropout=0.0, activation="gelu",
                self_attn_mask_type="causal", attn_input_format="sbhd") for _ in range(s["layers"]))
            self.norm = te.RMSNorm(h)
            self.head = torch.nn.Linear(h, s["vocab"], bias=False, device="cuda")
            inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
            f = torch.outer(torch.arange(s["seq"], device="cuda").float(), inv)
            self.register_buffer("freqs", torch.cat([f, f], -1)[:, None, None, :])

        def forward(self, tokens, targets):
            x = self.emb(tokens.t())
            for layer in self.layers:
                x = layer(x, rotary_pos_emb=self.freqs)
            logits = self.head(self.norm(x)).float()
            return F.cross_entropy(logits.reshape(-1, s["vocab"]), targets.t().reshape(-1))

    return HandGPT()


def tpkit_model():
    """tpkit/models/gpt.py's GPT with TE blocks, outside Fabric (tpkit state of one rank)."""
    import tpkit
    from tpkit.models.gpt import GPT, GPTConfig
    if not tpkit.topology.is_initialized():
        tpkit.init_parallel(backend="nccl")
    s = SIZE
    cfg = GPTConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_layers=s["layers"],
                    num_heads=s["heads"], num_gqa_groups=s["gqa"], ffn_hidden_size=s["ffn"],
                    backend="te")
    return GPT(cfg).cuda()


def time_loop(make, fp8: bool, steps: int) -> dict:
    """train.py's step by hand: corpus batch to the GPU, bf16 autocast (+ TE fp8 autocast),
    backward, clip 1.0 with the non-finite check (as fabric.clip_gradients), AdamW, the
    loss read back every step; median step time after a third of the steps."""
    import torch
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling
    from tpkit.train import corpus
    s = SIZE
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    recipe = DelayedScaling()
    data, _ = corpus.split(corpus.tokens())
    times = []
    for step in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x, y = corpus.batch(data, step, s["batch"], s["seq"], seed=1234)
        x, y = x.to("cuda"), y.to("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if fp8:
                with te.autocast(enabled=True, recipe=recipe):
                    loss = model(x, y)
            else:
                loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = sum(times[10:]) / len(times[10:])   # the steps train.py's rows cover
    del model, opt
    torch.cuda.empty_cache()
    return {"tokens_per_s": s["batch"] * s["seq"] / step_s, "step_s": step_s}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=31, help="steps per run (31: 10 warm-up, "
                    "then two logged intervals of 10)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--log", default=os.devnull)
    ap.add_argument("--only", nargs="*", default=None, help="variant names to run")
    args = ap.parse_args(argv)
    import torch
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "size": SIZE, "flops_per_token": flops_per_token(),
           "date": time.strftime("%Y-%m-%d", time.gmtime())}
    try:
        import transformer_engine
        res["te"] = transformer_engine.__version__
    except Exception as exc:  # torch-backend rows still run
        res["te"] = f"unavailable: {exc}"
    res["matmul_tflops"] = matmul_tflops()
    print(json.dumps({"matmul_tflops": res["matmul_tflops"]}), flush=True)
    with open(args.log, "a") as log:
        for name, extra in VARIANTS.items():
            if args.only and name not in args.only:
                continue
            r = run_train(extra, args.steps, log)
            if "tokens_per_s" in r:
                r.update(figures(r["tokens_per_s"], res["device"], fp8="fp8" in name,
                                 matmul_tflops=res["matmul_tflops"]))
            res[f"tpkit {name}"] = r
            print(json.dumps({name: r}), flush=True)
    for (who, make), fp8 in [((w, m), f) for w, m in (("hand te", hand_model),
                                                      ("tpkit gpt in hand loop", tpkit_model))
                             for f in (False, True)]:
        name = f"{who} {'fp8' if fp8 else 'bf16'}"
        if args.only and name not in args.only:
            continue
        try:
            r = time_loop(make, fp8, args.steps)
            r.update(figures(r["tokens_per_s"], res["device"], fp8=fp8,
                             matmul_tflops=res["matmul_tflops"]))
        except Exception as exc:
            r = {"error": f"{type(exc).__name__}: {exc}"}
        res[name] = r
        print(json.dumps({name: r}), flush=True)
    compiled, te = res.get("tpkit torch bf16 compiled", {}), res.get("tpkit te bf16", {})
    if "tokens_per_s" in compiled and "tokens_per_s" in te:
        res["compiled torch / te bf16"] = compiled["tokens_per_s"] / te["tokens_per_s"]
        print(json.dumps({"compiled torch / te bf16 (goal >= 1.0)":
                          res["compiled torch / te bf16"]}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
