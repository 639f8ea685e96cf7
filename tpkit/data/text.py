"""Text to tokens: a Hugging Face tokenizer from a local directory, records from local files
(jsonl, parquet, text, a saved ``datasets`` directory, or a ``datasets.Dataset``), and
documents tokenized from them (plain text, or SFT with a loss mask on the prompt).

Nothing here downloads: tokenizers load from ``tokenizer.json`` (``tokenizers``) or from a
directory ``transformers.AutoTokenizer`` reads with ``local_files_only=True``. Every record
carries where it came from (``file:line`` or ``file row N``) for the error messages.
"""
from __future__ import annotations

import json
import os

import numpy as np

EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")


class Tokenizer:
    """A Hugging Face tokenizer from a local path: a ``tokenizer.json`` file, a directory
    holding one (read with ``tokenizers``, no ``transformers`` import), or any directory
    ``transformers.AutoTokenizer`` reads offline. ``vocab_size`` counts added tokens;
    ``eod`` is the end-of-document id (the tokenizer's eos token, else a usual name such as
    ``<|endoftext|>``; ``None`` if it has none). Encoding adds no special tokens."""

    def __init__(self, path: str):
        self.path = str(path)
        if not os.path.exists(self.path):
            raise ValueError(f"tokenizer {self.path!r} does not exist; pass a directory with "
                             "tokenizer.json (or a tokenizer.json file)")
        file = self.path if os.path.isfile(self.path) else \
            os.path.join(self.path, "tokenizer.json")
        self._hf = None
        if os.path.isfile(file):
            from tokenizers import Tokenizer as _T
            self._fast = _T.from_file(file)
            self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
            eos = _config_eos(os.path.dirname(file))
        else:
            try:
                from transformers import AutoTokenizer
                self._hf = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
            except (OSError, ValueError) as e:
                raise ValueError(f"tokenizer {self.path!r}: no tokenizer.json and "
                                 f"transformers cannot read it offline ({e})") from None
            self._fast = getattr(self._hf, "_tokenizer", None)
            self.vocab_size = len(self._hf)
            eos = self._hf.eos_token
        ids = [self.token_id(t) for t in ((eos,) if eos else ()) + EOD_NAMES]
        self.eod = next((i for i in ids if i is not None), None)

    def token_id(self, token: str):
        if self._fast is not None:
            return self._fast.token_to_id(token)
        i = self._hf.convert_tokens_to_ids(token)
        return None if i == self._hf.unk_token_id else i

    def encode_batch(self, texts) -> list[list[int]]:
        texts = list(texts)
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=False)]
        return self._hf(texts, add_special_tokens=False)["input_ids"]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids) -> str:
        """The text of token ids (special tokens kept: generated text shows its eos)."""
        ids = [int(i) for i in ids]
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=False)
        return self._hf.decode(ids, skip_special_tokens=False)

    def __repr__(self):
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod})"


def _config_eos(directory: str):
    cfg = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(cfg):
        return None
    eos = json.load(open(cfg)).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def as_tokenizer(tokenizer) -> Tokenizer:
    return tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)


def check_vocabulary(tokenizer, vocab_size: int, what: str = "the model") -> None:
    """ValueError unless every id of ``tokenizer`` fits ``vocab_size`` (the model's
    embedding rows): a tokenizer of another model would index past them."""
    tok = as_tokenizer(tokenizer)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {tok.path!r} has {tok.vocab_size} tokens but {what} "
                         f"has vocab_size={vocab_size}; its ids would index past the "
                         "embedding: use the model's own tokenizer, or a vocabulary of at "
                         f"least {tok.vocab_size}")


# --- records -------------------------------------------------------------------------------
TEXT_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt", ".text")


def read_records(source, keys=("text",)):
    """``(where, record)`` for every record of ``source``: a ``.jsonl``/``.json`` file (one
    JSON object a line), ``.parquet``, a text file (one document a line, as ``keys[0]``), a
    directory written by ``datasets.Dataset.save_to_disk``, or a ``datasets.Dataset`` (a
    streaming ``IterableDataset`` too: it is read once, in order)."""
    if not isinstance(source, (str, os.PathLike)):        # a datasets.Dataset (or a list)
        for i, rec in enumerate(source):
            yield f"dataset row {i}", rec
        return
    path = str(source)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "dataset_info.json")):
            raise ValueError(f"{path} is a directory but not one datasets' save_to_disk wrote "
                             "(no dataset_info.json)")
        from datasets import load_from_disk
        ds = load_from_disk(path)
        if hasattr(ds, "keys"):                             # a DatasetDict: its train split
            if "train" not in ds:
                raise ValueError(f"{path}: a DatasetDict without a 'train' split "
                                 f"({sorted(ds)}); save the split to read")
            ds = ds["train"]
        for i, rec in enumerate(ds):
            yield f"{path} row {i}", rec
        return
    if not os.path.isfile(path):
        raise ValueError(f"input {path!r} does not exist")
    if path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON object ({e.msg}); write one "
                                     "JSON object per line") from None
                if not isinstance(rec, dict):
                    raise ValueError(f"{path}:{n}: a JSON {type(rec).__name__}, not an "
                                     "object; write one JSON object per line")
                yield f"{path}:{n}", rec
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq
        i = 0
        for batch in pq.ParquetFile(path).iter_batches():
            for rec in batch.to_pylist():
                yield f"{path} row {i}", rec
                i += 1
    else:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield f"{path}:{n}", {keys[0]: line.rstrip("\n")}


def field(where: str, rec: dict, key: str) -> str:
    """``rec[key]`` as text, or a ValueError naming the record's file and line."""
    if key not in rec:
        raise ValueError(f"{where}: no field {key!r} (it has {sorted(rec)}); pass the text's "
                         "field with --json-keys / json_keys")
    value = rec[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {key!r} is a {type(value).__name__}, not text")
    return value


# --- documents in memory -------------------------------------------------------------------
class TokenizedDocuments:
    """Documents held in memory (one token array, offsets), each with an optional loss mask
    (1: the token is a target, 0: it is not). A document source like ``IndexedDataset``."""

    def __init__(self, docs, masks=None, name="documents"):
        self.name = name
        lens = [len(d) for d in docs]
        self._off = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=self._off[1:])
        self.lengths = np.asarray(lens, np.int64)
        self._tokens = np.concatenate([np.asarray(d, np.int64) for d in docs]) if docs \
            else np.zeros(0, np.int64)
        self._masks = None if masks is None else \
            np.concatenate([np.asarray(m, np.uint8) for m in masks]) if docs else None

    def __len__(self):
        return len(self.lengths)

    def document(self, i):
        return self._tokens[self._off[i]:self._off[i + 1]]

    def loss_mask(self, i):
        return None if self._masks is None else self._masks[self._off[i]:self._off[i + 1]]


def _records_or_empty(source, keys, what):
    recs = list(read_records(source, keys))
    if not recs:
        raise ValueError(f"{what} {source if isinstance(source, str) else 'dataset'} has no "
                         "records; pass a non-empty file")
    return recs


def text_documents(source, tokenizer, json_keys=("text",), append_eod=True,
                   batch: int = 1024) -> TokenizedDocuments:
    """Documents tokenized (in this process, when called) from ``source`` (see
    :func:`read_records`): the text of ``json_keys`` joined by newlines, with the eod token
    appended if ``append_eod`` and the tokenizer has one. Held in memory: for corpora that
    do not fit, write an indexed dataset with ``tpkit-data`` instead."""
    tok = as_tokenizer(tokenizer)
    recs = _records_or_empty(source, json_keys, "text input")
    texts = ["\n".join(field(w, r, k) for k in json_keys) for w, r in recs]
    docs = []
    for i in range(0, len(texts), batch):
        docs += tok.encode_batch(texts[i:i + batch])
    eod = [tok.eod] if append_eod and tok.eod is not None else []
    docs = [d + eod for d in docs]
    return TokenizedDocuments([d for d in docs if d], name=str(source))


def chat_template(role: str, content: str) -> str:
    """The simple template of SFT messages: ``<|role|>\\ncontent\\n``."""
    return f"<|{role}|>\n{content}\n"


def sft_documents(source, tokenizer, prompt_key="prompt", response_key="response",
                  messages_key="messages") -> TokenizedDocuments:
    """Instruction/chat documents with the loss masked on prompt tokens.

    A record is ``{"prompt": ..., "response": ...}`` (the prompt's tokens get mask 0, the
    response's 1) or ``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered by
    :func:`chat_template` (only ``assistant`` messages get mask 1). The tokenizer's eod
    token, if it has one, ends every document with mask 1 (the model learns to stop).
    Every part is tokenized on its own, so a mask boundary is a token boundary."""
    tok = as_tokenizer(tokenizer)
    docs, masks = [], []
    for where, rec in _records_or_empty(source, (prompt_key,), "SFT input"):
        if messages_key in rec:
            msgs = rec[messages_key]
            if not isinstance(msgs, list) or not msgs:
                raise ValueError(f"{where}: {messages_key!r} must be a non-empty list of "
                                 "{'role': ..., 'content': ...}")
            parts = []
            for j, m in enumerate(msgs):
                if not isinstance(m, dict):
                    raise ValueError(f"{where}: message {j} is not an object")
                role, content = field(f"{where} message {j}", m, "role"), \
                    field(f"{where} message {j}", m, "content")
                parts.append((chat_template(role, content), int(role == "assistant")))
        elif prompt_key in rec or response_key in rec:
            parts = [(field(where, rec, prompt_key), 0), (field(where, rec, response_key), 1)]
        else:
            raise ValueError(f"{where}: neither {messages_key!r} nor {prompt_key!r}/"
                             f"{response_key!r} (it has {sorted(rec)}); write prompt/response "
                             "or a messages list")
        if not any(m for _, m in parts):
            raise ValueError(f"{where}: nothing to learn (no response / assistant message)")
        ids = tok.encode_batch([p for p, _ in parts])
        doc = [t for part in ids for t in part]
        mask = [m for part, (_, m) in zip(ids, parts) for _ in part]
        if tok.eod is not None:
            doc.append(tok.eod)
            mask.append(1)
        docs.append(doc)
        masks.append(mask)
    return TokenizedDocuments(docs, masks, name=str(source))
