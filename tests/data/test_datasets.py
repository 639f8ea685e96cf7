"""tpkit.data's datasets (issue 36): Megatron-Core's indexed format against the megatron-core
package itself (both directions, byte for byte), flat token files, Hugging Face sources
with a tiny BPE trained here, the tpkit-data command, samples (windows, packing, blend,
split), SFT loss masks at cp=2 with packing against a reference written here, the
layout-independent order resumed at another dp, and the bad-input rows of the datasets."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from typing import Callable

import numpy as np
import pytest
import torch

import paths
from dist import run

WORDS = ("the quick brown fox jumps over a lazy dog while tensor sequence context and data "
         "parallel ranks pipeline their micro batches").split()


def _texts(n, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(lo, hi)))) for _ in range(n)]


def make_tokenizer(directory, vocab_size: int = 300) -> str:
    """A byte-level BPE of ``vocab_size`` tokens trained here (no download), with
    <|endoftext|>, saved as DIRECTORY/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_texts(300, seed=1), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(os.path.join(str(directory), "tokenizer.json"))
    return str(directory)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _ref_encode(tok_dir, texts):
    """The reference tokenization: the tokenizers library itself, no tpkit."""
    from tokenizers import Tokenizer
    t = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    return [e.ids for e in t.encode_batch(texts, add_special_tokens=False)], \
        t.token_to_id("<|endoftext|>")


def _jsonl(path, recs):
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _megatron():
    """megatron-core's IndexedDataset module; skipped where it cannot be installed, but
    never under CI (it is in the test extra)."""
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
        return indexed_dataset
    except ImportError as e:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"megatron-core is not installed ({e}); pip install megatron-core")


def _megatron_helpers():
    """megatron-core's compiled helpers (blend indices), as _megatron()."""
    _megatron()
    from megatron.core.datasets import helpers_cpp
    return helpers_cpp


# --- Megatron-Core's indexed format ------------------------------------------------------
DOCS = [[5, 6, 7], [300, 1], [9] * 10, [70000 % 65000, 2, 3, 4, 5]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_indexed_format_against_megatron_core(tmp_path, dtype):
    """tpkit writes what Megatron's IndexedDatasetBuilder writes (the same bytes), Megatron
    reads tpkit's files and tpkit reads Megatron's, token for token, documents of one and
    of several sequences."""
    mi = _megatron()
    from tpkit.data import IndexedDataset, IndexedDatasetWriter
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    with IndexedDatasetWriter(ours, dtype) as w:
        for i, d in enumerate(DOCS):
            w.add_document(d, [2, len(d) - 2] if i == 2 else None)
    b = mi.IndexedDatasetBuilder(theirs + ".bin", dtype=dtype)
    for i, d in enumerate(DOCS):
        b.add_document(torch.tensor(d), [2, len(d) - 2] if i == 2 else [len(d)])
    b.finalize(theirs + ".idx")
    for ext in (".bin", ".idx"):
        assert open(ours + ext, "rb").read() == open(theirs + ext, "rb").read(), ext
    m = mi.IndexedDataset(ours)                       # Megatron reads tpkit's
    seqs = [d[:2] if i == 2 else d for i, d in enumerate(DOCS)]
    seqs.insert(3, DOCS[2][2:])
    assert [m[i].tolist() for i in range(len(m))] == seqs
    assert m.document_indices.tolist() == [0, 1, 2, 4, 5]
    assert m[0].dtype == dtype
    t = IndexedDataset(theirs)                        # tpkit reads Megatron's
    assert [t.document(i).tolist() for i in range(len(t))] == DOCS
    assert t.lengths.tolist() == [len(d) for d in DOCS]
    assert t.get(3, 1, 3).tolist() == m.get(3, 1, 3).tolist()


# --- flat token files ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_documents(tmp_path, dtype):
    from tpkit.data import TokenFile
    eod = 50
    flat = [1, 2, eod, 3, eod, 4, 5, 6, eod, 7]          # nanoGPT: eod after each document
    path = tmp_path / "train.bin"
    np.asarray(flat, dtype).tofile(path)
    tf = TokenFile(str(path), dtype, eod=eod)
    assert [tf.document(i).tolist() for i in range(len(tf))] == \
        [[1, 2, eod], [3, eod], [4, 5, 6, eod], [7]]
    assert [TokenFile(str(path), dtype).document(0).tolist()] == [flat]


# --- text sources ---------------------------------------------------------------------------
def test_text_sources_tokenize_like_the_tokenizer(tmp_path, tok_dir):
    """jsonl, parquet, text lines, a saved datasets directory, a datasets.Dataset and a
    streaming one give the documents the tokenizers library gives, plus the eod token."""
    import datasets
    from tpkit.data import Tokenizer, text_documents
    texts = _texts(20)
    ref, eod = _ref_encode(tok_dir, texts)
    want = [r + [eod] for r in ref]
    ds = datasets.Dataset.from_dict({"text": texts})
    ds.to_parquet(str(tmp_path / "c.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "c.txt").write_text("\n".join(texts) + "\n")
    sources = [_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts]),
               str(tmp_path / "c.parquet"), str(tmp_path / "c.txt"), str(tmp_path / "saved"),
               ds]
    sources.append(datasets.load_dataset("json", data_files=sources[0], split="train",
                                         streaming=True))          # an IterableDataset
    tok = Tokenizer(tok_dir)
    assert (tok.vocab_size, tok.eod) == (300, eod)
    for src in sources:
        docs = text_documents(src, tok)
        assert [docs.document(i).tolist() for i in range(len(docs))] == want, src
    # a directory transformers' AutoTokenizer reads offline (vocab.json + merges.txt, no
    # tokenizer.json): the same ids
    from tokenizers import Tokenizer as _T
    slow = tmp_path / "slow"
    slow.mkdir()
    _T.from_file(os.path.join(tok_dir, "tokenizer.json")).model.save(str(slow))
    (slow / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>",
         "unk_token": "<unk>", "bos_token": "<|endoftext|>"}))
    auto = Tokenizer(str(slow))
    assert auto._hf is not None and (auto.vocab_size, auto.eod) == (300, eod)
    docs = text_documents(sources[0], auto)
    assert [docs.document(i).tolist() for i in range(len(docs))] == want


# --- samples --------------------------------------------------------------------------------
def _docs(lengths, seed=0):
    from tpkit.data import TokenizedDocuments
    rng = np.random.default_rng(seed)
    return TokenizedDocuments([rng.integers(1, 1000, n).tolist() for n in lengths])


def test_windows_are_consecutive_slices_of_the_shuffled_concatenation():
    from tpkit.data import WindowSamples, token_batch
    docs = _docs([5, 17, 1, 9, 30, 2, 11])
    ws = WindowSamples(docs, 8, seed=3)
    order = sorted(range(len(docs)), key=lambda i: list(ws.order).index(i))
    assert sorted(order) == list(range(len(docs))) and order != list(range(len(docs)))
    concat = np.concatenate([docs.document(i) for i in ws.order])
    assert len(ws) == (len(concat) - 1) // 8
    for k in range(len(ws)):
        (tok, mask), = ws.sample(k)
        assert tok.tolist() == concat[8 * k:8 * k + 9].tolist() and mask is None
    x, y = token_batch([ws.sample(0), ws.sample(2)])
    assert x.shape == y.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1])


def test_packing_keeps_every_document_once_in_rows_of_at_most_seq_len():
    from tpkit.data import PackedSamples, count_targets, packed_batch
    lengths = [5, 17, 1, 9, 30, 2, 11, 16]
    docs = _docs(lengths)
    ps = PackedSamples(docs, 16, seed=1)
    seen = []
    for k in range(len(ps)):
        segs = ps.sample(k)
        assert sum(len(t) for t, _ in segs) <= 16
        seen += [t.tolist() for t, _ in segs]
    # documents longer than 16 come in pieces of 16, in order; all others whole
    want = []
    for i in range(len(docs)):
        d = docs.document(i).tolist()
        want += [d[j:j + 16] for j in range(0, len(d), 16)]
    assert sorted(seen) == sorted(want)
    assert len(ps) < len(want)                         # short documents share rows
    pb = packed_batch([ps.sample(0), ps.sample(1)], multiple=4)
    segs = ps.sample(0) + ps.sample(1)
    assert pb.cu_seqlens.tolist()[-1] == sum(len(t) for t, _ in segs)
    assert count_targets([ps.sample(0), ps.sample(1)]) == int((pb.labels != -100).sum()) == \
        sum(len(t) - 1 for t, _ in segs)


def test_blend_is_megatrons():
    """The dataset and sample index of every blended sample are those of Megatron-Core's
    own build_blending_indices (its C++ helper), for 2 and 3 datasets; after i samples,
    set j has drawn within one of w_j * i."""
    from tpkit.data import Blend, WindowSamples
    a, b = WindowSamples(_docs([40] * 5, 1), 4), WindowSamples(_docs([40] * 5, 2), 4)
    bl = Blend([a, b], [1, 3], size=200)
    counts = np.zeros(2)
    for i in range(200):
        counts[bl.which[i]] += 1
        assert np.all(np.abs(counts - np.array([0.25, 0.75]) * (i + 1)) <= 1)
    helpers = _megatron_helpers()

    class Big:                                       # a sample set of n samples
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n
    for weights, n in (([0.3, 0.7], 5000), ([2.0, 1.0, 7.0], 7000)):
        w = np.asarray(weights) / sum(weights)
        ds_index, ds_sample = np.zeros(n, np.int16), np.zeros(n, np.int64)
        helpers.build_blending_indices(ds_index, ds_sample, w, len(w), n, False)
        ours = Blend([Big(n) for _ in w], weights, size=n)
        assert np.array_equal(ours.which, ds_index) and np.array_equal(ours.index, ds_sample)
    first_b = int(np.flatnonzero(bl.which == 1)[5])
    assert bl.sample(first_b)[0][0].tolist() == b.sample(5)[0][0].tolist()


def test_split_and_build_data_with_a_blend(tmp_path, tok_dir):
    """Megatron's 'W1 P1 W2 P2' over an indexed dataset and a jsonl file, split 80/20 by
    documents: the validation documents never appear in training samples."""
    from tpkit.data import IndexedDatasetWriter, build_data, check_data, split_documents
    texts = _texts(50, seed=4)
    ref, eod = _ref_encode(tok_dir, texts)
    with IndexedDatasetWriter(str(tmp_path / "a"), np.uint16) as w:
        for r in ref:
            w.add_document(r + [eod])
    other = _texts(30, seed=5)
    src = _jsonl(tmp_path / "b.jsonl", [{"text": t} for t in other])
    train, valid = split_documents(_docs([3] * 10), "80,20")
    assert (train.indices.tolist(), valid.indices.tolist()) == (list(range(8)), [8, 9])
    assert check_data(f"0.3 {tmp_path / 'a'} 0.7 {src}", split="80,20", tokenizer=tok_dir,
                      vocab_size=300) == 300
    data = build_data(f"0.3 {tmp_path / 'a'} 0.7 {src}", seq_len=16, global_batch=4,
                      split="80,20", pack=True, tokenizer=tok_dir, vocab_size=300)
    assert data.vocab_size == 300
    held = {tuple(r + [eod]) for r in ref[40:] + _ref_encode(tok_dir, other[24:])[0]}
    seen = 0
    for _ in range(10):
        for sample in next(data.train):
            for tok, _ in sample:   # a held document would come as a first piece somewhere
                assert not any(tuple(tok.tolist()) == h[:len(tok)] for h in held)
                seen += 1
    assert seen >= 40
    n_valid = sum(len(s) for s in next(data.valid_batches()))
    assert n_valid > 0
    # a nanoGPT token file through the same call: windows over its documents
    flat = [t for r in ref for t in r + [eod]]
    np.asarray(flat, np.uint16).tofile(tmp_path / "train.bin")
    data = build_data(str(tmp_path / "train.bin"), seq_len=8, global_batch=2, split="90,10",
                      tokenizer=tok_dir)
    x, y = data.batch(next(data.train))
    assert x.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1])
    assert len(data.train.samples.source) == 45       # 90 % of the 50 documents


# --- order and resume -----------------------------------------------------------------------
def test_dp_rows_split_every_micro_batch_over_the_dp_ranks():
    """Micro-batch i is global rows [i*G/m, (i+1)*G/m) at every dp; each rank holds a
    contiguous G/(m*dp) of it, ranks in order."""
    from tpkit.data import dp_rows
    G, m = 24, 3
    for dp in (1, 2, 4):
        per_rank = [dp_rows(G, r, dp, m).reshape(m, -1) for r in range(dp)]
        for i in range(m):
            assert np.concatenate([p[i] for p in per_rank]).tolist() == \
                list(range(i * G // m, (i + 1) * G // m))


def test_resume_at_another_dp_continues_the_uninterrupted_order():
    """k steps at dp=2 (both ranks simulated), the position saved, resumed at dp=4: each
    later step's rows, gathered over the ranks, are the uninterrupted dp=1 run's."""
    from tpkit.data import Loader, WindowSamples
    samples = WindowSamples(_docs([37] * 20), 8)           # 92 samples: epochs wrap
    G, k, later = 8, 7, 20

    def step_rows(loaders):
        rows = [i for ld in loaders for i in ld.indices()]
        for ld in loaders:
            next(ld)
        return rows

    whole = Loader(samples, G, seed=5)
    ref = [step_rows([whole]) for _ in range(k + later)]
    assert sorted(ref[0]) != ref[0] and len(set(ref[0])) == G
    dp2 = [Loader(samples, G, seed=5, dp_rank=r, dp_size=2) for r in range(2)]
    first = [step_rows(dp2) for _ in range(k)]
    saved = json.loads(json.dumps(dp2[0].state_dict()))   # as a checkpoint stores it
    assert saved == dp2[1].state_dict()
    dp4 = [Loader(samples, G, seed=5, dp_rank=r, dp_size=4) for r in range(4)]
    for ld in dp4:
        ld.load_state_dict(saved)
    assert first + [step_rows(dp4) for _ in range(later)] == ref
    # step-indexed, no saved state: step s's rows are at stream position s * G
    fresh = [Loader(samples, G, seed=5, dp_rank=r, dp_size=4) for r in range(4)]
    assert [i for ld in fresh for i in ld.indices(k * G)] == ref[k]
    assert [s[0][0].tolist() for s in fresh[0].at(3 * G, range(G))] == \
        [samples.sample(i)[0][0].tolist() for i in ref[3]]
    # what a rank reads is those rows' samples
    ld = Loader(samples, G, seed=5, dp_rank=3, dp_size=4)
    ld.load_state_dict(saved)
    assert [s[0][0].tolist() for s in next(ld)] == \
        [samples.sample(i)[0][0].tolist() for i in ref[k][6:8]]


# --- SFT masks at cp=2 with packing ---------------------------------------------------------
SFT = [{"prompt": "the quick brown fox", "response": " jumps over a lazy dog"},
       {"messages": [{"role": "user", "content": "tensor and data"},
                     {"role": "assistant", "content": "parallel ranks"},
                     {"role": "user", "content": "pipeline"},
                     {"role": "assistant", "content": "micro batches"}]},
       {"prompt": "a", "response": " dog while the fox"},
       {"prompt": "sequence context parallel ranks", "response": " the"}]


def _sft_reference(tok_dir):
    """Each record's tokens and target flags, written here from the tokenizers library:
    a position is a target iff its token belongs to a response / an assistant message
    (or is the final eod)."""
    from tokenizers import Tokenizer
    t = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    enc = lambda s: t.encode(s, add_special_tokens=False).ids
    eod = t.token_to_id("<|endoftext|>")
    out = []
    for r in SFT:
        parts = [(r["prompt"], 0), (r["response"], 1)] if "prompt" in r else \
            [(f"<|{m['role']}|>\n{m['content']}\n", m["role"] == "assistant")
             for m in r["messages"]]
        toks, flags = [], []
        for text, learn in parts:
            ids = enc(text)
            toks += ids
            flags += [bool(learn)] * len(ids)
        out.append((toks + [eod], flags + [True]))
    return out


def _sft_rank(tok_dir, path):
    import torch.nn.functional as F
    import tpkit
    from tpkit.cp import packed_cp_indices
    from tpkit.data import PackedSamples, packed_batch, sft_documents
    st = tpkit.init_parallel(cp=2)
    docs = sft_documents(path, tok_dir)
    ps = PackedSamples(docs, 256, seed=0)
    assert len(ps) == 1
    row = packed_batch([ps.sample(0)], state=st)
    local = row.shard(st)
    g = torch.Generator().manual_seed(0)
    table = torch.randn(300, 300, generator=g, dtype=torch.float64)
    pos = torch.randn(256, 300, generator=g, dtype=torch.float64)
    logits = (table[local.tokens] + pos[local.position_ids]).requires_grad_()
    loss = F.cross_entropy(logits, local.labels, ignore_index=-100, reduction="sum")
    loss.backward()
    idx = packed_cp_indices(row.cu_seqlens_padded, st.cp_rank, st.cp_size)
    segs = [t.tolist() for t, _ in ps.sample(0)]
    return (loss.item(), idx.tolist(), logits.grad.abs().sum(1).tolist(), segs,
            row.cu_seqlens_padded.tolist())


def test_sft_prompt_tokens_have_zero_loss_weight_at_cp2_packed(tmp_path, tok_dir):
    """At cp=2 over one packed row of four SFT documents: the loss summed over the CP ranks
    equals the reference's (positions predicting a target token only), and the gradient of
    every position predicting a prompt token is exactly zero."""
    import torch.nn.functional as F
    path = _jsonl(tmp_path / "sft.jsonl", SFT)
    ref = {tuple(t): f for t, f in _sft_reference(tok_dir)}
    res = run(_sft_rank, 2, tok_dir, path, timeout=240)
    segs, cup = res[0][3], res[0][4]
    assert sorted(map(tuple, segs)) == sorted(ref)
    g = torch.Generator().manual_seed(0)
    table = torch.randn(300, 300, generator=g, dtype=torch.float64)
    pos = torch.randn(256, 300, generator=g, dtype=torch.float64)
    want, weight = 0.0, {}                     # weight: row index -> does it predict a target
    for d, toks in enumerate(segs):
        flags = ref[tuple(toks)]
        for j in range(1, len(toks)):
            weight[cup[d] + j - 1] = flags[j]
            if flags[j]:
                want += F.cross_entropy((table[toks[j - 1]] + pos[j - 1])[None],
                                        torch.tensor([toks[j]]), reduction="sum").item()
    assert abs(sum(r[0] for r in res) - want) < 1e-9 * max(1.0, want)
    checked = 0
    for _, idx, grad, _, _ in res:
        for i, gsum in zip(idx, grad):
            if i in weight:
                assert (gsum == 0.0) == (not weight[i]), (i, gsum, weight[i])
                checked += 1
    assert checked == len(weight) and 0 < sum(weight.values()) < len(weight)


def _sft_model_loss(tp, cp, tok_dir, path):
    """The token-mean loss of one global batch of packed SFT rows (build_data, dp x cp x tp
    from the pool's world) through the reference GPT (tpkit.models.GPT), weights drawn at
    full shape from one seed and sharded in (the same model at every layout)."""
    import torch.distributed as dist
    import tpkit
    from tpkit.checkpoint import full_shapes, load_full_state_dict
    from tpkit.data import build_data, count_targets
    from tpkit.models import GPT, GPTConfig
    st = tpkit.init_parallel(tp=tp, cp=cp)
    model = GPT(GPTConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=4,
                          num_gqa_groups=2, ffn_hidden_size=64), st)
    g = torch.Generator().manual_seed(0)
    load_full_state_dict(model, {n: torch.randn(s, generator=g) * 0.2
                                 for n, s in sorted(full_shapes(model).items())})
    data = build_data(path, format="sft", tokenizer=tok_dir, seq_len=48, global_batch=2,
                      pack=True, split="100,0", state=st, vocab_size=300)
    rows = next(data.train)
    local = data.batch(rows, st).shard(st)
    loss = model(local.tokens, local.labels, local.position_ids, **local.attention_kwargs())
    stats = torch.tensor([loss.item(), float(count_targets(rows))], dtype=torch.float64)
    dist.all_reduce(stats[:1], group=st.cp_group)      # every token's loss, once per replica
    dist.all_reduce(stats, group=st.dp_group)
    return (stats[0] / stats[1]).item()


def test_sft_packed_loss_through_a_model_is_the_same_at_dp2_cp2(tmp_path, tok_dir):
    """build_data's packed SFT rows through a real model: the token-mean loss at
    dp=2 x cp=2 (4 ranks: each DP rank its own rows, each CP rank its shard of them)
    equals the single-process one (1e-5). (TP over packed rows: tests/nn/test_packed.py.)"""
    path = _jsonl(tmp_path / "sft.jsonl", SFT * 3)
    (ref,) = run(_sft_model_loss, 1, 1, 1, tok_dir, path, timeout=240)
    res = run(_sft_model_loss, 4, 1, 2, tok_dir, path, timeout=240)
    assert all(abs(r - ref) <= 1e-5 * abs(ref) for r in res), (res, ref)


# --- bad input (one line naming the value and the fix each) ---------------------------------
@dataclasses.dataclass
class Row:
    id: str
    value: str
    fix: str
    call: Callable


def _indexed(tmp, cut_idx=0, cut_bin=0):
    from tpkit.data import IndexedDataset, IndexedDatasetWriter
    with IndexedDatasetWriter(str(tmp / "d"), np.uint16) as w:
        for d in DOCS:
            w.add_document(d)
    for ext, cut in ((".idx", cut_idx), (".bin", cut_bin)):
        if cut:
            data = open(tmp / f"d{ext}", "rb").read()
            open(tmp / f"d{ext}", "wb").write(data[:-cut])
    return IndexedDataset(str(tmp / "d"))


def _patch(path, offset, data):
    raw = bytearray(open(path, "rb").read())
    raw[offset:offset + len(data)] = data
    open(path, "wb").write(bytes(raw))


def _indexed_open(tmp):
    return __import__("tpkit.data").data.IndexedDataset(str(tmp / "d"))


def _cut(path, n):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-n])


def _check(path, **kw):
    return __import__("tpkit.data").data.check_data(path, **kw)


def _write_tokens(tmp, tokens, dtype="uint16"):
    np.asarray(tokens, dtype).tofile(tmp / "train.bin")
    return str(tmp / "train.bin")


def _cli(*argv):
    from tpkit.data.preprocess import parse_args, run as run_cli
    return lambda tmp, tok: run_cli(parse_args([a.format(tmp=tmp, tok=tok) for a in argv]))


BAD = [
    Row("truncated-idx", "d.idx: 117 bytes, but its header announces 4 sequences",
        "truncated: rewrite",
        lambda tmp, tok: _indexed(tmp, cut_idx=5)),
    Row("idx-header-only", "shorter than the 34-byte header", "rewrite it",
        lambda tmp, tok: _indexed(tmp, cut_idx=90)),
    Row("short-bin", "d.bin: 38 bytes", "truncated or belongs to another index",
        lambda tmp, tok: _indexed(tmp, cut_bin=2)),
    Row("idx-pointers", "d.idx: its sequence pointers are not the sequences laid back to "
        "back", "the index is corrupt", lambda tmp, tok: (_indexed(tmp), _patch(
            tmp / "d.idx", 34 + 4 * 4 + 8, np.int64(7).tobytes()), _indexed_open(tmp))),
    Row("vocab-mismatch", "has 300 tokens but the model has vocab_size=256",
        "use the model's own tokenizer",
        lambda tmp, tok: __import__("tpkit.data").data.build_data(
            _jsonl(tmp / "c.jsonl", [{"text": "the fox"}] * 4), seq_len=4, global_batch=2,
            tokenizer=tok, vocab_size=256)),
    Row("cli-vocab-mismatch", "has 300 tokens but --vocab-size has vocab_size=256",
        "use the model's own tokenizer",
        lambda tmp, tok: (_jsonl(tmp / "c.jsonl", [{"text": "a"}]), _cli(
            "--input", "{tmp}/c.jsonl", "--output-prefix", "{tmp}/o", "--tokenizer", "{tok}",
            "--vocab-size", "256")(tmp, tok))),
    Row("missing-field", "c.jsonl:3: no field 'text' (it has ['body'])", "--json-keys",
        lambda tmp, tok: (_jsonl(tmp / "c.jsonl", [{"text": "a"}] * 2 + [{"body": "b"}]),
                          _cli("--input", "{tmp}/c.jsonl", "--output-prefix", "{tmp}/o",
                               "--tokenizer", "{tok}", "--workers", "2")(tmp, tok))),
    Row("bad-json", "c.jsonl:2: not a JSON object", "one JSON object per line",
        lambda tmp, tok: ((tmp / "c.jsonl").write_text('{"text": "a"}\n{"text": \n'),
                          _cli("--input", "{tmp}/c.jsonl", "--output-prefix", "{tmp}/o",
                               "--tokenizer", "{tok}")(tmp, tok))),
    Row("empty-input", "c.jsonl: no records", "pass a file with one document per line",
        lambda tmp, tok: ((tmp / "c.jsonl").write_text("\n"), _cli(
            "--input", "{tmp}/c.jsonl", "--output-prefix", "{tmp}/o", "--tokenizer",
            "{tok}")(tmp, tok))),
    Row("empty-split", "leaves the validation part of", "use more documents",
        lambda tmp, tok: __import__("tpkit.data").data.split_documents(_docs([3] * 10),
                                                                       "99,1")),
    Row("data-token-past-vocab", "token id 299 >= the model's vocab_size=200",
        "re-run tpkit-data with the model's tokenizer",
        lambda tmp, tok: (lambda d: d.batch(next(d.train), multiple=1))(
            __import__("tpkit.data").data.build_data(
                _write_tokens(tmp, [299, 3, 1] * 20), seq_len=4, global_batch=2,
                vocab_size=200, eod=1, split="100,0"))),
    # the same mistakes through check_data, a launcher's pre-flight (nothing tokenized)
    Row("check-truncated-idx", "d.idx: 117 bytes, but its header announces 4 sequences",
        "truncated: rewrite", lambda tmp, tok: (_indexed(tmp), _cut(tmp / "d.idx", 5),
                                                _check(f"{tmp}/d"))),
    Row("check-short-bin", "d.bin: 38 bytes", "truncated or belongs to another index",
        lambda tmp, tok: (_indexed(tmp), _cut(tmp / "d.bin", 2), _check(f"{tmp}/d"))),
    Row("check-vocab", "has 300 tokens but the model has vocab_size=256",
        "use the model's own tokenizer",
        lambda tmp, tok: _check(_jsonl(tmp / "c.jsonl", [{"text": "a"}]), tokenizer=tok,
                                vocab_size=256)),
    Row("check-missing-field", "c.jsonl:2: no field 'text' (it has ['body'])", "--json-keys",
        lambda tmp, tok: _check(_jsonl(tmp / "c.jsonl", [{"text": "a"}, {"body": "b"}]),
                                tokenizer=tok)),
    Row("check-empty-split", "leaves the validation part of", "use more documents",
        lambda tmp, tok: (_indexed(tmp), _check(f"{tmp}/d", split="99,1"))),
    Row("check-no-tokenizer", "is text (text): pass a tokenizer directory",
        "--tokenizer DIR", lambda tmp, tok: _check(_jsonl(tmp / "c.jsonl", [{"text": "a"}]))),
    Row("train-data-path-no-tokenizer", "--data-path='x' (data.path) needs data.tokenizer",
        "--tokenizer DIR", lambda tmp, tok: __import__("tpkit.train.config").train.config
        .parse(["--data-path", "x"], env={})),
    Row("train-data-path-missing", "--data-path=", "check the path",
        lambda tmp, tok: __import__("tpkit.train.config").train.config.parse(
            ["--data-path", str(tmp / "nope"), "--tokenizer", tok], env={})),
    Row("train-eval-without-data", "--eval-every=5 (data.eval_every) needs data.path",
        "--data-path", lambda tmp, tok: __import__("tpkit.train.config").train.config.parse(
            ["--eval-every", "5"], env={})),
    Row("data-path-blend", "'0.5 a b'", "'W1 PREFIX1 W2 PREFIX2'",
        lambda tmp, tok: __import__("tpkit.data").data.parse_data_path("0.5 a b")),
    Row("resume-other-data", "num_samples=99", "resume with the same --data-path",
        lambda tmp, tok: __import__("tpkit.data").data.Loader(
            __import__("tpkit.data").data.WindowSamples(_docs([9] * 4), 4), 2)
        .load_state_dict({"consumed_samples": 4, "seed": 0, "num_samples": 99})),
]


@pytest.mark.parametrize("row", BAD, ids=lambda r: r.id)
def test_bad_data_input_names_value_and_fix(row, tmp_path, tok_dir):
    with pytest.raises(ValueError) as e:
        row.call(tmp_path, tok_dir)
    msg = str(e.value)
    assert "\n" not in msg
    assert row.value in msg, msg
    assert row.fix in msg, msg
    assert not os.path.exists(tmp_path / "o_text_document.idx")   # nothing written


def test_tpkit_data_error_is_one_line_exit_2(tmp_path, tok_dir, capsys):
    from tpkit.data.preprocess import main
    _jsonl(tmp_path / "c.jsonl", [{"body": "b"}])
    with pytest.raises(SystemExit) as e:
        main(["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "o"),
              "--tokenizer", tok_dir])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"tpkit-data: error: {tmp_path / 'c.jsonl'}:1: no field 'text'")


# --- as a user runs it ----------------------------------------------------------------------
@pytest.mark.slow
def test_tpkit_data_then_launched_loader_at_dp2_cp2(tmp_path, tok_dir):
    """As a user runs them: python -m tpkit.data with 2 workers and two json keys on jsonl
    (Megatron-Core reads the result: the tokenizer's own tokens + eod, in input order),
    then that dataset read under tpkit-launch at dp=2 x cp=2
    (tests/launch_scripts/data_loader.py: CP ranks share rows, the DP ranks' rows form the
    single-process batch)."""
    from test_launch_run import finish, launch
    mi = _megatron()
    texts = _texts(700)                                  # several chunks of 256
    src = _jsonl(tmp_path / "c.jsonl", [{"text": t, "title": t[:9]} for t in texts])
    out = subprocess.run([sys.executable, "-m", "tpkit.data", "--input", src,
                          "--output-prefix", str(tmp_path / "c"), "--tokenizer", tok_dir,
                          "--json-keys", "text", "title", "--workers", "2", "--append-eod"],
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": paths.PYTHONPATH})
    assert out.returncode == 0, out.stderr
    ref, eod = _ref_encode(tok_dir, texts)
    titles, _ = _ref_encode(tok_dir, [t[:9] for t in texts])
    tokens = sum(map(len, ref + titles)) + 2 * 700
    assert f"1,400 documents, {tokens:,} tokens (uint16)" in out.stdout, out.stdout
    m = mi.IndexedDataset(str(tmp_path / "c_text_document"))
    assert [m[i].tolist() for i in range(len(m))] == [r + [eod] for r in ref]
    assert m[0].dtype == np.uint16
    assert os.path.exists(str(tmp_path / "c_title_document.idx"))
    rc, out, err = finish(launch("--nproc-per-node", "4", "--cp", "2",
                                 os.path.join(paths.SCRIPTS, "data_loader.py"),
                                 str(tmp_path / "c_text_document"), tok_dir))
    assert rc == 0, err[-3000:]
    assert sorted(int(x) for x in re.findall(r"DATA OK rank=(\d)", out)) == [0, 1, 2, 3], out
