"""Sharded, reshardable checkpoints with torch.distributed.checkpoint (DCP).

Re-exported as ``tpkit.checkpoint.save`` / ``tpkit.checkpoint.load``.

Format: one DCP directory. Every tensor is stored under its *global* shape, so a
checkpoint written at one layout loads at any other (tp, cp, dp change freely):
- a parameter sharded over TP (tpkit's ``tp_partition_dim``, or TE's ``partition_dim``
  with ``tensor_model_parallel=True``) is presented to DCP as a DTensor view of the local
  shard with ``Shard(dim)`` on the 1-D TP mesh. It is replicated over dp/cp, and DCP's
  planner de-duplicates identical chunks, so exactly one replica writes each chunk;
- a parameter with ``tp_partition_sizes`` (fused q/k/v, gate/up: each segment sharded on
  its own) is stored as one entry per segment, ``<key>.seg<i>``, plus ``<key>.seg_dim``
  (the dim they concatenate along, read back by ``read``);
- an expert weight (tpkit.nn.MoE: this ep rank's ``E/ep`` experts in dim 0, its etp shard
  along ``etp_partition_dim``) is a DTensor with ``(Shard(0), Shard(etp dim))`` on the
  2-D (ep, etp) mesh (``ParallelState.expert_mesh``): stored as all ``E`` experts, each
  at its global index, so it reloads at any ep/etp; replicated over edp (de-duplicated
  like TP chunks); gated ``experts_fc1`` per segment (``etp_partition_sizes``) at every
  layout, ep=etp=1 included (plain tensors there);
- replicated tensors (norms, the step counter) are plain tensors, written once;
- every other entry (plain values, ``state_dict()`` of other objects) is stored whole, one
  ``torch.save`` blob as written by one rank (``_Whole``), so it reads back exactly: nested
  dicts, their key types, tuples, tensors. Only what ``torch.load(weights_only=True)``
  reads (tensors, numbers, strings, containers of them) may be saved: checked before the
  write, and read back that way, so loading a checkpoint never runs code from it (the
  ``.metadata`` too, see ``_dcp_verify``);
- optimizer state is keyed by parameter name (not by index) and every state tensor shaped
  like its parameter (Adam's exp_avg/exp_avg_sq) gets the parameter's sharding;
- FSDP2 parameters (DTensors over the dp(x cp) mesh) are gathered to the TP-local tensor
  on save and re-sliced on load;
- TE ``_extra_state`` (fp8 amax history and scales) is dropped: it is per-rank
  calibration state tied to the amax group of the writing layout, not a model weight,
  and TE rebuilds it within ``amax_history_len`` steps. fp8 runs therefore resume with
  fresh scaling factors (the first steps after a resume can differ slightly).

Saves are atomic: ranks write into ``<path>.tmp-<job>-<id>``; after a barrier rank 0 swaps
it into place (``_dcp_verify.replace_dir``: an atomic exchange, the parent directory
fsynced), so a crash mid-save leaves the previous checkpoint at ``path`` untouched. A
``path`` that is a symbolic link is refused on every rank before anyone writes.
``async_save`` keeps the guarantee: rank 0 renames only after the background write
finished on every rank.
"""
from __future__ import annotations

import io
import os
import re
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import _dcp_fs as fs
from ._dcp_fs import checkpoint_dir, is_url, verify_files
from ._dcp_verify import (agree, check_mode, dir_problem, link_problem,
                          load_metadata, replace_dir, set_mode, staging_path)
from ..comm.collectives import all_gather, group_size
from ..param_tags import is_expert, tp_spec
from ..topology import resolve_state

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
    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        raise ValueError(f"FSDP parameter placements {t.placements} on a {t.device_mesh.ndim}-D "
                         "mesh are not supported; use TPKitStrategy(data_parallel='fsdp')")
    n = group_size(group)
    assert n == t.device_mesh.size(), "FSDP mesh is not the state's dp x cp mesh"
    rows = -(-t.shape[0] // n)  # torch.chunk's chunk size
    with torch.no_grad():
        local = t.to_local().detach()
        padded = local.new_zeros((rows, *t.shape[1:]))
        padded[: local.shape[0]] = local
        out = all_gather(padded, group)
        sizes = [c.shape[0] for c in torch.empty(t.shape[0]).chunk(n)]
        return torch.cat([out[i * rows: i * rows + c] for i, c in enumerate(sizes)], 0)


def _module_views(module, state, slots, *, for_load, keep=None):
    out = {}
    for key, value in unwrap_module(module).state_dict(keep_vars=True).items():
        if key.endswith(EXTRA_STATE_SUFFIX):
            continue  # TE fp8 meta: see the module docstring
        if keep is not None and not keep(key, value.detach() if isinstance(value, torch.Tensor)
                                         else value):
            continue
        if isinstance(value, torch.Tensor):
            slot = _Slot(value, _layout(value, state), state, for_load=for_load)
            slots.append(slot)
            out[key] = slot.view
        else:
            out[key] = value
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


def _optimizer_views(opt, names, state, slots, *, for_load, init=True):
    if for_load and init:
        _init_optimizer_state(opt)
    groups, per_param = [], {}
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
                    slot = _Slot(v, layout, state, for_load=for_load)
                    slots.append(slot)
                    entry[k] = slot.view
                else:
                    entry[k] = v
            per_param[fqn] = entry
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": fqns})
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
                                    init=init_optimizers)
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


# --- save ------------------------------------------------------------------------------
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _staging_name(path: str, mode: int | None) -> str:
    """``<path>.tmp-<job>-<id>`` (``_dcp_verify.staging_path``), chosen by rank 0 and the
    same on every rank; with ``mode``, rank 0 creates it first, private (0o700), so no
    one else reads the files while they are written. Collective."""
    name = [None]
    if _rank() == 0 and is_url(path):   # no atomic rename: in place, complete at the marker
        fs.clear_for_save(path)
        name = [path]
    elif _rank() == 0:
        name = [staging_path(path)]
        if mode is not None:
            os.mkdir(name[0], 0o700)
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return name[0]


def _prepare(path, state_dict: dict, filter: dict | None, mode: int | None):
    """What ``save`` and ``async_save`` both do before writing: check the filter, the
    target (a writable directory, ``path`` no symbolic link) and the plain entries (they
    must load under ``weights_only=True``) on every rank, together; pick the staging name;
    build DCP's views. Returns (absolute path, staging path, views). Collective."""
    _check_filter(filter, state_dict)
    check_mode(mode)
    if is_url(path):
        problem = None if mode is None else (
            f"mode={oct(mode)} sets local files' modes; a URL's access is its store's: "
            "drop mode")
    else:
        path = os.path.abspath(os.fspath(path))
        problem = dir_problem(os.path.dirname(path))   # before any rank writes a byte
        if problem is not None:
            problem += "; pass a path in a writable directory"
        problem = problem or link_problem(path)
    agree(None if problem is None else ValueError(f"cannot save checkpoint {path}: {problem}"))
    views, _ = _build(state_dict, for_load=False, filter=filter)   # collective with FSDP2
    error = None
    try:
        for key, view in views.items():
            if isinstance(view, _Whole):
                view.data = _plain_bytes(key, view.value)
    except ValueError as e:
        error = e
    agree(error)
    tmp = _staging_name(path, mode)
    return path, tmp, views


def _commit(tmp: str, path: str, mode: int | None) -> ValueError | None:
    """Rank 0: swap the finished ``tmp`` into place (``replace_dir``: ``path`` holds the
    old or the new checkpoint at every moment); with ``mode``, every file gets it first.
    The error (the staging directory removed) instead of raising, for ``agree``."""
    try:
        if is_url(path):
            fs.write_marker(path)   # the save's last write: complete from now on
            return None
        if mode is not None:
            set_mode(tmp, mode)
        replace_dir(tmp, path)
    except OSError as e:
        fs.remove_tree(tmp)
        return ValueError(f"cannot save checkpoint {path}: {e.strerror or e}; the previous "
                          "one (if any) is unchanged")
    return None


def save(path: str | os.PathLike, state_dict: dict[str, Any], *,
         filter: dict | None = None, mode: int | None = None) -> None:
    """Write ``state_dict`` (modules, optimizers, objects with ``state_dict()``, plain
    values) as a sharded checkpoint directory at ``path``, atomically. Collective.
    ``filter``: as Fabric's ``save(filter=...)`` (see ``_build``); load a filtered
    checkpoint with ``strict=False``. ``mode``: the files' mode, e.g. ``0o600`` or
    ``0o640`` (directories get the matching execute bits; default: the umask's); the
    staging directory is private (0o700) while it is written."""
    path, tmp, views = _prepare(path, state_dict, filter, mode)
    try:
        dcp.save(views, storage_writer=fs.writer(tmp), planner=_SavePlanner())
    except BaseException:
        # DCP gathers write failures to every rank, so all ranks land here together.
        if _rank() == 0:
            fs.remove_tree(tmp)
        raise
    _barrier()
    agree(_commit(tmp, path, mode) if _rank() == 0 else None)   # every rank learns it


class PendingSave:
    """A checkpoint being written in the background by :func:`async_save`. Rank 0 moves
    it to its final path once DCP's write finished everywhere (rank 0's part ends with
    the metadata file, written after every rank reported its files), so ``path`` only
    ever holds a complete checkpoint. Not collective: each rank waits for its own part."""

    def __init__(self, future, tmp: str, path: str, mode: int | None = None):
        self.future, self.tmp, self.path, self.mode = future, tmp, path, mode
        self.committed = False

    def done(self) -> bool:
        """Without blocking: whether this rank's part is written (rank 0: and committed)."""
        if not self.future.done():
            return False
        self.wait()
        return True

    def wait(self) -> None:
        """Block until this rank's part is written; rank 0 then commits. Re-raises a
        write failure (rank 0 removes the staging directory first)."""
        if self.committed:
            return
        try:
            self.future.result()
        except BaseException:
            if _rank() == 0:
                fs.remove_tree(self.tmp)
            self.committed = True
            raise
        self.committed = True
        error = _commit(self.tmp, self.path, self.mode) if _rank() == 0 else None
        if error is not None:
            raise error


def _cpu_copy(obj, buffers: dict | None = None, key: tuple = ()):
    """``obj`` with every tensor (a DTensor's local shard) copied to CPU memory, so the
    background write sees this step's values while training changes the live ones.
    (DCP's own stager deep-copies DTensors, which fails for views of parameters.) With
    ``buffers``, copies go into the buffers of the previous call (same key, shape and
    dtype): no fresh allocation (and page faults) per save."""
    if isinstance(obj, dict):
        return {k: _cpu_copy(v, buffers, (*key, k)) for k, v in obj.items()}
    if isinstance(obj, _Whole):   # its bytes (_prepare) are this step's value already
        return obj
    if isinstance(obj, DTensor):  # same spec, CPU local shard (from_local costs ~10x more)
        return DTensor(_cpu_copy(obj.to_local(), buffers, key), obj._spec,
                       requires_grad=False)
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if buffers is None:
            return src.to("cpu", copy=True)
        buf = buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = buffers[key] = torch.empty(src.shape, dtype=src.dtype,
                                             pin_memory=src.is_cuda)
        return buf.copy_(src)
    return obj


class _Staged(dcp.staging.AsyncStager):
    """A stager for a state dict :func:`_cpu_copy` already staged."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def async_save(path: str | os.PathLike, state_dict: dict[str, Any], *,
               process_group=None, buffers: dict | None = None,
               filter: dict | None = None, mode: int | None = None) -> PendingSave:
    """Like :func:`save`, but DCP writes in a background thread (``dcp.async_save``) after
    copying the tensors to CPU here, so training may change them at once. Collective (the
    copy and the name); the write's own collectives run on ``process_group``, which must be
    a CPU (gloo) group other than the one training uses, e.g. ``dist.new_group(
    backend="gloo")`` made once. Call ``wait()`` (or ``done()``) on the result before the
    next save and before exiting: the checkpoint reaches ``path`` only then. ``buffers``:
    a dict kept by the caller and passed to every save (each after the previous one's
    ``wait()``), so that the copies reuse the CPU memory (pinned, from GPUs) of the last.
    ``filter``, ``mode``, the checks and the format are :func:`save`'s."""
    if dist.is_initialized() and process_group is None:
        raise ValueError("async_save needs process_group=: a gloo group of its own (e.g. "
                         "torch.distributed.new_group(backend='gloo')), since the background "
                         "write's collectives must not interleave with training's")
    path, tmp, views = _prepare(path, state_dict, filter, mode)
    try:
        future = dcp.async_save(_cpu_copy(views, buffers), storage_writer=fs.writer(tmp),
                                process_group=process_group, async_stager=_Staged(),
                                planner=_SavePlanner())
    except BaseException:
        if _rank() == 0:
            fs.remove_tree(tmp)
        raise
    return PendingSave(future, tmp, path, mode)


# --- load ------------------------------------------------------------------------------
def _metadata(path: str):
    """The checkpoint's DCP metadata, its files checked first (``verify_files``)."""
    return verify_files(path)


def _paths(md) -> dict[str, tuple]:
    """Each DCP key's path in the saved nested dict (DCP's own record of its flattening)."""
    data = md.planner_data if isinstance(md.planner_data, dict) else {}
    return {k: tuple(data.get(k) or k.split(".")) for k in md.state_dict_metadata}


class MissingKeyError(KeyError, ValueError):
    """A key that strict loading needs is absent: a KeyError, as Lightning Fabric's
    strategies raise for strict loading, and a ValueError, as tpkit's other user errors.
    ``str()`` is the message itself (not KeyError's quoted repr)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def missing_key_error(key: str, path: str | None = None, saved=()) -> MissingKeyError:
    """Fabric's strict-loading error (lightning.fabric.strategies.strategy), same wording,
    then which checkpoint and the keys it has."""
    where = (f" (checkpoint {path}, which has {sorted(saved)})" if path is not None else "")
    return MissingKeyError(f"The requested state contains a key '{key}' that does not exist in "
                           f"the loaded checkpoint{where}. To disable strict loading, set "
                           "`strict=False`.")


def _check_against(path: str, meta: dict, flat: dict, strict: bool) -> list[str]:
    """ValueError for tensors whose global shape differs from the checkpoint's; returns
    the keys absent from the checkpoint (MissingKeyError, a KeyError as Fabric's and a
    ValueError, if ``strict``). ``meta``: the checkpoint's ``state_dict_metadata``."""
    other = ("this checkpoint was written by another model (or another configuration of it); "
             "load a checkpoint of this model, or build the model the checkpoint was saved from")
    missing = []
    for key, value in flat.items():
        if key not in meta:
            missing.append(key)
            continue
        md = meta[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"checkpoint {path}: entry {key!r} is not a tensor but the "
                                 f"target is a tensor of shape {tuple(value.shape)}; {other}")
            if tuple(md.size) != tuple(value.shape):
                raise ValueError(
                    f"checkpoint {path}: tensor {key!r} has global shape {tuple(md.size)} but "
                    f"the target expects {tuple(value.shape)}; shapes must match globally to "
                    f"reshard (check the model config, e.g. hidden/vocab sizes or fused "
                    f"partition_sizes): {other}")
    if missing and strict:
        raise MissingKeyError(f"{len(missing)} keys are missing from checkpoint {path}: "
                              f"{missing[:8]}{' ...' if len(missing) > 8 else ''}; {other}, "
                              "or pass strict=False to load only the keys it has")
    return missing


_SEGMENT = re.compile(r"\.(seg\d+|seg_dim)$")


def unexpected_keys(md, live: dict, flat_keys, extra_keys=()) -> list[str]:
    """The checkpoint's tensors under a module (or an optimizer's ``state``) of ``live``
    that the target lacks: what a load of a deeper or other model would silently drop.
    ``flat_keys``: the target's flattened keys; ``extra_keys``: other ranks' (pipeline
    stages hold only their blocks). Segments (``<key>.seg<i>``) count as their key."""
    have = {_SEGMENT.sub("", k) for k in (*flat_keys, *extra_keys)}
    with_state = {k.split(".", 2)[0] for k in have if k.split(".", 2)[1:2] == ["state"]}
    out = []
    for key, path in _paths(md).items():
        obj = live.get(path[0])
        if obj is None or key.endswith(EXTRA_STATE_SUFFIX) or _SEGMENT.sub("", key) in have:
            continue
        if isinstance(obj, torch.optim.Optimizer) and (
                len(path) < 2 or path[1] != "state" or path[0] not in with_state):
            continue   # hyper-parameters; a fresh optimizer in verify has no state to match
        out.append(_SEGMENT.sub("", key))
    return sorted(set(out))


def unexpected_error(path: str, keys: list[str]) -> ValueError:
    return ValueError(
        f"checkpoint {path} holds {len(keys)} tensors this model does not have, first "
        f"{keys[0]!r} ({keys[:4]}{' ...' if len(keys) > 4 else ''}): it was written by a "
        "larger or other model (e.g. more layers), and loading it would drop them; build "
        "the model the checkpoint was saved from, or load only the shared tensors with "
        "strict=False (tpkit-train: --resume-partial)")


def verify(path: str | os.PathLike, state_dict: dict[str, Any] | None = None, *,
           strict: bool = True, state=None) -> None:
    """Check the checkpoint at ``path`` without restoring anything: its ``.metadata`` and
    every shard file (present, and as long as the metadata says), and, given
    ``state_dict``, that every module tensor (and the state of optimizers that have
    state) is in it with the same global shape (missing keys only with ``strict``).
    ValueError naming the file or key and what to do, e.g. the previous complete
    checkpoint next to it. Not collective; reads no tensor data; ``state`` (default: the
    current one) is the layout the modules are sharded over. ``load`` runs it first."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    md = verify_files(path)
    if state_dict is None:
        return
    path = checkpoint_dir(path)
    saved, live = _entries(path, md, state_dict, strict)
    if live:
        views, _ = _build(live, for_load=True, init_optimizers=False, state=state)
        flat = flatten_state_dict(views)[0]
        _check_against(path, md.state_dict_metadata, flat, strict)
        if strict and resolve_state(state).pp_size == 1:   # pp: the stages' keys together
            extra = unexpected_keys(md, live, flat)
            if extra:
                raise unexpected_error(path, extra)


def _entries(path: str, md, state_dict: dict, strict: bool) -> tuple[set, dict]:
    """The top-level keys the checkpoint holds, and the modules and optimizers of
    ``state_dict`` among them; with ``strict`` a key it lacks is a MissingKeyError."""
    saved = {p[0] for p in _paths(md).values()}
    absent = [k for k in state_dict if k not in saved]
    if absent and strict:
        raise missing_key_error(absent[0], path, saved)
    return saved, {k: v for k, v in state_dict.items()
                   if k in saved and isinstance(v, (nn.Module, torch.optim.Optimizer))}


def _read_plain(path: str, md, keys, weights_only: bool) -> dict[str, Any]:
    """The plain (non-tensor) entries ``keys`` of the checkpoint, each read from its shard
    and loaded with ``torch.load(weights_only=weights_only)``: with True (the default
    everywhere), an entry whose loading would run code (a crafted or foreign pickle) is a
    ValueError naming it, and nothing of it runs. Not collective."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    out = {}
    for key in keys:
        info = md.storage_data.get(MetadataIndex(key))
        if info is None or info.transform_descriptors:
            why = ("no shard holds it" if info is None else
                   f"it is stored with DCP transforms {list(info.transform_descriptors)}")
            raise ValueError(f"checkpoint {path}: cannot read entry {key!r} ({why}); tpkit "
                             "reads the checkpoints tpkit.checkpoint.save writes")
        with fs.open_shard(path, info.relative_path) as f:   # its metadata's read checked it
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            out[key] = torch.load(io.BytesIO(data), weights_only=weights_only)
        except Exception as e:  # noqa: BLE001 (what a damaged or crafted blob raises)
            if not weights_only:
                first = (str(e).strip().splitlines() or [""])[0]
                raise ValueError(f"checkpoint {path}: entry {key!r} cannot be read "
                                 f"({type(e).__name__}: {first})") from None
            raise ValueError(f"checkpoint {path}: entry {key!r} {_unsafe_global(e)}, "
                             "which loads only by running code from the file; not read "
                             "(tpkit saves only what weights_only=True reads; pass "
                             "weights_only=False only for a checkpoint you trust)") from None
    return out


def _dcp_load(flat: dict, path: str, md, weights_only: bool) -> None:
    """``dcp.load(flat)`` in place: the tensors through DCP (``_SafeReader``), the plain
    entries through ``_read_plain`` (a refusal on any rank raised on every rank).
    Collective."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    meta = md.state_dict_metadata
    plain = [k for k in flat if isinstance(meta.get(k), BytesStorageMetadata)]
    tensors = {k: v for k, v in flat.items() if k not in plain}
    dcp.load(tensors, storage_reader=_reader(path), planner=_SafeLoadPlanner())
    flat.update(tensors)
    error = None
    try:
        flat.update(_read_plain(path, md, plain, weights_only))
    except ValueError as e:
        error = e
    agree(error)   # no rank goes on into the next collective while another stopped


def load(path: str | os.PathLike, state_dict: dict[str, Any], *,
         strict: bool = True, weights_only: bool = True) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``state_dict`` in place, resharding to the
    current layout: modules and optimizers load into their tensors, objects with
    ``load_state_dict`` get their saved state, plain values are replaced in the dict.
    ``strict``: every key of ``state_dict`` (and every tensor of its modules and
    optimizers) must be in the checkpoint, else MissingKeyError (a KeyError, as
    Fabric's strategies raise, and a ValueError). The files and shapes are checked
    first (``verify``), on every rank, before any tensor is touched: a problem found by
    any rank is raised on all of them. Returns ``state_dict``. Collective.
    ``weights_only``: plain entries are read with ``torch.load(weights_only=True)``, so
    nothing in the files runs; False only for a checkpoint you trust."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
    fresh = [o for o in state_dict.values() if isinstance(o, torch.optim.Optimizer)
             and not o.state]  # load creates their state first; undone if it fails
    error = None
    try:
        try:
            md = verify_files(path)
            path = checkpoint_dir(path)
            saved, live = _entries(path, md, state_dict, strict)
            if live:
                views, slots = _build(live, for_load=True)
                flat, mapping = flatten_state_dict(views)
                missing = set(_check_against(path, md.state_dict_metadata, flat, strict))
        except ValueError as e:
            error = e
        agree(error)  # every rank stops here if any rank found a problem
        if live and strict:   # the checkpoint's tensors the target lacks (a deeper model)
            agree(_unexpected_problem(path, md, live, flat))
    except BaseException:
        for opt in fresh:
            opt.state.clear()
        raise
    if live:
        flat = {k: v for k, v in flat.items() if k not in missing}
        _dcp_load(flat, path, md, weights_only)
        loaded = unflatten_state_dict(flat, {k: v for k, v in mapping.items() if k in flat})
        for slot in slots:
            slot.write_back()
        names = _param_names([v for v in live.values() if isinstance(v, nn.Module)])
        for key, obj in live.items():
            if isinstance(obj, torch.optim.Optimizer) and key in loaded:
                _restore_optimizer_scalars(obj, loaded[key], names)
    rest = [k for k in state_dict if k in saved and k not in live]
    for key, value in read(path, keys=rest, weights_only=weights_only).items():
        obj = state_dict[key]
        if _stateful(obj):
            obj.load_state_dict(value)
        else:
            state_dict[key] = value
    return state_dict


def _unexpected_problem(path: str, md, live: dict, flat: dict) -> ValueError | None:
    """unexpected_keys' error, or None; collective over the pipeline group (each stage
    holds only its blocks: the keys of every stage together are the model's)."""
    extra = ()
    state = resolve_state(None)
    if state.pp_size > 1:
        every = [None] * state.pp_size
        dist.all_gather_object(every, sorted(flat), group=state.pp_group)
        extra = [k for keys in every for k in keys]
    keys = unexpected_keys(md, live, flat, extra)
    return unexpected_error(path, keys) if keys else None


def _restore_optimizer_scalars(opt, loaded: dict, names: dict) -> None:
    """Hyper-parameters and non-tensor per-param state (tensors were loaded in place),
    paired by parameter name: under pipeline parallelism an optimizer holds one stage's
    parameters, and the param groups' name lists in the checkpoint are those of the rank
    that wrote them, so positions do not match. A live group takes the hyper-parameters of
    the saved group sharing a parameter name with it, else of the saved group at its
    position (every stage builds its groups the same way). ``names``: _param_names."""
    by_name = {fqn: p for fqn, p in names.values()}
    live_names = {id(p): fqn for fqn, p in names.values()}
    saved = loaded.get("param_groups", [])
    for i, g in enumerate(opt.param_groups):
        mine = {live_names.get(id(p)) for p in g["params"]}
        match = [lg for lg in saved if mine & set(lg.get("params", ()))]
        lg = match[0] if match else (saved[i] if i < len(saved) else None)
        for k, v in (lg or {}).items():
            if k != "params":
                g[k] = v
    for fqn, entry in loaded.get("state", {}).items():
        p = by_name.get(fqn)
        if p is None:
            continue
        for k, v in entry.items():
            if not isinstance(v, (torch.Tensor, dict)):
                opt.state[p][k] = v


def read(path: str | os.PathLike, keys=None, *, exclude=(),
         weights_only: bool = True) -> dict[str, Any]:
    """The checkpoint's top-level entries (those in ``keys``, default all, minus
    ``exclude``) as nested Python objects, every tensor whole (its global shape, on CPU, on
    every rank): a module as its full state dict, an optimizer as a full state dict keyed
    by parameter name (``torch.optim.Optimizer.load_state_dict`` of the unsharded model
    takes it), plain values as saved. Collective when it reads tensors. ``weights_only``:
    as :func:`load`'s."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    path = os.fspath(path) if is_url(path) else os.path.abspath(os.fspath(path))
    md = _metadata(path)
    paths = _paths(md)
    exclude = set(exclude)
    keys = None if keys is None else set(keys)
    flat: dict[str, Any] = {}
    for key, meta in md.state_dict_metadata.items():
        top = paths[key][0]
        if top in exclude or (keys is not None and top not in keys):
            continue
        flat[key] = (None if isinstance(meta, BytesStorageMetadata)
                     else torch.empty(tuple(meta.size), dtype=meta.properties.dtype))
    if not flat:
        return {}
    if all(v is None for v in flat.values()):   # plain entries only: no collective
        flat.update(_read_plain(path, md, list(flat), weights_only))
    else:
        _dcp_load(flat, path, md, weights_only)
    out: dict[str, Any] = {}
    for key, value in flat.items():
        set_element(out, paths[key], value)
    whole = {p[0] for k, p in paths.items() if len(p) == 1 and k in flat
             and isinstance(md.state_dict_metadata[k], BytesStorageMetadata)}
    return {k: v if k in whole else _merge_segments(v) for k, v in out.items()}


def _merge_segments(obj):
    """``{"seg0": t0, "seg1": t1, ..., "seg_dim": d}`` (a fused parameter) -> ``cat(t, d)``.
    Checkpoints written before ``seg_dim`` existed concatenate along dim 0 (tpkit's fused
    layers are all column-parallel)."""
    if isinstance(obj, list):
        return [_merge_segments(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    obj = {k: _merge_segments(v) for k, v in obj.items()}
    n = sum(1 for k in obj if k != SEG_DIM)
    segs = [obj.get(f"seg{i}") for i in range(n)]
    if n and all(isinstance(t, torch.Tensor) for t in segs) and set(obj) <= {
            *(f"seg{i}" for i in range(n)), SEG_DIM}:
        return torch.cat(segs, obj.get(SEG_DIM, 0))
    return obj


def read_extras(path: str | os.PathLike, exclude, *,
                weights_only: bool = True) -> dict[str, Any]:
    """The checkpoint's top-level entries not named in ``exclude`` (Fabric's remainder:
    step counters, user metadata, an optimizer not loaded), as ``read`` returns them."""
    return read(path, exclude=exclude, weights_only=weights_only)
