"""Launched by tests/nn/test_packed.py as
``tpkit-launch --nproc-per-node 4 --tp 2 --cp 2 packed.py``: packed sequences the way a
user writes them (public API only), checked on every rank:

A. ``pack_sequences`` -> ``PackedBatch.shard()``: the shards' position ids, unsharded,
   restart at 0 in every document.
B. ``DotProductAttention(qkv_format="thd")`` on the shard (the layout's comm type, then
   each other comm type set through ``set_context_parallel_group``) equals SDPA run on
   every document alone, float64, output and q/k/v gradients (1e-10).
C. Unsupported inputs raise ValueError on every rank before any collective (a barrier
   afterwards proves no rank is left waiting).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpkit
from tpkit.data import pack_sequences, shard_packed, unshard_packed
from tpkit.nn import DotProductAttention

st = tpkit.init_parallel()
assert (st.tp_size, st.cp_size) == (2, 2), (st.tp_size, st.cp_size)
DOCS = [7, 1, 22, 4, 3]          # 22 > 7 + 1 + 4 + 3
H, G, D = 8, 4, 8
errors = {}

# A. positions
g = torch.Generator().manual_seed(0)
pb = pack_sequences([torch.randint(0, 100, (n,), generator=g) for n in DOCS])
local = pb.shard()
cu, cup = pb.cu_seqlens.tolist(), pb.cu_seqlens_padded.tolist()
restart = torch.cat([torch.arange(b - a) for a, b in zip(cup[:-1], cup[1:])])
assert torch.equal(unshard_packed(local.position_ids, pb.cu_seqlens_padded), restart)
assert torch.equal(unshard_packed(local.tokens, pb.cu_seqlens_padded), pb.tokens)

# B. attention vs per-document SDPA (full heads), float64
T = cup[-1]
q, k, v, go = (torch.randn(T, n, D, generator=g, dtype=torch.float64) for n in (H, G, G, H))
ref_out, ref_grads = torch.zeros_like(go), [torch.zeros_like(t) for t in (q, k, v)]
for i in range(len(DOCS)):
    a, n = cup[i], cu[i + 1] - cu[i]
    qi, ki, vi = (t[a:a + n].transpose(0, 1).clone().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
    o.backward(go[a:a + n].transpose(0, 1))
    ref_out[a:a + n] = o.detach().transpose(0, 1)
    for r, t in zip(ref_grads, (qi, ki, vi)):
        r[a:a + n] = t.grad.transpose(0, 1)
hs, gs = slice(st.tp_rank * H // 2, (st.tp_rank + 1) * H // 2), \
    slice(st.tp_rank * G // 2, (st.tp_rank + 1) * G // 2)
worst = {}
for comm in ("p2p", "all_gather", "a2a"):
    attn = DotProductAttention(H, D, num_gqa_groups=G, qkv_format="thd",
                               attn_mask_type="padding_causal")
    attn.set_context_parallel_group(st.cp_group, st.cp_global_ranks, None, comm)
    leaves = [shard_packed(t[:, s], pb.cu_seqlens_padded).clone().requires_grad_()
              for t, s in ((q, hs), (k, gs), (v, gs))]
    out = attn(*leaves, **pb.attention_kwargs())
    out.backward(shard_packed(go[:, hs].flatten(1), pb.cu_seqlens_padded))
    got = [unshard_packed(x, pb.cu_seqlens_padded) for x in
           [out.detach()] + [t.grad for t in leaves]]
    want = [ref_out[:, hs].flatten(1), ref_grads[0][:, hs], ref_grads[1][:, gs],
            ref_grads[2][:, gs]]
    worst[comm] = max((a - b).abs().max().item() for a, b in zip(got, want))
    assert all(t.dtype == torch.float64 for t in got)
assert max(worst.values()) <= 1e-10, worst


# C. bad inputs: ValueError before any collective, on every rank
def expect(name, fn, match):
    try:
        fn()
    except ValueError as e:
        assert match in str(e), (name, str(e))
        errors[name] = str(e)
    else:
        raise AssertionError(f"{name}: no ValueError")


thd = DotProductAttention(H, D, num_gqa_groups=G, qkv_format="thd",
                          attn_mask_type="padding_causal")
x = [shard_packed(t[:, s], pb.cu_seqlens_padded) for t, s in ((q, hs), (k, gs), (v, gs))]
kw = pb.attention_kwargs()
expect("causal mask", lambda: thd(*x, attn_mask_type="causal", **kw), "'padding_causal'")
expect("no padded cu_seqlens", lambda: thd(*x, cu_seqlens_q=pb.cu_seqlens,
                                           cu_seqlens_kv=pb.cu_seqlens), "cu_seqlens_q_padded")
odd = pb.cu_seqlens_padded.clone()
odd[1:] += 2                      # the first document padded to a length not divisible by 4
odd[0] = 0
expect("odd document", lambda: thd(*[torch.cat([t, t[:1]]) for t in x],
                                   **dict(kw, cu_seqlens_q_padded=odd, cu_seqlens_kv_padded=odd)),
       "not a multiple of 2*cp = 4")
expect("dropout", lambda: DotProductAttention(H, D, qkv_format="thd",
                                              attn_mask_type="padding", attention_dropout=0.1),
       "attention_dropout=0.1")
expect("padding under CP", lambda: DotProductAttention(H, D, num_gqa_groups=G,
                                                      attn_mask_type="padding")(
    *(t.unsqueeze(1) for t in x), torch.zeros(1, 1, 1, x[0].shape[0], dtype=torch.bool)),
       "pack the sequences")
dist.barrier()
print(f"PACKED OK rank={st.rank} worst={worst} errors={sorted(errors)}", flush=True)
tpkit.destroy_parallel()
