"""Token files on disk: Megatron-Core's indexed format (read and write) and flat token files.

Megatron-Core's indexed dataset is two files with one prefix (``megatron.core.datasets.
indexed_dataset``; Megatron's ``tools/preprocess_data.py`` writes
``PREFIX_text_document.bin/.idx``):

- ``PREFIX.bin``: the tokens of every sequence, back to back, in the index's dtype;
- ``PREFIX.idx``: the 9-byte header ``MMIDIDX\\0\\0``, the version (``<Q`` = 1), the dtype
  code (``<B``: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16),
  the sequence count ``N`` and document-index count ``D`` (``<Q`` each), then the
  sequence lengths (int32 x N), the byte offset of every sequence in the ``.bin`` (int64
  x N) and the document indices (int64 x D: ``0``, then the index of the sequence after
  each document's last, so document ``d`` is sequences ``[doc[d], doc[d+1])``).

A flat token file (nanoGPT's ``train.bin``) is the tokens alone (``uint16`` or ``uint32``),
documents separated by an end-of-document token that the file keeps.

Both readers keep their resident memory independent of the file's size: the index is
memory-mapped (numpy), the tokens are read with ``os.pread`` into a new array per request
(a memory map of the ``.bin`` would count every page read so far in the process's RSS).
Every reader is a *document source*: ``len()`` documents, ``lengths`` (int64 tokens per
document), ``document(i)`` (a 1-D numpy array) and ``loss_mask(i)`` (``None``: every token
counts).
"""
from __future__ import annotations

import os
import struct

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}
_CODES = {np.dtype(t): c for c, t in DTYPES.items()}
_FIXED = len(HEADER) + 8 + 1 + 8 + 8     # header, version, dtype code, two counts: 34 bytes


def index_paths(prefix: str) -> tuple[str, str]:
    """``(PREFIX.bin, PREFIX.idx)``: Megatron's names for one indexed dataset."""
    return prefix + ".bin", prefix + ".idx"


def optimal_dtype(vocab_size: int):
    """The token dtype Megatron's ``tools/preprocess_data.py`` picks: uint16 below 65500
    ids, else int32 (``DType.optimal_dtype``)."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


class _PReader:
    """Tokens from a file by ``os.pread`` (no shared file position: safe after fork)."""

    def __init__(self, path: str, dtype):
        self.path, self.dtype = path, np.dtype(dtype)
        self._fd, self._pid = None, None
        self.nbytes = os.path.getsize(path)

    def read(self, offset_items: int, count: int) -> np.ndarray:
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        size = self.dtype.itemsize
        buf = os.pread(self._fd, count * size, offset_items * size)
        if len(buf) != count * size:
            raise ValueError(f"{self.path}: read {len(buf)} of {count * size} bytes at byte "
                             f"{offset_items * size}; the file is shorter than its index "
                             "says (truncated copy?); rewrite it")
        return np.frombuffer(buf, dtype=self.dtype)

    def close(self):
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def __del__(self):
        self.close()

    def __getstate__(self):
        return {"path": self.path, "dtype": self.dtype, "nbytes": self.nbytes,
                "_fd": None, "_pid": None}


class IndexedDataset:
    """Megatron-Core's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), read.

    ``len(ds)`` is the number of *documents*; ``ds.sequence_lengths``, ``ds.sequence_pointers``
    and ``ds.document_indices`` are the index's arrays (memory-mapped), ``ds.dtype`` the
    token dtype, ``ds.get(i, offset, length)`` one sequence (Megatron's ``get``). Every
    inconsistency between the two files is a ``ValueError`` naming the file."""

    def __init__(self, prefix: str):
        self.prefix = str(prefix)
        bin_path, idx_path = index_paths(self.prefix)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise ValueError(f"indexed dataset {self.prefix!r}: {p} does not exist; pass "
                                 "the prefix without .bin/.idx (tpkit-data writes "
                                 "PREFIX_text_document.bin/.idx)")
        size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(_FIXED)
        if len(head) < _FIXED:
            raise ValueError(f"{idx_path}: {size} bytes, shorter than the {_FIXED}-byte header "
                             "of an indexed dataset's index (truncated?); rewrite it with "
                             "tpkit-data or Megatron's tools/preprocess_data.py")
        if head[:9] != HEADER:
            raise ValueError(f"{idx_path}: starts with {head[:9]!r}, not {HEADER!r}: not a "
                             "Megatron-Core index (.idx) file")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
        if version != VERSION:
            raise ValueError(f"{idx_path}: index version {version}; only version {VERSION} "
                             "(Megatron-Core's) is read")
        if code not in DTYPES:
            raise ValueError(f"{idx_path}: dtype code {code} is none of Megatron's "
                             f"{sorted(DTYPES)}")
        need = _FIXED + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if size < need:
            raise ValueError(f"{idx_path}: {size} bytes, but its header announces {n_seq} "
                             f"sequences and {n_doc} document indices ({need} bytes); the "
                             "file is truncated: rewrite it")
        self.dtype = np.dtype(DTYPES[code])
        mm = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(mm, np.int32, n_seq, _FIXED)
        self.sequence_pointers = np.frombuffer(mm, np.int64, n_seq, _FIXED + 4 * n_seq)
        self.document_indices = np.frombuffer(mm, np.int64, n_doc, _FIXED + 12 * n_seq)
        docs = self.document_indices
        ordered = n_doc >= 1 and docs[0] == 0 and docs[-1] == n_seq and _chunks_ok(
            n_doc - 1, lambda lo, hi: np.all(docs[lo + 1:hi + 1] >= docs[lo:hi]))
        if not ordered:
            raise ValueError(f"{idx_path}: its document indices do not run from 0 to the "
                             f"sequence count {n_seq} in order; the index is corrupt")
        self._bin = _PReader(bin_path, self.dtype)
        item = self.dtype.itemsize
        end = int(self.sequence_pointers[-1]) + item * int(self.sequence_lengths[-1]) \
            if n_seq else 0
        if self._bin.nbytes < end:
            raise ValueError(f"{bin_path}: {self._bin.nbytes} bytes, but {idx_path} indexes "
                             f"{end} bytes ({end // item} tokens of {self.dtype}); the .bin is "
                             "truncated or belongs to another index: rewrite both")
        # the sequences lie back to back in the .bin (checked a piece at a time: no array
        # of the index's size is made), so document d is one run of tokens
        ptr, lens = self.sequence_pointers, self.sequence_lengths
        if n_seq and (ptr[0] != 0 or not _chunks_ok(n_seq - 1, lambda lo, hi: np.array_equal(
                ptr[lo + 1:hi + 1] - ptr[lo:hi], lens[lo:hi].astype(np.int64) * item))):
            raise ValueError(f"{idx_path}: its sequence pointers are not the sequences laid "
                             "back to back in the .bin; the index is corrupt")
        self.num_tokens = end // item
        if n_doc == n_seq + 1 and _chunks_ok(n_doc, lambda lo, hi: np.array_equal(
                docs[lo:hi], np.arange(lo, hi))):
            self._doc_seq = None                 # one sequence a document (tpkit-data's)
            self.lengths = lens                  # memory-mapped, nothing copied
        else:
            self._doc_seq = docs[:-1]
            tok = np.zeros(n_seq + 1, np.int64)
            np.cumsum(lens, out=tok[1:])
            self.lengths = tok[docs[1:]] - tok[docs[:-1]]

    def __len__(self) -> int:
        return len(self.lengths)

    def __repr__(self):
        return (f"IndexedDataset({self.prefix!r}: {len(self)} documents, {self.num_tokens} "
                f"tokens, {self.dtype})")

    def document(self, i: int) -> np.ndarray:
        seq = i if self._doc_seq is None else int(self._doc_seq[i])
        n = int(self.lengths[i])
        if n == 0:
            return np.zeros(0, self.dtype)
        return self._bin.read(int(self.sequence_pointers[seq]) // self.dtype.itemsize, n)

    def tokens(self, offset: int, count: int) -> np.ndarray:
        """``count`` tokens from token ``offset`` of the whole ``.bin``."""
        return self._bin.read(offset, count)

    def loss_mask(self, i: int):
        return None

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Sequence ``idx`` (or ``length`` tokens of it from ``offset``), as Megatron's."""
        n = int(self.sequence_lengths[idx])
        length = n - offset if length is None else length
        return self._bin.read(int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset,
                              length)

    @staticmethod
    def exists(prefix: str) -> bool:
        return all(os.path.isfile(p) for p in index_paths(prefix))


def _chunks_ok(n: int, ok, step: int = 1 << 22) -> bool:
    """``ok(lo, hi)`` for every piece ``[lo, hi)`` of ``range(n)``."""
    return all(ok(lo, min(n, lo + step)) for lo in range(0, n, step))


class IndexedDatasetWriter:
    """Writes Megatron-Core's indexed dataset, byte for byte as its ``IndexedDatasetBuilder``
    (``add_document`` then ``finalize``)::

        with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
            w.add_document([1, 2, 3])            # one sequence
            w.add_document([4, 5, 6, 7], [2, 2])  # one document of two sequences
    """

    def __init__(self, prefix: str, dtype=np.int32):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODES:
            raise ValueError(f"dtype {self.dtype} is none of Megatron's index dtypes "
                             f"{sorted(str(np.dtype(t)) for t in DTYPES.values())}")
        self.bin_path, self.idx_path = index_paths(self.prefix)
        self._bin = open(self.bin_path, "wb")
        self._lengths: list[int] = []
        self._docs = [0]

    def _checked(self, tokens) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.size and arr.dtype.kind in "iu" and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise ValueError(f"{self.prefix}: token ids {lo}..{hi} do not fit the "
                                 f"dataset's {self.dtype}; write it with a wider dtype")
        return arr.astype(self.dtype, copy=False)

    def add_document(self, tokens, lengths=None) -> None:
        """Append one document: its tokens, as one sequence or as ``lengths`` sequences."""
        arr = self._checked(tokens)
        lengths = [arr.size] if lengths is None else [int(n) for n in lengths]
        if sum(lengths) != arr.size:
            raise ValueError(f"lengths {lengths} sum to {sum(lengths)}, the document has "
                             f"{arr.size} tokens")
        self._bin.write(arr.tobytes(order="C"))
        self._lengths += lengths
        self._docs.append(len(self._lengths))

    def add_documents(self, tokens, lengths) -> None:
        """Append many one-sequence documents at once: all their tokens, back to back, and
        each one's length."""
        lengths = [int(n) for n in lengths]
        arr = self._checked(tokens)
        if sum(lengths) != arr.size:
            raise ValueError(f"lengths sum to {sum(lengths)}, the documents have {arr.size} "
                             "tokens")
        self._bin.write(arr.tobytes(order="C"))
        start = len(self._lengths)
        self._lengths += lengths
        self._docs += range(start + 1, start + len(lengths) + 1)

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1].astype(np.int64), out=pointers[1:])
        with open(self.idx_path, "wb") as f:
            f.write(HEADER + struct.pack("<QBQQ", VERSION, _CODES[self.dtype], len(lengths),
                                         len(self._docs)))
            f.write(lengths.tobytes())
            f.write((pointers * self.dtype.itemsize).tobytes())
            f.write(np.asarray(self._docs, np.int64).tobytes())

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.finalize()
        else:
            self._bin.close()


class TokenFile:
    """A flat token file (nanoGPT's ``.bin``: ``uint16`` or ``uint32`` tokens back to back).

    ``eod``: the end-of-document token that separates documents (kept at the end of each
    document, as nanoGPT writes them); ``None``: the file is one document. Finding the
    documents reads the file once, in 64 MiB pieces."""

    def __init__(self, path: str, dtype="uint16", eod: int | None = None):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise ValueError(f"token file {self.path!r} does not exist")
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
            raise ValueError(f"token file dtype {dtype!r}: pass 'uint16' or 'uint32'")
        size = os.path.getsize(self.path)
        if size % self.dtype.itemsize:
            raise ValueError(f"{self.path}: {size} bytes is not a whole number of {self.dtype} "
                             "tokens; wrong dtype, or a truncated file")
        self._bin = _PReader(self.path, self.dtype)
        self.num_tokens = size // self.dtype.itemsize
        if self.num_tokens == 0:
            raise ValueError(f"token file {self.path!r} is empty")
        ends = []
        if eod is not None:
            step = 1 << 25
            for lo in range(0, self.num_tokens, step):
                chunk = self._bin.read(lo, min(step, self.num_tokens - lo))
                ends.append(np.flatnonzero(chunk == eod) + lo + 1)
        ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
        if len(ends) == 0 or ends[-1] != self.num_tokens:
            ends = np.append(ends, self.num_tokens)
        self._doc_start = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        self.lengths = (ends - self._doc_start).astype(np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def document(self, i: int) -> np.ndarray:
        return self._bin.read(int(self._doc_start[i]), int(self.lengths[i]))

    def loss_mask(self, i: int):
        return None
