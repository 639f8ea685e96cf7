"""Memory of importing a Hugging Face checkpoint: ``hf.from_hf`` at tp=4 on 4 gloo ranks.

    python -m bench.hf [--layers N]

Writes a random Llama checkpoint of about 320 MiB (float32, two safetensors shards and an
index, the layout ``save_pretrained`` writes) and launches 4 ranks with tpkit-launch.
Each rank measures its peak RSS growth (VmHWM after, the peak reset through
/proc/self/clear_refs, minus VmRSS just before) during

- ``hf.from_hf(dir)`` at tp=4, against the bound ``1.2 x (own shard + largest single
  tensor)`` (own shard: the bytes of this rank's parameters; largest tensor: from
  the checkpoint's headers);
- the peer, in the same processes afterwards: reading the whole checkpoint into memory
  (``safetensors.torch.load_file``, each tensor copied out of the mapped file), which is
  what an import that loads the full state dict and then shards it holds at its peak.

RSS counts the checkpoint pages a rank has mapped (safetensors reads through mmap), so
the figure includes them; the files are in the page cache when both are measured.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

MIB = 2**20
TP = 4
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8192,
          "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
          "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
          "max_position_embeddings": 2048}


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        text = f.read()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1)) * 1024
            for k in ("VmRSS", "VmHWM")}


def _growth(fn):
    """(result, peak RSS growth in bytes) of ``fn()``."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                       # VmHWM := VmRSS
    before = _status()["VmRSS"]
    out = fn()
    return out, _status()["VmHWM"] - before


def write_checkpoint(path: str, layers: int) -> dict:
    """A random Llama in two safetensors shards + index; returns {name: bytes}."""
    import torch
    from safetensors.torch import save_file
    from tpkit.models.hf import config_from_hf, expected_shapes
    cfg = dict(CONFIG, num_hidden_layers=layers)
    shapes = expected_shapes(config_from_hf(cfg))
    g = torch.Generator().manual_seed(0)
    names = sorted(shapes)
    halves = [names[:len(names) // 2], names[len(names) // 2:]]
    weight_map, sizes = {}, {}
    for i, half in enumerate(halves):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        tensors = {n: torch.randn(shapes[n], generator=g) * 0.02 for n in half}
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n], sizes[n] = file, t.numel() * t.element_size()
        del tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return sizes


def worker(path: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    import tpkit
    from safetensors.torch import load_file
    from tpkit.models import hf
    from tpkit.models.hf import CheckpointIndex
    state = tpkit.init_parallel(tp=TP)
    index = CheckpointIndex(path)
    largest = max(4 * torch.Size(s).numel() for _, s in index.tensors.values())
    total = sum(4 * torch.Size(s).numel() for _, s in index.tensors.values())
    dist.barrier()
    model, grown = _growth(lambda: hf.from_hf(path, state))
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    dist.barrier()
    files = sorted({f for f, _ in index.tensors.values()})

    def read_all():   # load_file maps the file lazily: copy every tensor into memory
        return {k: v.clone() for f in files for k, v in load_file(f).items()}
    _, full = _growth(read_all)
    with open(os.path.join(out_dir, f"rank{state.rank}.json"), "w") as f:
        json.dump({"rank": state.rank, "from_hf": grown, "own": own, "largest": largest,
                   "total": total, "full_read": full}, f)
    tpkit.destroy_parallel()


def main(argv=None) -> list[dict]:
    from bench.common import ROOT, fmt, table, write_section
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--worker", nargs=2, metavar=("CKPT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(*args.worker)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, out = os.path.join(tmp, "ckpt"), os.path.join(tmp, "out")
        os.makedirs(ckpt)
        os.makedirs(out)
        sizes = write_checkpoint(ckpt, args.layers)
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, "-m", "tpkit.cli.launch", "--nproc-per-node", str(TP),
                        "--tp", str(TP), "-m", "bench.hf", "--worker", ckpt, out],
                       cwd=ROOT, env=env, check=True)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(TP)]
    total = sum(sizes.values())
    rows = []
    for r in ranks:
        bound = 1.2 * (r["own"] + r["largest"])
        rows.append({"what": f"from_hf peak RSS growth, rank {r['rank']} (own shard "
                             f"{fmt(r['own'], 'MiB')})",
                     "figure": fmt(r["from_hf"], "MiB"), "peer": fmt(bound, "MiB"),
                     "peer_name": "1.2 x (own shard + largest tensor)",
                     "ratio": r["from_hf"] / bound, "target": "<= 1"})
    worst = max(ranks, key=lambda r: r["from_hf"])
    rows.append({"what": "from_hf peak RSS growth, worst rank",
                 "figure": fmt(worst["from_hf"], "MiB"), "peer": fmt(worst["full_read"], "MiB"),
                 "peer_name": "the whole checkpoint read into memory, same rank",
                 "ratio": worst["from_hf"] / worst["full_read"], "target": "about 1/tp"})
    body = (f"A random Llama checkpoint of {fmt(total, 'MiB')} (float32, {args.layers} layers, "
            f"hidden {CONFIG['hidden_size']}, vocab {CONFIG['vocab_size']}, two safetensors "
            f"shards; largest tensor {fmt(max(sizes.values()), 'MiB')}) imported at tp={TP} "
            "on 4 gloo ranks (`python -m bench.hf`). Peak RSS growth of each rank during "
            "`hf.from_hf` (VmHWM reset just before), against 1.2 x (its own shard + the "
            "largest single tensor) and against the same rank reading the whole checkpoint "
            "into memory. RSS includes the checkpoint pages a rank maps while reading."
            "\n\n" + table(rows))
    write_section("hf", "Hugging Face import memory", body)
    print(body)
    return rows


if __name__ == "__main__":
    main()
