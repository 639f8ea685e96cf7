"""The data path's speed and memory: ``python -m bench.data [--gib G] [--mb M]``.

- the loader (``tpkit.data``: ``IndexedDataset`` -> ``WindowSamples`` / ``PackedSamples``
  -> ``Loader`` -> ``token_batch`` / ``packed_batch``) reading a >= 1 GiB indexed dataset
  (uint16, written here, then in the page cache) from end to end: tokens/s, against the
  trainer's own tokens/s at the README's size (``launch/train.py`` at tp=2 x cp=2,
  launched here for a few steps: its last progress line);
- the RSS growth while reading the whole file (VmRSS sampled every 2,000 samples, minus
  VmRSS before the dataset was opened), against 100 MiB;
- ``tpkit-data`` with 2 worker processes on a jsonl file of ``--mb`` MB, against the
  tokenizer's own ``encode_batch`` on the same texts in one process (the limit);
- what a TP/CP rank of a replica pays for a global batch's rows: reading them itself,
  against one rank reading them and a gloo broadcast of the same tokens (2 processes).

Generated files live in a temporary directory removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.common import ROOT, table, write_section

MIB = 2**20


def rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def write_big(prefix: str, gib: float, seed: int = 0) -> int:
    from tpkit.data import IndexedDatasetWriter
    rng = np.random.default_rng(seed)
    total, target = 0, int(gib * 2**30) // 2
    block = rng.integers(0, 50000, 1 << 22, dtype=np.uint16)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        while total < target:
            n = int(rng.integers(200, 4000))
            lo = int(rng.integers(0, len(block) - n))
            w.add_document(block[lo:lo + n])
            total += n
    return total


def read_all(samples, batch, make, global_batch=8, every=2000):
    from tpkit.data import Loader
    ld = Loader(samples, global_batch, seed=0)
    steps = len(samples) // global_batch
    peak, t0, tokens = rss(), time.perf_counter(), 0
    for s in range(steps):
        b = make(next(ld))
        tokens += b[0].numel() if isinstance(b, tuple) else int(b.cu_seqlens[-1])
        if (s * global_batch) % every < global_batch:
            peak = max(peak, rss())
    return tokens / (time.perf_counter() - t0), max(peak, rss())


def trainer_tokens_per_s() -> float:
    cmd = [sys.executable, "-m", "tpkit.cli.launch", "--tp", "2", "--cp", "2",
           os.path.join(ROOT, "launch", "train.py"), "--steps", "12", "--log-every", "4"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    rates = re.findall(r"([\d,]+) tokens/s", out.stdout)
    if out.returncode or not rates:
        raise RuntimeError(f"launch/train.py failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    return float(rates[-1].replace(",", ""))


def tokenizer_case(tmp: str, mb: float):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    rng = np.random.default_rng(1)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), int(rng.integers(2, 9))))
             for _ in range(3000)]
    texts, size = [], 0
    while size < mb * 1e6:
        t = " ".join(rng.choice(words, int(rng.integers(50, 400))))
        texts.append(t)
        size += len(t)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts[:2000], trainers.BpeTrainer(
        vocab_size=8000, special_tokens=["<unk>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    os.makedirs(os.path.join(tmp, "tok"), exist_ok=True)
    tok.save(os.path.join(tmp, "tok", "tokenizer.json"))
    src = os.path.join(tmp, "c.jsonl")
    with open(src, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    t0 = time.perf_counter()
    n = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    limit = n / (time.perf_counter() - t0)
    from tpkit.data.preprocess import parse_args, run
    s = run(parse_args(["--input", src, "--output-prefix", os.path.join(tmp, "c"),
                        "--tokenizer", os.path.join(tmp, "tok"), "--workers", "2",
                        "--log-interval", "1e9"]))
    assert s["tokens"] == n, (s["tokens"], n)
    return s["tokens_per_s"], limit, n, size


def _bcast(rank, port, tokens, out):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    t = torch.zeros(tokens, dtype=torch.int64)
    for _ in range(5):
        dist.broadcast(t, 0)
    times = []
    for _ in range(50):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(t, 0)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(float(np.median(times)))
    dist.destroy_process_group()


def share_vs_read(samples, global_batch=8):
    import multiprocessing as mp
    import socket
    from tpkit.data import Loader, token_batch
    ld = Loader(samples, global_batch, seed=0)
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        token_batch(next(ld))
        times.append(time.perf_counter() - t0)
    read = float(np.median(times))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_bcast, args=(r, port, global_batch * (samples.seq_len + 1),
                                              q)) for r in range(2)]
    for p in procs:
        p.start()
    bcast = q.get(timeout=300)
    for p in procs:
        p.join()
    return read, bcast


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.05)
    ap.add_argument("--mb", type=float, default=20.0)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--no-write", action="store_true", help="print, keep BENCHMARKS.md")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    from tpkit.data import (IndexedDataset, PackedSamples, WindowSamples, packed_batch,
                            token_batch)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        prefix = os.path.join(tmp, "big_text_document")
        n_tok = write_big(prefix, args.gib)
        size = os.path.getsize(prefix + ".bin")
        before = rss()
        ds = IndexedDataset(prefix)
        win = WindowSamples(ds, args.seq_len)
        win_rate, win_peak = read_all(win, token_batch, token_batch)
        packed = PackedSamples(ds, args.seq_len)
        pk_rate, pk_peak = read_all(packed, packed_batch,
                                    lambda rows: packed_batch(rows, multiple=4))
        read, bcast = share_vs_read(win)
        grow = max(win_peak, pk_peak) - before
        print(f"windows {win_rate:,.0f} tok/s, packed {pk_rate:,.0f} tok/s, RSS +"
              f"{grow / MIB:.1f} MiB over {size / 2**30:.2f} GiB; read {read * 1e3:.3f} ms "
              f"vs broadcast {bcast * 1e3:.3f} ms", flush=True)
        cli, limit, n_text, text_bytes = tokenizer_case(tmp, args.mb)
        print(f"tpkit-data {cli:,.0f} tok/s, encode_batch {limit:,.0f}", flush=True)
    train = trainer_tokens_per_s()
    print(f"trainer {train:,.0f} tok/s", flush=True)
    rows = [
        dict(what=f"loader, windows of {args.seq_len} (IndexedDataset -> WindowSamples -> "
                  "Loader -> token_batch), one process", figure=f"{win_rate:,.0f} tokens/s",
             peer_name="launch/train.py at tp=2 x cp=2, README size (4 ranks)",
             peer=f"{train:,.0f} tokens/s", ratio=win_rate / train, target=">= 20"),
        dict(what=f"loader, packed rows of <= {args.seq_len} (PackedSamples -> "
                  "packed_batch)", figure=f"{pk_rate:,.0f} tokens/s",
             peer_name="launch/train.py, same run", peer=f"{train:,.0f} tokens/s",
             ratio=pk_rate / train, target=">= 20"),
        dict(what=f"RSS growth reading all of a {size / 2**30:.2f} GiB indexed dataset "
                  f"({n_tok / 1e6:,.0f} M tokens) twice", figure=f"{grow / MIB:.1f} MiB",
             peer_name="limit", peer="100 MiB", ratio=grow / (100 * MIB), target="<= 1"),
        dict(what=f"tpkit-data, 2 worker processes ({text_bytes / 1e6:.0f} MB jsonl, "
                  f"{n_text / 1e6:.1f} M tokens, BPE 8000)", figure=f"{cli:,.0f} tokens/s",
             peer_name="tokenizers' encode_batch on the same texts, one process (its own "
                       "threads)", peer=f"{limit:,.0f} tokens/s", ratio=cli / limit,
             target="the limit on this machine's cores"),
        dict(what=f"a TP/CP rank's global batch ({8} x {args.seq_len + 1} tokens): every "
                  "rank reads it itself", figure=f"{read * 1e3:.3f} ms",
             peer_name=f"one rank reads it and broadcasts it (gloo, 2 processes: "
                       f"{bcast * 1e3:.3f} ms)", peer=f"{(read + bcast) * 1e3:.3f} ms",
             ratio=read / (read + bcast), target="< 1: each reads"),
    ]
    body = ("The data path of `tpkit.data` (`python -m bench.data`): an indexed dataset of "
            f"{size / 2**30:.2f} GiB written here (uint16, documents of 200-4000 tokens) "
            "and read end to end, once as windows and once packed (both from the page "
            "cache: the file was just written), RSS (VmRSS) sampled every 2,000 samples "
            "against VmRSS before the dataset was opened; `tpkit-data` against the "
            "tokenizer's `encode_batch` on the same texts; the trainer's tokens/s is "
            "launch/train.py's last progress line at the README's size (12 steps, "
            "tp=2 x cp=2, 4 gloo ranks on this machine's cores). 1-minute load average "
            f"at the start and the end: {load0:.1f}, {os.getloadavg()[0]:.1f} (a shared "
            "machine: the ratios move between runs).\n\n" + table(rows))
    if not args.no_write:
        write_section("data", "Data loading and tokenizing (tpkit.data, tpkit-data)", body)
    print(body)


if __name__ == "__main__":
    main()
