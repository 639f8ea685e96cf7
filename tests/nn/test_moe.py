"""tpkit.nn.MoE at the issue's expert layouts vs a single-process dense reference written
here (every expert on every token, then masked: no dispatch, no all-to-all): outputs,
the aux loss, tokens per expert (routed and kept), the input gradient and the gradient of
every parameter after the library's reductions (router: SP sum + the dp x cp sum DDP
does; experts: tpkit.grads.reduce_expert_grads over edp), dropless and with capacity
dropping, fp64 (1e-10) and fp32 (1e-6). Also the layout checks before any group exists,
the expert RNG streams and the expert-aware gradient norm, and the TE backend (expert
GEMMs through tests/fake_te's GroupedLinear) against the same reference and the torch
backend."""
import math
import os
import re

import pytest
import torch

from dist import run
from paths import SCRIPTS
from shared import register_trainer_script, script_output

S, B, H, F, E = 8, 2, 8, 6, 4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_SMALL = ["--steps", "20", "--hidden", "32", "--layers", "2", "--heads", "4",
               "--gqa-groups", "2", "--ffn", "64", "--seq-len", "32", "--global-batch", "4",
               "--warmup", "5", "--log-every", "100"]


# --- the reference ------------------------------------------------------------------------
def reference(x, w, *, top_k, score_func, normalize, cf, aux_coeff, z_coeff, act, q=None):
    """One replica's tokens ``x`` [T, H] (float64 math unless x is fp32): output [T, H],
    aux loss, routed and kept tokens per expert. ``q``: applied to both operands of every
    expert GEMM (an elementwise fp8 cast: tests/fabric_conformance.py)."""
    T = x.shape[0]
    logits = x @ w["router"].t()
    scores = torch.softmax(logits, -1) if score_func == "softmax" else torch.sigmoid(logits)
    idx = torch.stack([torch.tensor(sorted(range(E), key=lambda e: (-scores[t, e].item(), e))
                                    [:top_k]) for t in range(T)])
    probs = scores.gather(1, idx)
    if normalize:
        probs = probs / probs.sum(-1, keepdim=True)
    routed = torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):
        routed[t, idx[t]] = True
    keep = routed.clone()
    if cf is not None:
        cap = math.ceil(top_k * T * cf / E)
        for e in range(E):
            toks = [t for t in range(T) if routed[t, e]]
            toks.sort(key=lambda t: (-float(probs.detach()[t, (idx[t] == e).nonzero()[0, 0]]), t))
            for t in toks[cap:]:
                keep[t, e] = False
    def mlp(x, fc1, fc2, q=lambda t: t):
        h = q(x) @ q(fc1)
        if act == "swiglu":
            gate, up = h.chunk(2, -1)
            return q(torch.nn.functional.silu(gate) * up) @ q(fc2)
        return q(torch.nn.functional.gelu(h, approximate="tanh")) @ q(fc2)
    outs = [mlp(x, w["fc1"][e], w["fc2"][e], *([q] if q else [])) for e in range(E)]
    outs = torch.stack(outs)                                        # [E, T, H]
    rows = torch.arange(T)
    y = sum(probs[:, j, None] * keep[rows, idx[:, j], None] * outs[idx[:, j], rows]
            for j in range(top_k))
    counts = routed.sum(0).to(x.dtype)
    p = scores if score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    aux = aux_coeff * E / top_k * ((counts / T) * p.mean(0)).sum()
    aux = aux + z_coeff * torch.logsumexp(logits, -1).square().mean()
    if "shared_fc1" in w:
        y = y + mlp(x, w["shared_fc1"].t(), w["shared_fc2"].t())
    return y, aux, routed.sum(0), keep.sum(0)


# --- the ranks ------------------------------------------------------------------------------
def _chunk(t, c, n):
    return t.chunk(n, 0)[c]


def _rank_case(st, case):
    import torch.distributed as dist
    from tpkit.grads import reduce_expert_grads, sync_sequence_parallel_grads
    from tpkit.nn import MoE
    ep, etp, tp, cp, dp, sp = case["layout"]
    dtype = case["dtype"]
    assert (st.ep_size, st.etp_size, st.edp_size) == (ep, etp, tp * cp * dp // (ep * etp))
    g = torch.Generator().manual_seed(11)
    gated = case["act"] == "swiglu"
    w = {"router": torch.randn(E, H, generator=g, dtype=torch.float64),
         "fc1": torch.randn(E, H, F * (2 if gated else 1), generator=g,
                            dtype=torch.float64) / 3,
         "fc2": torch.randn(E, F, H, generator=g, dtype=torch.float64) / 3}
    shared = case.get("shared")
    if shared:
        w["shared_fc1"] = torch.randn(shared * (2 if gated else 1), H, generator=g, dtype=torch.float64) / 3
        w["shared_fc2"] = torch.randn(H, shared, generator=g, dtype=torch.float64) / 3
    X = torch.randn(dp, S, B, H, generator=g, dtype=torch.float64)
    G = torch.randn(dp, S, B, H, generator=g, dtype=torch.float64)
    w = {k: v.to(dtype) for k, v in w.items()}
    X, G = X.to(dtype), G.to(dtype)
    kw = dict(top_k=case["top_k"], score_func=case["score"], normalize=case["norm"],
              cf=case["cf"], aux_coeff=0.1, z_coeff=0.01, act=case["act"])
    # Reference: each dp replica's full sequence, one process.
    ref_w = {k: v.clone().requires_grad_() for k, v in w.items()}
    d = st.dp_rank
    xr = X[d].reshape(-1, H).clone().requires_grad_()
    yr, aux_r, routed_r, kept_r = reference(xr, ref_w, **kw)
    scope = case.get("scope", "sequence")
    total = (yr * G[d].reshape(-1, H)).sum() + aux_r
    for e in range(dp):   # the other replicas contribute to the shared weights' gradients
        if e != d:
            ye, ae, _, _ = reference(X[e].reshape(-1, H), ref_w, **kw)
            total = total + (ye * G[e].reshape(-1, H)).sum() + ae
    if scope == "global":   # one aux loss over the whole batch instead of one per replica
        rows = [xr if e == d else X[e].reshape(-1, H) for e in range(dp)]
        total = total - sum(reference(r, ref_w, **kw)[1] for r in rows)
        every = torch.cat(rows)
        _, aux_r, routed_r, _ = reference(every, ref_w, **kw)
        total = total + aux_r
    total.backward()
    # tpkit: this rank's tokens (cp chunk, then tp chunk under SP).
    backend = case.get("backend", "torch")     # "te": through tests/fake_te's GroupedLinear
    moe = MoE(H, F, E, case["top_k"], activation=case["act"], score_func=case["score"],
              normalize_topk=case["norm"], aux_loss_coeff=0.1, z_loss_coeff=0.01,
              capacity_factor=case["cf"], shared_ffn_hidden_size=shared, dtype=dtype,
              aux_loss_scope=scope, backend=backend)
    L = E // ep
    lo = st.ep_rank * L
    Fl = F // etp
    cols = list(range(st.etp_rank * Fl, (st.etp_rank + 1) * Fl))
    if gated:
        cols += [F + c for c in cols]
    with torch.no_grad():
        moe.router_weight.copy_(w["router"])
        moe.experts_fc1.copy_(w["fc1"][lo:lo + L][:, :, cols])
        moe.experts_fc2.copy_(w["fc2"][lo:lo + L][:, st.etp_rank * Fl:(st.etp_rank + 1) * Fl])
        if shared:
            n = shared // tp
            srows = list(range(st.tp_rank * n, (st.tp_rank + 1) * n))
            if gated:
                srows += [shared + r for r in srows]
            moe.shared_experts.linear_fc1.weight.copy_(w["shared_fc1"][srows])
            moe.shared_experts.linear_fc2.weight.copy_(w["shared_fc2"][:, srows[:n]])

    # full state dicts: gathered = the full weights; loading them = the slicing above
    from tpkit.checkpoint import full_shapes, full_state_dict, load_full_state_dict
    full = full_state_dict(moe, st)
    for name, key in (("router_weight", "router"), ("experts_fc1", "fc1"),
                      ("experts_fc2", "fc2")):
        assert torch.equal(full[name], w[key]), name
        assert full_shapes(moe, st)[name] == w[key].shape
    # the torch backend (also for backend "te": its full state dict loads there)
    twin = MoE(H, F, E, case["top_k"], activation=case["act"], score_func=case["score"],
               normalize_topk=case["norm"], aux_loss_coeff=0.1, z_loss_coeff=0.01,
               capacity_factor=case["cf"], shared_ffn_hidden_size=shared, dtype=dtype,
               aux_loss_scope=scope)
    load_full_state_dict(twin, full, st)
    for (name, a), b in zip(moe.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name

    def mine(t):   # [S, B, ...] -> this rank's rows
        t = _chunk(t, st.cp_rank, cp)
        return _chunk(t, st.tp_rank, tp) if sp else t

    def step(m):
        x = mine(X[d]).clone().requires_grad_()
        y = m(x)
        loss = (y * mine(G[d])).sum() + m.aux_loss / (cp * (dp if scope == "global" else 1))
        loss.backward()
        # The reductions a training loop does: SP sums, DDP's dp x cp sum (un-averaged
        # here), expert weights over edp.
        sync_sequence_parallel_grads(m, st)
        dense = [p for n, p in m.named_parameters() if not n.startswith("experts_")]
        for p in dense:
            dist.all_reduce(p.grad, group=st.dp_cp_group)
        assert reduce_expert_grads(m, st, average=False) == 2
        return x, y, m.aux_loss
    x, y, aux = step(moe)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else \
        dict(rtol=1e-6, atol=1e-6)
    T = S * B
    ref_y = yr.detach().reshape(S, B, H)
    torch.testing.assert_close(y, mine(ref_y), **tol, msg="output")
    torch.testing.assert_close(x.grad, mine(xr.grad.reshape(S, B, H)), **tol, msg="input grad")
    torch.testing.assert_close(moe.router_weight.grad, ref_w["router"].grad, **tol, msg="router")
    torch.testing.assert_close(moe.experts_fc1.grad,
                               ref_w["fc1"].grad[lo:lo + L][:, :, cols], **tol, msg="fc1")
    torch.testing.assert_close(moe.experts_fc2.grad, ref_w["fc2"].grad[lo:lo + L][
        :, st.etp_rank * Fl:(st.etp_rank + 1) * Fl], **tol, msg="fc2")
    if shared:
        torch.testing.assert_close(moe.shared_experts.linear_fc1.weight.grad,
                                   ref_w["shared_fc1"].grad[srows], **tol, msg="shared fc1")
        torch.testing.assert_close(moe.shared_experts.linear_fc2.weight.grad,
                                   ref_w["shared_fc2"].grad[:, srows[:n]], **tol,
                                   msg="shared fc2")
    # the gradient norm counts every expert shard once and each replica once
    from tpkit.grads import grad_norm
    ref_norm = torch.stack([v.grad.norm() for v in ref_w.values()]).norm()
    torch.testing.assert_close(grad_norm(list(moe.parameters()), st).to(dtype), ref_norm,
                               **tol, msg="grad norm")
    # aux: the mean over the CP ranks is the replica's aux loss (the same on TP ranks)
    a = aux.detach().clone()
    dist.all_reduce(a, group=st.dp_cp_group if scope == "global" else st.cp_group)
    torch.testing.assert_close(a / (cp * (dp if scope == "global" else 1)), aux_r.detach(),
                               **tol, msg="aux loss")
    if backend == "te":   # the same as the torch backend with the same weights
        tx, ty, taux = step(twin)
        torch.testing.assert_close(y, ty, **tol, msg="te vs torch output")
        torch.testing.assert_close(x.grad, tx.grad, **tol, msg="te vs torch input grad")
        torch.testing.assert_close(aux, taux, **tol, msg="te vs torch aux")
        for (name, a), b in zip(moe.named_parameters(), twin.parameters()):
            torch.testing.assert_close(a.grad, b.grad, **tol, msg=f"te vs torch {name}")
        _te_checkpoint_round_trip(st, moe, twin, case, mine(X[d]), tol)
    r = moe.last_routing
    assert torch.equal(r.tokens_per_expert.long(), routed_r), "routed tokens per expert"
    if scope == "global":
        return 1   # kept counts: per sequence, checked by the other variants
    kept = torch.bincount(r.indices[r.keep], minlength=E)
    seq = st.tp_cp_group if sp else st.cp_group
    dist.all_reduce(kept, group=seq)
    assert torch.equal(kept, kept_r), (kept, kept_r)
    assert 0 < T
    return int((routed_r - kept_r).sum())


def _te_checkpoint_round_trip(st, moe, twin, case, x, tol):
    """A sharded checkpoint of the torch backend loads into the te backend and back."""
    import tpkit.checkpoint as ckpt
    from tpkit.nn import MoE
    path = os.path.join(case["ckpt"], "-".join(map(str, case["layout"])))

    def fresh(backend):
        return MoE(H, F, E, case["top_k"], activation=case["act"], score_func=case["score"],
                   normalize_topk=case["norm"], shared_ffn_hidden_size=case.get("shared"),
                   dtype=case["dtype"], capacity_factor=case["cf"], backend=backend)
    assert list(moe.state_dict()) == list(twin.state_dict())   # the same keys
    ckpt.save(path + "-torch", {"model": twin})
    te_moe = fresh("te")
    ckpt.load(path + "-torch", {"model": te_moe})
    ckpt.save(path + "-te", {"model": te_moe})
    back = fresh("torch")
    ckpt.load(path + "-te", {"model": back})
    for (name, a), b, c in zip(twin.named_parameters(), te_moe.parameters(), back.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c), name
    with torch.no_grad():
        torch.testing.assert_close(te_moe(x), back(x), **tol, msg="after the round trip")
        torch.testing.assert_close(te_moe(x), moe(x), **tol, msg="te after loading")


def _rank_cases(cases):
    """Every case, one init_parallel per run of cases with the same layout; cases with
    backend "te" run on tests/fake_te (tpkit.te told CUDA is there)."""
    if any(c.get("backend") == "te" for c in cases):
        import te_fake
        import tpkit.te
        te_fake.install()
        cuda = tpkit.te._cuda_available
        tpkit.te._cuda_available = lambda: True
        try:
            return _rank_cases_on(cases)
        finally:
            tpkit.te._cuda_available = cuda
            te_fake.uninstall()
    return _rank_cases_on(cases)


def _rank_cases_on(cases):
    import tpkit
    out, st = [], None
    for i, c in enumerate(cases):
        if st is None:
            ep, etp, tp, cp, dp, sp = c["layout"]
            st = tpkit.init_parallel(tp=tp, cp=cp, dp=dp, ep=ep, etp=etp,
                                     sequence_parallel=sp, seed=5)
        out.append(_rank_case(st, c))
        if i + 1 == len(cases) or cases[i + 1]["layout"] != c["layout"]:
            tpkit.destroy_parallel()
            st = None
    return out


BASE = dict(top_k=2, score="softmax", norm=False, cf=None, act="gelu", dtype=torch.float64)
# (ep, etp, tp, cp, dp, sp): the acceptance layouts, plus etp=2 without SP
LAYOUTS4 = [(4, 1, 1, 1, 4, False), (2, 1, 2, 1, 2, True), (2, 2, 2, 1, 2, True),
            (2, 2, 2, 1, 2, False), (2, 1, 1, 2, 2, False)]


def _cases(layouts, **over):
    out = []
    for i, lay in enumerate(layouts):
        c = dict(BASE, layout=lay)
        c.update(over)
        out.append(c)
    return out


VARIANTS = [dict(), dict(cf=1.0),                  # dropless; capacity dropping
            dict(act="swiglu", score="sigmoid", norm=True, top_k=3, cf=1.0, shared=4),
            dict(dtype=torch.float32), dict(scope="global", cf=1.0)]


def test_moe_layouts_world4():
    cases = [dict(BASE, layout=lay, **v) for lay in LAYOUTS4 for v in VARIANTS]
    dropped = run(_rank_cases, 4, cases, timeout=300)[0]
    assert all(d == 0 for d, c in zip(dropped, cases) if c["cf"] is None), "dropless dropped"
    assert all(d > 0 for d, c in zip(dropped, cases) if c["cf"]), "nothing dropped: no test"


def test_moe_layouts_world1_2():
    small = _cases([(1, 1, 1, 1, 1, False)]) + _cases([(1, 1, 1, 1, 1, False)], cf=1.0,
                                                      act="swiglu", shared=2)
    run(_rank_cases, 1, small)
    run(_rank_cases, 2, _cases([(2, 1, 1, 1, 2, False)]) + _cases([(2, 1, 1, 1, 2, False)],
                                                                  cf=0.75))


TE = dict(BASE, backend="te", dtype=torch.float32)   # fp32: TE's GEMMs have no fp64


def test_moe_te_backend(tmp_path):
    """MoE(backend="te"): the expert GEMMs through tests/fake_te's GroupedLinear (TE
    2.20.2's signature, torch math) equal the reference and the torch backend with the
    same weights (output, aux loss, input and parameter gradients after the edp / dp x cp
    reductions, fp32 1e-6) at (ep, etp, tp) = (1, 1, 1), (2, 1, 1) and (2, 2, 2) with SP;
    a sharded checkpoint of the torch backend loads into the te backend and back."""
    ck = str(tmp_path)
    run(_rank_cases, 1, [dict(TE, layout=(1, 1, 1, 1, 1, False), act="swiglu", cf=1.0,
                              shared=2, ckpt=ck)])
    run(_rank_cases, 4, [dict(TE, layout=(2, 1, 1, 1, 4, False), ckpt=ck),
                         dict(TE, layout=(2, 2, 2, 1, 2, True), act="swiglu",
                              score="sigmoid", norm=True, top_k=3, cf=1.0, shared=4,
                              ckpt=ck)])
    run(_rank_te_build, 4)


def _rank_te_build():
    """What tpkit hands TE for the expert GEMMs, and the bad input of backend="te"."""
    import te_fake
    import tpkit
    import tpkit.te
    from tpkit.nn import MoE
    from tpkit.layout.random import EXPERT_PARALLEL_RNG, model_parallel_seed
    te_fake.install()
    cuda, tpkit.te._cuda_available = tpkit.te._cuda_available, lambda: True
    try:
        st = tpkit.init_parallel(tp=2, dp=2, ep=2, etp=2, sequence_parallel=True, seed=1)
        moe = MoE(H, F, E, 2, activation="swiglu", backend="auto")   # auto: TE + "CUDA"
        assert moe.backend == "te" and tpkit.te.wire_parallel_groups(moe) == []
        for lin, (i, o) in ((moe.te_experts.fc1, (H, 2 * F // 2)),
                            (moe.te_experts.fc2, (F // 2, H))):
            a = lin.init_args
            assert (a["num_gemms"], a["in_features"], a["out_features"]) == (E // 2, i, o)
            assert (a["tp_size"], a["tp_group"], a["parallel_mode"], a["bias"]) == \
                (1, None, None, False)
            assert a["sequence_parallel"] is False and a["rng_tracker_name"] == EXPERT_PARALLEL_RNG
            assert not list(lin.parameters())   # the weights are the MoE's
        tags = {n: (p.expert_parallel, p.num_experts) for n, p in moe.named_parameters()
                if getattr(p, "expert_parallel", False)}
        assert tags == {"experts_fc1": (True, E), "experts_fc2": (True, E)}
        built = {}
        for backend in ("torch", "te"):   # initialised on the same streams as torch's
            model_parallel_seed(7, st)
            built[backend] = MoE(H, F, E, 2, activation="swiglu", backend=backend)
        for (n, a), b in zip(built["torch"].named_parameters(), built["te"].parameters()):
            assert torch.equal(a, b), n
        for kw, words in [(dict(dtype=torch.float64), "dtype=torch.float64"),
                          (dict(backend="gpu"), "backend='gpu'")]:
            try:
                MoE(H, F, E, 2, **dict(dict(backend="te"), **kw))
            except ValueError as exc:
                assert words in str(exc) and ("backend='torch'" in str(exc) or
                                              "use one of" in str(exc)), exc
            else:
                raise AssertionError(f"{kw} accepted")
        tpkit.te._cuda_available = lambda: False
        try:
            MoE(H, F, E, 2, backend="te")
        except RuntimeError as exc:
            assert "needs CUDA" in str(exc) and "backend='torch'" in str(exc), exc
        else:
            raise AssertionError("backend='te' without CUDA accepted")
        assert MoE(H, F, E, 2, backend="auto").te_experts is None   # auto: torch here
    finally:
        tpkit.te._cuda_available = cuda
        te_fake.uninstall()
        tpkit.destroy_parallel()


def _rank_rng():
    """The expert-parallel stream: the same on expert-data-parallel replicas, distinct
    per (etp, ep) shard and from every other stream (layout (ep2, etp1, tp2, dp2))."""
    import torch.distributed as dist
    import tpkit
    from tpkit.layout.random import EXPERT_PARALLEL_RNG, MODEL_PARALLEL_RNG, get_rng_tracker
    st = tpkit.init_parallel(tp=2, dp=2, ep=2, etp=1, seed=9)
    draws = {}
    for name in (EXPERT_PARALLEL_RNG, MODEL_PARALLEL_RNG):
        with get_rng_tracker().fork(name):
            draws[name] = torch.rand(4)
    draws["default"] = torch.rand(4)
    out = {}
    for name, t in draws.items():
        every = [torch.empty(4) for _ in range(st.world_size)]
        dist.all_gather(every, t)
        out[name] = [tuple(e.tolist()) for e in every]
    tpkit.destroy_parallel()
    return out


def test_expert_rng_streams():
    got = run(_rank_rng, 4)[0]
    # rank = tp + 2*dp; expert coords: etp = 0, ep = rank % 2, edp = rank // 2
    ex = got["expert-parallel-rng"]
    assert ex[0] == ex[2] and ex[1] == ex[3] and ex[0] != ex[1]
    everything = set(ex) | set(got["model-parallel-rng"]) | set(got["default"])
    assert len(everything) == 2 + 2 + 1, "streams collide"


def test_bad_input_before_any_group():
    from tpkit.layout.config import ParallelConfig
    from tpkit.nn.moe import check_moe_args
    for kw, world, words in [(dict(ep=0), 1, "ep=0"), (dict(etp=0), 1, "etp=0"),
                             (dict(tp=2, ep=4), 4, "etp*ep = 2*4"),
                             (dict(tp=2, cp=2, ep=3, etp=1), 8, "does not divide tp*cp*dp")]:
        with pytest.raises(ValueError, match=words.replace("*", r"\*")):
            ParallelConfig(**kw).validate(world)
    for args, words in [((4, 5, None), "top_k=5"), ((4, 0, None), "top_k=0"),
                        ((4, 2, 0.0), "capacity_factor=0.0"), ((4, 2, -1), "capacity_factor"),
                        ((0, 1, None), "num_experts=0")]:
        with pytest.raises(ValueError, match=words):
            check_moe_args(*args)
    with pytest.raises(ValueError, match="score_func"):
        check_moe_args(4, 2, None, "relu")


def test_launcher_checks_ep(capsys):
    from tpkit.cli.launch import main
    assert main(["--nproc-per-node", "6", "--tp", "2", "--ep", "4", "--dry-run",
                 "launch/smoke.py"]) == 2
    assert "etp*ep = 2*4 = 8 does not divide tp*cp*dp = 2*1*3 = 6" in capsys.readouterr().err
    assert main(["--nproc-per-node", "4", "--tp", "2", "--ep", "2", "--etp", "1",
                 "--dry-run", "launch/smoke.py"]) == 0
    out = capsys.readouterr().out
    assert "ep=2 etp=1 edp=2" in out and "TPKIT_EP=2" in out and "TPKIT_ETP=1" in out
    header, *rows = out.split("rank table:\n")[1].strip().splitlines()
    assert header.split()[-3:] == ["etp", "ep", "edp"]
    # Megatron's expert order inside a stage: etp innermost, then ep, then edp
    assert [r.split()[-3:] for r in rows] == [["0", "0", "0"], ["0", "1", "0"],
                                             ["0", "0", "1"], ["0", "1", "1"]]


register_trainer_script("moe-layouts", os.path.join(SCRIPTS, "moe_layouts.py"),
                        flags=("--tp", "2", "--ep", "2", "--sequence-parallel"))


@pytest.mark.slow
def test_launched_moe_layouts(tmp_path_factory):
    """tests/launch_scripts/moe_layouts.py as under ``tpkit-launch --nproc-per-node 4 --tp 2
    --ep 2 --sequence-parallel`` (in tests/shared.py's trainer launch, with the variables
    those flags export): the launched layout's expert groups and getters, MoE vs its
    dense reference at four layouts, a bad ep refused before any group (the script's
    docstring lists the checks)."""
    out = script_output(tmp_path_factory, "moe-layouts")   # the launch exited 0
    assert sorted(re.findall(r"rank \d+ OK", out)) == \
        [f"rank {r} OK" for r in range(4)], out


# --- launch/train.py with experts -------------------------------------------------------
MOE = ["--moe-experts", "4", "--moe-topk", "2", "--moe-every", "2", "--moe-aux-coeff", "0.01"]


def _train(flags):
    from tpkit.train import trainer as train
    return train.main(TRAIN_SMALL + MOE + list(flags))


def test_train_moe_same_curve_at_every_ep():
    """20 steps at ep=1 on one rank, then on 4 ranks at ep=2 (tp=2, SP; etp=2 and etp=1)
    and ep=4 (dp=4): the same global loss curve (Fabric: DDP leaves expert weights to the
    edp sum), every rank reporting the same loss; with recompute, the replayed routing
    and the aux loss's gradient change nothing. Then --precision fp8 at ep=1 and ep=2."""
    (ref,) = run(_train, 1, ["--tp", "1", "--ep", "1"])
    assert ref[-1] < ref[0] - 0.5, ref   # it learns
    for flags in (["--tp", "2", "--sequence-parallel", "--ep", "2"],
                  ["--tp", "2", "--ep", "2", "--etp", "1", "--recompute"],
                  ["--tp", "1", "--ep", "4"]):
        results = run(_train, 4, flags)
        assert all(r == results[0] for r in results), flags
        for i, (a, b) in enumerate(zip(results[0], ref)):
            assert abs(a - b) <= 1e-5 * abs(b), (flags, i, a, b)
    # --precision fp8 (delayed) with experts: ep=2 (tp=2, SP, etp=1, edp=2) vs ep=1. Step 0
    # runs every GEMM at scale 1: ep=1's loss up to float32 rounding. After it the layouts'
    # float32 rounding (sums in another order) moves a few values across an fp8 rounding
    # boundary, a jump of up to an fp8 ulp each, and the curves drift apart as any two fp8
    # runs do: measured 1.0e-5 at step 1 and <= 1.1e-3 over 20 steps (fp8's own distance to
    # the float32 curve: 1.6e-3). Expert scales mixed across experts (amaxes by local
    # expert index) move step 1 by ~5e-5. tests/fp8/test_moe_fp8.py checks the expert GEMMs
    # themselves against a per-expert fp8 reference.
    (ref8,) = run(_train, 1, ["--tp", "1", "--ep", "1", "--precision", "fp8"])
    got8 = run(_train, 4, ["--tp", "2", "--sequence-parallel", "--ep", "2", "--etp", "1",
                           "--precision", "fp8"])
    assert all(r == got8[0] for r in got8) and ref8 != ref
    rel = [abs(a - b) / b for a, b in zip(got8[0], ref8)]
    assert rel[0] <= 1e-6 and rel[1] <= 2.5e-5 and max(rel) <= 3e-3, rel


@pytest.mark.parametrize("argv,words", [
    (["--moe-experts", "4", "--moe-topk", "5"], "top_k=5"),
    (["--moe-experts", "6", "--ep", "4"],
     "--moe-experts=6 (experts.num) is not divisible by ep=4; use a multiple of 4"),
    (["--moe-experts", "4", "--moe-capacity-factor", "0"], "capacity_factor=0.0"),
    (["--ep", "2"], "--ep=2 (parallelism.ep) needs --moe-experts > 0"),
    (["--moe-experts", "4", "--ep", "0"], "--ep=0 (parallelism.ep) must be >= 1"),
    (["--moe-experts", "4", "--moe-every", "3"], "--moe-every=3 (experts.every) must be"),
    (["--moe-experts", "4", "--pack"],
     "--moe-experts=4 (experts.num) with --pack (data.pack) is not supported"),
])
def test_train_moe_bad_input(argv, words):
    """tpkit-train's MoE options: one line naming the value, before any process group."""
    from jobs import refusal
    assert words in refusal(argv)


def test_train_moe_fp8_accepted():
    """--precision fp8 with --moe-experts (once refused: expert GEMMs had no fp8 path) and
    every fp8 recipe pass tpkit-train's checks; the runs: test_train_moe_same_curve_at_every_ep."""
    from tpkit.train import parse
    for recipe in ("delayed", "current", "block", "mxfp8"):
        job, _ = parse(MOE + ["--ep", "2", "--precision", "fp8", "--fp8-recipe", recipe])
        assert (job.experts.num, job.precision.mode, job.precision.fp8_recipe) == \
            (4, "fp8", recipe)
