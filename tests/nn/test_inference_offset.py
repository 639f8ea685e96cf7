"""The KV cache with ``InferenceParams.batch_size_offset`` (issue 52), TE's documented
semantics: a call's batch occupies cached rows ``[batch_size_offset, batch_size_offset +
b)`` (TE's MultiheadAttention writes ``key_memory[seq_start:seq_end, batch_start:
batch_end]`` and attends to ``key_memory[:seq_end, batch_start:batch_end]``), so several
batches (requests) share one cache, each at its own rows, decoded in turns.

Reference: each request's attention recomputed without a cache over its whole sequence
with PyTorch's ``F.scaled_dot_product_attention`` (causal, GQA), float64, one process
(``fake_state``: tp=1). Checked: interleaved requests at offsets 0, 3 and 5 (a gap row
left unused) give every position's output of the recomputation, the rows of one request
are never touched by another's calls, the unused rows stay empty, a padding mask over a
request's keys, and a call past ``max_batch_size`` through its offset is refused."""
import pytest
import torch
import torch.nn.functional as F

HEADS, GROUPS, D, S, P = 4, 2, 8, 9, 4
MAX_B = 7
REQUESTS = {0: 2, 3: 2, 5: 1}          # batch_size_offset -> rows (row 2 stays unused)


def _dpa(state):
    from tpkit.nn import DotProductAttention
    return DotProductAttention(HEADS, D, num_gqa_groups=GROUPS, state=state)


def _qkv(b, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, b, HEADS, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(S, b, GROUPS, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _recomputed(q, k, v, kv_mask=None):
    """[S, b, HEADS*D]: causal GQA attention of the whole sequence, no cache."""
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kb, vb = (t.repeat_interleave(HEADS // GROUPS, 1) for t in (kb, vb))
    mask = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    if kv_mask is not None:
        mask = mask & ~kv_mask
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
    return out.permute(2, 0, 1, 3).reshape(S, q.shape[1], HEADS * D)


def _decode_interleaved(dpa, params, data, masks=None):
    """The prompt of every request, then one token of each in turn, TE's rule: the
    sequence offset advances after a complete pass over the requests."""
    outs = {b0: [] for b0 in data}
    steps = [(0, P)] + [(t, t + 1) for t in range(P, S)]
    for lo, hi in steps:
        params.sequence_len_offset = lo
        for b0, (q, k, v) in data.items():
            params.batch_size_offset = b0
            kw = {}
            if masks is not None:
                kw = {"attention_mask": masks[b0][..., :hi]}
            outs[b0].append(dpa(q[lo:hi], k[lo:hi], v[lo:hi], inference_params=params, **kw))
    return {b0: torch.cat(o) for b0, o in outs.items()}


def test_requests_at_batch_offsets_decode_as_their_recomputation():
    from tpkit.layout.config import ParallelConfig
    from tpkit.nn.inference import InferenceParams
    from tpkit.layout.planning import fake_state
    with fake_state(ParallelConfig(), 1) as state:
        dpa = _dpa(state)
        data = {b0: _qkv(b, seed=b0) for b0, b in REQUESTS.items()}
        params = InferenceParams(MAX_B, S)
        got = _decode_interleaved(dpa, params, data)
        for b0, (q, k, v) in data.items():
            err = (got[b0] - _recomputed(q, k, v)).abs().max().item()
            assert err <= 1e-10, (b0, err)
        (km, vm), = params.key_value_memory_dict.values()
        assert tuple(km.shape) == (S, MAX_B, GROUPS, D)
        for b0, (q, k, v) in data.items():       # each request's rows hold its own keys
            rows = slice(b0, b0 + REQUESTS[b0])
            assert torch.equal(km[:, rows], k) and torch.equal(vm[:, rows], v), b0
        for unused in (2, 6):
            assert not km[:, unused].any() and not vm[:, unused].any(), unused


def test_a_request_alone_at_an_offset_equals_the_same_request_at_zero():
    """One request decoded at batch offset 5 of a cache of 7, and at offset 0 of a cache
    of its own size: the same outputs (the offset only chooses the rows)."""
    from tpkit.layout.config import ParallelConfig
    from tpkit.nn.inference import InferenceParams
    from tpkit.layout.planning import fake_state
    with fake_state(ParallelConfig(), 1) as state:
        dpa = _dpa(state)
        q, k, v = _qkv(2, seed=9)
        at5 = _decode_interleaved(dpa, InferenceParams(MAX_B, S), {5: (q, k, v)})[5]
        at0 = _decode_interleaved(_dpa(state), InferenceParams(2, S), {0: (q, k, v)})[0]
        assert torch.equal(at5, at0)
        assert (at5 - _recomputed(q, k, v)).abs().max().item() <= 1e-10


def test_padding_masks_per_request_at_offsets():
    """Left padding (the first keys of a row are padding): each request's mask covers its
    own rows' keys so far; positions that see at least one key match the recomputation."""
    from tpkit.layout.config import ParallelConfig
    from tpkit.nn import DotProductAttention
    from tpkit.nn.inference import InferenceParams
    from tpkit.layout.planning import fake_state
    with fake_state(ParallelConfig(), 1) as state:
        dpa = DotProductAttention(HEADS, D, num_gqa_groups=GROUPS,
                                  attn_mask_type="padding_causal", state=state)
        data = {b0: _qkv(b, seed=10 + b0) for b0, b in REQUESTS.items()}
        masks = {}
        for b0, b in REQUESTS.items():
            m = torch.zeros(b, 1, 1, S, dtype=torch.bool)
            m[0, ..., :1 + b0 % 3] = True        # row 0 of each request: left padding
            masks[b0] = m
        got = _decode_interleaved(dpa, InferenceParams(MAX_B, S), data, masks)
        for b0, (q, k, v) in data.items():
            pad = 1 + b0 % 3
            want = _recomputed(q, k, v, masks[b0])
            err = (got[b0][pad:] - want[pad:]).abs().max().item()   # positions with a key
            assert err <= 1e-10, (b0, err)
            # a padding position sees no key: it attends to itself, finite (a NaN there
            # would reach every position of the next layer through its keys and values)
            assert torch.isfinite(got[b0]).all(), b0


def test_an_offset_past_the_cache_is_refused():
    from tpkit.layout.config import ParallelConfig
    from tpkit.nn.inference import InferenceParams
    from tpkit.layout.planning import fake_state
    with fake_state(ParallelConfig(), 1) as state:
        dpa = _dpa(state)
        q, k, v = _qkv(2, seed=1)
        params = InferenceParams(MAX_B, S)
        params.batch_size_offset = 6
        with pytest.raises(ValueError, match=r"batch_size_offset=6 \+ batch 2 exceeds "
                                             r"InferenceParams\(max_batch_size=7\)"):
            dpa(q[:P], k[:P], v[:P], inference_params=params)
        params.batch_size_offset = -1
        with pytest.raises(ValueError, match="batch_size_offset=-1"):
            dpa(q[:P], k[:P], v[:P], inference_params=params)
        assert not params.key_value_memory_dict      # nothing written by a refused call


def test_swap_reorders_every_cached_row_and_refuses_another_count():
    """TE's beam-search step: row i of every layer's cache becomes row batch_indices[i]
    (one index per cached row, the unused ones included)."""
    from tpkit.layout.config import ParallelConfig
    from tpkit.nn.inference import InferenceParams
    from tpkit.layout.planning import fake_state
    with fake_state(ParallelConfig(), 1) as state:
        dpa, other = _dpa(state), _dpa(state)
        params = InferenceParams(MAX_B, S)
        for b0, b in REQUESTS.items():
            q, k, v = _qkv(b, seed=20 + b0)
            params.batch_size_offset = b0
            dpa(q[:P], k[:P], v[:P], inference_params=params)
            other(q[:P], k[:P], v[:P], inference_params=params)
        before = {key: (k.clone(), v.clone()) for key, (k, v) in
                  params.key_value_memory_dict.items()}
        assert len(before) == 2
        perm = [4, 0, 6, 1, 3, 5, 2]
        params.swap_key_value_dict(perm)
        for key, (k, v) in params.key_value_memory_dict.items():
            for i, j in enumerate(perm):
                assert torch.equal(k[:, i], before[key][0][:, j]), (i, j)
                assert torch.equal(v[:, i], before[key][1][:, j]), (i, j)
        for bad in ([0, 1, 2, 3, 4, 5], list(range(8)), [[0, 1, 2, 3, 4, 5, 6]]):
            with pytest.raises(ValueError, match="pass one index per row"):
                params.swap_key_value_dict(bad)


@pytest.mark.parametrize("sizes", [(0, 8), (-1, 8), (2, -3), (2, 0), (True, 8), (2.0, 8)])
def test_inference_params_sizes_are_positive_integers(sizes):
    from tpkit.nn.inference import InferenceParams
    with pytest.raises(ValueError, match="must be a positive integer"):
        InferenceParams(*sizes)
