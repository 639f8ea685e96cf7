"""TP=2 x CP=2 ParallelSelfAttention (GQA, RoPE in the CP layout, SP on/off) vs a
single-process reference built from the same full weights: output, input grad and
weight grads (summed over CP like the dp_cp gradient reduction)."""
from dist import run

TOL = 1e-5


def _reference(sd, x, freqs, heads, groups, d):
    import torch.nn.functional as F
    from tpkit.nn.rope import apply_rotary_pos_emb

    s, b, _ = x.shape
    qkv = F.linear(x, sd["linear_qkv.weight"], sd["linear_qkv.bias"])
    q, k, v = qkv.split([heads * d, groups * d, groups * d], dim=-1)
    q, k, v = q.view(s, b, heads, d), k.view(s, b, groups, d), v.view(s, b, groups, d)
    q, k = apply_rotary_pos_emb(q, freqs), apply_rotary_pos_emb(k, freqs)
    o = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                       is_causal=True, enable_gqa=True)
    o = o.permute(2, 0, 1, 3).reshape(s, b, heads * d)
    return F.linear(o, sd["linear_proj.weight"], sd["linear_proj.bias"])


def _block_worker(layouts):
    import torch
    import torch.distributed as dist
    import tpkit
    from tpkit.checkpoint import full_state_dict, gather_param, load_full_state_dict
    from tpkit.data import shard_position_ids, shard_sequence, unshard_sequence
    from tpkit.nn import ParallelSelfAttention, RotaryEmbedding, sync_sequence_parallel_grads
    from tpkit.nn.dot_product_attention import DotProductAttention

    S, B, H, HEADS, GROUPS = 16, 2, 32, 8, 4
    d = H // HEADS
    out = {}
    for comm, sp in layouts:
        st = tpkit.init_parallel(tp=2, cp=2, cp_comm_type=comm, sequence_parallel=sp)
        torch.manual_seed(5)  # same weights on every rank before sharding
        psa = ParallelSelfAttention(H, HEADS, num_gqa_groups=GROUPS)
        assert isinstance(psa.core_attention, DotProductAttention)
        # The layers draw weight shards from the tracker's model-parallel stream, which
        # differs per CP rank; CP ranks must hold one model, so take CP rank 0's weights.
        sd = {k: v.clone() for k, v in full_state_dict(psa).items()}
        for t in sd.values():
            dist.broadcast(t, src=st.cp_global_ranks[0], group=st.cp_group)
        load_full_state_dict(psa, sd)
        g = torch.Generator().manual_seed(9)
        x = torch.randn(S, B, H, generator=g)
        gout = torch.randn(S, B, H, generator=g)
        rope = RotaryEmbedding(d)

        def local(t):  # CP load-balanced shard, then the TP slice of it under SP
            t = shard_sequence(t, 0)
            return t.chunk(st.tp_size, 0)[st.tp_rank] if sp else t
        xl = local(x).clone().requires_grad_()
        y = psa(xl, rotary_pos_emb=rope(shard_position_ids(S)))
        (y * local(gout)).sum().backward()

        ref_sd = {k: v.clone().requires_grad_() for k, v in sd.items()}
        xr = x.clone().requires_grad_()
        yr = _reference(ref_sd, xr, rope(S), HEADS, GROUPS, d)
        yr.backward(gout)

        def full_seq(t):  # undo the TP slice (SP) and the CP layout
            if sp:
                parts = [torch.empty_like(t) for _ in range(st.tp_size)]
                dist.all_gather(parts, t.contiguous(), group=st.tp_group)
                t = torch.cat(parts, 0)
            return unshard_sequence(t, 0)
        errs = {"out": (full_seq(y.detach()) - yr).abs().max().item(),
                "dx": (full_seq(xl.grad) - xr.grad).abs().max().item()}
        sync_sequence_parallel_grads(psa, st)
        for name, p in psa.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad, group=st.cp_group)  # CP ranks saw different tokens
            dim = getattr(p, "tp_partition_dim", None)
            if dim is not None:
                grad = gather_param(grad, dim, getattr(p, "tp_partition_sizes", None), st.tp_group)
            errs["d" + name] = (grad - ref_sd[name].grad).abs().max().item()
        out[(comm, sp)] = errs
        tpkit.destroy_parallel()
    return out


def test_tp2_cp2_attention_block_matches_reference():
    layouts = [("p2p", False), ("p2p", True), ("all_gather", True), ("a2a", False)]
    for res in run(_block_worker, 4, layouts, timeout=240):
        assert len(res) == len(layouts)
        bad = {k: v for k, v in res.items() if not max(v.values()) <= TOL}
        assert not bad, bad
