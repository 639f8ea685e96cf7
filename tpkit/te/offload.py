"""Activation offload with Transformer Engine's semantics (``get_cpu_offload_context``).

``ctx, sync = get_cpu_offload_context(True, num_layers, model_layers)`` gives a context
manager (autograd's saved-tensor hooks) and a synchronizer applied to each layer's output
(``out = sync(out)``: an identity that marks the layer boundary). The tensors that the
first ``num_layers`` of the ``model_layers`` layers save for backward (their activations:
every saved tensor but parameters, their views and what ``mark_not_offload`` marks) leave the compute device when their layer's
synchronizer runs in forward, and come back when the gradient reaches that layer's
output in backward (the layer below is prefetched then too), as TE's handler does.

What moves is the whole storage of a saved tensor (views of one storage share one copy;
they come back as views of one storage, with the same offsets and strides), so the
gradients are bitwise those without offload.

- CUDA: the copies run on two side streams (device to host into pinned memory, host to
  device into fresh device memory) so that they overlap the next layer's forward and the
  layer above's backward; ``record_stream`` keeps a device block until its copy is done.
- CPU: the compute device *is* host memory, so the offloaded copy goes to a separate
  host pool, shared memory (``UntypedStorage.share_memory_``): the same bookkeeping and
  copies, and an allocation anyone can tell apart from the compute device's private
  memory (tests/te/test_offload.py measures both with its own tensor-bytes tracker).

``offload_weights`` is deprecated in TE and has no effect there; the same here (TE's
DeprecationWarning). TE refuses to offload the last layer (``num_layers <=
model_layers - 1``): its activations are needed first in backward.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

__all__ = ["get_cpu_offload_context", "mark_not_offload", "OffloadHandler"]


def mark_not_offload(*tensors: torch.Tensor) -> None:
    """TE's ``mark_not_offload``: these tensors stay where they are when saved for backward
    (tpkit.fp8's fp8 weights mark their codes: the module holds them anyway)."""
    for t in tensors:
        if t is not None:
            t._tpkit_not_offload = True


class _Stored:
    """One offloaded storage: the device storage until its layer commits, then the host
    copy until the backward brings it back."""

    __slots__ = ("device_st", "host", "event", "nbytes", "device", "saved")

    def __init__(self, st: torch.UntypedStorage):
        self.device_st, self.host, self.event = st, None, None
        self.nbytes, self.device = st.nbytes(), st.device
        self.saved = []          # (tensor, version) until the copy: autograd's check


_MODIFIED = ("a tensor saved for backward under get_cpu_offload_context was modified by an "
             "in-place operation before {when} (autograd refuses this without offload too); "
             "use an out-of-place operation")


class _Kept:
    """A saved tensor left where it is, with its version (the saved-tensor hooks take
    autograd's in-place check away; this puts it back)."""

    __slots__ = ("t", "version")

    def __init__(self, t):
        self.t, self.version = t, t._version


def _bytes_of(st: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


class OffloadHandler:
    """The bookkeeping of one ``get_cpu_offload_context``: which layer (group) runs, the
    storages each offloaded group saved, where they are. ``offloaded_bytes``: the bytes
    moved off the compute device so far (each storage counted once)."""

    def __init__(self, num_layers: int, model_layers: int):
        self.num_layers, self.model_layers = num_layers, model_layers
        self.group = 0
        self.groups: dict[int, dict[int, _Stored]] = {}
        self.offloaded_bytes = 0
        self._streams = None

    # --- saved-tensor hooks ------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        base = t._base if t._is_view() else t
        if (self.group >= self.num_layers or not t.numel() or type(t) is not torch.Tensor
                or isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)
                or getattr(t, "_tpkit_not_offload", False)
                or getattr(base, "_tpkit_not_offload", False)):
            return _Kept(t)   # parameters (and their views) stay, as autograd keeps them
        st = t.untyped_storage()
        entries = self.groups.setdefault(self.group, {})
        key = st._cdata
        if key not in entries:
            entries[key] = _Stored(st)
        entries[key].saved.append((t, t._version))
        return (self.group, key, t.dtype, t.storage_offset(), t.size(), t.stride())

    def unpack(self, packed):
        if isinstance(packed, _Kept):
            if packed.t._version != packed.version:
                raise RuntimeError(_MODIFIED.format(when="the backward"))
            return packed.t
        group, key, dtype, offset, size, stride = packed
        entry = self.groups.get(group, {}).get(key)
        if entry is None:
            raise RuntimeError(f"an activation of offloaded layer {group} was read after its "
                               "backward released it (backward twice, retain_graph=True?); "
                               "offloaded activations serve one backward")
        if entry.device_st is None:
            self._reload(entry)
        if entry.event is not None:
            torch.cuda.current_stream().wait_event(entry.event)
        st = entry.device_st
        return torch.empty(0, dtype=dtype, device=st.device).set_(st, offset, size, stride)

    # --- the synchronizer --------------------------------------------------------------
    def commit_forward(self) -> None:
        g = self.group
        if g >= self.model_layers:
            raise ValueError(f"the offload synchronizer ran after {g + 1} layers in one "
                             f"forward, but model_layers={self.model_layers}; pass "
                             "model_layers= the number of layers run under the context")
        if g < self.num_layers:
            for entry in self.groups.get(g, {}).values():
                self._offload(entry)
        self.group += 1

    def commit_backward(self) -> None:
        self.group -= 1
        g = self.group
        self.groups.pop(g + 1, None)          # layer g+1's backward is over
        if g < 0:
            raise RuntimeError("the offload synchronizer's backward ran more often than its "
                               "forward")
        for h in (g, g - 1):                  # this layer now, the one below prefetched
            for entry in self.groups.get(h, {}).values():
                if entry.device_st is None:
                    self._reload(entry)

    # --- copies --------------------------------------------------------------------------
    def _cuda_streams(self):
        if self._streams is None:
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream())
        return self._streams

    def _offload(self, entry: _Stored) -> None:
        if any(t._version != v for t, v in entry.saved):
            raise RuntimeError(_MODIFIED.format(when="its layer's offload synchronizer ran"))
        entry.saved = []
        src = _bytes_of(entry.device_st)
        if entry.device.type == "cuda":
            d2h, _ = self._cuda_streams()
            d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(d2h):
                host = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=True)
                host.copy_(src, non_blocking=True)
                src.record_stream(d2h)
                entry.event = torch.cuda.Event()
                entry.event.record(d2h)
        else:
            host = torch.empty(entry.nbytes, dtype=torch.uint8)
            host.copy_(src)
            host.untyped_storage().share_memory_()
        entry.host, entry.device_st = host, None
        self.offloaded_bytes += entry.nbytes

    def _reload(self, entry: _Stored) -> None:
        host = entry.host
        dev = torch.empty(entry.nbytes, dtype=torch.uint8, device=entry.device)
        if entry.device.type == "cuda":
            _, h2d = self._cuda_streams()
            h2d.wait_stream(torch.cuda.current_stream())   # dev's allocation
            with torch.cuda.stream(h2d):
                h2d.wait_event(entry.event)                # the offload's copy
                dev.copy_(host, non_blocking=True)   # pinned: the host allocator keeps
                dev.record_stream(h2d)               # `host` until the copy is done
                entry.event = torch.cuda.Event()
                entry.event.record(h2d)
        else:
            dev.copy_(host)
        entry.device_st, entry.host = dev.untyped_storage(), None


class _Commit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handler):
        handler.commit_forward()
        ctx.handler = handler
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.handler.commit_backward()
        return g, None


class _Context(contextlib.ContextDecorator):
    def __init__(self, handler: OffloadHandler):
        self.handler = handler
        self._hooks = []

    def __enter__(self):
        hooks = torch.autograd.graph.saved_tensors_hooks(self.handler.pack, self.handler.unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc):
        self._hooks.pop().__exit__(*exc)
        return False


def _check_count(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        hint = (" (TE's older positional order was enabled, num_layers, offload_activations, "
                "offload_weights: pass keywords)" if isinstance(value, bool) else "")
        raise ValueError(f"get_cpu_offload_context({name}={value!r}): must be an int >= "
                         f"{low}{hint}")
    return value


def get_cpu_offload_context(enabled: bool = False, num_layers: int = 1, model_layers: int = 1,
                            offload_activations: bool = True, offload_weights: bool = False):
    """TE's ``get_cpu_offload_context``: ``(context, synchronizer)``. Run each layer's
    forward inside ``context`` and pass its output through ``synchronizer``; the
    activations of the first ``num_layers`` of the ``model_layers`` layers wait for the
    backward off the compute device (module docstring). Disabled: ``(nullcontext(),
    synchronizer)`` where the synchronizer is an identity, as TE's."""
    if not offload_activations and not offload_weights:
        raise ValueError("get_cpu_offload_context(offload_activations=False, "
                         "offload_weights=False) offloads nothing; set "
                         "offload_activations=True")
    if offload_weights:
        warnings.warn("offload_weights is deprecated in Transformer Engine and has no effect "
                      "(the same in tpkit)", DeprecationWarning, stacklevel=2)
        if not offload_activations:
            return contextlib.nullcontext(), (lambda x: x)
    num_layers = _check_count("num_layers", num_layers, 0)
    model_layers = _check_count("model_layers", model_layers, 1)
    if enabled and num_layers > model_layers - 1:
        raise ValueError(f"get_cpu_offload_context(num_layers={num_layers}, model_layers="
                         f"{model_layers}): at most model_layers - 1 = {model_layers - 1} "
                         "layers can be offloaded (the last layer's activations are needed "
                         "first in backward, as in TE)")
    handler = OffloadHandler(num_layers, model_layers)

    def synchronizer(tensor):
        if not isinstance(tensor, torch.Tensor) or not enabled or not (
                torch.is_grad_enabled() and tensor.requires_grad):
            return tensor
        return _Commit.apply(tensor, handler)

    if not enabled:
        return contextlib.nullcontext(), synchronizer
    ctx = _Context(handler)
    ctx.handler = handler
    return ctx, synchronizer
