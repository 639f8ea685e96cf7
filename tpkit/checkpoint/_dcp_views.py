"""Sharded checkpoints' plumbing shared by save and load: the planners and the safe reader, and
the views that present each rank's local tensors (TP shards, FSDP shards, expert shards,
optimizer state) as the global tensors DCP writes and reads."""
from __future__ import annotations

import io
import os
import re
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._dcp_fs import is_url, verify_files
from ._dcp_verify import load_metadata
from ..comm.collectives import all_gather, group_size
from ..layout.param_tags import is_expert, tp_spec
from ..layout.topology import resolve_state


EXTRA_STATE_SUFFIX = "_extra_state"
SEG_DIM = "seg_dim"


class _Whole:
    """An entry stored as one ``torch.save`` blob of its value (DCP would flatten a dict
    into one entry per leaf, turning its keys into strings): ``data``, made and checked
    to load under ``weights_only=True`` by ``_plain_bytes`` before the write."""

    def __init__(self, value):
        self.value, self.data = value, None


def _plain_bytes(key: str, value) -> bytes:
    """``torch.save(value)``, or ValueError when ``torch.load(weights_only=True)`` could
    not read it back (an object whose loading runs code), naming the entry and type."""
    try:
        buf = io.BytesIO()
        torch.save(value, buf)
        data = buf.getvalue()
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 (UnpicklingError and what weights_only raises)
        raise ValueError(f"checkpoint entry {key!r} {_unsafe_global(e)}, which "
                         "torch.load(weights_only=True) cannot read back; store tensors, "
                         "numbers, strings and lists/tuples/dicts of them (e.g. the object's "
                         "state_dict()) so that loading the checkpoint runs no code") from None
    return data


def _unsafe_global(e: Exception) -> str:
    m = re.search(r"GLOBAL ([\w.]+)", str(e))
    return (f"refers to {m.group(1)}" if m else
            f"holds an object pickle cannot load safely ({type(e).__name__})")


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner, writing a ``_Whole`` entry as its ``torch.save`` blob (``data``)."""

    def transform_object(self, write_item, object):
        if isinstance(object, _Whole):
            return io.BytesIO(object.data)
        return super().transform_object(write_item, object)


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader, reading ``.metadata`` without running code from it and with
    every shard path checked inside the directory (``_dcp_verify.load_metadata``)."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta
        md = load_metadata(os.fspath(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def _reader(path: str):
    """DCP's reader for ``path``, with ``.metadata`` read safely (local or a URL)."""
    if not is_url(path):
        return _SafeReader(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    class _SafeFsspecReader(FsspecReader):
        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta
            md = verify_files(path)   # marker, metadata (no code runs), shard paths, sizes
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md
    return _SafeFsspecReader(path)


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner with plain entries loaded by ``torch.load(weights_only=True)``
    (DCP's own uses ``weights_only=False``). tpkit reads them itself (``_read_plain``);
    this covers any that reach DCP."""

    def load_bytes(self, read_item, value) -> None:
        from torch.distributed.checkpoint._traverse import set_element
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def unwrap_module(module: nn.Module) -> nn.Module:
    """The user module inside DDP (FSDP2 modifies the module in place)."""
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


# --- presenting local tensors as global ones ----------------------------------------------
class _Layout:
    """How a sharded tensor's local piece sits in its global tensor: a DTensor over
    ``mesh`` with ``placements`` (mesh None: a whole tensor); ``dim``/``sizes``/``n``: the
    dim split into segments (global ``sizes``, each sharded ``n`` ways on its own), or
    sizes None."""

    def __init__(self, mesh, placements, dim, sizes, n):
        self.mesh, self.placements, self.dim, self.sizes, self.n = \
            mesh, placements, dim, sizes, n


def _layout(t, state) -> _Layout | None:
    """The global layout of ``t`` (a parameter, or the tags' owner of a state tensor):
    - a TP shard (tpkit's or TE's tags): ``Shard(dim)`` on the 1-D TP mesh;
    - an expert weight (tpkit.nn.MoE) at ep x etp > 1: ``(Shard(0), Shard(etp dim))`` on
      the 2-D (ep, etp) mesh, so the stored tensor holds every expert at its global index
      (dim 0) and every etp column/row; replicated over edp (DCP writes one replica);
    - else None: stored as is (replicated)."""
    if is_expert(t):
        dim, sizes = getattr(t, "etp_partition_dim", None), getattr(t, "etp_partition_sizes", None)
        if state.ep_size * state.etp_size == 1:   # whole; segments stay segments (the format)
            return None if sizes is None else _Layout(None, None, dim, sizes, 1)
        return _Layout(state.expert_mesh, [Shard(0), Replicate() if dim is None else Shard(dim)],
                       dim, sizes, state.etp_size)
    spec = tp_spec(t)
    if spec is None:
        return None
    return _Layout(state.tp_mesh, [Shard(spec[0])], spec[0], spec[1], state.tp_size)


class _Slot:
    """One model/optimizer tensor: its DCP view (tensor, DTensor or dict of segments) and
    how to write the loaded values back into the live tensor."""

    def __init__(self, live: torch.Tensor, layout: _Layout | None, state, *, for_load: bool):
        self.live = live
        self.fsdp = isinstance(live, DTensor)
        if self.fsdp:  # FSDP2 shard over dp(x cp): work on the TP-local full tensor
            local = (torch.empty(live.shape, dtype=live.dtype, device=live.to_local().device)
                     if for_load else _gather_fsdp(live, state.dp_cp_group))
        else:
            local = live.detach()
        self.local = local
        self.layout = layout
        if layout is None:
            self.view = local
            return
        if layout.sizes is None:
            self.view = DTensor.from_local(local, layout.mesh, layout.placements,
                                           run_check=False)
            return
        parts = torch.split(local, [s // layout.n for s in layout.sizes], dim=layout.dim)
        self.view = {f"seg{i}": p if layout.mesh is None else
                     DTensor.from_local(p, layout.mesh, layout.placements, run_check=False)
                     for i, p in enumerate(parts)}
        if not for_load:
            self.view[SEG_DIM] = layout.dim

    def write_back(self) -> None:
        views = self.view.values() if isinstance(self.view, dict) else [self.view]
        locs = [v.to_local() if isinstance(v, DTensor) else v for v in views]
        full = locs[0] if len(locs) == 1 else None
        with torch.no_grad():
            if full is None:  # segments: they are views of self.local unless DCP replaced them
                dim = self.layout.dim
                offset = 0
                for loc in locs:
                    dst = self.local.narrow(dim, offset, loc.shape[dim])
                    if dst.data_ptr() != loc.data_ptr():
                        dst.copy_(loc)
                    offset += loc.shape[dim]
            elif full.data_ptr() != self.local.data_ptr():
                self.local.copy_(full)
            if self.fsdp:
                self.live.to_local().copy_(fsdp_local(self.live, self.local))


def fsdp_local(live: DTensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` (the whole tensor, over dp(x cp)) for the FSDP2
    parameter or state tensor ``live``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(live.shape, live.device_mesh,
                                                          live.placements)
    for d, (n, o) in enumerate(zip(shape, offset)):
        full = full.narrow(d, o, n)
    return full


def _gather_fsdp(t: DTensor, group) -> torch.Tensor:
    """The full tensor of an FSDP2 ``Shard(0)`` DTensor over the dp(x cp) ``group``, with
    one all-gather. Not ``t.full_tensor()``: torch caches DTensor specs/plans by mesh
    *layout*, so after a layout is destroyed and rebuilt in one process (tests) a DTensor's
    mesh can name dead groups; the current state's group is always the live one."""
    hsdp = t.device_mesh.ndim == 2 and tuple(t.placements) == (Replicate(), Shard(0))
    if not hsdp and (t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),)):
        raise ValueError(f"FSDP parameter placements {t.placements} on a {t.device_mesh.ndim}-D "
                         "mesh are not supported; use TPKitStrategy(data_parallel='fsdp')")
    if hsdp:   # HSDP (replicate, shard): every replica holds the whole; gather one's shards
        group = t.device_mesh.get_group(1)
    n = group_size(group)
    assert n == t.device_mesh.size(t.device_mesh.ndim - 1), \
        "FSDP mesh is not the state's dp x cp mesh"
    rows = -(-t.shape[0] // n)  # torch.chunk's chunk size
    with torch.no_grad():
        local = t.to_local().detach()
        padded = local.new_zeros((rows, *t.shape[1:]))
        padded[: local.shape[0]] = local
        out = all_gather(padded, group)
        sizes = [c.shape[0] for c in torch.empty(t.shape[0]).chunk(n)]
        return torch.cat([out[i * rows: i * rows + c] for i, c in enumerate(sizes)], 0)


# --- fewer kv heads than tp: one process's names ----------------------------------------
def _replicated_kv(modules) -> dict[int, int]:
    """``{id(parameter): rows of one segment}`` for the ``linear_kv`` weight and bias of every
    attention with fewer kv heads than tp (tpkit.nn.ReplicatedKV: ``linear_qkv`` holds the
    queries, ``linear_kv`` the whole [K; V]). The checkpoint stores them under one
    process's names, the fused ``linear_qkv``'s segments (seg0 Q, seg1 K, seg2 V), so a
    checkpoint resumes at any tp."""
    out = {}
    for m in modules:
        for mod in unwrap_module(m).modules():
            if getattr(mod, "replicated_kv", False) and hasattr(mod, "linear_kv"):
                kv = mod.linear_kv
                for p in (kv.weight, kv.bias):
                    if p is not None:
                        out[id(p)] = kv.kv_heads * kv.head_dim
    return out


def _kv_layout(rows: int) -> _Layout:
    """A replicated [K; V] as two whole segments (the fused tensor's seg1 and seg2)."""
    return _Layout(None, None, 0, (rows, rows), 1)


def _fused_name(kv_name: str) -> str:
    head, _, kind = kv_name.rpartition(".linear_kv.")
    return f"{head}.linear_qkv.{kind}"


def _fuse_kv(views: dict, kv_names, follow=None) -> None:
    """Move each ``linear_kv`` entry of ``views`` into its ``linear_qkv`` entry as seg1/seg2
    (dicts of segments, nested one level for optimizer state). Other values of the kv entry
    (the optimizer's ``step``) are the queries' too: ``follow(kv value, q value)``."""
    for name in kv_names:
        q = _fused_name(name)
        if name not in views or q not in views:
            continue
        kv, into = views.pop(name), views[q]
        # new dicts: the queries' segment dict is their _Slot's view (written back alone)
        if "seg0" in kv:
            views[q] = {**into, "seg1": kv["seg0"], "seg2": kv["seg1"]}
            continue
        for k, v in kv.items():
            if isinstance(v, dict) and isinstance(into.get(k), dict):
                into[k] = {**into[k], "seg1": v["seg0"], "seg2": v["seg1"]}
        if follow is not None:
            for k, v in kv.items():
                if not isinstance(v, dict) and k in into:
                    follow(v, into[k])


class _Follow:
    """After a load, the kv parameter's ``step`` takes the queries' (the checkpoint holds
    one, as one process's fused parameter)."""

    def __init__(self, mine, theirs):
        self.mine, self.theirs = mine, theirs

    def write_back(self) -> None:
        if isinstance(self.mine, torch.Tensor) and isinstance(self.theirs, torch.Tensor):
            with torch.no_grad():
                self.mine.copy_(self.theirs)


def _module_views(module, state, slots, *, for_load, keep=None):
    out = {}
    kv = _replicated_kv([module])
    kv_names = []
    for key, value in unwrap_module(module).state_dict(keep_vars=True).items():
        if key.endswith(EXTRA_STATE_SUFFIX):
            continue  # TE fp8 meta: see the module docstring
        if keep is not None and not keep(key, value.detach() if isinstance(value, torch.Tensor)
                                         else value):
            continue
        if isinstance(value, torch.Tensor):
            layout = _kv_layout(kv[id(value)]) if id(value) in kv else _layout(value, state)
            if id(value) in kv:
                kv_names.append(key)
            slot = _Slot(value, layout, state, for_load=for_load)
            slots.append(slot)
            out[key] = slot.view
        else:
            out[key] = value
    _fuse_kv(out, kv_names)
    return out


def _param_names(modules) -> dict[int, tuple[str, torch.Tensor]]:
    names = {}
    for m in modules:
        for n, p in unwrap_module(m).named_parameters():
            names.setdefault(id(p), (n, p))
    return names


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazy state (exp_avg, ...) so DCP can load into it: one step
    with zero gradients and lr=0, which leaves the parameters unchanged."""
    if opt.state:
        return
    for g in opt.param_groups:
        if any(p.grad is not None for p in g["params"]):
            raise ValueError("load the optimizer state before the first backward (a "
                             "parameter already has a gradient)")
    saved = []
    for g in opt.param_groups:
        lr = g.get("lr")
        saved.append(lr.clone() if isinstance(lr, torch.Tensor) else lr)
        if isinstance(lr, torch.Tensor):
            lr.zero_()  # keep the tensor object (capturable/compiled optimizers hold it)
        elif lr is not None:
            g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, saved):
        if isinstance(lr, torch.Tensor):
            g["lr"].copy_(lr)
        elif lr is not None:
            g["lr"] = lr
        for p in g["params"]:
            p.grad = None


def _optimizer_views(opt, names, state, slots, *, for_load, init=True, kv_rows=None):
    if for_load and init:
        _init_optimizer_state(opt)
    groups, per_param = [], {}
    kv_rows, kv_names = kv_rows or {}, set()
    for gi, g in enumerate(opt.param_groups):
        fqns = []
        for p in g["params"]:
            if id(p) not in names:
                raise ValueError(f"optimizer param group {gi} holds a parameter of shape "
                                 f"{tuple(p.shape)} that belongs to no module in the state "
                                 "dict; put the module in the same state dict as its optimizer")
            fqn, _ = names[id(p)]
            fqns.append(fqn)
            entry = {}
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    layout = _layout(p, state) if v.shape == p.shape and v.dim() > 0 else None
                    if kv_rows.get(id(p)) and layout is None and v.dim() > 0:
                        layout = _kv_layout(kv_rows[id(p)])
                        kv_names.add(fqn)
                    slot = _Slot(v, layout, state, for_load=for_load)
                    slots.append(slot)
                    entry[k] = slot.view
                else:
                    entry[k] = v
            per_param[fqn] = entry
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": fqns})
    _fuse_kv(per_param, sorted(kv_names),
             follow=(lambda mine, theirs: slots.append(_Follow(mine, theirs))) if for_load
             else None)
    return {"state": per_param, "param_groups": groups}


def _build(state_dict: dict, *, for_load: bool, filter: dict | None = None,
           init_optimizers: bool = True, state=None):
    """DCP views of the modules and optimizers in ``state_dict`` (tensors presented at their
    global shapes, see _Slot); on save, every other entry wrapped whole (_Whole).
    ``filter``: Fabric's ``save(filter=...)``, ``{key: fn(name, value) -> keep}`` applied to
    the items of that entry's state dict; an entry with no item left is not saved.
    ``init_optimizers=False``: optimizers without state are not stepped to create it
    (``verify`` only looks). ``state``: the layout (default: the current one)."""
    state = resolve_state(state)
    filter = filter or {}
    modules = [v for v in state_dict.values() if isinstance(v, nn.Module)]
    names = _param_names(modules)
    slots: list[_Slot] = []
    out: dict[str, Any] = {}
    for key, obj in state_dict.items():
        keep = filter.get(key)
        if isinstance(obj, nn.Module):
            view = _module_views(obj, state, slots, for_load=for_load, keep=keep)
        elif isinstance(obj, torch.optim.Optimizer):
            view = _optimizer_views(obj, names, state, slots, for_load=for_load,
                                    init=init_optimizers, kv_rows=_replicated_kv(modules))
        else:
            assert not for_load, "plain entries are read whole (read)"
            view = obj.state_dict() if _stateful(obj) else obj
        if keep is not None and isinstance(view, dict) and not isinstance(obj, nn.Module):
            view = {k: v for k, v in view.items() if keep(k, v)}   # modules: _module_views
        if keep is not None and isinstance(view, dict) and not view:
            continue  # as Fabric's own filter: nothing kept, no entry
        out[key] = view if isinstance(obj, (nn.Module, torch.optim.Optimizer)) else _Whole(view)
    return out, slots


def _stateful(obj) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")


def _check_filter(filter, state_dict) -> None:
    """Fabric.save's own checks (and exception types), for direct callers."""
    if filter is None:
        return
    if not isinstance(filter, dict):
        raise TypeError(f"filter should be a dict of {{key: callable}}, got {filter!r}")
    if not set(filter) <= set(state_dict):
        raise ValueError(f"the filter keys {sorted(set(filter) - set(state_dict))} are not "
                         f"state keys {sorted(state_dict)}")
    for k, fn in filter.items():
        if not callable(fn):
            raise TypeError(f"filter[{k!r}] must be a callable (name, value) -> bool, got {fn!r}")
