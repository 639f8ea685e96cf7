"""One rank of a verification run (the reference, or one rank of a layout): build the
model at the current layout, load the reference's full weights, run ``steps`` training
steps and record what ``compare`` needs, as plain tensors:

- per module call (forward order): its output, the gradient reaching its output, the
  gradient it passes to its input (this call's own contribution), this rank's local
  pieces, as they are;
- per step: every parameter's gradient after tpkit's reductions (the sequence-parallel
  TP sum, the dp x cp sum) and every parameter after the optimizer step, both gathered
  to full tensors with tpkit's full-state-dict machinery (``checkpoint.gather_param``);
- the masks of every ``nn.Dropout`` (one forward before the steps), which are then
  switched off (p = 0, and tpkit's attention dropout) so that values can be compared.

Nothing here compares: ``compare`` does, in the parent process.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..checkpoint import full_state_dict, gather_param, load_full_state_dict
from ..comm.collectives import all_reduce_sum
from ..grads import sync_sequence_parallel_grads
from ..nn._common import ParallelModule
from ..nn.dot_product_attention import DotProductAttention
from ..layout.param_tags import is_sequence_parallel, tp_spec
from ..plans import parallelize
from ..layout.random import model_parallel_seed

__all__ = ["run_rank", "split_batch", "loss_of", "is_tpkit_model", "batch_shape"]


def is_tpkit_model(model: nn.Module) -> bool:
    """Built from tpkit's layers for the current layout (then it is not parallelized
    again: its full weights are loaded by their tags)."""
    return any(isinstance(m, ParallelModule) for m in model.modules()) or any(
        tp_spec(p) is not None or is_sequence_parallel(p) for p in model.parameters())


def _as_call(batch):
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    raise ValueError(f"make_batch returned a {type(batch).__name__}; return the model's "
                     "arguments: a tensor, a tuple of positional arguments or a dict of "
                     "keyword arguments")


def batch_shape(batch) -> tuple[int, int]:
    """(batch size, sequence length) of the first 2-D integer tensor of the batch."""
    args, kwargs = _as_call(batch)
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point():
            return int(t.shape[0]), int(t.shape[1])
    raise ValueError("make_batch(step) must return the full batch with at least one 2-D "
                     "integer tensor [batch, sequence] (the token ids); got "
                     f"{[type(t).__name__ for t in list(args) + list(kwargs.values())]}")


def split_batch(batch, rows: int, dp: int, dp_rank: int):
    """This DP replica's rows of every tensor whose first dim is the batch."""
    args, kwargs = _as_call(batch)

    def cut(t):
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == rows and dp > 1:
            return t.chunk(dp, 0)[dp_rank]
        return t
    return tuple(cut(t) for t in args), {k: cut(v) for k, v in kwargs.items()}


def loss_of(out) -> torch.Tensor:
    """The scalar loss in a model's output: the output itself, its ``.loss`` (Hugging
    Face), or the first 0-dim tensor of a tuple/list (nanoGPT's ``(logits, loss)``)."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    if isinstance(out, (tuple, list)):
        for t in out:
            if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point():
                return t
    raise ValueError(f"the model returned {type(out).__name__}, which holds no scalar loss; "
                     "tpkit.verify needs the model's forward (with the batch make_batch "
                     "returns) to give the loss: a 0-dim tensor, an output with .loss, or a "
                     "tuple holding one")


def _first_float(values):
    for i, t in enumerate(values):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return i, t
    return None, None


class Recorder:
    """Forward pre/post hooks on every module: outputs, output and input gradients by
    ``(module name, call index)``, in forward (completion) order."""

    def __init__(self, model: nn.Module, *, linear_inputs: bool):
        self.linear_inputs = linear_inputs
        self.handles = []
        for name, m in model.named_modules():
            name = name or "(model)"
            self.handles.append(m.register_forward_pre_hook(
                self._pre(name), with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post(name, m),
                                                        with_kwargs=True))
        self.start()

    def start(self):
        self.calls, self.stack, self.pending = {}, {}, []
        self.order, self.out, self.gout, self.gin, self.lin, self.inp = [], {}, {}, {}, {}, {}

    def _store(self, where, key):
        def hook(g):
            where[key] = g.detach().clone()
        return hook

    def _pre(self, name):
        def hook(module, args, kwargs):
            n = self.calls.get(name, 0)
            self.calls[name] = n + 1
            self.stack.setdefault(name, []).append(n)
            self.pending.append(name)
            key = (name, n)
            i, t = _first_float(args)
            where = "args"
            if t is None:
                keys = list(kwargs)
                j, t = _first_float([kwargs[k] for k in keys])
                where, i = "kwargs", (keys[j] if j is not None else None)
            if t is None:
                return None
            self.inp[key] = t.detach().clone()
            if self.linear_inputs and isinstance(module, nn.Linear):
                self.lin[key] = t.detach().clone()
            if not t.requires_grad:
                return None
            t = t.view_as(t)
            t.register_hook(self._store(self.gin, key))
            if where == "args":
                return args[:i] + (t,) + args[i + 1:], kwargs
            return args, {**kwargs, i: t}
        return hook

    def _post(self, name, module):
        def hook(mod, args, kwargs, output):
            n = self.stack[name].pop()
            self.pending.pop()
            key = (name, n)
            self.order.append(key)
            if isinstance(output, torch.Tensor):
                values, rebuild = [output], lambda v: v[0]
            elif isinstance(output, tuple) and not hasattr(output, "_fields"):
                values, rebuild = list(output), tuple
            else:   # a dict / ModelOutput / anything else: its values, recorded only
                vals = list(output.values()) if isinstance(output, dict) else []
                i, t = _first_float(vals)
                if t is not None:
                    self.out[key] = t.detach().clone()
                return None
            i, t = _first_float(values)
            if t is None:
                return None
            self.out[key] = t.detach().clone()
            if not t.requires_grad:
                return None
            t = t.view_as(t)
            t.register_hook(self._store(self.gout, key))
            values[i] = t
            return rebuild(values)
        return hook

    def take(self) -> dict:
        rec = dict(order=list(self.order), out=self.out, gout=self.gout, gin=self.gin,
                   lin=self.lin, inp=self.inp, loss=None, grads={}, params={})
        self.start()
        return rec

    def remove(self):
        for h in self.handles:
            h.remove()


def _dropout_masks(model, args, kwargs) -> dict:
    """One forward in training mode with every active nn.Dropout's input and kept-mask
    recorded (first call of each)."""
    masks, handles = {}, []
    for name, m in model.named_modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            def hook(mod, inp, out, name=name):
                if name not in masks and isinstance(out, torch.Tensor):
                    masks[name] = (inp[0].detach().clone(), (out != 0).detach().clone())
            handles.append(m.register_forward_hook(hook))
    if handles:
        with torch.no_grad():
            model(*args, **kwargs)
    for h in handles:
        h.remove()
    return masks


def _dropout_off(model) -> None:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, DotProductAttention):
            m.attention_dropout = 0.0


def _meta(model) -> dict:
    """Per module: its class and the TP segments of its output (a column-parallel
    layer's fused outputs); per parameter: its owning module and TP tags."""
    mods, params = {}, {}
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        spec = tp_spec(w) if isinstance(w, torch.Tensor) else None
        mods[name or "(model)"] = dict(cls=type(m).__name__,
                                       sizes=spec[1] if spec and spec[0] == 0 else None,
                                       split_dim=spec[0] if spec else None)
        for pname, p in m.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            params[full] = dict(module=name or "(model)",
                                dim=spec_dim(p), sp=is_sequence_parallel(p))
    return dict(modules=mods, params=params)


def spec_dim(p):
    spec = tp_spec(p)
    return spec[0] if spec else None


def _gathered(model, state, grads: bool) -> dict:
    """Every parameter (or its gradient) as a full tensor, named as the model names it."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        spec = tp_spec(p)
        if spec:   # collective: every TP rank gathers, with or without a gradient
            full = gather_param(torch.zeros_like(p) if t is None else t, spec[0], spec[1],
                                state.tp_group)
        out[name] = None if t is None else full if spec else t.detach().clone()
    return out


def run_rank(job: dict, state, full_sd: dict | None) -> dict:
    """Build, load, train ``job["steps"]`` steps and record. ``full_sd`` None: this is
    the reference (the model as built, unparallelized), whose full weights go back."""
    model_parallel_seed(job["seed"], state)   # the same streams for every job
    state.last_sharded_len = None               # no guard state from an earlier job
    model = job["build_model"]()
    if not isinstance(model, nn.Module):
        raise ValueError(f"build_model() returned {type(model).__name__}, not an nn.Module")
    tpkit_model = is_tpkit_model(model)
    reference = full_sd is None
    if reference:
        full_sd = full_state_dict(model, state)
    elif tpkit_model:
        load_full_state_dict(model, full_sd, state)
    else:
        model.load_state_dict(full_sd)
        model = parallelize(model, job["plan"], state)
    model.train()
    meta = _meta(model)
    rows, _ = job["shape"]
    batch0 = split_batch(job["make_batch"](0), rows, state.dp_size, state.dp_rank)
    try:
        masks = {} if reference else _dropout_masks(model, *batch0)
    except Exception:  # noqa: BLE001 - the first step raises it again, where it is recorded
        masks = {}
    _dropout_off(model)
    opt = job["optimizer"](model)
    live = {id(p) for p in model.parameters()}
    held = [p for g in opt.param_groups for p in g["params"]]
    stale = sum(1 for p in held if id(p) not in live)
    missing = sum(1 for p in model.parameters() if p.requires_grad
                  and id(p) not in {id(q) for q in held})
    initial = _gathered(model, state, grads=False)
    rec = Recorder(model, linear_inputs=reference)
    share = state.dp_size * state.cp_size
    steps = []
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if job["precision"] == "bf16-mixed"
                else contextlib.nullcontext())
    error = None
    for step in range(job["steps"]):
        args, kwargs = split_batch(job["make_batch"](step), rows, state.dp_size,
                                   state.dp_rank)
        try:
            with autocast:
                out = model(*args, **kwargs)
            loss = loss_of(out)
            (loss.float() / share).backward()
        except Exception as e:  # noqa: BLE001 - what was recorded so far is compared
            where = rec.pending[-1] if rec.pending else "(model)"
            error = (step, where, f"{type(e).__name__}: {e}".splitlines()[0])
            steps.append(rec.take())
            if reference:
                raise
            break
        sync_sequence_parallel_grads(model, state)
        if share > 1:   # collective: every rank sums every parameter's gradient
            for p in model.parameters():
                g = all_reduce_sum((p.grad if p.grad is not None else torch.zeros_like(p))
                                   .contiguous(), state.dp_cp_group)
                p.grad = g if p.grad is not None or bool(g.any()) else None
        record = rec.take()
        record["loss"] = float(loss.detach())
        record["grads"] = _gathered(model, state, grads=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        record["params"] = _gathered(model, state, grads=False)
        steps.append(record)
    rec.remove()
    return dict(coords=dict(tp=state.tp_rank, cp=state.cp_rank, dp=state.dp_rank),
                meta=meta, steps=steps, masks=masks, stale=stale, missing=missing,
                initial=initial, tpkit_model=tpkit_model, error=error,
                full_sd=full_sd if reference else None)
