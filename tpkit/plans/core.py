"""``parallelize(model, plan)``: an existing PyTorch model's layers swapped for tpkit's,
keeping the loaded weights, by a plan of module-name patterns -> styles.

A plan (``Plan``) maps ``fnmatch`` patterns of module names (``"transformer.h.*.mlp.c_fc"``)
to styles; the first pattern that matches a module wins and its submodules are not
visited again. Each style replaces the module by a tpkit layer built from it (the full
weights sharded for this TP rank), under the same attribute and parameter names:

=========================  ==============================================================
style                      what it does
=========================  ==============================================================
``Column()``               ``nn.Linear`` -> ColumnParallelLinear (output features over TP;
                           ``segments``: fused outputs each sharded on its own)
``Row()``                  ``nn.Linear`` -> RowParallelLinear (input features over TP)
``VocabEmbedding()``       ``nn.Embedding`` -> VocabParallelEmbedding (rows over TP)
``VocabHead()``            the output ``nn.Linear`` -> ColumnParallelLinear that gathers the
                           logits (the model's own loss sees the whole vocabulary)
``PositionEmbedding()``    a learned position ``nn.Embedding`` that returns the rows of this
                           rank's CP shard (and SP slice)
``Norm()``                 LayerNorm / RMSNorm (torch's, or any module with ``weight``,
                           optional ``bias`` and ``eps``/``variance_epsilon``) -> tpkit's,
                           sequence-parallel under SP
``Attention(...)``         the attention module -> ``layers.PlannedAttention`` (heads over TP,
                           CP attention, kv heads replicated when fewer than TP ranks)
``Replicate()``            kept as it is, on every TP rank (tagged for the TP gradient sum
                           under SP, where each rank sees only its tokens)
=========================  ==============================================================

Coverage: at tp > 1 every module that owns parameters must be matched (or lie inside a
matched module), and every pattern must match something; otherwise ``ValueError`` names
them. ``plan.shard_inputs`` (a function of ``(args, kwargs, state)``) runs before the
model's forward: it takes the full sequences the user passes and gives the model this CP
rank's shard (and whatever the model needs to agree: position ids, shifted labels).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Callable

import torch
from torch import nn

from .. import nn as tnn
from ..nn._common import divide, local_kv_heads
from ..layout.topology import ParallelState, resolve_state
from .layers import (LayoutPositionEmbedding, PlannedAttention, column, fill, keep,
                     replicated_kv)

__all__ = ["Plan", "Style", "Column", "Row", "VocabEmbedding", "VocabHead",
           "PositionEmbedding", "Norm", "Attention", "Replicate", "parallelize", "ready_plan",
           "READY_PLANS"]


@dataclasses.dataclass(frozen=True)
class _Ctx:
    state: ParallelState
    sequence_parallel: bool
    sequence_dim: int


class Style:
    """A way to parallelize one module (see the module docstring)."""
    kinds: tuple = ()   # module types the style takes (empty: any)

    def check(self, name: str, module: nn.Module) -> None:
        if self.kinds and not isinstance(module, self.kinds):
            raise ValueError(f"plan style {self!r} for module {name!r} needs "
                             f"{' or '.join(k.__name__ for k in self.kinds)}, got "
                             f"{type(module).__name__}")

    def apply(self, name: str, module: nn.Module, ctx: _Ctx) -> nn.Module:
        raise NotImplementedError


# Names of fused projections (gate/up, q/k/v) in the models people bring: Column() on them
# without segments= trains wrong (each rank a slice of the concatenation).
_FUSED = re.compile(r"(gate_up|up_gate|w13|w1_3|qkv|query_key_value|c_attn)", re.I)


@dataclasses.dataclass(frozen=True)
class Column(Style):
    gather_output: bool = False
    segments: tuple | None = None
    kinds = (nn.Linear,)

    def check(self, name, module):
        super().check(name, module)
        fused = _FUSED.search(name.rsplit(".", 1)[-1])
        if fused and self.segments is None and not self.gather_output:
            n = module.out_features
            eg = f"({n // 2}, {n // 2}) for gate/up" if "qkv" not in fused.group(1).lower() \
                and fused.group(1).lower() not in ("query_key_value", "c_attn") \
                else "(q, k, v) sizes, e.g. (heads*d, kv_heads*d, kv_heads*d), for q/k/v"
            raise ValueError(
                f"plan style Column() for {name!r} (nn.Linear {module.in_features} -> {n}): "
                f"the name says it is a fused projection ({fused.group(1)!r}) whose parts "
                "must each be sharded on its own, else every rank holds a slice of the "
                "concatenation and the model trains wrong; pass Column(segments=...) with "
                f"the part sizes, e.g. {eg}, or Column(segments=({n},)) if it is one "
                "projection")

    def apply(self, name, module, ctx):
        return column(module, gather_output=self.gather_output, segments=self.segments,
                      sequence_parallel=ctx.sequence_parallel, sequence_dim=ctx.sequence_dim,
                      state=ctx.state)


@dataclasses.dataclass(frozen=True)
class VocabHead(Style):
    kinds = (nn.Linear,)

    def apply(self, name, module, ctx):
        return column(module, gather_output=True, sequence_parallel=ctx.sequence_parallel,
                      sequence_dim=ctx.sequence_dim, state=ctx.state)


@dataclasses.dataclass(frozen=True)
class Row(Style):
    kinds = (nn.Linear,)

    def apply(self, name, module, ctx):
        w = module.weight
        layer = tnn.RowParallelLinear(
            module.in_features, module.out_features, module.bias is not None,
            input_is_parallel=True, sequence_parallel=ctx.sequence_parallel,
            sequence_dim=ctx.sequence_dim, init_method=keep, state=ctx.state,
            device=w.device, dtype=w.dtype)
        fill(layer.weight, w, 1, None, ctx.state)
        if module.bias is not None:
            fill(layer.bias, module.bias, None, None, ctx.state)
        return layer


@dataclasses.dataclass(frozen=True)
class VocabEmbedding(Style):
    kinds = (nn.Embedding,)

    def apply(self, name, module, ctx):
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ValueError(f"{name!r}: nn.Embedding with max_norm, scale_grad_by_freq or "
                             "sparse is not supported by VocabEmbedding()")
        w = module.weight
        layer = tnn.VocabParallelEmbedding(
            module.num_embeddings, module.embedding_dim, init_method=keep,
            sequence_parallel=ctx.sequence_parallel, sequence_dim=ctx.sequence_dim,
            state=ctx.state, device=w.device, dtype=w.dtype)
        fill(layer.weight, w, 0, None, ctx.state)
        pad = module.padding_idx
        if pad is not None and layer.vocab_start <= pad < layer.vocab_end:
            row = pad - layer.vocab_start   # nn.Embedding never updates the padding row

            def _zero_pad_row(g, row=row):
                g = g.clone()
                g[row] = 0
                return g
            layer.weight.register_hook(_zero_pad_row)
        return layer


@dataclasses.dataclass(frozen=True)
class PositionEmbedding(Style):
    kinds = (nn.Embedding,)

    def apply(self, name, module, ctx):
        return LayoutPositionEmbedding(module, sequence_parallel=ctx.sequence_parallel,
                                 state=ctx.state)


@dataclasses.dataclass(frozen=True)
class Norm(Style):
    """``kind``: "layernorm" or "rmsnorm" (None: RMSNorm when the class name says "RMS");
    ``eps`` (None: the module's ``eps`` / ``variance_epsilon``, else 1e-5)."""
    kind: str | None = None
    eps: float | None = None

    def apply(self, name, module, ctx):
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 1:
            raise ValueError(f"Norm() for module {name!r} ({type(module).__name__}) needs a "
                             "1-D weight")
        kind = self.kind or ("rmsnorm" if "rms" in type(module).__name__.lower()
                             else "layernorm")
        if kind not in ("layernorm", "rmsnorm"):
            raise ValueError(f"Norm(kind={kind!r}) for {name!r}: use 'layernorm' or 'rmsnorm'")
        eps = self.eps
        for attr in ("eps", "variance_epsilon"):
            if eps is None and isinstance(getattr(module, attr, None), float):
                eps = getattr(module, attr)
        eps = 1e-5 if eps is None else eps
        bias = getattr(module, "bias", None)
        kw = dict(sequence_parallel=ctx.sequence_parallel, state=ctx.state, device=w.device,
                  dtype=w.dtype)
        if kind == "rmsnorm":
            if bias is not None:
                raise ValueError(f"Norm(kind='rmsnorm') for {name!r}: the module has a bias")
            layer = tnn.RMSNorm(w.numel(), eps=eps, **kw)
        else:
            layer = tnn.LayerNorm(w.numel(), eps=eps, bias=bias is not None, **kw)
            if bias is not None:
                fill(layer.bias, bias, None, None, ctx.state)
        fill(layer.weight, w, None, None, ctx.state)
        return layer


def _read(module: nn.Module, spec):
    """An int/float as is; a dotted attribute path of ``module``; or a callable of it."""
    if spec is None or isinstance(spec, (int, float)):
        return spec
    if callable(spec):
        return spec(module)
    value = module
    for part in spec.split("."):
        value = getattr(value, part)
    return value


@dataclasses.dataclass(frozen=True)
class Attention(Style):
    """Causal self-attention. ``heads``/``kv_heads``: counts, attribute paths of the
    module (``"n_head"``, ``"config.num_key_value_heads"``) or callables of it (kv_heads
    None: heads). ``qkv``: the fused ``[q; k; v]`` projection's name, or the three names;
    ``out``: the output projection's. ``rope``: None or "hf" (Hugging Face's
    ``position_embeddings=(cos, sin)`` keyword). ``dropout``: attention-probability dropout
    (a number or an attribute path); ``output_dropout``: a submodule applied to the output
    (nanoGPT's ``resid_dropout``). ``returns``: "tensor" or "tuple" (``(out, None)``).
    ``window``: a sliding-window size (number, attribute path or callable; None: none):
    longer sequences are refused, since the attention is plain causal."""
    heads: object = "n_head"
    kv_heads: object = None
    qkv: object = "c_attn"
    out: str = "c_proj"
    rope: str | None = None
    dropout: object = None
    output_dropout: str | None = None
    returns: str = "tensor"
    window: object = None

    def apply(self, name, module, ctx):
        state = ctx.state
        tp = state.tp_size
        heads = _read(module, self.heads)
        kv = _read(module, self.kv_heads) or heads
        names = (self.qkv,) if isinstance(self.qkv, str) else tuple(self.qkv)
        lins = [getattr(module, n, None) for n in names + (self.out,)]
        bad = [n for n, m in zip(names + (self.out,), lins) if not isinstance(m, nn.Linear)]
        if bad:
            raise ValueError(f"Attention() for module {name!r} ({type(module).__name__}): "
                             f"{bad} are not nn.Linear submodules; set qkv=/out= to its "
                             "projections' names")
        q_rows = lins[0].out_features * heads // (heads + 2 * kv) if len(names) == 1 \
            else lins[0].out_features
        head_dim = q_rows // heads
        divide(heads, tp, f"{name}: attention heads")
        local_kv_heads(kv, tp)
        seg = dict(sequence_parallel=False, sequence_dim=ctx.sequence_dim, state=state)
        if len(names) == 1:
            if kv < tp:
                raise ValueError(f"{name!r}: a fused q/k/v projection with {kv} kv heads < "
                                 f"tp={tp} is not supported; use tp <= {kv}")
            qkv = {names[0]: column(lins[0], segments=(heads * head_dim, kv * head_dim,
                                                       kv * head_dim), **seg)}
        elif len(names) == 3:
            qkv = {names[0]: column(lins[0], **seg)}
            for n, lin in zip(names[1:], lins[1:3]):
                qkv[n] = replicated_kv(lin, kv, head_dim, state) if kv < tp \
                    else column(lin, **seg)
        else:
            raise ValueError(f"Attention(qkv={self.qkv!r}): give one fused or three names")
        out = Row().apply(f"{name}.{self.out}", lins[-1], ctx)
        drop = getattr(module, self.output_dropout) if self.output_dropout else None
        p = float(_read(module, self.dropout) or 0.0)
        if self.returns not in ("tensor", "tuple") or self.rope not in (None, "hf"):
            raise ValueError(f"Attention(returns={self.returns!r}, rope={self.rope!r}): "
                             "returns is 'tensor' or 'tuple', rope None or 'hf'")
        window = _read(module, self.window)
        return PlannedAttention(qkv=qkv, out_name=self.out, out=out, heads=heads, kv_heads=kv,
                                head_dim=head_dim, dropout=p, output_dropout=drop, window=window,
                                rope=self.rope, returns=self.returns,
                                batch_first=ctx.sequence_dim == 1,
                                sequence_parallel=ctx.sequence_parallel, state=state)


@dataclasses.dataclass(frozen=True)
class Replicate(Style):
    def apply(self, name, module, ctx):
        if ctx.sequence_parallel:
            for p in module.parameters():
                p.sequence_parallel = True
        return module


@dataclasses.dataclass
class Plan:
    """``layers``: ``{module-name pattern: style}`` (fnmatch; first match wins).
    ``batch_first``: the model's activations are ``[b, s, h]`` (SP shards dim 1).
    ``shard_inputs(args, kwargs, state) -> (args, kwargs)``: called before the root
    module's forward; under CP it must hand the model this rank's shard of every
    sequence (and, where the model needs them, positions and shifted labels); a plan
    without it is refused at cp > 1. ``name``: for messages."""
    layers: dict
    batch_first: bool = True
    shard_inputs: Callable | None = None
    name: str = "plan"


# class name -> plan factory; plans.ready fills it (tpkit.plans imports it)
READY_PLANS: dict = {}


def ready_plan(model) -> Plan:
    """The ready plan for ``model``'s class (or a base class), else ValueError listing the
    classes that have one."""
    for cls in type(model).__mro__:
        factory = READY_PLANS.get(cls.__name__)
        # a factory's ``fits(model)`` tells a same-named class of another layout apart
        if factory is not None and getattr(factory, "fits", lambda m: True)(model):
            return factory()
    raise ValueError(f"no ready plan for {type(model).__name__}; ready plans exist for "
                     f"{sorted(READY_PLANS)}; pass plan={{pattern: style}} (docs/byom.md)")


def _ties(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, parameter name) sharing one Parameter."""
    seen: dict[int, list] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False):
            seen.setdefault(id(p), []).append((mname, pname))
    return [v for v in seen.values() if len(v) > 1]


def _get(model, name):
    return model.get_submodule(name) if name else model


def _set(model, name, new):
    parent, _, attr = name.rpartition(".")
    setattr(_get(model, parent), attr, new)


def parallelize(model: nn.Module, plan: Plan | dict | None = None,
                state: ParallelState | None = None) -> nn.Module:
    """Swap ``model``'s layers for tpkit's by ``plan`` (None: the ready plan for the
    model's class, ``tpkit.plans.ready_plan``), keeping its weights; returns ``model``.
    Also ``parallelize(model, state)`` (``TPKitStrategy(parallelize_fn=tpkit.parallelize)``
    calls it so). Build the optimizer afterwards: the parameters are new tensors."""
    if isinstance(plan, ParallelState):
        plan, state = None, plan
    state = resolve_state(state)
    if plan is None:
        plan = ready_plan(model)
    if isinstance(plan, dict):
        plan = Plan(plan)
    for pattern, style in plan.layers.items():
        if not isinstance(style, Style):
            raise ValueError(f"plan[{pattern!r}] = {style!r} is not a style; use one of "
                             "tpkit.plans' Column(), Row(), VocabEmbedding(), VocabHead(), "
                             "PositionEmbedding(), Norm(), Attention(...), Replicate()")
    if state.cp_size > 1 and plan.shard_inputs is None:
        raise ValueError(f"{plan.name} has no shard_inputs, so under cp={state.cp_size} the "
                         "model would see whole sequences; give the plan a shard_inputs "
                         "function (see docs/byom.md)")
    ctx = _Ctx(state, bool(state.sequence_parallel), 1 if plan.batch_first else 0)
    ties = _ties(model)
    matched: dict[str, str] = {}         # module name -> pattern
    covered: set[str] = set()            # names inside matched modules
    for name, module in list(model.named_modules()):
        if not name or any(name.startswith(c + ".") for c in covered):
            continue
        for pattern, style in plan.layers.items():
            if fnmatch.fnmatchcase(name, pattern):
                style.check(name, module)
                matched[name] = pattern
                covered.add(name)
                break
    unused = [p for p in plan.layers if p not in matched.values()]
    if unused:
        raise ValueError(f"{plan.name}: patterns {unused} match no module of "
                         f"{type(model).__name__}; fix them (module names look like "
                         f"{[n for n, _ in model.named_modules() if n][:4]})")
    if state.tp_size > 1:
        left = [f"{n} ({type(m).__name__})" for n, m in model.named_modules()
                if n not in covered and not any(n.startswith(c + ".") for c in covered)
                and any(True for _ in m.parameters(recurse=False))]
        if left:
            raise ValueError(f"{plan.name} leaves {len(left)} module(s) with parameters "
                             f"unmatched at tp={state.tp_size}: {left[:6]}; add a style for "
                             "each (Replicate() keeps one whole on every TP rank)")
    for name, pattern in matched.items():
        _set(model, name, plan.layers[pattern].apply(name, _get(model, name), ctx))
    _retie(model, ties)
    if plan.shard_inputs is not None:
        fn = plan.shard_inputs

        def _hook(module, args, kwargs):
            return fn(args, kwargs, state)
        model.register_forward_pre_hook(_hook, with_kwargs=True)
    return model


def _retie(model: nn.Module, ties) -> None:
    """Parameters the model shared (tied embeddings) are shared again when both sides got
    the same shard; a tie the plan broke is an error."""
    for group in ties:
        params = []
        for mname, pname in group:
            try:
                params.append(getattr(_get(model, mname), pname))
            except (AttributeError, ValueError):
                params.append(None)
        first = params[0]
        names = [f"{m}.{p}" for m, p in group]
        ok = first is not None and all(
            p is not None and p.shape == first.shape
            and getattr(p, "tp_partition_dim", None) == getattr(first, "tp_partition_dim", None)
            for p in params)
        if not ok:
            raise ValueError(f"the model ties {names}, but the plan shards them differently; "
                             "give both the same sharding (VocabEmbedding() and VocabHead() "
                             "shard the same rows)")
        for (mname, pname), p in zip(group[1:], params[1:]):
            if p is not first:
                setattr(_get(model, mname), pname, first)
