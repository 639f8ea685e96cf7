"""CUDA's autocast rules on CPU (tests/cuda_autocast.py) and the defects they expose
(issue 48 items 1, 2): every test here fails on the code before its fix.

- test_fixture_follows_cuda_policy: under cuda_rules(), CPU autocast casts as CUDA's
  (softmax, sum, exp, layer_norm, rms_norm in float32; matmul in the low precision;
  index_copy of mismatched dtypes raises; index_put promotes) and PyTorch's CPU rules
  come back after it (index_copy widens again, softmax stays bf16). The policy's lists
  are parsed from the installed PyTorch's ATen/autocast_mode.h.
- test_moe_under_cuda_autocast: tpkit.nn.MoE (capacity factor, top-2) forward and backward
  under bf16 and fp16 autocast with CUDA's rules (before: "index_copy_(): self and source
  expected to have the same dtype"), within the low precision's tolerance of float32.
- test_router_is_fp32_under_autocast: the router's logits, probabilities and top-k are
  bitwise those without autocast (before: the logits ran in bf16 and ties broke there).
- test_attention_maths_fp32_under_autocast (2 ranks): CP attention on the reference
  kernels (every comm type; p2p's ring and the a2a/all_gather local maths are autograd
  Functions or plain torch) and packed attention give under bf16 autocast bitwise the
  output and gradients they give without it (before: their matmuls ran in bf16).
"""
import pytest
import torch

from cuda_autocast import cuda_policy, cuda_rules
from dist import run


def _dtypes():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    out = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = x @ w
        out["mm"] = y.dtype
        for name, f in (("softmax", lambda: torch.softmax(y, -1)), ("sum", y.sum),
                        ("exp", y.exp), ("norm", y.norm),
                        ("layer_norm", lambda: torch.nn.functional.layer_norm(y, (4,))),
                        ("rms_norm", lambda: torch.nn.functional.rms_norm(y, (4,))),
                        ("index_copy", lambda: x.new_zeros(4, 4).index_copy(
                            0, torch.arange(4), y)),
                        ("index_put", lambda: torch.zeros(4).index_put(
                            (torch.arange(2),), y[0, :2]))):
            try:
                out[name] = f().dtype
            except RuntimeError:
                out[name] = "error"
    return out


def test_fixture_follows_cuda_policy():
    policy = cuda_policy()
    assert policy["aten::softmax.int"] == "fp32_set_opt_dtype"
    assert policy["aten::layer_norm"] == "fp32" and policy["aten::linear"] == "lower_precision_fp"
    assert "aten::index_copy" not in policy and "aten::cat" not in policy
    f32, bf = torch.float32, torch.bfloat16
    cpu = _dtypes()
    assert cpu["softmax"] == bf and cpu["index_copy"] == f32, cpu
    with cuda_rules():
        cuda = _dtypes()
    assert cuda == {"mm": bf, "softmax": f32, "sum": f32, "exp": f32, "norm": f32,
                    "layer_norm": f32, "rms_norm": f32, "index_copy": "error",
                    "index_put": f32}, cuda
    assert _dtypes() == cpu


def _moe_worker(dtypes):
    import tpkit
    from tpkit.nn import MoE
    st = tpkit.init_parallel()
    torch.manual_seed(0)
    moe = MoE(16, 32, 4, top_k=2, capacity_factor=1.5, state=st)
    x = torch.randn(8, 2, 16)
    errs = {}
    ref_x = x.clone().requires_grad_()
    ref = moe(ref_x)
    ref.sum().backward()
    ref_g = ref_x.grad
    for name in dtypes:
        xi = x.clone().requires_grad_()
        with cuda_rules(), torch.autocast("cpu", dtype=getattr(torch, name)):
            y = moe(xi)
        y.float().sum().backward()
        errs[name] = max(((y.float() - ref).abs().max() / ref.abs().max()).item(),
                         ((xi.grad - ref_g).abs().max() / ref_g.abs().max()).item())
    tpkit.destroy_parallel()
    return errs


def test_moe_under_cuda_autocast():
    (errs,) = run(_moe_worker, 1, ["bfloat16", "float16"], timeout=300)
    assert errs["bfloat16"] < 2 ** -5 and errs["float16"] < 2 ** -8, errs


def _router_worker():
    import tpkit
    from tpkit.nn import MoE
    st = tpkit.init_parallel()
    torch.manual_seed(0)
    moe = MoE(16, 32, 8, top_k=2, state=st)
    x = torch.randn(64, 16)
    plain = moe.route(x)
    got = []
    for rules in (False, True):
        with (cuda_rules() if rules else torch.autocast("cpu", enabled=True)), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            r = moe.route(x)
        got.append(torch.equal(r[0], plain[0]) and torch.equal(r[1], plain[1])
                   and r[1].dtype == torch.float32)
    tpkit.destroy_parallel()
    return got


def test_router_is_fp32_under_autocast():
    (got,) = run(_router_worker, 1, timeout=300)
    assert got == [True, True], got


def _attention_worker():
    import os

    import tpkit
    from tpkit.data import shard_sequence
    from tpkit.nn.dot_product_attention import DotProductAttention
    res = {}
    os.environ["TPKIT_FUSED_ATTN"] = "0"
    try:
        for comm in ("p2p", "all_gather", "a2a"):
            st = tpkit.init_parallel(cp=2, cp_comm_type=comm)
            g = torch.Generator().manual_seed(3)
            q, k, v = (shard_sequence(torch.randn(16, 2, h, 4, generator=g), 0)
                       .to(torch.bfloat16) for h in (4, 2, 2))
            for mask in ("causal", "no_mask"):
                outs = []
                for cast in (False, True):
                    dpa = DotProductAttention(4, 4, num_gqa_groups=2, attn_mask_type=mask,
                                              cp_comm_type=comm)
                    ins = [t.clone().requires_grad_() for t in (q, k, v)]
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
                        y = dpa(*ins)
                    y.float().square().sum().backward()
                    assert dpa.kernel == "reference", dpa.kernel
                    outs.append([y.detach()] + [t.grad for t in ins])
                res[(comm, mask)] = all(torch.equal(a, b) for a, b in zip(*outs))
            tpkit.destroy_parallel()
    finally:
        del os.environ["TPKIT_FUSED_ATTN"]
    # packed sequences (THD): cp=1 (masked local maths) and cp=2 p2p (packed_ring)
    from tpkit.nn.packed_attention import packed_attention
    for cp in (1, 2):
        st = tpkit.init_parallel(cp=cp)
        cu = torch.tensor([0, 8, 16], dtype=torch.int32)
        g = torch.Generator().manual_seed(4 + st.rank)
        q, k, v = (torch.randn(1, h, 16 // cp, 4, generator=g).to(torch.bfloat16)
                   for h in (4, 2, 2))
        outs = []
        for cast in (False, True):
            ins = [t.clone().requires_grad_() for t in (q, k, v)]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
                y = packed_attention(*ins, cu_seqlens=cu, cu_seqlens_padded=cu,
                                     comm_type="p2p", group=st.cp_group, cp_size=cp,
                                     cp_rank=st.cp_rank, causal=True, scale=0.5)
            y.float().square().sum().backward()
            outs.append([y.detach()] + [t.grad for t in ins])
        res[("packed", cp)] = all(torch.equal(a, b) for a, b in zip(*outs))
        tpkit.destroy_parallel()
    return res


def test_attention_maths_fp32_under_autocast():
    for res in run(_attention_worker, 2, timeout=300):
        assert all(res.values()), res
