"""``tpkit-data``: text to Megatron-Core's indexed dataset, tokenized in worker processes.

    tpkit-data --input corpus.jsonl --output-prefix data/corpus --tokenizer tok/ \\
        [--json-keys text] [--workers N] [--append-eod] [--vocab-size N]

writes ``data/corpus_text_document.bin`` and ``.idx`` (one dataset per json key, named as
Megatron's ``tools/preprocess_data.py`` names them: ``PREFIX_KEY_document``), tokens in
uint16 below 65500 ids, else int32 (Megatron's choice). Input: ``.jsonl``/``.json`` (one
object a line), ``.parquet``, a text file (one document a line) or a saved ``datasets``
directory. Every record is checked (JSON, the fields) before any worker starts; a bad
one stops the command with one line naming the file and line, and nothing is written.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from .indexed import IndexedDatasetWriter, optimal_dtype
from .text import Tokenizer, check_vocabulary, field, read_records

CHUNK = 256          # documents per task sent to a worker
_TOK = None          # the worker's tokenizer
_MAIN_TOK = None     # this process's, with --workers 1


def output_prefix(prefix: str, key: str) -> str:
    """Megatron's name of the dataset of json key ``key``: ``PREFIX_KEY_document``."""
    return f"{prefix}_{key}_document"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="tpkit-data", description="Tokenize text into Megatron-Core's indexed dataset "
        "(PREFIX_KEY_document.bin/.idx), in parallel processes (docs/data.md).")
    ap.add_argument("--input", required=True, nargs="+", metavar="FILE",
                    help=".jsonl/.json, .parquet, .txt (a document a line) or a saved "
                         "datasets directory; several are concatenated in order")
    ap.add_argument("--output-prefix", required=True, metavar="PREFIX")
    ap.add_argument("--tokenizer", required=True, metavar="DIR",
                    help="a local Hugging Face tokenizer: tokenizer.json, or a directory "
                         "with it, or one AutoTokenizer reads offline")
    ap.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                    help="the text fields; one dataset per key (default: text)")
    ap.add_argument("--workers", type=int, default=1, metavar="N",
                    help="tokenizer processes (default 1: this process)")
    ap.add_argument("--append-eod", action="store_true",
                    help="end every document with the tokenizer's end-of-document token")
    ap.add_argument("--vocab-size", type=int, default=None, metavar="N",
                    help="the model's vocabulary: refuse a tokenizer with more tokens")
    ap.add_argument("--log-interval", type=float, default=5.0, metavar="S",
                    help="seconds between progress lines (stderr)")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error(f"--workers={args.workers} must be >= 1")
    return args


def _init_worker(path: str) -> None:
    global _TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # one core per worker
    _TOK = Tokenizer(path)


def _encode(task) -> tuple[np.ndarray, np.ndarray]:
    """One chunk: ``("json", lines, key)`` (raw jsonl lines, checked before) or
    ``("text", texts, None)``, as (all token ids, int32; each document's length)."""
    kind, items, key = task
    texts = [json.loads(line)[key] for line in items] if kind == "json" else items
    ids = (_TOK or _MAIN_TOK).encode_batch(texts)
    lengths = np.fromiter((len(d) for d in ids), np.int64, len(ids))
    flat = np.fromiter((t for d in ids for t in d), np.int32, int(lengths.sum()))
    return flat, lengths


def check_inputs(inputs, keys) -> int:
    """Every record of every input parsed and its fields checked (ValueError naming the
    file and line); the number of documents."""
    n = 0
    for path in inputs:
        m = 0
        for where, rec in read_records(path, keys):
            for k in keys:
                field(where, rec, k)
            m += 1
        if m == 0:
            raise ValueError(f"--input {path}: no records (an empty file); pass a file with "
                             "one document per line")
        n += m
    return n


def _chunks(inputs, key):
    """Tasks for ``_encode``: raw lines of jsonl files (the worker parses them), texts of
    the other inputs."""
    for path in inputs:
        if isinstance(path, str) and path.endswith((".jsonl", ".json")) and \
                os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                buf = []
                for line in f:
                    if line.strip():
                        buf.append(line)
                        if len(buf) == CHUNK:
                            yield "json", buf, key
                            buf = []
                if buf:
                    yield "json", buf, key
            continue
        buf = []
        for where, rec in read_records(path, (key,)):
            buf.append(field(where, rec, key))
            if len(buf) == CHUNK:
                yield "text", buf, None
                buf = []
        if buf:
            yield "text", buf, None


def run(args) -> dict:
    """Tokenize ``args`` (``parse_args``) and write the datasets; the summary's numbers."""
    tok = Tokenizer(args.tokenizer)
    if args.vocab_size is not None:
        check_vocabulary(tok, args.vocab_size, f"--vocab-size")
    if args.append_eod and tok.eod is None:
        raise ValueError(f"--append-eod: tokenizer {args.tokenizer} has no end-of-document "
                         "token (no eos_token, no <|endoftext|> or </s>); drop --append-eod")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise ValueError(f"--output-prefix {args.output_prefix}: directory {out_dir} does not "
                         "exist; create it first")
    t0 = time.perf_counter()   # the summary's rate counts the checks and the pool's start
    total = check_inputs(args.input, args.json_keys)
    dtype = optimal_dtype(tok.vocab_size)
    eod = [tok.eod] if args.append_eod else []
    pool = None
    if args.workers > 1:
        import multiprocessing as mp
        pool = mp.get_context("fork").Pool(args.workers, _init_worker, (args.tokenizer,))
        encode = lambda chunks: pool.imap(_encode, chunks)
    else:
        global _MAIN_TOK
        _MAIN_TOK = tok
        encode = lambda chunks: map(_encode, chunks)
    last = time.perf_counter()
    docs = tokens = 0
    written = []
    try:
        for key in args.json_keys:
            prefix = output_prefix(args.output_prefix, key)
            with IndexedDatasetWriter(prefix, dtype) as w:
                for flat, lengths in encode(_chunks(args.input, key)):
                    if eod:   # the eod after every document
                        ends = np.cumsum(lengths)
                        flat = np.insert(flat, ends, eod[0])
                        lengths = lengths + 1
                    w.add_documents(flat, lengths)
                    tokens += len(flat)
                    docs += len(lengths)
                    now = time.perf_counter()
                    if now - last >= args.log_interval:
                        done = docs / (total * len(args.json_keys))
                        print(f"tpkit-data: [{'#' * int(30 * done):<30}] {100 * done:5.1f}%  "
                              f"{docs:,} documents  {tokens:,} tokens  "
                              f"{tokens / (now - t0):,.0f} tokens/s", file=sys.stderr,
                              flush=True)
                        last = now
            written.append(prefix)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    secs = time.perf_counter() - t0
    return dict(prefixes=written, documents=docs, tokens=tokens, seconds=secs,
                tokens_per_s=tokens / max(secs, 1e-9), workers=args.workers,
                dtype=np.dtype(dtype).name)


def main(argv=None) -> int:
    """The console script: 0 after the summary line, exit 2 with one line on a mistake
    (:func:`run` returns the summary's numbers to Python callers)."""
    args = parse_args(argv)
    try:
        s = run(args)
    except ValueError as e:
        print(f"tpkit-data: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    names = ", ".join(f"{p}.bin/.idx" for p in s["prefixes"])
    print(f"tpkit-data: wrote {names}: {s['documents']:,} documents, {s['tokens']:,} tokens "
          f"({s['dtype']}) in {s['seconds']:.2f} s, {s['tokens_per_s']:,.0f} tokens/s with "
          f"{s['workers']} worker(s)", flush=True)
    return 0
