"""One call from a data section to loaders: ``build_data``.

``data_path`` is Megatron's: one prefix or file, or a blend ``"W1 PREFIX1 W2 PREFIX2"``.
Each dataset is opened (:func:`open_documents`), split into train/validation by documents
(Megatron's ``split``), turned into samples (windows, or packed documents), and the
train parts blended by weight; the result holds a :class:`~tpkit.data.order.Loader` for
this DP rank and the validation samples.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from .indexed import IndexedDataset, TokenFile
from .order import Loader, dp_rows, eval_indices
from .samples import Blend, PackedSamples, WindowSamples, packed_batch, split_bounds, \
    split_documents, token_batch
from .text import TEXT_SUFFIXES, as_tokenizer, check_vocabulary, field, read_records, \
    sft_documents, text_documents

FORMATS = ("auto", "indexed", "tokens", "text", "sft")


def parse_data_path(data_path) -> list[tuple[float, str]]:
    """``[(weight, path)]`` from ``"PREFIX"``, ``"W1 P1 W2 P2"`` or a list of either form."""
    parts = data_path.split() if isinstance(data_path, str) else [str(p) for p in data_path]
    if not parts:
        raise ValueError("data_path is empty; pass a dataset prefix or 'W1 PREFIX1 W2 "
                         "PREFIX2'")
    if len(parts) == 1:
        return [(1.0, parts[0])]
    if len(parts) % 2:
        raise ValueError(f"data_path {data_path!r}: a blend is weight/path pairs ('W1 PREFIX1 "
                         f"W2 PREFIX2'), got {len(parts)} words")
    out = []
    for w, p in zip(parts[::2], parts[1::2]):
        try:
            out.append((float(w), p))
        except ValueError:
            raise ValueError(f"data_path {data_path!r}: {w!r} is not a weight; write 'W1 "
                             "PREFIX1 W2 PREFIX2' (numbers before paths)") from None
    return out


def detect_format(path: str) -> str:
    if IndexedDataset.exists(path):
        return "indexed"
    if path.endswith(".bin") and os.path.isfile(path):
        return "tokens"
    if os.path.isdir(path) or path.endswith(TEXT_SUFFIXES):
        return "text"
    raise ValueError(f"data path {path!r}: neither an indexed dataset ({path}.bin/.idx), a "
                     "token file (.bin) nor text (.jsonl, .json, .parquet, .txt, a saved "
                     "datasets directory); check the path (an indexed prefix has no "
                     "extension: PREFIX_text_document)")


def open_documents(path, *, format: str = "auto", tokenizer=None, json_keys=("text",),
                   token_dtype: str = "uint16", eod: int | None = None):
    """A document source for ``path`` (see :mod:`tpkit.data.samples`)."""
    if format not in FORMATS:
        raise ValueError(f"data format {format!r}: choose one of {FORMATS}")
    fmt = detect_format(str(path)) if format == "auto" and isinstance(path, (str, os.PathLike)) \
        else ("text" if format == "auto" else format)
    if fmt == "indexed":
        return IndexedDataset(path)
    if fmt == "tokens":
        if eod is None and tokenizer is not None:
            eod = as_tokenizer(tokenizer).eod
        return TokenFile(path, token_dtype, eod)
    if tokenizer is None:
        raise ValueError(f"data path {path!r} is text ({fmt}): pass a tokenizer directory "
                         "(--tokenizer DIR) to tokenize it")
    if fmt == "sft":
        return sft_documents(path, tokenizer)
    return text_documents(path, tokenizer, json_keys)


@dataclasses.dataclass
class Data:
    """What :func:`build_data` returns: ``train`` (this DP rank's :class:`Loader`: keep its
    ``state_dict()`` in every checkpoint), ``valid`` (the held-out samples, or None),
    ``vocab_size`` (the tokenizer's, or None), ``pack`` (THD rows or ``[B, S]`` batches)."""
    train: Loader
    valid: object
    vocab_size: int | None
    pack: bool
    seq_len: int
    model_vocab: int | None = None
    name: str = ""

    def batch(self, samples, state=None, multiple: int | None = None):
        """Tensors for this rank's samples: a ``PackedBatch`` (whole row, every document
        padded to ``multiple``, default the layout's; ``.shard(state)`` for the CP part)
        when packing, else ``(inputs, targets)`` ``[b, S]``."""
        if self.model_vocab is not None:
            top = max((int(t.max()) for sample in samples for t, _ in sample if len(t)),
                      default=-1)
            if top >= self.model_vocab:
                raise ValueError(f"data path {self.name}: token id {top} >= the model's "
                                 f"vocab_size={self.model_vocab} (in the batch at sample "
                                 f"{self.train.consumed - self.train.global_batch}); the data "
                                 "was tokenized for another vocabulary: re-run tpkit-data "
                                 "with the model's tokenizer")
        return packed_batch(samples, state=state, multiple=multiple) if self.pack \
            else token_batch(samples)

    def state_dict(self) -> dict:
        """The position in the data, for the checkpoint (``Loader.state_dict``)."""
        return self.train.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.train.load_state_dict(sd)

    def valid_batches(self, batches: int | None = None):
        """This rank's samples of each validation global batch (the same at every layout)."""
        if self.valid is None:
            raise ValueError("no validation split: pass split with a validation weight")
        t = self.train
        rows = dp_rows(t.global_batch, t.dp_rank, t.dp_size)
        for idx in eval_indices(len(self.valid), t.global_batch, batches):
            yield [self.valid.sample(int(idx[r])) for r in rows]


def check_data(data_path, *, split="98,2", format: str = "auto", tokenizer=None,
               json_keys=("text",), vocab_size: int | None = None,
               token_dtype: str = "uint16") -> int | None:
    """What :func:`build_data` would refuse, checked without tokenizing or reading tokens,
    for a launcher's pre-flight (before any worker starts): the data path's form, every
    indexed dataset's index against its ``.bin``, a token file's size, every text
    record's JSON and fields, the tokenizer against ``vocab_size``, and no empty split
    part (token files: their documents are known only after a scan, not counted here).
    Returns the tokenizer's vocabulary size (None without a tokenizer)."""
    if format not in FORMATS:
        raise ValueError(f"data format {format!r}: choose one of {FORMATS}")
    tok = as_tokenizer(tokenizer) if tokenizer is not None else None
    if tok is not None and vocab_size is not None:
        check_vocabulary(tok, vocab_size)
    for _, path in parse_data_path(data_path):
        fmt = detect_format(path) if format == "auto" else format
        if fmt == "indexed":
            n = len(IndexedDataset(path))
        elif fmt == "tokens":
            size = os.path.getsize(path) if os.path.isfile(path) else -1
            if size <= 0 or size % np.dtype(token_dtype).itemsize:
                TokenFile(path, token_dtype)           # its own message
            continue
        else:
            if tok is None:
                raise ValueError(f"data path {path!r} is text ({fmt}): pass a tokenizer "
                                 "directory (--tokenizer DIR) to tokenize it")
            n = 0
            for where, rec in read_records(path, json_keys):
                if fmt == "text":
                    for k in json_keys:
                        field(where, rec, k)
                n += 1
            if n == 0:
                raise ValueError(f"data path {path!r} has no records; pass a non-empty file")
        split_bounds(n, split, path)
    return None if tok is None else tok.vocab_size


def build_data(data_path, *, seq_len: int, global_batch: int, seed: int = 0,
               split="98,2", pack: bool = False, format: str = "auto", tokenizer=None,
               json_keys=("text",), vocab_size: int | None = None,
               token_dtype: str = "uint16", eod: int | None = None, state=None,
               dp_rank: int | None = None, dp_size: int | None = None,
               microbatches: int = 1) -> Data:
    """Open, split, sample, blend and order the data of ``data_path`` (module doc).

    ``vocab_size``: the model's; a tokenizer with more tokens is refused, and so is a
    batch holding a token id >= it (``Data.batch``: data made by another tokenizer, seen
    when it is read; a full scan would read the whole dataset). ``state`` (or
    ``dp_rank`` / ``dp_size``): which rows this process reads. ``split``: Megatron's
    ``"train,valid"`` weights by documents (``"100,0"``: no validation)."""
    tok = as_tokenizer(tokenizer) if tokenizer is not None else None
    if tok is not None and vocab_size is not None:
        check_vocabulary(tok, vocab_size)
    make = PackedSamples if pack else WindowSamples
    trains, valids, weights = [], [], []
    for w, path in parse_data_path(data_path):
        docs = open_documents(path, format=format, tokenizer=tok, json_keys=json_keys,
                              token_dtype=token_dtype, eod=eod)
        parts = split_documents(docs, split, name=path)
        trains.append(make(parts[0], seq_len, seed))
        if len(parts) > 1 and len(parts[1]):
            valids.append((w, make(parts[1], seq_len, seed)))
        weights.append(w)
    train = trains[0] if len(trains) == 1 else Blend(trains, weights)
    valid = None if not valids else valids[0][1] if len(valids) == 1 else \
        Blend([v for _, v in valids], [w for w, _ in valids])
    loader = Loader(train, global_batch, seed=seed, state=state, dp_rank=dp_rank,
                    dp_size=dp_size, microbatches=microbatches)
    return Data(loader, valid, None if tok is None else tok.vocab_size, pack, seq_len,
                vocab_size, str(data_path))
