"""Samples from document sources: fixed-length windows, document-aware packed rows, weighted
blends, a held-out split; and the batches the model eats (``[B, S]`` tokens, or one THD row).

A *document source* has ``len()`` documents, ``lengths`` (int64 tokens each),
``document(i)`` and ``loss_mask(i)`` (``None``, or 1 where the token is a target):
``IndexedDataset``, ``TokenFile``, ``TokenizedDocuments`` and :class:`Subset`.
A *sample set* has ``len()`` samples and ``sample(k)``: a list of segments
``(tokens, loss_mask or None)``. Everything here depends on the data and a seed only,
never on the parallel layout.
"""
from __future__ import annotations

import numpy as np
import torch


class Subset:
    """Documents ``indices`` of ``source`` (a document source itself)."""

    def __init__(self, source, indices, name=None):
        self.source = source
        self.indices = np.asarray(indices, np.int64)
        self.lengths = np.asarray(source.lengths)[self.indices]
        self.name = name or getattr(source, "name", None) or getattr(source, "prefix", "")

    def __len__(self):
        return len(self.indices)

    def document(self, i):
        return self.source.document(int(self.indices[i]))

    def loss_mask(self, i):
        return self.source.loss_mask(int(self.indices[i]))


def parse_split(split) -> list[float]:
    """Megatron's split string ``"98,2"`` (or ``"969,30,1"``, or a list): fractions."""
    parts = [float(x) for x in (split.replace("/", ",").split(",") if isinstance(split, str)
                                else split)]
    if not parts or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"split={split!r}: give non-negative weights such as '98,2' (train, "
                         "validation)")
    return [p / sum(parts) for p in parts]


def split_bounds(n: int, split="98,2", what="the dataset") -> list[int]:
    """Where ``split`` cuts ``n`` documents (Megatron's: consecutive ranges, train first,
    then validation, [test]); a part that would be empty but has a weight is a
    ValueError."""
    fr = parse_split(split)
    bounds = [0]
    for f in fr:
        bounds.append(bounds[-1] + int(round(f * n)))
    bounds[-1] = n
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if hi <= lo and fr[i] > 0:
            label = ("train", "validation", "test")[i] if i < 3 else f"split {i}"
            raise ValueError(f"split={split!r} leaves the {label} part of {what} empty ({n} "
                             "documents); use more documents or a larger weight for it")
    return bounds


def split_documents(source, split="98,2", name=None) -> list[Subset]:
    """The documents cut into consecutive ranges by ``split`` (:func:`split_bounds`)."""
    what = name or getattr(source, "name", None) or getattr(source, "prefix", "the dataset")
    b = split_bounds(len(source), split, what)
    return [Subset(source, np.arange(lo, hi)) for lo, hi in zip(b[:-1], b[1:])]


def _nonempty(source) -> np.ndarray:
    return np.flatnonzero(np.asarray(source.lengths) > 0)


def _piece(source, d, lo, hi):
    doc = source.document(int(d))
    m = source.loss_mask(int(d))
    return doc[lo:hi], None if m is None else m[lo:hi]


class WindowSamples:
    """Fixed-length windows over the documents concatenated in a seeded shuffled order
    (pretraining as Megatron's GPTDataset): sample ``k`` is tokens ``[k*S, k*S + S + 1)``
    of the concatenation (``S + 1``: the inputs and the next-token targets), one segment."""

    def __init__(self, source, seq_len: int, seed: int = 0):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        self.source, self.seq_len = source, seq_len
        docs = _nonempty(source)
        self.order = docs[np.random.default_rng([seed, 17]).permutation(len(docs))]
        self.cum = np.zeros(len(self.order) + 1, np.int64)
        np.cumsum(np.asarray(source.lengths)[self.order], out=self.cum[1:])
        self.n = max(0, int(self.cum[-1] - 1) // seq_len)
        if self.n == 0:
            raise ValueError(f"{getattr(source, 'name', 'the dataset')} has {int(self.cum[-1])} "
                             f"tokens, not enough for one sample of seq_len={seq_len}")

    def __len__(self):
        return self.n

    def sample(self, k: int):
        lo, hi = k * self.seq_len, (k + 1) * self.seq_len + 1
        first = int(np.searchsorted(self.cum, lo, side="right")) - 1
        toks, masks = [], []
        j = first
        while lo < hi:
            start = int(self.cum[j])
            stop = min(int(self.cum[j + 1]), hi)
            t, m = _piece(self.source, self.order[j], lo - start, stop - start)
            toks.append(t)
            masks.append(m)
            lo, j = stop, j + 1
        tok = np.concatenate(toks)
        mask = None if all(m is None for m in masks) else np.concatenate(
            [np.ones(len(t), np.uint8) if m is None else m for t, m in zip(toks, masks)])
        return [(tok, mask)]


class PackedSamples:
    """Whole documents packed into rows of at most ``seq_len`` tokens, in a seeded shuffled
    order (a document longer than ``seq_len`` is cut into pieces of ``seq_len``): each
    sample is its documents as separate segments, for :func:`packed_batch` (attention and
    positions per document). The packing is greedy in order (the next piece goes into the
    current row if it fits, else starts a new one), so it depends on the data only."""

    def __init__(self, source, seq_len: int, seed: int = 0):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        self.source, self.seq_len = source, seq_len
        docs = _nonempty(source)
        docs = docs[np.random.default_rng([seed, 17]).permutation(len(docs))]
        lengths = np.asarray(source.lengths)[docs].astype(np.int64)
        # pieces of at most seq_len per document, in order: (document, start, stop)
        count = -(-lengths // seq_len)
        doc = np.repeat(docs, count)
        first = np.repeat(np.cumsum(count) - count, count)
        lo = (np.arange(len(doc)) - first) * seq_len
        hi = np.minimum(lo + seq_len, np.repeat(lengths, count))
        self.pieces = np.stack([doc, lo, hi], axis=1).reshape(-1, 3)
        starts, used, sizes = [0], 0, hi - lo      # greedy rows, a million pieces at a time
        for base in range(0, len(sizes), 1 << 20):
            for i, size in enumerate(sizes[base:base + (1 << 20)].tolist(), base):
                if used + size > seq_len:
                    starts.append(i)
                    used = 0
                used += size
        starts.append(len(doc))
        self.rows = np.asarray(starts if len(doc) else [0], np.int64)
        if len(self) == 0:
            raise ValueError(f"{getattr(source, 'name', 'the dataset')} has no non-empty "
                             "documents to pack")

    def __len__(self):
        return len(self.rows) - 1

    def sample(self, k: int):
        return [_piece(self.source, d, lo, hi)
                for d, lo, hi in self.pieces[self.rows[k]:self.rows[k + 1]].tolist()]


class Blend:
    """Samples drawn from several sample sets by weight, exactly as Megatron's
    ``BlendedDataset`` (``build_blending_indices``): sample ``i`` comes from the set ``j``
    with the largest ``w_j * max(i, 1) - count_j`` (ties to the first), and is that set's
    next sample (wrapping around a set that runs out). ``size``: default the sets' total."""

    def __init__(self, sets, weights, size: int | None = None):
        if len(sets) != len(weights) or not sets:
            raise ValueError(f"a blend needs one weight per dataset: {len(weights)} weights "
                             f"for {len(sets)} datasets")
        w = np.asarray(weights, np.float64)
        if np.any(w < 0) or w.sum() <= 0:
            raise ValueError(f"blend weights {list(weights)} must be >= 0 with a positive sum")
        self.sets, self.weights = list(sets), w / w.sum()
        size = sum(len(s) for s in sets) if size is None else int(size)
        wl, counts, rest = self.weights.tolist(), [0] * len(sets), range(1, len(sets))
        which, index = [], []
        for i in range(size):          # plain floats: ~1 s per million samples
            x = 1.0 if i < 1 else float(i)
            best, err = 0, wl[0] * x - counts[0]
            for j in rest:
                e = wl[j] * x - counts[j]
                if e > err:
                    best, err = j, e
            which.append(best)
            index.append(counts[best] % len(sets[best]))
            counts[best] += 1
        self.which = np.asarray(which, np.int64)
        self.index = np.asarray(index, np.int64)

    def __len__(self):
        return len(self.which)

    def sample(self, k: int):
        return self.sets[int(self.which[k])].sample(int(self.index[k]))


# --- batches -------------------------------------------------------------------------------
def count_targets(samples) -> int:
    """How many labels of ``samples`` carry loss: in every segment, each token after the
    first whose loss mask is not 0 (``token_batch`` and ``packed_batch`` label exactly
    these). Sum it over the DP ranks for a step's global token count: the divisor that
    makes a token-mean loss the same at every layout."""
    n = 0
    for sample in samples:
        for tok, mask in sample:
            n += len(tok) - 1 if mask is None else int(np.count_nonzero(mask[1:]))
    return n


def token_batch(samples, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)``, int64 ``[B, S]``, from window samples (one segment of ``S+1``
    tokens each): targets are the next tokens, ``ignore_index`` where the loss mask is 0."""
    xs, ys = [], []
    for segs in samples:
        if len(segs) != 1:
            raise ValueError(f"token_batch takes window samples (one segment each), got "
                             f"{len(segs)} segments: use packed_batch for packed samples")
        tok, mask = segs[0]
        t = torch.from_numpy(np.asarray(tok, np.int64))
        y = t[1:].clone()
        if mask is not None:
            y[torch.from_numpy(np.asarray(mask[1:], np.bool_)) == 0] = ignore_index
        xs.append(t[:-1])
        ys.append(y)
    return torch.stack(xs), torch.stack(ys)


def packed_batch(samples, *, state=None, multiple: int | None = None, pad_id: int = 0,
                 ignore_index: int = -100):
    """One THD row (``PackedBatch``) of every segment of ``samples``, in order, through
    :func:`~tpkit.data.packing.pack_sequences` (padding per document to the layout's
    multiple; loss masks of SFT samples applied to the labels). Call ``.shard(state)`` for
    this CP rank's part."""
    from .packing import pack_sequences
    segs = [s for sample in samples for s in sample]
    docs = [torch.from_numpy(np.asarray(t, np.int64)) for t, _ in segs]
    masks = None if all(m is None for _, m in segs) else \
        [np.ones(len(t), np.uint8) if m is None else m for t, m in segs]
    return pack_sequences(docs, state=state, multiple=multiple, pad_id=pad_id,
                          ignore_index=ignore_index, loss_masks=masks)
