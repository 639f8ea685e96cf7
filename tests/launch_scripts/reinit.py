"""Launched by tests/test_userpath.py (tpkit-launch, torchrun, srun + tpkit-launch): one
process builds and destroys many layouts, the way a user sweeping layouts in a notebook or
a job does, through the public API only.

    reinit.py ROUNDS [--out FILE]

Each round runs every layout of LAYOUTS[world] (the first one with no arguments, i.e. the
layout tpkit-launch exported; then explicit ones, the same layout twice in a row among
them). For each layout every rank checks, against the rank formula of docs/design.md
("Layout and rank order", independent of tpkit's mesh code):
- the tp/cp/dp/pp group ranks, and an all-reduce over every group summing its ranks
  (launched, every rank then prints check_layout.py's ``OK rank=...`` line for the first
  layout: its coordinates, backend and rendezvous id);
- the TP sums of tpkit.nn (shared memory on CPU) through a column -> row parallel MLP
  equal to the same MLP computed whole;
- with cp > 1, float64 DotProductAttention (the layout's comm type, causal) equal to
  float64 SDPA of the full sequence within 1e-10, output and q/k/v gradients; on gloo
  the CP ring groups have their shared-memory transport (released with the layout);
- after destroy_parallel: no current state, the default process group is the *same* one
  (never re-created), the layout's groups are unregistered from torch.distributed, and
  freed: with the cyclic GC off, the process has as many threads after every round as
  after the first (gloo's loop threads of destroyed groups would pile up otherwise).
Launched (RANK set), it then destroys tpkit's default group by hand and checks that
init_parallel() refuses with a RuntimeError (re-creating it on the rendezvous store would
hang). At exit (an atexit hook registered before tpkit's, so it runs after it) the default
group must be gone when tpkit created it. Rank 0 writes a JSON summary to
``--out`` and prints ``REINIT OK``. Tensors live on the layout's device, so the same
script runs on nccl (``--backend nccl``, one rank per GPU).
"""
import argparse
import atexit
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

# (tp, cp, pp, options) per world size; None = take the layout from TPKIT_* (tpkit-launch)
LAYOUTS = {
    1: [None, (1, 1, 1, {}), (1, 1, 1, {})],
    2: [None, (2, 1, 1, {}), (1, 2, 1, {}), (1, 2, 1, {}), (1, 1, 2, {}),
        (2, 1, 1, {"sequence_parallel": True}), (1, 2, 1, {"cp_comm_type": "all_gather"})],
    4: [None, (2, 1, 1, {}), (4, 1, 1, {}), (4, 1, 1, {}), (2, 2, 1, {}),
        (1, 4, 1, {"cp_comm_type": "a2a+p2p", "cp_a2a_size": 2}), (2, 1, 2, {}),
        (1, 2, 1, {"cp_comm_type": "a2a"}), (2, 1, 1, {"sequence_parallel": True})],
    8: [None, (8, 1, 1, {}), (2, 2, 2, {}), (2, 2, 2, {}),
        (2, 4, 1, {"cp_comm_type": "all_gather"}),
        (1, 4, 1, {"cp_comm_type": "a2a+p2p", "cp_a2a_size": 2}), (4, 1, 2, {}),
        (1, 8, 1, {}), (4, 2, 1, {"sequence_parallel": True, "cp_comm_type": "a2a"})],
}


def _at_exit(created_by_tpkit):
    if created_by_tpkit and dist.is_initialized():
        # os.write: print() may be unusable this late in interpreter shutdown
        os.write(2, f"reinit.py: default group still alive at exit on rank "
                    f"{os.environ.get('RANK')}\n".encode())
        os._exit(3)


def expected_groups(rank, world, tp, cp, pp):
    dp = world // (tp * cp * pp)
    t, c, d, p = rank % tp, rank // tp % cp, rank // (tp * cp) % dp, rank // (tp * cp * dp)
    at = lambda t_, c_, d_, p_: t_ + tp * (c_ + cp * (d_ + dp * p_))  # noqa: E731
    return {"tp": [at(i, c, d, p) for i in range(tp)], "cp": [at(t, i, d, p) for i in range(cp)],
            "dp": [at(t, c, i, p) for i in range(dp)], "pp": [at(t, c, d, i) for i in range(pp)]}


def check_mlp(state):
    from tpkit.nn import ColumnParallelLinear, RowParallelLinear
    g = torch.Generator().manual_seed(1)
    h, f, s = 8, 16, 4 * state.tp_size
    w1, w2, x = (t.to(state.device) for t in (
        torch.randn(f, h, generator=g), torch.randn(h, f, generator=g),
        torch.randn(s, 2, h, generator=g)))
    sp = state.sequence_parallel
    fc1 = ColumnParallelLinear(h, f, bias=False, state=state, sequence_parallel=sp)
    fc2 = RowParallelLinear(f, h, bias=False, state=state, sequence_parallel=sp)
    part, r = f // state.tp_size, state.tp_rank
    with torch.no_grad():
        fc1.weight.copy_(w1[r * part:(r + 1) * part])
        fc2.weight.copy_(w2[:, r * part:(r + 1) * part])
    rows = slice(r * s // state.tp_size, (r + 1) * s // state.tp_size) if sp else slice(None)
    got = fc2(F.gelu(fc1(x[rows])))
    want = F.gelu(x @ w1.t()) @ w2.t()
    err = (got - want[rows]).abs().max().item()
    assert err < 1e-4, ("mlp", err)


def check_attention64(state):
    from tpkit.data import shard_sequence, unshard_sequence
    from tpkit.nn import DotProductAttention
    heads, d, s = 4 * state.tp_size, 8, 8 * state.cp_size
    g = torch.Generator().manual_seed(2)
    q, k, v, go = (torch.randn(s, 2, heads, d, generator=g, dtype=torch.float64)
                   .to(state.device) for _ in range(4))
    ref_in = [t.permute(1, 2, 0, 3).clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    ref.backward(go.permute(1, 2, 0, 3))
    hs = slice(state.tp_rank * 4, (state.tp_rank + 1) * 4)
    local = [shard_sequence(t[:, :, hs], 0).contiguous().requires_grad_() for t in (q, k, v)]
    out = DotProductAttention(heads, d, attn_mask_type="causal")(*local)
    out.backward(shard_sequence(go[:, :, hs], 0).flatten(2))
    pairs = [(unshard_sequence(out.detach(), 0), ref.detach().permute(2, 0, 1, 3)[:, :, hs].flatten(2))]
    pairs += [(unshard_sequence(t.grad, 0), r.grad.permute(2, 0, 1, 3)[:, :, hs])
              for t, r in zip(local, ref_in)]
    assert all(a.dtype == torch.float64 for a, _ in pairs)
    err = max((a - b).abs().max().item() for a, b in pairs)
    assert err <= 1e-10, ("float64 attention", state.cp_comm_type, err)
    return err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", type=int)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import tpkit
    from tpkit.comm import shm

    created = not dist.is_initialized()  # true under tpkit-launch/torchrun/srun
    atexit.register(_at_exit, created)  # before tpkit's own hook: runs after it
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    layouts = LAYOUTS[world]
    default_group, cycles, worst64, t0 = None, 0, 0.0, time.perf_counter()
    shm_rings, threads = 0, []
    # the cyclic GC off: a destroyed layout must free its groups (gloo's loop threads) by
    # itself, so the process's threads after every round are those after the first
    gc.disable()
    for rnd in range(args.rounds):
        for lay in layouts:
            if lay is None:
                state = tpkit.init_parallel()
            else:
                tp, cp, pp, opts = lay
                state = tpkit.init_parallel(tp=tp, cp=cp, pp=pp, **opts)
            tp, cp, pp = state.tp_size, state.cp_size, state.pp_size
            if lay is not None:
                assert (tp, cp, pp) == lay[:3], ((tp, cp, pp), lay)
            if default_group is None:
                default_group = dist.group.WORLD
            assert dist.group.WORLD is default_group, "the default group was re-created"
            assert state.world_size == world and state.rank == rank
            for name, ranks in expected_groups(rank, world, tp, cp, pp).items():
                assert state.group_ranks(name) == ranks, (lay, name, state.group_ranks(name), ranks)
                t = torch.tensor([float(rank)], device=state.device)
                dist.all_reduce(t, group=getattr(state, f"{name}_group"))
                assert t.item() == sum(ranks), (lay, name, t.item(), ranks)
            if rnd == 0 and lay is None and "RANK" in os.environ:
                # the layout the launcher exported, reported as check_layout.py does (one
                # write per line: the ranks share one pipe)
                assert state.backend == os.environ.get("TPKIT_BACKEND", state.backend)
                sys.stdout.write(
                    f"OK rank={rank} world={world} local_rank={os.environ['LOCAL_RANK']} "
                    f"tp={state.tp_rank} cp={state.cp_rank} dp={state.dp_rank} "
                    f"backend={state.backend} "
                    f"run_id={os.environ.get('TORCHELASTIC_RUN_ID')} args={sys.argv[1:]}\n")
                sys.stdout.flush()
            check_mlp(state)
            ring = []
            if cp > 1:
                if state.backend == "gloo":   # one host: the ring goes through /dev/shm
                    ring = [g for g in (state.cp_group, state.cp_p2p_group) if g is not None
                            and dist.get_world_size(g) > 1]
                    assert all(shm.get_p2p(g) is not None for g in ring), (lay, "shm p2p")
                    shm_rings += len(ring)
                worst64 = max(worst64, check_attention64(state))
            groups = [g for g in state.all_groups().values() if g is not dist.group.WORLD]
            tpkit.destroy_parallel()
            assert all(shm.get_p2p(g) is None for g in ring), (lay, "shm p2p not released")
            assert not tpkit.is_initialized()
            assert dist.is_initialized() and dist.group.WORLD is default_group, \
                "destroy_parallel destroyed the default process group"
            for g in groups:  # unregistered from torch.distributed (gloo objects stay usable)
                try:
                    dist.get_process_group_ranks(g)
                except KeyError:
                    continue
                raise AssertionError(f"a group of {lay} outlived destroy_parallel")
            del groups, state
            cycles += 1
        threads.append(len(os.listdir("/proc/self/task")))
    # a leak grows the count round after round; a gloo thread of the previous round still
    # exiting on a loaded machine may count once ([8, 7] was seen): no round above the first
    assert max(threads) == threads[0], f"threads after each round grew: {threads}"
    gc.enable()
    recreate_error = None
    if created and "RANK" in os.environ:
        # Destroying tpkit's default group by hand and asking for a layout again would hang
        # on the rendezvous store; it must be a clear error instead, on every rank.
        dist.barrier()
        dist.destroy_process_group()
        try:
            tpkit.init_parallel()
        except RuntimeError as e:
            recreate_error = str(e)
        assert recreate_error and "cannot be created again" in recreate_error, recreate_error
    if rank == 0:
        summary = {"world": world, "cycles": cycles, "layouts": len(layouts),
                   "recreate_error": recreate_error,
                   "float64_attention_max_err": worst64, "shm_p2p_groups": shm_rings,
                   "seconds": round(time.perf_counter() - t0, 2)}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f)
        sys.stdout.write(f"REINIT OK {json.dumps(summary)}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
