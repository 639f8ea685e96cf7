"""tpkit.data.order over more than one epoch (issue 52), against references written here
from the module's documented contract, not from its code:

- the stream is epochs back to back, each a permutation of ``range(n)`` (every sample
  exactly once per epoch), epoch ``e`` a function of ``(seed, e)`` alone: different
  epochs and different seeds give different orders, ``shuffle=False`` is ``0..n-1``
  repeated;
- step ``s`` of a loop taking one global batch a step reads stream positions
  ``[s*G, (s+1)*G)``, so a global batch that straddles an epoch end takes the last
  samples of one epoch and the first of the next, whatever ``G`` (the stream does not
  depend on the global batch, nor on the layout);
- a DP rank's rows are its contiguous share of each micro-batch (``dp_rows``), whatever
  the position; reading positions in any order (a resume, an evaluation of an earlier
  step) gives the same samples as reading them in order.
"""
import json

import numpy as np
import pytest

N = 13          # samples: a prime, so no global batch below divides it and epochs straddle


class Samples:
    """The smallest dataset Loader takes: sample i is i."""

    def __init__(self, n=N):
        self.n = n

    def __len__(self):
        return self.n

    def sample(self, i):
        return int(i)


def _stream(loader, steps):
    """The sample indices of ``steps`` consecutive global batches, read with ``next``."""
    out = []
    for _ in range(steps):
        out += loader.global_indices()
        next(loader)
    return out


@pytest.mark.parametrize("G", [1, 4, 5, 8, 26])
def test_every_epoch_is_a_permutation_and_epochs_differ(G):
    from tpkit.data import Loader
    epochs = 6
    ld = Loader(Samples(), G, seed=3)
    stream = _stream(ld, -(-epochs * N // G))[:epochs * N]
    per_epoch = [stream[e * N:(e + 1) * N] for e in range(epochs)]
    for e, order in enumerate(per_epoch):
        assert sorted(order) == list(range(N)), (G, e, order)     # each sample once an epoch
    # a new order each epoch (13! orders: equal ones would be a bug, not chance)
    assert len({tuple(o) for o in per_epoch}) == epochs, per_epoch
    assert all(o != list(range(N)) for o in per_epoch)           # shuffled
    # consumed counts samples, across the epoch ends too
    assert ld.consumed == -(-epochs * N // G) * G
    assert ld.state_dict()["consumed_samples"] == ld.consumed


def test_the_stream_does_not_depend_on_the_global_batch_or_the_layout():
    """Position p of the stream is the same sample for every G, dp and micro-batch count:
    gather every DP rank's rows of each step (micro-batch i of rank r: rows
    [i*G/m + r*G/(m*dp), ...)) and compare with the G=1 stream."""
    from tpkit.data import Loader
    ref = _stream(Loader(Samples(), 1, seed=11), 5 * N)
    for G, dp, m in ((8, 2, 2), (12, 4, 3), (6, 3, 1), (4, 1, 4)):
        loaders = [Loader(Samples(), G, seed=11, dp_rank=r, dp_size=dp, microbatches=m)
                   for r in range(dp)]
        per = G // (m * dp)
        for step in range(5 * N // G):
            glob = [None] * G
            for r, ld in enumerate(loaders):
                got = next(ld)
                for i in range(m):
                    for j in range(per):
                        glob[i * G // m + r * per + j] = got[i * per + j]
            assert glob == ref[step * G:(step + 1) * G], (G, dp, m, step)


def test_epoch_order_is_a_function_of_seed_and_epoch():
    from tpkit.data import epoch_order
    a = [epoch_order(N, 5, e).tolist() for e in range(4)]
    assert a == [epoch_order(N, 5, e).tolist() for e in range(4)]        # reproducible
    assert len({tuple(x) for x in a}) == 4
    b = [epoch_order(N, 6, e).tolist() for e in range(4)]
    assert all(x != y for x, y in zip(a, b))                              # the seed matters
    assert all(sorted(x) == list(range(N)) for x in a + b)
    assert epoch_order(N, 5, 2, shuffle=False).tolist() == list(range(N))
    assert epoch_order(N, 5, 0).dtype == np.int64
    # the loader's epochs are epoch_order's, epoch e at stream positions [e*N, (e+1)*N)
    from tpkit.data import Loader
    ld = Loader(Samples(), N, seed=5)
    assert [ld.global_indices(e * N) for e in range(4)] == a


def test_unshuffled_stream_repeats_the_dataset():
    from tpkit.data import Loader
    ld = Loader(Samples(), 5, seed=9, shuffle=False)
    assert _stream(ld, 8) == [i % N for i in range(40)]


def test_random_access_across_epochs_equals_the_sequential_read():
    """Positions read out of order (later epoch first, then back to the first, then a
    batch straddling an epoch end) are the sequential stream's samples."""
    from tpkit.data import Loader
    G = 4
    ref = _stream(Loader(Samples(), G, seed=2), 12)          # 48 positions: 3.7 epochs
    ld = Loader(Samples(), G, seed=2, dp_rank=1, dp_size=2)
    for pos in (40, 0, 24, 12, 36, 4, 44, 8):
        assert ld.at(pos, range(G)) == ref[pos:pos + G], pos
        assert ld.indices(pos) == ref[pos + 2:pos + 4], pos        # rank 1's rows
        assert ld.at(pos) == ref[pos + 2:pos + 4], pos
    assert ld.consumed == 0                                   # at/indices do not advance
    # a fresh loader whose first read is in the second epoch
    assert Loader(Samples(), G, seed=2).at(N, range(G)) == ref[N:N + G]


def test_the_default_seed_is_0():
    from tpkit.data import Loader, epoch_order
    assert Loader(Samples(), N).global_indices(N) == epoch_order(N, 0, 1).tolist()


def test_resume_in_a_later_epoch_at_another_layout():
    """Saved after 2.5 epochs at dp=2 (both ranks), resumed at dp=1 and dp=4 with fresh
    loaders: the steps after are the uninterrupted run's, epoch ends included."""
    from tpkit.data import Loader
    G, k, later = 4, 8, 14                                   # 32 samples = 2.46 epochs first
    ref = _stream(Loader(Samples(), G, seed=7), k + later)
    dp2 = [Loader(Samples(), G, seed=7, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(k):
        for ld in dp2:
            next(ld)
    saved = json.loads(json.dumps(dp2[0].state_dict()))
    assert saved["consumed_samples"] == k * G
    for dp in (1, 4):
        lds = [Loader(Samples(), G, seed=7, dp_rank=r, dp_size=dp) for r in range(dp)]
        for ld in lds:
            ld.load_state_dict(saved)
        got = []
        for _ in range(later):
            got += [s for ld in lds for s in next(ld)]
        assert got == ref[k * G:], dp
    other = Loader(Samples(), G, seed=8)
    with pytest.raises(ValueError, match="seed=7, this run has seed=8"):
        other.load_state_dict(saved)
    with pytest.raises(ValueError, match="num_samples=13, this run has num_samples=14"):
        Loader(Samples(14), G, seed=7).load_state_dict(saved)


def test_eval_indices_are_the_held_out_samples_in_order():
    from tpkit.data.order import eval_indices
    got = eval_indices(N, 4)
    assert [b.tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [b.tolist() for b in eval_indices(N, 4, batches=2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [b.tolist() for b in eval_indices(N, 4, batches=9)] == [b.tolist() for b in got]
    assert [b.tolist() for b in eval_indices(4, 4)] == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="3 samples, fewer than one global batch of 4"):
        eval_indices(3, 4)


def test_dp_rows_by_hand():
    from tpkit.data import dp_rows
    assert dp_rows(8, 0, 2, 2).tolist() == [0, 1, 4, 5]
    assert dp_rows(8, 1, 2, 2).tolist() == [2, 3, 6, 7]
    assert dp_rows(12, 2, 3, 1).tolist() == [8, 9, 10, 11]
    assert dp_rows(6, 0, 1, 3).tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="global batch 10 is not divisible by micro-batches "
                                         "x dp = 2 x 2; use a multiple of 4"):
        dp_rows(10, 0, 2, 2)
    with pytest.raises(ValueError, match="x dp = 3 x 2; use a multiple of 6"):
        dp_rows(8, 0, 2, 3)


def test_empty_dataset_is_refused():
    from tpkit.data import Loader
    with pytest.raises(ValueError, match="no samples"):
        Loader(Samples(0), 4)


def test_dp_rows_with_odd_shares_are_integers():
    """Shares of 3 rows (no power of two: an offset ORed instead of added shows) and
    integer indices."""
    from tpkit.data import dp_rows
    got = dp_rows(18, 1, 2, 3)
    assert got.tolist() == [3, 4, 5, 9, 10, 11, 15, 16, 17]
    assert got.dtype.kind == "i", got.dtype
    assert dp_rows(9, 2, 3, 1).tolist() == [6, 7, 8]


def test_the_order_is_pinned_across_versions():
    """A checkpoint stores the position only: a resume with another tpkit version must see
    the same order, so epoch_order's draw is part of the format (numpy's PCG64 seeded
    with [seed, epoch, 7]). Changing it needs a version in the loader's state."""
    from tpkit.data import epoch_order
    assert epoch_order(13, 5, 0).tolist() == [11, 4, 6, 7, 5, 1, 12, 0, 8, 3, 10, 9, 2]
    assert epoch_order(13, 5, 1).tolist() == [6, 1, 3, 4, 10, 5, 11, 12, 9, 8, 0, 7, 2]


def test_state_checks_both_ways_and_large_values():
    from tpkit.data import Loader
    saved = Loader(Samples(300), 4, seed=1000).state_dict()
    same = Loader(Samples(300), 4, seed=1000)
    same.load_state_dict(saved)            # equal values above CPython's small-int cache
    for other in (Loader(Samples(300), 4, seed=999), Loader(Samples(299), 4, seed=1000)):
        with pytest.raises(ValueError, match="belongs to another dataset or seed"):
            other.load_state_dict(saved)   # smaller than the saved ones too
    with pytest.raises(TypeError):
        Loader(Samples(), 4, 3)            # the seed is keyword-only


def test_one_micro_batch_by_default():
    from tpkit.data import Loader, dp_rows
    assert dp_rows(8, 1, 2).tolist() == [4, 5, 6, 7]
    assert Loader(Samples(), 8, dp_rank=1, dp_size=2).rows.tolist() == [4, 5, 6, 7]
