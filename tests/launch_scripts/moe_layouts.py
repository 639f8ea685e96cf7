"""Worker script for tests/nn/test_moe.py: MoE with expert parallelism the way a user runs
it, under ``tpkit-launch --nproc-per-node 4 --tp 2 --ep 2 --sequence-parallel``, public
API only. Every rank checks, then prints one ``OK`` line:

1. init_parallel() with no arguments builds the launched layout; the Megatron-style
   expert getters match Megatron's expert rank order (etp innermost, ep, then edp);
2. at that layout and at init_parallel(tp=1, ep=4) / (tp=2, ep=2, etp=2, no SP)
   re-layouts, a tpkit.nn.MoE loaded with the same full weights gives the
   output, input gradient and (after tpkit.grads' reductions) parameter gradients of the
   dense computation written here (every expert on every token, one process), in fp64;
3. an ep that does not divide the stage is a ValueError before any group is built, and
   the layout after it still works.
"""
import math
import sys

import torch
import torch.distributed as dist

import tpkit
from tpkit.grads import grad_norm, reduce_expert_grads, sync_sequence_parallel_grads
from tpkit.nn import MoE
from tpkit.layout.parallel_state import (get_expert_data_parallel_group,
                                         get_expert_model_parallel_rank,
                                         get_expert_model_parallel_world_size,
                                         get_expert_tensor_parallel_rank,
                                         get_expert_tensor_parallel_world_size)

S, B, H, F, E, K = 8, 2, 8, 4, 4, 2
f64 = torch.float64


def dense(x, w):
    """The reference: softmax router, top-2 (ties: lower expert), every expert computed on
    every token and masked."""
    probs = torch.softmax(x @ w["router"].t(), -1)
    top = probs.topk(K, -1)
    y = torch.zeros_like(x)
    for e in range(E):
        out = torch.nn.functional.gelu(x @ w["fc1"][e], approximate="tanh") @ w["fc2"][e]
        weight = (top.values * (top.indices == e)).sum(-1, keepdim=True)
        y = y + weight * out
    return y


def check(st, w, X, G):
    tp, cp, dp, sp = st.tp_size, st.cp_size, st.dp_size, st.sequence_parallel
    ep, etp = st.ep_size, st.etp_size
    ref_w = {k: v.clone().requires_grad_() for k, v in w.items()}
    ys = [dense(X[d].reshape(-1, H), ref_w) for d in range(dp)]
    sum((y * G[d].reshape(-1, H)).sum() for d, y in enumerate(ys)).backward()
    moe = MoE(H, F, E, K, dtype=f64)
    L, Fl = E // ep, F // etp
    lo, fl = st.ep_rank * L, st.etp_rank * Fl
    with torch.no_grad():
        moe.router_weight.copy_(w["router"])
        moe.experts_fc1.copy_(w["fc1"][lo:lo + L, :, fl:fl + Fl])
        moe.experts_fc2.copy_(w["fc2"][lo:lo + L, fl:fl + Fl])
    d = st.dp_rank
    rows = X[d].chunk(tp, 0)[st.tp_rank] if sp else X[d]
    x = rows.clone().requires_grad_()
    y = moe(x)
    (y * (G[d].chunk(tp, 0)[st.tp_rank] if sp else G[d])).sum().backward()
    sync_sequence_parallel_grads(moe, st)
    dist.all_reduce(moe.router_weight.grad, group=st.dp_cp_group)
    reduce_expert_grads(moe, st, average=False)
    full_y = ys[d].detach().reshape(S, B, H)
    exp_y = full_y.chunk(tp, 0)[st.tp_rank] if sp else full_y
    tol = dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y, exp_y, **tol)
    torch.testing.assert_close(moe.router_weight.grad, ref_w["router"].grad, **tol)
    torch.testing.assert_close(moe.experts_fc1.grad,
                               ref_w["fc1"].grad[lo:lo + L, :, fl:fl + Fl], **tol)
    torch.testing.assert_close(moe.experts_fc2.grad, ref_w["fc2"].grad[lo:lo + L, fl:fl + Fl],
                               **tol)
    norm = torch.stack([v.grad.norm() for v in ref_w.values()]).norm()
    torch.testing.assert_close(grad_norm(list(moe.parameters()), st), norm, **tol)
    return moe


def main() -> None:
    st = tpkit.init_parallel(seed=3)      # the launched layout, from TPKIT_*
    assert (st.tp_size, st.ep_size, st.etp_size, st.edp_size) == (2, 2, 2, 1)
    assert st.sequence_parallel
    r = st.rank
    # Megatron's expert order (etp innermost, then ep, then edp) on the getters
    assert get_expert_tensor_parallel_world_size() == 2
    assert get_expert_model_parallel_world_size() == 2
    assert get_expert_tensor_parallel_rank() == r % 2
    assert get_expert_model_parallel_rank() == r // 2 % 2
    assert dist.get_world_size(get_expert_data_parallel_group()) == 1
    g = torch.Generator().manual_seed(0)
    w = {"router": torch.randn(E, H, generator=g, dtype=f64),
         "fc1": torch.randn(E, H, F, generator=g, dtype=f64) / 3,
         "fc2": torch.randn(E, F, H, generator=g, dtype=f64) / 3}
    X = torch.randn(4, S, B, H, generator=g, dtype=f64)
    G = torch.randn(4, S, B, H, generator=g, dtype=f64)
    check(st, w, X, G)
    tpkit.destroy_parallel()
    no_sp = dict(sequence_parallel=False)
    for kw in (dict(tp=1, ep=4, etp=1, **no_sp), dict(tp=2, ep=2, etp=2, **no_sp)):
        st = tpkit.init_parallel(seed=3, **kw)
        check(st, w, X, G)
        tpkit.destroy_parallel()
    try:
        tpkit.init_parallel(tp=1, ep=3, etp=1, **no_sp)
    except ValueError as e:
        assert "etp*ep = 1*3 = 3 does not divide tp*cp*dp = 1*1*4 = 4" in str(e), e
    else:
        raise AssertionError("ep=3 on 4 ranks was accepted")
    st = tpkit.init_parallel(tp=2, ep=2, etp=1)
    assert (st.etp_size, st.ep_size, st.edp_size) == (1, 2, 2) and math.isclose(
        st.edp_rank, r // 2)
    tpkit.destroy_parallel()
    # one write per line: the ranks share tpkit-launch's stdout
    sys.stdout.write(f"rank {r} OK\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
