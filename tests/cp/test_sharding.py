"""tpkit.cp.sharding (through tpkit.data, where users import it): load-balanced CP sharding, position ids, unshard (values and gradient)."""
import re
from types import SimpleNamespace

import pytest
import torch

import paths
from dist import run
from tpkit.data import check_sequence_length, shard_position_ids, shard_sequence


def fake(cp, rank, tp=1, sp=False):
    return SimpleNamespace(cp_size=cp, cp_rank=rank, tp_size=tp, sequence_parallel=sp)


@pytest.mark.parametrize("cp", [2, 4])
def test_layout_is_chunks_r_and_mirror(cp):
    s = 4 * cp  # chunks of 2 tokens
    seen = []
    for r in range(cp):
        pos = shard_position_ids(s, fake(cp, r)).tolist()
        a, b = 2 * r, 2 * (2 * cp - 1 - r)
        assert pos == [a, a + 1, b, b + 1]
        seen += pos
        x = torch.arange(s * 3).view(3, s)  # seq_dim=1 works like seq_dim=0
        assert torch.equal(shard_sequence(x, 1, fake(cp, r)), x[:, pos])
    assert sorted(seen) == list(range(s))


def test_balance_of_causal_work():
    # keys visible to a rank's queries: equal for every rank under the load-balanced layout
    cp, s = 4, 32
    work = [sum(p + 1 for p in shard_position_ids(s, fake(cp, r)).tolist()) for r in range(cp)]
    assert len(set(work)) == 1
    contiguous = [sum(range(r * s // cp + 1, (r + 1) * s // cp + 1)) for r in range(cp)]
    assert len(set(contiguous)) == cp  # what the layout avoids


def test_divisibility_errors():
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2\*cp = 8"):
        shard_sequence(torch.zeros(12), 0, fake(4, 0))
    with pytest.raises(ValueError, match=r"2\*cp\*tp = 2\*2\*2 = 8"):
        check_sequence_length(12, fake(2, 0, tp=2, sp=True))
    check_sequence_length(16, fake(2, 0, tp=2, sp=True))
    check_sequence_length(12, fake(2, 0, tp=2, sp=False))
    with pytest.raises(ValueError, match=r"tp = 2 \(sequence parallelism\)"):
        check_sequence_length(7, fake(1, 0, tp=2, sp=True))
    x = torch.zeros(7)
    assert shard_sequence(x, 0, fake(1, 0)) is x  # cp=1: nothing to cut, any length


def _unshard_worker(cp):
    import torch
    import tpkit
    from tpkit.data import shard_sequence, unshard_sequence

    tpkit.init_parallel(cp=cp)
    full = torch.arange(2 * 16 * 3, dtype=torch.float32).view(2, 16, 3)
    local = shard_sequence(full, 1).clone().requires_grad_()
    back = unshard_sequence(local, -2)
    w = torch.randn(full.shape, generator=torch.Generator().manual_seed(3))
    (back * w).sum().backward()
    errors = []
    try:
        unshard_sequence(torch.zeros(3, 2), 0)
    except ValueError as e:
        errors.append(str(e))
    return (torch.equal(back, full), torch.equal(local.grad, shard_sequence(w, 1)), errors)


def test_unshard_roundtrip_and_grad():
    for ok_val, ok_grad, errors in run(_unshard_worker, 4, 4):
        assert ok_val and ok_grad
        assert "odd" in errors[0]


def test_set_context_parallel_group_has_te_signature():
    """Same parameters as TE's (tests/fake_te mirrors TE, checked by test_te_contract)."""
    import os
    import te_contract
    from tpkit.nn.dot_product_attention import DotProductAttention
    with open(te_contract.FAKE_FILE) as f:
        fake = te_contract.signature(f.read(), "DotProductAttention.set_context_parallel_group")
    mine = os.path.abspath(DotProductAttention.__module__.replace(".", "/") + ".py")
    with open(os.path.join(paths.ROOT, "tpkit", "nn", os.path.basename(mine))) as f:
        ours = te_contract.signature(f.read(), "DotProductAttention.set_context_parallel_group")
    assert [n for n, _, _ in ours] == [n for n, _, _ in fake]
    assert ours[:4] == fake[:4]  # cp_comm_type defaults to 'p2p'; the strategy to dual chunk swap
    assert fake[4][2] == "CPLoadBalancingStrategy.DUAL_CHUNK_SWAP"


# --- single process: every CP rank's unshard, with the all-gather done by the test -----
def _mine(length, cp, r, docs=None):
    """Indices CP rank r holds: of every document [lo, hi), chunks r and 2cp-1-r of 2cp
    (the whole row is one document by default), written out independently."""
    out = []
    for lo, hi in zip(*(lambda b: (b[:-1], b[1:]))(docs or [0, length])):
        c = (hi - lo) // (2 * cp)
        out += list(range(lo + r * c, lo + (r + 1) * c))
        out += list(range(lo + (2 * cp - 1 - r) * c, lo + (2 * cp - r) * c))
    return out


def _gather_from(shards):
    """An all_gather(x, group, dim) that returns every rank's shard in rank order."""
    def all_gather(x, group, dim):
        assert group == "cp-group"
        return torch.cat(shards, dim)
    return all_gather


@pytest.mark.parametrize("cp", [2, 4])
def test_unshard_sequence_every_rank_values_and_grad(cp, monkeypatch):
    import tpkit.cp.sharding as data
    from tpkit.data import packing
    s = 8 * cp   # chunks of 4 tokens
    full = torch.randn(2, s, 3, dtype=torch.float64)
    shards = [full[:, _mine(s, cp, r)] for r in range(cp)]
    monkeypatch.setattr(data, "all_gather", _gather_from(shards))
    for r in range(cp):
        st = SimpleNamespace(cp_size=cp, cp_rank=r, cp_group="cp-group", tp_size=1,
                             sequence_parallel=False)
        assert torch.equal(shard_sequence(full, 1, st), shards[r])
        local = shards[r].clone().requires_grad_()
        back = data.unshard_sequence(local, -2, st)
        assert torch.equal(back, full)
        assert torch.equal(data.unshard_sequence(shards[r], 1, st), full)   # same dim
        pos = shard_position_ids(s, st)
        assert pos.dtype == torch.int64 and pos.tolist() == _mine(s, cp, r)
        w = torch.randn(full.shape, dtype=torch.float64)
        (back * w).sum().backward()
        assert torch.equal(local.grad, w[:, _mine(s, cp, r)])
        assert data.cp_positions(r, cp, s // cp).tolist() == _mine(s, cp, r)
    with pytest.raises(ValueError, match=r"length along dim 1 is 3 \(odd\)"):
        data.unshard_sequence(torch.zeros(2, 3), 1, st)
    one = SimpleNamespace(cp_size=1, cp_rank=0, cp_group=None)
    x = torch.zeros(3)
    assert data.unshard_sequence(x, 0, one) is x
    assert data.cp_positions(0, 1, 5).tolist() == list(range(5))


@pytest.mark.parametrize("cp", [2, 4])
def test_unshard_packed_every_rank_values_and_grad(cp, monkeypatch):
    import tpkit.cp.sharding as data
    from tpkit.data import packing
    pb = packing.pack_sequences([list(range(1, 6)), [7], list(range(20, 33)),
                              list(range(100, 140))], multiple=2 * cp)
    cup = pb.cu_seqlens_padded.tolist()
    n = cup[-1]
    full = torch.randn(n, 2, dtype=torch.float64)
    shards = [full[_mine(n, cp, r, cup)] for r in range(cp)]
    monkeypatch.setattr(data, "all_gather", _gather_from(shards))
    for r in range(cp):
        st = SimpleNamespace(cp_size=cp, cp_rank=r, cp_group="cp-group")
        assert torch.equal(data.shard_packed(full, cup, 0, st), shards[r])
        sharded = pb.shard(st)
        assert sharded.tokens.tolist() == pb.tokens[_mine(n, cp, r, cup)].tolist()
        assert torch.equal(sharded.labels, pb.labels[_mine(n, cp, r, cup)])
        assert torch.equal(sharded.position_ids, pb.position_ids[_mine(n, cp, r, cup)])
        local = shards[r].clone().requires_grad_()
        back = data.unshard_packed(local, pb.cu_seqlens_padded, -2, st)
        assert torch.equal(back, full)
        w = torch.randn(full.shape, dtype=torch.float64)
        (back * w).sum().backward()
        assert torch.equal(local.grad, w[_mine(n, cp, r, cup)])
        with pytest.raises(ValueError, match=rf"the shard has {n} tokens along dim 0, but "
                                             rf"cu_seqlens_padded says {n // cp}"):
            data.unshard_packed(full, cup, 0, st)
    one = SimpleNamespace(cp_size=1, cp_rank=0, cp_group=None)
    assert data.unshard_packed(full, cup, 0, one) is full
    assert data.shard_packed(full, cup, 0, one) is full
    assert data.packed_cp_indices(cup, 0, 1).tolist() == list(range(n))
    assert data.packed_cp_indices([0, 3, 8], 0, 1).tolist() == list(range(8))   # odd: cp=1
    kw = pb.attention_kwargs()
    assert kw["max_seqlen_q"] == kw["max_seqlen_kv"] == pb.max_seqlen == 40   # the longest document
    for k in ("cu_seqlens_q", "cu_seqlens_kv"):
        assert kw[k] is pb.cu_seqlens
    for k in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert kw[k] is pb.cu_seqlens_padded


def test_layout_rules_at_cp_3_and_messages():
    import tpkit.cp.sharding as data
    from tpkit.data import packing
    # 2*cp = 6 is no power of two: documents at offsets that share bits with their ends
    cup = [0, 6, 18, 30]
    for r in range(3):
        assert data.packed_cp_indices(cup, r, 3).tolist() == _mine(30, 3, r, cup)
    with pytest.raises(ValueError, match=r"document 1 has padded length 8, not a multiple "
                                         r"of 2\*cp = 6; pad every document"):
        data.packed_cp_indices([0, 6, 14], 0, 3)
    with pytest.raises(ValueError, match=r"not a multiple of 2\*cp = 8;"):
        data.packed_cp_indices([0, 12], 0, 4)
    with pytest.raises(ValueError, match=r"sequence length 6 is not divisible by 2\*cp = 4 "
                                         r"\(context parallelism cuts the sequence into 2\*cp "
                                         r"load-balanced chunks\); pad the sequence to a "
                                         r"multiple of 4"):
        check_sequence_length(6, fake(2, 0))
    for bad in (torch.ones(2, 2, dtype=torch.long), torch.tensor(5),
                torch.tensor([], dtype=torch.long)):
        with pytest.raises(ValueError, match=re.escape(f"document 0 has shape {tuple(bad.shape)} ")):
            packing.pack_sequences([bad])
    t = torch.tensor([1, 2])
    pb = packing.PackedBatch(t, t, t, t, t, 2)
    assert pb.ignore_index == -100
    for bad in (True, 2.0, 0):
        with pytest.raises(ValueError, match=rf"multiple={bad!r} must be a positive integer"):
            packing.pack_sequences([[1, 2]], multiple=bad)
    with pytest.raises(TypeError):   # the options are keyword-only
        packing.pack_sequences([[1, 2]], fake(1, 0))
    with pytest.raises(TypeError):
        data.shard_position_ids(8, fake(2, 0), None)


def test_packed_defaults_long_rows_and_wrong_lengths(monkeypatch):
    import tpkit.cp.sharding as data
    from tpkit.data import packing
    cp = 2
    pb = packing.pack_sequences([list(range(300)), list(range(7))], multiple=2 * cp)
    cup = pb.cu_seqlens_padded.tolist()
    n = cup[-1]
    assert n == 308    # a row longer than 256: lengths compare by value
    full = torch.randn(n, 3, dtype=torch.float64)
    shards = [full[_mine(n, cp, r, cup)] for r in range(cp)]
    monkeypatch.setattr(data, "all_gather", _gather_from(shards))
    for r in range(cp):
        st = SimpleNamespace(cp_size=cp, cp_rank=r, cp_group="cp-group")
        assert torch.equal(data.shard_packed(full, cup, state=st), shards[r])   # dim 0
        assert torch.equal(data.unshard_packed(shards[r], cup, state=st), full)
        with pytest.raises(ValueError, match=rf"the shard has {n // cp - 1} tokens"):
            data.unshard_packed(shards[r][1:], cup, state=st)
        with pytest.raises(ValueError, match=rf"the packed tensor has {n - 1} tokens"):
            data.shard_packed(full[1:], cup, state=st)
        # an odd shard length that has bit 1 clear (5) is still odd
        with pytest.raises(ValueError, match=r"is 5 \(odd\)"):
            data.unshard_sequence(torch.zeros(2, 5), 1, st)
