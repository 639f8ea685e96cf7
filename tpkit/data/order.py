"""The global sample order and each data-parallel rank's rows of it, resumable at any layout.

The order is a stream of sample indices: epoch ``e`` is a permutation of ``range(n)``
seeded by ``(seed, e)``, epochs back to back. Step ``s`` consumes stream positions
``[s*G, (s+1)*G)`` (``G``: the global batch). Nothing depends on the layout: a DP rank
takes its rows of each global batch, and the position saved in a checkpoint is the
number of samples the whole job consumed, so a resume at another dp (tp, cp, pp)
continues with exactly the samples an uninterrupted run would have seen.

Rows of a DP rank, as the Trainer's (``tpkit.train``) ``rows``: with ``m`` micro-batches,
micro-batch ``i`` is global rows ``[i*G/m, (i+1)*G/m)`` at every layout and DP rank ``r``
takes its contiguous ``G/(m*dp)`` of them. TP and CP ranks of one replica read the same
rows themselves (a read from the page cache costs less than a broadcast over the group:
bench/data.py).
"""
from __future__ import annotations

import numpy as np


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Epoch ``epoch``'s sample order: a permutation of ``range(n)`` from ``(seed, epoch)``."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([seed, epoch, 7]).permutation(n).astype(np.int64)


def dp_rows(global_batch: int, dp_rank: int, dp_size: int, microbatches: int = 1) -> np.ndarray:
    """The rows of a global batch that DP rank ``dp_rank`` of ``dp_size`` reads, in order
    (micro-batch ``i`` of them is chunk ``i``)."""
    m = microbatches
    if global_batch % (m * dp_size):
        raise ValueError(f"global batch {global_batch} is not divisible by micro-batches x "
                         f"dp = {m} x {dp_size}; use a multiple of {m * dp_size}")
    per = global_batch // (m * dp_size)
    return np.concatenate([np.arange(per) + i * per * dp_size + dp_rank * per
                           for i in range(m)])


class Loader:
    """This DP rank's batches of ``samples`` in the global order (see the module doc).

    ``next()`` returns this rank's list of samples of the next global batch (each a list
    of ``(tokens, loss_mask)`` segments: ``token_batch`` / ``packed_batch`` make tensors)
    and advances the position by ``global_batch`` samples. ``state_dict()`` is the position
    to keep in a checkpoint (plain ints); ``load_state_dict`` takes it back at any layout
    and refuses one written for another dataset or seed. ``state``: a ParallelState (its
    ``dp_rank`` / ``dp_size``), or pass ``dp_rank`` / ``dp_size``."""

    def __init__(self, samples, global_batch: int, *, seed: int = 0, state=None,
                 dp_rank: int | None = None, dp_size: int | None = None,
                 microbatches: int = 1, shuffle: bool = True):
        if state is not None:
            dp_rank, dp_size = state.dp_rank, state.dp_size
        self.dp_rank, self.dp_size = dp_rank or 0, dp_size or 1
        self.samples, self.global_batch, self.seed = samples, int(global_batch), int(seed)
        self.shuffle = shuffle
        self.rows = dp_rows(self.global_batch, self.dp_rank, self.dp_size, microbatches)
        self.n = len(samples)
        if self.n == 0:
            raise ValueError("the loader got no samples (an empty dataset or split)")
        self.consumed = 0
        self._epoch, self._perm = -1, None

    def _index(self, pos: int) -> int:
        e = pos // self.n
        if e != self._epoch:
            self._epoch, self._perm = e, epoch_order(self.n, self.seed, e, self.shuffle)
        return int(self._perm[pos % self.n])

    def global_indices(self, step_start: int | None = None) -> list[int]:
        """Sample indices of the global batch starting at stream position ``step_start``
        (default: the current position), all ``global_batch`` rows."""
        start = self.consumed if step_start is None else step_start
        return [self._index(start + i) for i in range(self.global_batch)]

    def indices(self, position: int | None = None, rows=None) -> list[int]:
        """Sample indices of the global batch starting at stream ``position`` (default: the
        current one): this rank's rows, or ``rows`` of it. No advance."""
        start = self.consumed if position is None else int(position)
        return [self._index(start + int(r)) for r in (self.rows if rows is None else rows)]

    def at(self, position: int, rows=None) -> list:
        """The samples of the global batch starting at stream ``position`` (``step *
        global_batch`` for a loop that takes one global batch a step: a step-indexed
        reader needs no other state), this rank's rows or ``rows`` of it (all of them,
        ``range(global_batch)``, e.g. for the step's labelled-token count without a
        collective). No advance."""
        return [self.samples.sample(i) for i in self.indices(position, rows)]

    def __iter__(self):
        return self

    def __next__(self) -> list:
        out = self.at(self.consumed)
        self.consumed += self.global_batch
        return out

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed, "seed": self.seed,
                "num_samples": self.n, "global_batch": self.global_batch}

    def load_state_dict(self, sd: dict) -> None:
        for key, mine in (("num_samples", self.n), ("seed", self.seed)):
            if int(sd[key]) != mine:
                raise ValueError(f"the data position in the checkpoint was saved with "
                                 f"{key}={int(sd[key])}, this run has {key}={mine}: it "
                                 "belongs to another dataset or seed; resume with the same "
                                 "--data-path, split, seq_len and seed")
        self.consumed = int(sd["consumed_samples"])


def eval_indices(n: int, global_batch: int, batches: int | None = None) -> list[np.ndarray]:
    """Validation's global batches: the held-out samples in order, ``global_batch`` at a
    time (the last partial one dropped), at most ``batches`` of them; the same at every
    layout (each DP rank takes ``dp_rows`` of each)."""
    count = n // global_batch if batches is None else min(batches, n // global_batch)
    if count == 0:
        raise ValueError(f"the validation split has {n} samples, fewer than one global batch "
                         f"of {global_batch}; give it more documents (split) or lower the "
                         "global batch")
    return [np.arange(b * global_batch, (b + 1) * global_batch) for b in range(count)]
