"""Planted-bug guards for the layers (issue 26): ``skip_bias_add``/``return_bias`` on both
parallel linears, the gated activations' formulas, and recompute re-entering autocast.

References are written here from the definitions (the tanh GELU and SiLU formulas, a
plain float64 matmul of the full weights), never tpkit's own code; every rank's result
is compared, not rank 0's only."""
import math

import torch

from dist import run

H, FFN, S, B = 8, 12, 4, 2


def _gelu_tanh(x):
    """TE's "gelu"/"geglu": 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _silu(x):
    return x / (1.0 + torch.exp(-x))


# --- skip_bias_add / return_bias -------------------------------------------------------------
def _bias_worker(tp):
    import tpkit
    from tpkit.checkpoint import load_full_state_dict
    from tpkit.nn import ColumnParallelLinear, RowParallelLinear
    state = tpkit.init_parallel(tp=tp)
    g = torch.Generator().manual_seed(3)
    w1, b1 = torch.randn(FFN, H, generator=g), torch.randn(FFN, generator=g)
    w2, b2 = torch.randn(H, FFN, generator=g), torch.randn(H, generator=g)
    x = torch.randn(S, B, H, generator=g, dtype=torch.float64).float()
    out = {}
    for flag in ("skip_bias_add", "return_bias", None):
        kw = {} if flag is None else {flag: True}
        col = ColumnParallelLinear(H, FFN, **kw)
        row = RowParallelLinear(FFN, H, **kw)
        load_full_state_dict(col, {"weight": w1, "bias": b1})
        load_full_state_dict(row, {"weight": w2, "bias": b2})
        if flag is None:
            h = col(x)
            y = row(h)
            out[flag] = (h, None, y, None)
        else:
            h, hb = col(x)
            y, yb = row(h)
            out[flag] = (h, hb, y, yb)
    return state.tp_rank, out, (w1, b1, w2, b2, x)


def test_skip_bias_add_returns_the_bias_unadded_on_every_rank():
    for tp in (1, 2):
        for rank, out, (w1, b1, w2, b2, x) in run(_bias_worker, tp, tp):
            xd = x.double()
            h_ref = xd @ w1.double().t()                  # without bias
            h_loc = h_ref.chunk(tp, -1)[rank]
            for flag in ("skip_bias_add", "return_bias"):
                h, hb, y, yb = out[flag]
                torch.testing.assert_close(h.double(), h_loc, rtol=1e-5, atol=1e-5)
                assert torch.equal(hb, b1.chunk(tp, 0)[rank]), (flag, rank)
                # the row layer's input is the column layer's bias-free output
                y_ref = h_ref @ w2.double().t()
                torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-4)
                assert torch.equal(yb, b2), (flag, rank)
            h, _, y, _ = out[None]                        # default: bias added, once
            h_ref = xd @ w1.double().t() + b1.double()
            torch.testing.assert_close(h.double(), h_ref.chunk(tp, -1)[rank], rtol=1e-5,
                                       atol=1e-5)
            torch.testing.assert_close(y.double(), h_ref @ w2.double().t() + b2.double(),
                                       rtol=1e-5, atol=1e-4)


# --- gated and plain activations ----------------------------------------------------------------
ACTS = {"gelu": _gelu_tanh, "relu": lambda t: t.clamp_min(0), "silu": _silu}
GATED = {"geglu": _gelu_tanh, "swiglu": _silu}


def _mlp_worker(tp):
    import tpkit
    from tpkit.checkpoint import load_full_state_dict
    from tpkit.nn import ParallelMLP
    state = tpkit.init_parallel(tp=tp)
    out = {}
    for act in (*ACTS, *GATED):
        g = torch.Generator().manual_seed(7)
        width = 2 * FFN if act in GATED else FFN
        sd = {"linear_fc1.weight": torch.randn(width, H, generator=g),
              "linear_fc1.bias": torch.randn(width, generator=g),
              "linear_fc2.weight": torch.randn(H, FFN, generator=g) / 3,
              "linear_fc2.bias": torch.randn(H, generator=g)}
        x = torch.randn(S, B, H, generator=g)
        mlp = ParallelMLP(H, FFN, activation=act)
        load_full_state_dict(mlp, sd)
        out[act] = (mlp(x), sd, x)
    return state.tp_rank, out


def test_activations_match_their_formulas_on_every_rank():
    for tp in (1, 2):
        for _, out in run(_mlp_worker, tp, tp):
            for act, (y, sd, x) in out.items():
                h = x.double() @ sd["linear_fc1.weight"].double().t() \
                    + sd["linear_fc1.bias"].double()
                if act in GATED:
                    gate, up = h[..., :FFN], h[..., FFN:]     # [gate; up], TE's order
                    a = GATED[act](gate) * up
                else:
                    a = ACTS[act](h)
                ref = a @ sd["linear_fc2.weight"].double().t() + sd["linear_fc2.bias"].double()
                torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5,
                                           msg=lambda m, act=act, tp=tp: f"{act} tp={tp}: {m}")


# --- recompute re-enters autocast ---------------------------------------------------------------
def _recompute_worker(tp):
    import tpkit
    from tpkit.nn import ParallelMLP
    from tpkit.recompute import checkpoint
    state = tpkit.init_parallel(tp=tp, seed=11)
    torch.manual_seed(0)
    mlp = ParallelMLP(H, FFN, activation="swiglu")
    x0 = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    results = {}
    for mode in ("plain", "reentrant", "non_reentrant"):
        x = x0.clone().requires_grad_()
        mlp.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if mode == "plain":
                y = mlp(x)
            else:
                y = checkpoint(mlp, x, use_reentrant=mode == "reentrant")
        y.float().square().sum().backward()
        results[mode] = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    return state.tp_rank, results


def test_recompute_under_bf16_autocast_gives_the_plain_gradients():
    for rank, res in run(_recompute_worker, 2, 2):
        for mode in ("reentrant", "non_reentrant"):
            for a, b in zip(res[mode], res["plain"]):
                assert torch.equal(a, b), (mode, rank)
