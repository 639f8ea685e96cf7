"""RNG tracker: stream seeding per layout coordinate, fork semantics, seed uniqueness."""
import pytest
import torch

from dist import run
from tpkit.layout.random import MODEL_PARALLEL_RNG, RNGStatesTracker, derive_seed


def _masks_worker():
    import torch.nn.functional as F
    import tpkit
    from tpkit.layout.random import get_rng_tracker
    s = tpkit.init_parallel(tp=2, cp=2, dp=2, seed=42)
    x = torch.ones(4096)
    default = F.dropout(x, 0.5).bool()
    with get_rng_tracker().fork():
        forked = F.dropout(x, 0.5).bool()
    return (s.tp_rank, s.cp_rank, s.dp_rank), default, forked


def test_forked_masks_follow_the_layout():
    res = run(_masks_worker, 8)
    defaults = [d for _, d, _ in res]
    # default stream: identical on every rank of the stage (so within every DP group)
    assert all(torch.equal(defaults[0], d) for d in defaults)
    by_coord = {}
    for (t, c, d), _, forked in res:
        by_coord.setdefault(t, []).append(forked)
    # model-parallel stream: equal across DP replicas and CP ranks (one model copy) ...
    for masks in by_coord.values():
        assert len(masks) == 4 and all(torch.equal(masks[0], m) for m in masks)
    # ... and different for every TP rank, and from the default stream
    firsts = {k: v[0] for k, v in by_coord.items()}
    keys = sorted(firsts)
    for i, a in enumerate(keys):
        assert not torch.equal(firsts[a], defaults[0])
        for b in keys[i + 1:]:
            assert not torch.equal(firsts[a], firsts[b]), (a, b)


def test_fork_restores_outer_state_and_advances_inner():
    tr = RNGStatesTracker("cpu")
    tr.add(MODEL_PARALLEL_RNG, 7)
    torch.manual_seed(0)
    outer = torch.get_rng_state()
    expected_after = torch.rand(3)
    torch.set_rng_state(outer)
    with tr.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer)
    assert torch.equal(torch.rand(3), expected_after)
    with tr.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the named stream advanced
    g = torch.Generator().manual_seed(7)
    assert torch.equal(torch.cat([a, b]), torch.rand(6, generator=g))
    # get_states / set_states rewind the named stream
    saved = tr.get_states()
    with tr.fork():
        c = torch.rand(3)
    tr.set_states(saved)
    with tr.fork():
        assert torch.equal(torch.rand(3), c)


def test_tracker_errors():
    tr = RNGStatesTracker("cpu")
    tr.add("a", 1)
    with pytest.raises(ValueError, match="seed 1"):
        tr.add("b", 1)
    with pytest.raises(ValueError, match="'a'"):
        tr.add("a", 2)
    with pytest.raises(KeyError, match="'missing'"):
        with tr.fork("missing"):
            pass
    tr.reset()
    tr.add("a", 1)  # reset frees names and seeds


def test_seeds_unique_across_65536_ranks():
    tp, cp, dp, pp = 8, 4, 256, 8  # 65,536 ranks
    seen = {}
    for p in range(pp):
        seen[derive_seed(1234, 0, pp=p)] = ("default", p)
        for c in range(cp):  # the packing is injective in cp too (unused by default)
            for t in range(tp):
                seen[derive_seed(1234, 1, tp=t, cp=c, pp=p)] = ("mp", t, c, p)
    assert len(seen) == pp + pp * cp * tp
    # every rank's pair of seeds: DP replicas and CP ranks (one model copy) share them,
    # nothing else does
    per_rank = set()
    for r in range(tp * cp * dp * pp):
        t, p = r % tp, r // (tp * cp * dp)
        per_rank.add((derive_seed(1234, 0, pp=p), derive_seed(1234, 1, tp=t, pp=p)))
    assert len(per_rank) == tp * pp
    assert all(0 <= s < 2 ** 63 for s in seen)
    with pytest.raises(ValueError, match="tp rank"):
        derive_seed(1, 1, tp=1 << 20)


# --- single process, every rank of a layout on the fake process group (tools/mutation.py
# random runs these instead of the launched test above) --------------------------------
M63 = (1 << 63) - 1


def _reference_seed(seed, stream, a=0, b=0, c=0):
    """The module doc's formula, written out here: splitmix64's finaliser (constants and
    shifts from Steele et al.) modulo 2**63 of pack(stream, a, b, c) xor mix63(seed)."""
    def mix(x):
        x &= M63
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2 ** 63
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2 ** 63
        return x ^ (x >> 31)
    return mix((stream + 4 * a + 4 * 2 ** 20 * b + 4 * 2 ** 40 * c) ^ mix(seed))


def test_derive_seed_is_the_documented_formula():
    for args in [(0, 0), (1234, 1, 3, 0, 1), (2 ** 62 + 5, 2, 2 ** 20 - 1, 7, 2 ** 20 - 1),
                 (42, 1, 1), (42, 2, 0, 1), (42, 0, 0, 0, 3), (2 ** 70, 1, 5, 5, 5)]:
        assert derive_seed(*args[:2], *args[2:]) == _reference_seed(*args), args
    for name, kw in (("tp", dict(tp=-1)), ("cp", dict(cp=1 << 20)), ("pp", dict(pp=1 << 20)),
                     ("tp", dict(tp=(1 << 20) + 1))):
        with pytest.raises(ValueError, match=rf"{name} rank -?\d+ is out of the supported "
                                             r"range \[0, 1048576\)"):
            derive_seed(1, 1, **kw)
    derive_seed(1, 1, tp=(1 << 20) - 1, cp=(1 << 20) - 1, pp=(1 << 20) - 1)   # the limit


def _streams(seed, **layout):
    """Per rank of the layout: (its rank record, default, model-parallel and expert
    streams' first draws), with model_parallel_seed on that rank's fake state."""
    from tpkit.layout.config import ParallelConfig
    from tpkit.layout.planning import fake_state
    from tpkit.layout.random import EXPERT_PARALLEL_RNG, model_parallel_seed
    world = 8
    out = []
    for rank in range(world):
        with fake_state(ParallelConfig(**layout), world, rank) as s:
            tracker = model_parallel_seed(seed, s)
            assert tracker.device.type == "cpu" and set(tracker.get_states()) == {
                MODEL_PARALLEL_RNG, EXPERT_PARALLEL_RNG}
            default = torch.rand(4)
            with tracker.fork():
                mp = torch.rand(4)
            with tracker.fork(EXPERT_PARALLEL_RNG):
                ex = torch.rand(4)
            coords = dict(tp=s.tp_rank, pp=s.pp_rank, etp=s.etp_rank, ep=s.ep_rank)
        out.append((coords, default, mp, ex))
    return out


def _draw(seed):
    return torch.rand(4, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", [dict(tp=2, cp=2, dp=2), dict(tp=2, pp=2, dp=2),
                                    dict(tp=2, dp=4, ep=2, etp=1)])
def test_streams_per_rank_are_the_documented_seeds(layout):
    for c, default, mp, ex in _streams(42, **layout):
        assert torch.equal(default, _draw(_reference_seed(42, 0, 0, 0, c["pp"])))
        assert torch.equal(mp, _draw(_reference_seed(42, 1, c["tp"], 0, c["pp"])))
        assert torch.equal(ex, _draw(_reference_seed(42, 2, c["etp"], c["ep"], c["pp"])))


def test_model_parallel_seed_bad_seed_and_reseeding():
    from tpkit.layout.config import ParallelConfig
    from tpkit.layout.planning import fake_state
    from tpkit.layout.random import model_parallel_seed
    with fake_state(ParallelConfig(tp=2), 2, 1) as s:
        for bad in (-1, 1.5, True, "3"):
            with pytest.raises(ValueError, match=rf"seed={bad!r} must be a non-negative "):
                model_parallel_seed(bad, s)
        model_parallel_seed(0, s)
        model_parallel_seed(0, s)   # again: the tracker is reset, not refused


def test_device_choice_and_non_cuda_devices_use_the_cpu_generator():
    from tpkit.layout.config import ParallelConfig
    from tpkit.layout.planning import fake_state
    from tpkit.layout.random import get_device_rng_state, get_rng_tracker, model_parallel_seed
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert RNGStatesTracker().device.type == want
    torch.manual_seed(3)
    for dev in ("cpu", "meta"):   # anything but cuda: the CPU generator
        assert torch.equal(get_device_rng_state(torch.device(dev)), torch.get_rng_state())
    tr = RNGStatesTracker("meta")
    tr.add("a", 7)
    torch.manual_seed(0)
    outer = torch.rand(2)
    torch.manual_seed(0)
    with tr.fork("a"):
        assert torch.equal(torch.rand(3), _draw(7)[:3])
    assert torch.equal(torch.rand(2), outer)
    # the process-wide tracker follows the state's device type
    tracker = get_rng_tracker()
    tracker.device = torch.device("meta")
    with fake_state(ParallelConfig(tp=2), 2, 0) as s:
        assert model_parallel_seed(5, s) is tracker and tracker.device.type == "cpu"
