"""Mixture of experts with expert parallelism (torch backend): ``MoE``.

A top-k router picks ``top_k`` of ``num_experts`` experts per token; the tokens travel to
the ranks holding their experts and back over the expert groups of the layout
(``ParallelState.ep_group``/``etp_group``, docs/moe.md): Megatron-Core's all-to-all
dispatcher. Per forward, on ``[s, b, h]`` hidden states (``[s/tp, b, h]`` under SP; this
rank's CP shard under CP):

1. *Router* (replicated weight, fp32 or wider): scores (softmax or sigmoid) of every
   local token; the top-k by score, ties going to the lower expert index (a stable sort);
   optional normalisation of the k probabilities; the load-balancing loss and z-loss.
2. *Capacity* (``capacity_factor``): each expert keeps at most
   ``ceil(top_k * T * capacity_factor / num_experts)`` of the ``T`` tokens of one
   sequence (the tp x cp ranks that share it), those with the highest probability (ties:
   the earlier token of the gathered order); the others are dropped for that expert
   (they contribute zero; the residual carries them). Dropless when None.
3. *Dispatch*: without SP the TP ranks hold the same tokens, so each keeps its 1/tp
   slice; the kept (token, expert) pairs are sorted by expert, the per-expert counts are
   exchanged first over ``ep_group``, then the tokens with ``all_to_all_single``; under
   etp > 1 they are all-gathered over ``etp_group`` (each expert-tensor shard sees all
   tokens of its experts).
4. *Experts*: a grouped GEMM over this rank's ``num_experts/ep`` experts (each ``fc1 ->
   act -> fc2``, ``ffn_hidden_size/etp`` wide here): ``grouped_mm``, the one place that
   chooses ``torch._grouped_mm``, a per-expert loop, or (inside tpkit.fp8's autocast,
   installed with ``set_grouped_mm``) emulated fp8 GEMMs with per-expert scales kept by
   global expert index (docs/moe.md, "fp8"); with ``backend="te"``, TE's
   ``GroupedLinear`` on the same weights (``_TEExperts``; TE communicates nothing).
5. *Combine*: the reverse path (reduce-scatter over etp, all-to-all back), the outputs
   weighted by their probabilities and summed per token, plus the shared experts.

The layer returns the output; its auxiliary loss (load balancing + z-loss, already
scaled by their coefficients) is ``moe.aux_loss`` after the forward, as tpkit's models
use their losses: each rank's value is a share whose mean over the CP ranks is the aux
loss of the whole sequence (the same on every TP rank), so adding it to the per-rank
mean loss gives the right gradients when gradients are averaged over dp x cp.

Gradients: expert parameters (tagged ``expert_parallel``, tpkit.layout.param_tags) are summed
over ``edp_group`` (tpkit.grads.reduce_expert_grads), never over dp x cp; the router
weight is tagged ``sequence_parallel`` under SP (a TP sum, as norm weights).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import te
from ..comm.collectives import all_gather, group_rank
from ..layout.param_tags import set_expert_attrs
from ..layout.random import EXPERT_PARALLEL_RNG, get_rng_tracker
from ._backend import build_te, resolve_backend
from ._common import ParallelModule, check_sbh, divide, no_autocast, resolve_sp
from .export import is_onnx_export
from .mappings import gather_from_tp_region, reduce_from_tp_region, scatter_to_sp_region
from .mlp import _GATED, _PLAIN, ACTIVATIONS, ParallelMLP

__all__ = ["MoE", "grouped_mm", "plain_grouped_mm", "set_grouped_mm", "SCORE_FUNCTIONS"]

SCORE_FUNCTIONS = ("softmax", "sigmoid")
# "sequence": the load-balancing loss of each data-parallel replica's micro-batch
# (Megatron-Core's aux_loss); "global": of the whole global batch (its global_aux_loss),
# the same at every layout.
AUX_LOSS_SCOPES = ("sequence", "global")


# --- the grouped GEMM (one place chooses) ------------------------------------------------
def plain_grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of ``x`` ([sum(counts), k]) in groups of ``counts``, group e times ``w[e]``
    ([E, k, n]) -> [sum(counts), n]. ``torch._grouped_mm`` on CUDA bf16 (where the
    installed torch has it), else one matmul per group (any device and dtype)."""
    if (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and w.dtype == torch.bfloat16 and x.shape[0] > 0):
        # pinned memory and a non-blocking copy: no host sync
        offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        offs = offs.pin_memory().to(x.device, non_blocking=True)
        return torch._grouped_mm(x, w, offs=offs)
    outs = [xe @ w[e] for e, xe in enumerate(x.split(counts, 0))]
    return torch.cat(outs, 0) if outs else x.new_zeros(0, w.shape[-1])


def _plain(layer, name, x, w, counts, first_expert, num_experts):
    return plain_grouped_mm(x, w, counts)


_GROUPED_MM = _plain


def set_grouped_mm(fn):
    """Install ``fn(layer, name, x, w, counts, first_expert, num_experts)`` as the grouped
    GEMM of every MoE (None: ``plain_grouped_mm`` again); returns the previous one.
    tpkit.fp8 installs its emulated fp8 grouped GEMM when imported, as nn.linear's
    ``set_matmul`` (docs/design.md, "Layers")."""
    global _GROUPED_MM
    prev, _GROUPED_MM = _GROUPED_MM, (fn or _plain)
    return prev


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int], layer=None,
               name: str = "", first_expert: int = 0, num_experts: int | None = None):
    """The ONE place where expert GEMMs happen: the installed grouped GEMM
    (``plain_grouped_mm`` unless tpkit.fp8 installed its own, which keeps per-expert
    fp8 scales on ``layer`` under ``name`` for the global experts ``first_expert`` ..
    of ``num_experts``)."""
    return _GROUPED_MM(layer, name, x, w, counts, first_expert,
                       w.shape[0] if num_experts is None else num_experts)


# --- variable-size all-to-all with autograd ------------------------------------------------
def _size_hints(counts: list[list[int]], bound: int | None) -> None:
    """Under torch.compile, ``counts`` (token counts read from the device) are unbacked
    sizes: tell the compiler they are sizes (>= 0) and that they sum to at most ``bound``,
    so inductor can lower the slices and splits they give (no effect eagerly)."""
    if not torch.compiler.is_compiling():
        return
    for row in counts:
        for c in row:
            torch._check_is_size(c)
    if bound is not None:
        torch._check(sum(map(sum, counts)) <= bound)


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        back = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
        dist.all_to_all_single(back, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _a2av(x, out_splits, in_splits, group, size):
    """Send ``in_splits[j]`` rows of ``x`` to group rank j, receive ``out_splits[j]`` from
    each (in group-rank order). Identity on a group of one."""
    if size == 1:
        return x
    return _AllToAllV.apply(x, list(out_splits), list(in_splits), group)


def _int_all_to_all(counts: torch.Tensor, group, size: int) -> torch.Tensor:
    """``counts`` [size, n] (row j for rank j) -> [size, n] (row j from rank j)."""
    if size == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


class _RouterState:
    """What one forward's routing decided (kept for the tests and the load logging)."""
    __slots__ = ("indices", "probs", "keep", "tokens_per_expert")


class MoE(ParallelModule):
    """Top-k routed experts (plus optional shared experts) on ``[s, b, h]``.

    ``num_experts`` (global) are split over ``ep`` ranks, each expert's ``fc1``/``fc2``
    over ``etp`` ranks (``ffn_hidden_size`` is one expert's width). ``score_func``:
    "softmax" or "sigmoid"; ``normalize_topk``: divide the k probabilities by their sum;
    ``aux_loss_coeff``: the Switch load-balancing loss ``E * sum_e f_e P_e`` (f_e: the
    share of routed slots taken by e, P_e: e's mean score) times this; ``z_loss_coeff``:
    the mean squared logsumexp of the logits times this; ``capacity_factor``: None is
    dropless, else each expert keeps at most ``ceil(top_k*T*cf/E)`` tokens of a sequence;
    ``shared_ffn_hidden_size``: a ParallelMLP of that width over every token (TP-sharded
    like the dense MLP). Expert weights: ``experts_fc1`` ``[E/ep, h, ffn/etp (x2 gated)]``
    and ``experts_fc2`` ``[E/ep, ffn/etp, h]`` (no biases). ``backend``: "torch" (tpkit's
    grouped GEMM), "te" (Transformer Engine's GroupedLinear for the two expert GEMMs,
    same parameters and state dict; needs TE and CUDA) or "auto" (TE when both are
    there), as the dense layers' ``backend``.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int,
                 top_k: int = 2, *, activation: str = "gelu", score_func: str = "softmax",
                 normalize_topk: bool = False, aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float = 0.0, aux_loss_scope: str = "sequence",
                 capacity_factor: float | None = None,
                 shared_ffn_hidden_size: int | None = None,
                 sequence_parallel: bool | None = None, init_method=None,
                 output_layer_init_method=None, state=None, device=None, dtype=None,
                 backend: str = "torch"):
        super().__init__()
        check_moe_args(num_experts, top_k, capacity_factor, score_func, activation)
        self.backend = resolve_backend(backend)   # "te": TE and CUDA, or it raises
        if aux_loss_scope not in AUX_LOSS_SCOPES:
            raise ValueError(f"aux_loss_scope={aux_loss_scope!r} is unknown; use one of "
                             f"{AUX_LOSS_SCOPES}")
        self.aux_loss_scope = aux_loss_scope
        s = self._bind_state(state)
        self.sequence_parallel = resolve_sp(sequence_parallel, s)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k = num_experts, top_k
        self.local_experts = divide(num_experts, s.ep_size, "num_experts", by="ep")
        self.first_expert = s.ep_rank * self.local_experts
        ffn_local = divide(ffn_hidden_size, s.etp_size, "ffn_hidden_size", by="etp")
        self.score_func, self.normalize_topk = score_func, normalize_topk
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.capacity_factor = capacity_factor
        self.activation = activation
        self._gated = activation in _GATED
        self._act = (_GATED if self._gated else _PLAIN)[activation]
        # as tpkit's other layers: real shards on the layout's device by default, also
        # under Fabric's init_module(empty_init=True), which puts plain modules on meta
        kw = dict(device=s.device if device is None else device, dtype=dtype)
        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden_size, **kw))
        width = ffn_local * (2 if self._gated else 1)
        self.experts_fc1 = nn.Parameter(torch.empty(self.local_experts, hidden_size, width, **kw))
        self.experts_fc2 = nn.Parameter(torch.empty(self.local_experts, ffn_local, hidden_size,
                                                    **kw))
        if self.sequence_parallel:
            self.router_weight.sequence_parallel = True
        set_expert_attrs(self.experts_fc1, num_experts=num_experts, etp_partition_dim=2,
                         etp_partition_sizes=(ffn_hidden_size,) * 2 if self._gated else None)
        set_expert_attrs(self.experts_fc2, num_experts=num_experts, etp_partition_dim=1)
        self._init(init_method, output_layer_init_method)
        # backend "te": the two expert GEMMs are TE GroupedLinear modules (see _TEExperts)
        self.te_experts = _TEExperts(self, s) if self.backend == "te" else None
        self.shared_experts = None
        if shared_ffn_hidden_size:
            self.shared_experts = ParallelMLP(
                hidden_size, shared_ffn_hidden_size, activation=activation, bias=False,
                sequence_parallel=self.sequence_parallel, init_method=init_method,
                output_layer_init_method=output_layer_init_method, state=s, **kw)
        self.aux_loss: torch.Tensor | None = None
        self.last_routing: _RouterState | None = None

    # --- initialisation -----------------------------------------------------------
    def _init(self, init_method, output_init_method):
        """Router: the default stream (replicated on the stage); experts: the tracker's
        expert-parallel stream, distinct per (etp, ep, pp) shard, shared by edp replicas
        (tpkit.layout.random). Tests and train.py load full weights instead."""
        h = self.hidden_size

        def uniform(fan_in):
            return lambda w: nn.init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        with torch.no_grad():
            (init_method or uniform(h))(self.router_weight)
        tracker = get_rng_tracker()
        if EXPERT_PARALLEL_RNG not in tracker.states_:
            if self.state.ep_size * self.state.etp_size > 1:
                raise ValueError("the RNG tracker has no expert-parallel stream, so expert "
                                 "shards would be initialised identically; seed it with "
                                 "tpkit.init_parallel(seed=...) or "
                                 "tpkit.layout.random.model_parallel_seed")
            ctx = torch.no_grad()
        else:
            ctx = tracker.fork(EXPERT_PARALLEL_RNG)
        with torch.no_grad(), ctx:
            (init_method or uniform(h))(self.experts_fc1)
            (output_init_method or init_method or uniform(self.ffn_hidden_size))(self.experts_fc2)

    # --- routing --------------------------------------------------------------------
    def _seq_group(self):
        """The ranks that hold one sequence's tokens: tp x cp under SP, else cp (the TP
        ranks then hold the same tokens)."""
        s = self.state
        if self.sequence_parallel:
            return s.tp_cp_group, s.tp_size * s.cp_size
        return s.cp_group, s.cp_size

    def _aux_group(self):
        """Where the load-balancing counts are summed: the sequence's ranks, or (scope
        "global") those of every data-parallel replica too."""
        s = self.state
        if self.aux_loss_scope == "sequence":
            return self._seq_group()
        if self.sequence_parallel:
            return s.amax_group, s.tp_size * s.cp_size * s.dp_size
        return s.dp_cp_group, s.cp_size * s.dp_size

    def route(self, x: torch.Tensor):
        """Router on tokens ``x`` [T, h] -> (top-k indices [T, k], probabilities [T, k],
        kept mask [T, k], aux loss share); the router runs in fp32 (or wider)."""
        with no_autocast(x.device):   # an autocast would run the logits in its bf16/fp16
            return self._route(x)

    def _route(self, x: torch.Tensor):
        dtype = torch.promote_types(x.dtype, torch.float32)
        logits = x.to(dtype) @ self.router_weight.to(dtype).t()          # [T, E]
        if self.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
        # Stable sort: among equal scores the lower expert index wins (torch.topk does
        # not promise an order for ties).
        idx = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices
        idx = idx[:, : self.top_k]
        probs = scores.gather(1, idx)
        if self.normalize_topk:
            probs = probs / probs.sum(-1, keepdim=True)
        routed = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)
        group, size = self._aux_group()
        counts = routed.sum(0).to(dtype)                                  # [E], pre-drop
        if size > 1:
            counts = all_gather(counts[None], group).sum(0)
        total = x.shape[0] * size                                # T of the sequence (batch)
        aux = logits.new_zeros(())
        if self.aux_loss_coeff:
            p = scores if self.score_func == "softmax" else \
                scores / scores.sum(-1, keepdim=True)
            share = (p.sum(0) * counts).sum() * (
                self.num_experts * self.aux_loss_coeff / (self.top_k * total * total))
            aux = aux + share * size
        if self.z_loss_coeff:
            aux = aux + torch.logsumexp(logits, -1).square().mean() * self.z_loss_coeff
        if self.sequence_parallel and self.state.tp_size > 1:
            # The TP ranks' shares are summed (identity backward, tpkit's g): every TP
            # rank reports the value of its CP rank, as the main loss does.
            aux = reduce_from_tp_region(aux, self.state.tp_group) / self.state.tp_size
        keep = torch.ones_like(idx, dtype=torch.bool)
        if self.capacity_factor is not None:
            group, size = self._seq_group()
            keep = self._capacity_mask(probs.detach(), idx, routed, x.shape[0] * size, group,
                                       size)
        return idx, probs, keep, aux, counts

    def _capacity_mask(self, probs, idx, routed, total, group, size):
        cap = math.ceil(self.top_k * total * self.capacity_factor / self.num_experts)
        dense = torch.full(routed.shape, -1.0, dtype=probs.dtype, device=probs.device)
        dense.scatter_(1, idx, probs)                                      # -1: not routed
        full = all_gather(dense, group) if size > 1 else dense             # [T_seq, E]
        order = torch.sort(full, dim=0, descending=True, stable=True).indices
        kept = torch.zeros_like(full, dtype=torch.bool)
        kept.scatter_(0, order[:cap], True)
        kept &= full >= 0
        mine = kept.chunk(size, 0)[group_rank(group)] if size > 1 else kept
        return mine.gather(1, idx)

    # --- forward --------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        check_sbh(hidden_states, self.hidden_size, type(self).__name__)
        if is_onnx_export():
            raise ValueError("onnx_export(enabled=True) with a MoE layer: its token dispatch "
                             "has data-dependent shapes (tokens per expert), which "
                             "torch.onnx.export cannot trace; MoE models are not exportable "
                             "yet: export a dense model (moe_experts=0)")
        s = self.state
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])                            # [T, h]
        idx, probs, keep, aux, counts = self.route(x)
        self.aux_loss = aux
        r = _RouterState()
        r.indices, r.probs, r.keep, r.tokens_per_expert = idx, probs.detach(), keep, counts
        self.last_routing = r
        split_tp = not self.sequence_parallel and s.tp_size > 1
        if split_tp:
            # The TP ranks hold the same tokens: each dispatches its slice (all-gather of
            # the input gradient backward); the expert outputs are gathered after, and
            # combined on all tokens, so the router's gradient is whole on every TP rank.
            if x.shape[0] % s.tp_size:
                raise ValueError(f"{x.shape[0]} tokens cannot be split over tp={s.tp_size} "
                                 "for expert dispatch; make s*b a multiple of tp or use SP")
            n = x.shape[0] // s.tp_size
            sl = slice(s.tp_rank * n, (s.tp_rank + 1) * n)
            slots = self._dispatch_compute(scatter_to_sp_region(x, s.tp_group), idx[sl],
                                           keep[sl])
            slots = gather_from_tp_region(slots, s.tp_group, dim=0)
        else:
            slots = self._dispatch_compute(x, idx, keep)                  # [T, k, h]
        weights = (probs * keep).to(slots.dtype)
        y = (slots * weights[..., None]).sum(1).reshape(shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(hidden_states)
        return y

    def _dispatch_compute(self, x, idx, keep):
        """Every kept (token, slot)'s expert output, in place: [T, k, h] (zero rows for
        dropped slots).

        Host syncs: the all-to-all split sizes must be on the host, so the per-expert
        counts are copied there once per exchange: ``send`` [ep, L] (one ``tolist``) and,
        when ep x etp > 1, what every rank receives [etp, ep, L] (one more). Everything
        else (the order of the slots by expert, the regrouping of the received rows by
        local expert, TE's fp8 padding) is computed on the device from them: the number
        of syncs per forward does not grow with the number of experts."""
        s = self.state
        E, L, k = self.num_experts, self.local_experts, self.top_k
        # (token, slot) pairs sorted by expert, then token; dropped slots (expert E) last
        flat_e = torch.where(keep, idx, torch.full_like(idx, E)).reshape(-1)   # [T*k]
        order = torch.sort(flat_e, stable=True).indices
        send = torch.zeros(E + 1, dtype=torch.long, device=x.device)
        send = send.scatter_add_(0, flat_e, torch.ones_like(flat_e))[:E].view(s.ep_size, L)
        send_host = send.tolist()                                   # host sync 1
        _size_hints(send_host, flat_e.shape[0])
        in_splits = [sum(row) for row in send_host]
        pos = order[:sum(in_splits)]                                # flat (token, slot)
        xs = x.index_select(0, torch.div(pos, k, rounding_mode="floor"))
        # Per-expert counts first (ep), then the tokens; then the etp gather.
        recv = _int_all_to_all(send, s.ep_group, s.ep_size)                # [ep, L] from j
        recv_all = all_gather(recv[None], s.etp_group) if s.etp_size > 1 else recv[None]
        recv_host = recv_all.tolist() if s.ep_size * s.etp_size > 1 \
            else [send_host]                                        # host sync 2
        for m in recv_host:
            _size_hints(m, None)
        out_splits = [sum(row) for row in recv_host[s.etp_rank if s.etp_size > 1 else 0]]
        xs = _a2av(xs, out_splits, in_splits, s.ep_group, s.ep_size)
        if s.etp_size > 1:
            mine = xs.shape[0]
            lens = [sum(map(sum, m)) for m in recv_host]
            xs = _a2av(xs.repeat(s.etp_size, 1), lens, [mine] * s.etp_size, s.etp_group,
                       s.etp_size)
        # Regroup the received chunks (etp rank, ep source, local expert) by expert: the
        # chunk of each received row, then a stable sort by (expert, chunk).
        c = recv_all.reshape(-1, L)                                        # [(etp*ep), L]
        groups = c.shape[0]
        total = sum(sum(map(sum, m)) for m in recv_host)
        chunk = torch.repeat_interleave(torch.arange(groups * L, device=x.device),
                                        c.reshape(-1), output_size=total)
        perm = torch.sort((chunk % L) * groups + torch.div(chunk, L, rounding_mode="floor"),
                          stable=True).indices
        per_expert = [sum(m[i][e] for m in recv_host for i in range(len(m)))
                      for e in range(L)]
        counts = (per_expert, c.sum(0))                   # host list, device tensor
        h = self._expert_gemm(0, xs.index_select(0, perm), counts)
        if self._gated:
            gate, up = h.chunk(2, dim=-1)
            h = self._act(gate) * up
        else:
            h = self._act(h)
        out = self._expert_gemm(1, h, counts)
        out = torch.empty_like(out).index_copy(0, perm, out)               # back to received
        if s.etp_size > 1:
            out = _a2av(out, [mine] * s.etp_size, lens, s.etp_group, s.etp_size)
            out = out.view(s.etp_size, mine, -1).sum(0)                    # partial sums
        out = _a2av(out, in_splits, out_splits, s.ep_group, s.ep_size)
        # in x's dtype: under an autocast the experts' output is in its low precision, and
        # CUDA's index_copy (unlike CPU autocast's) requires equal dtypes
        slots = x.new_zeros(x.shape[0] * k, x.shape[1]).index_copy(0, pos, out.to(x.dtype))
        return slots.view(x.shape[0], k, x.shape[1])

    def _expert_gemm(self, i: int, x: torch.Tensor, counts) -> torch.Tensor:
        """Expert GEMM ``i`` (0: fc1, 1: fc2) of rows grouped by local expert (``counts``:
        rows per expert as a host list and as a device tensor): tpkit's ``grouped_mm`` or
        TE's GroupedLinear, on the same weights."""
        w = (self.experts_fc1, self.experts_fc2)[i].to(x.dtype)
        if self.te_experts is None:   # tpkit.fp8 keeps its scales by global expert
            return grouped_mm(x, w, counts[0], layer=self, name=("fc1", "fc2")[i],
                              first_expert=self.first_expert, num_experts=self.num_experts)
        return self.te_experts(i, x, w, counts)


class _TEExperts(nn.Module):
    """The expert GEMMs of ``MoE(backend="te")``: two TE ``GroupedLinear`` modules
    (``num_gemms`` = local experts, ``m_splits`` = tokens per local expert), built by
    tpkit.te.make("grouped_linear"): no TE communication (tpkit dispatches), no weights of
    their own. The weights stay the MoE's ``experts_fc1``/``experts_fc2`` (the torch
    backend's names, shapes, tags, RNG stream and checkpoints); each call hands TE expert
    j's ``[out, in]`` matrix as ``weight{j}`` (one transposed copy per forward, whose
    gradient autograd carries back into the MoE's parameter). The modules' fp8 metadata
    (TE's ``_extra_state``) is kept out of the state dict, as tpkit's checkpoints drop it
    for every TE module, so both backends have the same keys."""

    def __init__(self, moe: "MoE", state):
        super().__init__()
        if moe.experts_fc1.dtype == torch.float64:   # dtype=, or the default dtype
            raise ValueError("dtype=torch.float64 is not available with backend='te' "
                             "(TE's GEMMs run in fp32, bf16 or fp16); use dtype=torch.float32 "
                             "or backend='torch'")
        gemms = []
        for w in (moe.experts_fc1, moe.experts_fc2):
            lin = build_te("grouped_linear", state, num_gemms=moe.local_experts,
                           in_features=w.shape[1], out_features=w.shape[2], bias=False,
                           params_dtype=w.dtype, device="meta")
            if getattr(lin, "primary_weights_in_fp8", False):
                raise ValueError("MoE(backend='te') was built under TE's quantized_model_init "
                                 "(fp8 primary weights), which expert weights do not have: "
                                 "they are the MoE's experts_fc1/experts_fc2 in high "
                                 "precision (TE quantizes them per forward under "
                                 "te_autocast); build the MoE outside quantized_model_init")
            for j in range(moe.local_experts):
                delattr(lin, f"weight{j}")   # TE's (deferred, meta) weights: unused
            lin.register_state_dict_post_hook(_drop_extra_state)
            lin.register_load_state_dict_pre_hook(_keep_extra_state)
            gemms.append(lin)
        self.fc1, self.fc2 = gemms

    def forward(self, i: int, x: torch.Tensor, w: torch.Tensor, counts):
        """``counts``: (rows per local expert as a host list, the same on the device).

        Inside TE's fp8 autocast each expert's rows are padded with zero rows to TE's
        alignment (``tpkit.te.fp8_alignment``: cuBLASLt's fp8 wgrad GEMM needs the token
        dimension a multiple of 16 on Hopper and TE's GroupedLinear does not pad), and a
        rank that received no token still runs TE's GEMMs, on one aligned block of zeros:
        TE registers a module's amaxes in its global buffer on the module's first forward
        and MAX-all-reduces the buffers of all ranks position by position, so every rank
        must run every module (zero rows leave the maxima unchanged). Outside fp8, no
        token means an empty product and TE is not called."""
        host, dev = counts
        align = te.fp8_alignment()
        if not align:
            if x.shape[0] == 0:
                return plain_grouped_mm(x, w, host)
            return self._gemm(i, x, w, host)
        padded = [-(-m // align) * align for m in host]
        if not sum(padded):
            padded[0] = align                      # no token: one block of zeros for expert 0
        if padded == host:
            return self._gemm(i, x, w, host)
        # row r of expert e goes to (its padded expert start) + (its offset in e): on the
        # device, from the device counts (no host sync)
        dev_padded = torch.div(dev + (align - 1), align, rounding_mode="floor") * align
        shift = (torch.cumsum(dev_padded, 0) - dev_padded) - (torch.cumsum(dev, 0) - dev)
        dst = torch.arange(x.shape[0], device=x.device) + torch.repeat_interleave(
            shift, dev, output_size=x.shape[0])
        xp = x.new_zeros(sum(padded), x.shape[1]).index_copy(0, dst, x)
        return self._gemm(i, xp, w, padded).index_select(0, dst)

    def _gemm(self, i, x, w, splits):
        lin = (self.fc1, self.fc2)[i]
        wt = w.transpose(1, 2).contiguous()                    # [L, out, in]: TE's layout
        names = [f"weight{j}" for j in range(wt.shape[0])]
        for j, name in enumerate(names):
            lin.__dict__[name] = wt[j]
            lin.__dict__[f"bias{j}"] = x.new_empty(0)          # bias=False, on x's device
        try:
            return lin(x, splits)
        finally:
            for name in names:                                 # no reference past the call
                del lin.__dict__[name]


def _drop_extra_state(module, state_dict, prefix, local_metadata):
    state_dict.pop(prefix + "_extra_state", None)


def _keep_extra_state(module, state_dict, prefix, *args):
    """A state dict without the expert GEMMs' extra state (both backends write none) loads
    strictly: the module's own fp8 metadata is kept."""
    state_dict.setdefault(prefix + "_extra_state", module.get_extra_state())


def check_moe_args(num_experts, top_k, capacity_factor, score_func="softmax",
                   activation="gelu") -> None:
    """The layout-free checks of an MoE's options (ValueError naming the value and the
    fix): launch/train.py runs them before any process group exists."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} must be an integer >= 1")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r} must be an integer between 1 and num_experts="
                         f"{num_experts}; choose top_k <= num_experts")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor!r} must be > 0 (or None for "
                         "dropless routing)")
    if score_func not in SCORE_FUNCTIONS:
        raise ValueError(f"score_func={score_func!r} is unknown; use one of {SCORE_FUNCTIONS}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; use one of "
                         f"{ACTIVATIONS}")
