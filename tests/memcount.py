"""Live tensor bytes, measured independently of tpkit.memory (issue 38's reference).

``LiveBytes`` is a TorchDispatchMode that registers the storage of every tensor an op
returns (and every parameter, gradient and optimizer state handed to ``track``), keeps
the sum of the bytes of the storages still alive (a weakref finalizer subtracts a storage
when it dies; ``UntypedStorage.resize_``, which FSDP2 uses to free and refill its
unsharded parameters, is followed too) and records the peak. It knows nothing of
layers, layouts or the estimator's terms: only storages.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}      # storage key -> bytes
        self.now = 0
        self.peak = 0
        self._orig_resize = None
        self.names = None      # storage key -> (op, shape) when set to a dict (debugging)

    # --- bookkeeping ---------------------------------------------------------------
    def _add(self, st: torch.UntypedStorage) -> None:
        if st.device.type == "meta":
            return
        key = st._cdata
        if key in self.live:
            return
        n = st.nbytes()
        self.live[key] = n
        self.now += n
        try:
            weakref.finalize(st, self._drop, key)
        except TypeError:   # storages without weakref support: count them as kept
            pass
        self.peak = max(self.peak, self.now)

    def _drop(self, key: int) -> None:
        n = self.live.pop(key, 0)
        self.now -= n

    def track(self, *tensors) -> None:
        """Count tensors that exist already (parameters, gradients, optimizer states)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._storage(t)

    def _storage(self, t: torch.Tensor) -> None:
        try:
            from torch.distributed.tensor import DTensor
            if isinstance(t, DTensor):
                t = t._local_tensor
        except ImportError:
            pass
        if t.is_sparse or t.device.type == "meta":
            return
        if hasattr(type(t), "__tensor_flatten__"):   # a wrapper subclass (torch's protocol):
            for name in t.__tensor_flatten__()[0]:   # its inner tensors hold the bytes
                self._storage(getattr(t, name))
            return
        self._add(t.untyped_storage())

    def reset_peak(self) -> None:
        self.peak = self.now

    # --- the mode ------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                if self.names is not None and t.untyped_storage()._cdata not in self.live:
                    self.names[t.untyped_storage()._cdata] = (str(func), tuple(t.shape))
                self._storage(t)
        return out

    def __enter__(self):
        mode = self
        orig = self._orig_resize = torch.UntypedStorage.resize_

        def resize_(st, size):
            before = st.nbytes()
            r = orig(st, size)
            key = st._cdata
            if key in mode.live:
                mode.live[key] = st.nbytes()
                mode.now += st.nbytes() - before
                mode.peak = max(mode.peak, mode.now)
            elif st.nbytes():
                mode._add(st)
            return r

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)
