"""Helpers for the layer tests: run a parallel module and its single-process reference on
the same full weights and inputs, and compare outputs, input grads and gathered weight
grads. Imported by worker processes, so everything here is module-level."""
from __future__ import annotations

import torch

TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the reference's max magnitude."""
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def assert_close(a, b, what: str, tol: float = TOL) -> None:
    r = rel(a, b)
    assert r <= tol, f"{what}: relative error {r:.3e} > {tol:.0e}"


def shard(t: torch.Tensor, dim: int, state) -> torch.Tensor:
    return t.chunk(state.tp_size, dim)[state.tp_rank]


def seq_shard(t: torch.Tensor, state, sp: bool) -> torch.Tensor:
    return shard(t, 0, state).clone() if sp else t.clone()


def check_weight_grads(par, ref, state, what: str, tol: float = TOL) -> None:
    """Gather every parallel grad (generically, like tpkit.checkpoint) and compare with
    the reference's; sequence-parallel params are summed over TP first."""
    import torch.distributed as dist
    from tpkit.checkpoint import gather_param
    from tpkit.nn import sync_sequence_parallel_grads
    sync_sequence_parallel_grads(par, state)
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in par.named_parameters()]
    assert sorted(names) == sorted(ref_params), (names, list(ref_params))
    for name, p in par.named_parameters():
        g = p.grad
        assert g is not None, f"{what}: {name} got no gradient"
        dim = getattr(p, "tp_partition_dim", None)
        if dim is not None:
            g = gather_param(g, dim, getattr(p, "tp_partition_sizes", None), state.tp_group)
        assert_close(g, ref_params[name].grad, f"{what}: grad of {name}", tol)
        # every rank must end with the same full gradient
        if dist.get_world_size(state.tp_group) > 1:
            t = g.detach().clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=state.tp_group)
            assert torch.equal(t, g), f"{what}: {name} gradient differs across TP ranks"


# --- single-process references (same state-dict keys as the parallel modules) -----------
class RefMLP(torch.nn.Module):
    def __init__(self, h, ffn, activation="gelu", bias=True):
        super().__init__()
        import torch.nn.functional as F
        gated = activation in ("swiglu", "geglu")
        self.linear_fc1 = torch.nn.Linear(h, ffn * (2 if gated else 1), bias=bias)
        self.linear_fc2 = torch.nn.Linear(ffn, h, bias=bias)
        gelu = lambda v: F.gelu(v, approximate="tanh")  # noqa: E731  (TE's "gelu")
        self.act = {"gelu": gelu, "relu": F.relu, "silu": F.silu, "swiglu": F.silu,
                    "geglu": gelu}[activation]
        self.gated = gated

    def forward(self, x):
        h = self.linear_fc1(x)
        if self.gated:
            n = h.shape[-1] // 2
            h = self.act(h[..., :n]) * h[..., n:]
        else:
            h = self.act(h)
        return self.linear_fc2(h)


def ref_rope(t, pos, base=10000.0):
    """Rotate pairs (x_i, x_{i+d/2}) by pos * base**(-2i/d): TE's non-interleaved RoPE."""
    d = t.shape[-1]
    i = torch.arange(d // 2, dtype=torch.float64)
    ang = pos.double()[:, None] * base ** (-2 * i / d)            # [s, d/2]
    cos, sin = ang.cos()[:, None, None, :].to(t.dtype), ang.sin()[:, None, None, :].to(t.dtype)
    x1, x2 = t[..., : d // 2], t[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class RefAttention(torch.nn.Module):
    """Explicit softmax attention; fused qkv weight laid out [Q; K; V]."""

    def __init__(self, h, heads, groups=None, causal=True, bias=True):
        super().__init__()
        groups = groups or heads
        self.heads, self.groups, self.d, self.causal = heads, groups, h // heads, causal
        self.linear_qkv = torch.nn.Linear(h, (heads + 2 * groups) * self.d, bias=bias)
        self.linear_proj = torch.nn.Linear(heads * self.d, h, bias=bias)

    def forward(self, x, rope_pos=None):
        s, b, _ = x.shape
        d, H, G = self.d, self.heads, self.groups
        q, k, v = self.linear_qkv(x).split([H * d, G * d, G * d], -1)
        q, k, v = q.reshape(s, b, H, d), k.reshape(s, b, G, d), v.reshape(s, b, G, d)
        if rope_pos is not None:
            q, k = ref_rope(q, rope_pos), ref_rope(k, rope_pos)
        k = k.repeat_interleave(H // G, dim=2)
        v = v.repeat_interleave(H // G, dim=2)
        scores = torch.einsum("sbhd,tbhd->bhst", q, k) / d ** 0.5
        if self.causal:
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v)
        return self.linear_proj(out.reshape(s, b, H * d))


class RefTransformerLayer(torch.nn.Module):
    def __init__(self, h, ffn, heads, groups=None, normalization="LayerNorm",
                 activation="gelu", eps=1e-5):
        super().__init__()
        norm = (lambda: torch.nn.LayerNorm(h, eps=eps)) if normalization == "LayerNorm" \
            else (lambda: torch.nn.RMSNorm(h, eps=eps))
        self.input_layernorm = norm()
        self.self_attention = RefAttention(h, heads, groups)
        self.pre_mlp_layernorm = norm()
        self.mlp = RefMLP(h, ffn, activation)

    def forward(self, x, rope_pos=None):
        x = x + self.self_attention(self.input_layernorm(x), rope_pos)
        return x + self.mlp(self.pre_mlp_layernorm(x))


def randomize(module, seed=0):
    """Non-trivial weights everywhere (norm gains around 1), reproducibly."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g) * 0.3
            p.copy_(r + 1 if "layernorm.weight" in name else r)
