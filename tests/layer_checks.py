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
