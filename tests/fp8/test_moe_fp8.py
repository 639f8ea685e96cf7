"""fp8 of expert GEMMs (tpkit.nn.MoE inside tpkit.fp8.fp8_autocast) at expert layouts vs a
single-process per-expert fp8 reference written here: the casts are torch's float8 dtypes
(E4M3 values and weights, E5M2 gradients for HYBRID) and the scale formulas are written
here, never tpkit's quantiser. The reference runs the whole global batch (every dp
replica's tokens) through each expert's own GEMMs, each (expert, role) with its own scale:

- delayed: the scale of step k is ``fp8_max / (max amax of steps < k)`` per *global*
  expert (1 before any amax; an expert no token reached keeps its scale), the amax being
  over every token the expert saw in the global batch and over its whole weight (all etp
  shards), so every layout gives the reference's scales (input and weight bitwise);
- current: ``fp8_max / amax`` of the tensor the rank's GEMM sees: the expert's tokens
  (edp = 1 here: one rank sees all of them) and, under etp > 1, the etp shard of the
  weight and of the expert's hidden activation and its gradient;
- block / mxfp8: one scale per block along the contracted dimension (every dimension is
  at most one block here: power-of-two scales for "block" and a 128x128 tile for the
  weight, E8M0 rounded up for "mxfp8").

Outputs, the input gradient, the router's and every expert shard's gradient are compared
after the reductions a training loop does, step by step; delayed scaling's
``moe.fp8_meta_fc1/fc2.scale`` equal the reference's on every rank (input and weight
scales bitwise; gradient scales to float32 rounding, the backward's sums running in
another order at another layout); a recomputed (tpkit.recompute.checkpoint) step
replays the same scales and counts no amax twice."""
import torch

from dist import run

S, B, H, F, E, TOPK = 8, 2, 16, 16, 4, 2
E4M3, E5M2 = (torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)


# --- the reference -------------------------------------------------------------------------
def _cast(t, s, fmt):
    """The saturating fp8 cast of ``t * s``, back in float32."""
    dtype, fmax = fmt
    return (t.float() * s).clamp(-fmax, fmax).to(dtype).float()


class Scales:
    """Per-tensor scales of the reference, keyed (gemm, expert, shard, role)."""

    def __init__(self, recipe):
        self.recipe = recipe
        self.amax, self.scale, self.pending = {}, {}, {}

    def get(self, key, t, fmt):
        if self.recipe == "current":
            a = t.detach().abs().max().float() if t.numel() else torch.tensor(0.0)
            return torch.tensor(fmt[1]) / a if a > 0 else torch.tensor(1.0)
        g, e, _, role = key                    # delayed: one scale per global expert
        k = (g, e, role)
        if t.numel():
            a = t.detach().abs().max().float()
            self.pending[k] = torch.maximum(self.pending.get(k, a), a)
        return self.scale.get(k, torch.tensor(1.0))

    def step_done(self):
        """Delayed: after a step, amaxes of steps so far -> scales (fp8_max / max)."""
        for k, a in self.pending.items():
            self.amax[k] = torch.maximum(self.amax.get(k, a), a)
            fmax = E5M2[1] if k[2] == "grad" else E4M3[1]
            if self.amax[k] > 0:
                self.scale[k] = torch.tensor(fmax, dtype=torch.float32) / self.amax[k]
        self.pending = {}


class PerTensorMM(torch.autograd.Function):
    """x [m, k] @ w [k, n] as an fp8 GEMM: E4M3 operands, the product times
    (1/s_x)(1/s_w); backward: the output gradient cast to E5M2 with its own scale."""

    @staticmethod
    def forward(ctx, x, w, scales, key):
        sx, sw = scales.get(key + ("x",), x, E4M3), scales.get(key + ("w",), w, E4M3)
        xq, wq = _cast(x, sx, E4M3), _cast(w, sw, E4M3)
        ix, iw = 1.0 / sx, 1.0 / sw
        ctx.saved = (xq, wq, ix, iw, scales, key)
        return (xq @ wq) * (ix * iw)

    @staticmethod
    def backward(ctx, g):
        xq, wq, ix, iw, scales, key = ctx.saved
        sg = scales.get(key + ("grad",), g, E5M2)
        gq, ig = _cast(g, sg, E5M2), 1.0 / sg
        return (gq @ wq.t()) * (ig * iw), (xq.t() @ gq) * (ix * ig), None, None


def _block_q(t, dim, recipe, whole=False):
    """``t`` quantized E4M3 with one scale per line along ``dim`` (the contracted one; a
    single block covers it here) or one for the whole tensor, dequantized to float32."""
    a = t.detach().abs().float()
    a = a.amax() if whole else a.amax(dim=dim, keepdim=True)
    if recipe == "block":                      # power of two below 448 / amax
        s = torch.tensor(448.0) / a
        m, e = torch.frexp(s)
        mult = torch.where(a > 0, torch.ldexp(torch.ones_like(s), e - 1), torch.ones_like(s))
    else:                                      # mxfp8: 2**ceil(log2(amax / 448))
        v = a * torch.tensor(1.0 / 448.0)
        m, e = torch.frexp(v)
        inv = torch.ldexp(torch.ones_like(v), torch.where(m == 0.5, e - 1, e))
        mult = torch.where(a > 0, 1.0 / inv, torch.ones_like(v))
    return _cast(t, mult, E4M3) / mult


class BlockMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, recipe):
        two_d = recipe == "block"              # Float8BlockScaling: 128x128 weight tiles
        ctx.saved = (x, w, recipe)
        return _block_q(x, 1, recipe) @ _block_q(w, 0, recipe, two_d)

    @staticmethod
    def backward(ctx, g):
        x, w, recipe = ctx.saved
        two_d = recipe == "block"
        dx = _block_q(g, 1, recipe) @ _block_q(w, 1, recipe, two_d).t()
        dw = _block_q(x, 0, recipe).t() @ _block_q(g, 0, recipe)
        return dx, dw, None


def reference_moe(x, w, recipe, scales, etp):
    """The global batch's tokens ``x`` [T, H] through the router (fp32) and each expert's
    fp8 GEMMs, ``etp`` shards of the expert width each with its own GEMMs (what every etp
    rank computes), the shards' outputs summed."""
    T = x.shape[0]
    scores = torch.softmax(x @ w["router"].t(), -1)
    idx = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices[:, :TOPK]
    probs = scores.gather(1, idx)
    y = torch.zeros(T, H)
    Fl = F // etp
    for e in range(E):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        assert len(tok) <= 32, "the block reference assumes one block along the tokens"
        xe = x[tok]
        out = 0
        for j in range(etp):
            cols = slice(j * Fl, (j + 1) * Fl)
            w1, w2 = w["fc1"][e][:, cols], w["fc2"][e][cols]
            if recipe in ("delayed", "current"):
                h = PerTensorMM.apply(xe, w1, scales, ("fc1", e, j))
                out = out + PerTensorMM.apply(torch.nn.functional.gelu(h, approximate="tanh"),
                                              w2, scales, ("fc2", e, j))
            else:
                h = BlockMM.apply(xe, w1, recipe)
                out = out + BlockMM.apply(torch.nn.functional.gelu(h, approximate="tanh"),
                                          w2, recipe)
        y = y.index_put((tok,), probs[tok, slot, None] * out, accumulate=True)
    return y


# --- the ranks -------------------------------------------------------------------------------
def _rank(case):
    import torch.distributed as dist

    import tpkit
    from tpkit.fp8 import fp8_autocast
    from tpkit.grads import reduce_expert_grads
    from tpkit.nn import MoE
    from tpkit.recompute import checkpoint
    ep, etp, tp, dp = case["layout"]
    recipe, steps = case["recipe"], case["steps"]
    st = tpkit.init_parallel(tp=tp, dp=dp, ep=ep, etp=etp, seed=3)
    assert st.edp_size == 1
    g = torch.Generator().manual_seed(7)
    w = {"router": torch.randn(E, H, generator=g),
         "fc1": torch.randn(E, H, F, generator=g) / 3, "fc2": torch.randn(E, F, H, generator=g) / 3}
    moe = MoE(H, F, E, TOPK, activation="gelu")
    L, Fl = E // ep, F // etp
    lo, cols = st.ep_rank * L, slice(st.etp_rank * Fl, (st.etp_rank + 1) * Fl)
    with torch.no_grad():
        moe.router_weight.copy_(w["router"])
        moe.experts_fc1.copy_(w["fc1"][lo:lo + L][:, :, cols])
        moe.experts_fc2.copy_(w["fc2"][lo:lo + L][:, cols])
    scales = Scales(recipe)
    report = []
    for step in range(steps):
        X = torch.randn(dp, S, B, H, generator=g) * (1 + step)   # amaxes move every step
        G = torch.randn(dp, S, B, H, generator=g)
        ref_w = {k: v.clone().requires_grad_() for k, v in w.items()}
        xr = X.reshape(-1, H).clone().requires_grad_()
        yr = reference_moe(xr, ref_w, recipe, scales, etp)
        (yr * G.reshape(-1, H)).sum().backward()
        scales.step_done()
        moe.zero_grad()
        x = X[st.dp_rank].clone().requires_grad_()
        recompute = case.get("recompute") and step == steps - 1
        with fp8_autocast(recipe=recipe):
            y = checkpoint(moe, x) if recompute else moe(x)
        (y * G[st.dp_rank]).sum().backward()
        dist.all_reduce(moe.router_weight.grad, group=st.dp_cp_group)
        reduce_expert_grads(moe, st, average=False)
        tol = dict(rtol=1e-5, atol=1e-5)
        d = st.dp_rank
        torch.testing.assert_close(y, yr.detach().reshape(dp, S, B, H)[d], **tol)
        torch.testing.assert_close(x.grad, xr.grad.reshape(dp, S, B, H)[d], **tol)
        torch.testing.assert_close(moe.router_weight.grad, ref_w["router"].grad, **tol)
        torch.testing.assert_close(moe.experts_fc1.grad,
                                   ref_w["fc1"].grad[lo:lo + L][:, :, cols], **tol)
        torch.testing.assert_close(moe.experts_fc2.grad,
                                   ref_w["fc2"].grad[lo:lo + L][:, cols], **tol)
        if recipe == "delayed":    # the reference's scales, every expert, every rank
            for name in ("fc1", "fc2"):
                got = getattr(moe, f"fp8_meta_{name}").scale
                want = torch.tensor([[float(scales.scale.get((name, e, role), 1.0))
                                      for e in range(E)] for role in ("x", "w", "grad")])
                # input and weight scales: bitwise (amaxes of the same values); gradient
                # scales: the backward GEMMs' float32 sums run in another order at another
                # layout (matrix shapes), which can move an amax by an ulp
                assert torch.equal(got[:2], want[:2]), (step, name, got, want)
                torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=0)
                report.append(got[:2].tolist())
    tpkit.destroy_parallel()
    return report


def _cases(layout, *recipes, steps=1, **kw):
    return [dict(layout=layout, recipe=r, steps=steps, **kw) for r in recipes]


def _rank_cases(cases):
    return [_rank(c) for c in cases]


def test_expert_fp8_at_two_layouts():
    """(ep, etp, tp, dp) = (2, 1, 1, 2) on 2 ranks: delayed over 3 steps, current, mxfp8;
    (2, 2, 2, 2) on 4 ranks: delayed over 3 steps (the last one recomputed), current,
    block. Delayed scaling's input and weight scales are the same at both layouts and on
    every rank (bitwise)."""
    two = run(_rank_cases, 2, _cases((2, 1, 1, 2), "delayed", steps=3) +
              _cases((2, 1, 1, 2), "current", "mxfp8"))
    four = run(_rank_cases, 4, _cases((2, 2, 2, 2), "delayed", steps=3, recompute=True) +
               _cases((2, 2, 2, 2), "current", "block"))
    scales = [r[0] for r in two + four]
    assert len(scales[0]) == 2 * 3 and all(s == scales[0] for s in scales)
