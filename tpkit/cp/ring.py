"""The ring driver of context-parallel attention, written once for tpkit.nn's kernels.

Every CP rank holds one shard of queries, keys and values. At step ``i`` of the ring,
rank ``r`` of ``n`` holds the K/V of ``src = (r - i) mod n`` and passes it on to
``r + 1`` while it computes with it (the hop overlaps the block's compute). What a step
computes is the kernel's (``RingBlocks``): the dense kernel's causal trimming of the
load-balanced layout (tpkit.nn.ring_attention), the packed kernel's per-document masks
(tpkit.nn.packed_attention). The driver owns the rest:

- the online softmax: each block's output and log-sum-exp folded into the running ones
  (``merge_into``, also the fused kernels' merge);
- the backward: K/V travel the ring again and the dK/dV accumulator of the block held now
  travels with it, so after ``n`` hops every rank holds the whole gradient of its own
  K/V; only local-sized tensors (q, k, v, out, lse) are saved: O(S/cp) memory;
- the per-call state: a block call's backward gets the state its forward call returned
  (``States``, also the fused kernels'): a dropout mask's generator state here, CUDA's
  philox seed/offset in the fused ops (``BlockOp.needs_state``). Forward and backward
  make the same calls in the same order, and a mismatch is an error naming the kernel.

The fused p2p kernel (tpkit.nn.fused_cp) exchanges pieces pairwise on its own schedule
instead of rotating whole shards; it shares the group (``RingGroup``), the merge and the
states with this driver.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import exchange, group_rank, group_size

KV_TAG, DKV_TAG = 0, 1


def wait(works) -> None:
    for w in works or ():
        w.wait()


def merge_into(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
    """Fold a block result ``(o, l)`` into the running ``(out, lse)`` in place (views ok):
    the online softmax. A row that has seen no key yet and sees none in this block (both
    LSEs -inf: a packed row's padding) stays 0 and -inf. ``o`` is the caller's temporary:
    when it has ``out``'s dtype it is scaled in place (no temporary of its size)."""
    new = torch.logaddexp(lse, l)
    ref = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    w = torch.exp(l - ref).unsqueeze(-1)
    scaled = o.mul_(w) if o.dtype == out.dtype else o * w
    out.mul_(torch.exp(lse - ref).unsqueeze(-1)).add_(scaled)
    lse.copy_(new)


class RingGroup:
    """The ring's group (None: no CP, this rank alone), its size ``n``, this rank, the
    global rank of every group rank (``glob``) and of the next and previous ranks."""

    def __init__(self, group):
        self.group = group
        self.n = 1 if group is None else group_size(group)
        self.rank = 0 if group is None else group_rank(group)
        self.glob = [0] if group is None else [dist.get_global_rank(group, i)
                                               for i in range(self.n)]
        self.nxt = self.glob[(self.rank + 1) % self.n]
        self.prv = self.glob[(self.rank - 1) % self.n]

    def rotate(self, kv: torch.Tensor):
        """Yield ``(src, K/V of src)`` for every step while the next step's K/V is in
        flight (the caller computes with the block it is given)."""
        for step in range(self.n):
            works, nxt_kv = None, None
            if step < self.n - 1:
                nxt_kv = torch.empty_like(kv)
                works = exchange(kv, nxt_kv, self.group, self.nxt, self.prv, KV_TAG)
            yield (self.rank - step) % self.n, kv
            wait(works)
            kv = nxt_kv


_END = object()


class States:
    """The forward's per-call states in call order, for the backward's calls. Where the
    backward needs them (``need``: the op's needs_state, dropout), running out or leaving
    some over is an error naming the kernel: forward and backward ran different
    schedules. Otherwise every call gets None."""

    def __init__(self, states, name: str, need: bool):
        self.need, self.name, self.n = need, name, len(states)
        self.it = iter(states)

    def __call__(self):
        if not self.need:
            return None
        st = next(self.it, _END)
        if st is _END:
            raise RuntimeError(f"{self.name}: the ring's backward needs the state of each "
                               f"forward call and the forward saved only {self.n}: forward "
                               "and backward ran different schedules")
        return st

    def check_done(self):
        if self.need and next(self.it, _END) is not _END:
            raise RuntimeError(f"{self.name}: the ring's backward made fewer calls than "
                               f"the {self.n} its forward saved states for (the schedules "
                               "differ)")


class RingBlocks:
    """What a kernel computes at each ring step, on grouped tensors in the compute dtype
    (q ``[b, g, r, s, d]``, k/v ``[b, g, 1, s, d]``). ``forward`` returns ``(q rows,
    out, lse, state)`` of the block of ``src``'s K/V (None: nothing to compute);
    ``backward`` returns ``(q rows, k rows, dq, dk, dv)`` of the same block (None when
    forward computed none), taking its forward's state from ``states()``."""
    name = "ring"
    needs_state = False

    def forward(self, src: int, q, k, v):
        raise NotImplementedError

    def backward(self, src: int, q, k, v, dout, lse, delta, states: States):
        raise NotImplementedError


class Ring(torch.autograd.Function):
    """Grouped q ``[b, g, r, s, d]`` and k/v ``[b, g, 1, s, d]`` (this rank's shard) ->
    output like q: ``blocks``' block of every step around ``ring`` (a ``RingGroup``),
    merged by LSE, in ``compute dtype`` (at least float32; float64 stays float64)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: RingGroup, blocks: RingBlocks):
        cdt = torch.promote_types(q.dtype, torch.float32)
        qf = q.to(cdt)
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=cdt, device=q.device)
        states = []
        for src, kv in ring.rotate(torch.stack([k, v]).to(cdt).contiguous()):
            res = blocks.forward(src, qf, kv[0], kv[1])
            if res is not None:
                rows, o, l, st = res
                merge_into(out[..., rows, :], lse[..., rows], o, l)
                states.append(st)
                del o, l
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.blocks, ctx.states = ring, blocks, states
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, blocks = ctx.ring, ctx.blocks
        cdt = out.dtype  # forward's compute dtype
        qf, dout = q.to(cdt), dout.to(cdt)
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v]).to(cdt).contiguous()
        dkv = torch.zeros_like(kv)  # gradient of the K/V block held now, travelling with it
        states = States(ctx.states, blocks.name, blocks.needs_state)
        dkv_works = None
        for src, kv in ring.rotate(kv):
            grads = blocks.backward(src, qf, kv[0], kv[1], dout, lse, delta, states)
            wait(dkv_works)  # the accumulator of the K/V held now arrived
            if grads is not None:
                rows, cols, dq_b, dk_b, dv_b = grads
                dq[..., rows, :] += dq_b
                dkv[0][..., cols, :] += dk_b
                dkv[1][..., cols, :] += dv_b
            if ring.n > 1:
                recv = torch.empty_like(dkv)
                dkv_works = exchange(dkv, recv, ring.group, ring.nxt, ring.prv, DKV_TAG)
                dkv = recv
        wait(dkv_works)  # after n hops the accumulator of our own K/V is back
        states.check_done()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None
