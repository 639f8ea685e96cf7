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
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import _dcp_fs as fs
from ._dcp_fs import checkpoint_dir, is_url, verify_files
from ._dcp_verify import agree
from ..layout.topology import resolve_state
from ._dcp_views import (EXTRA_STATE_SUFFIX, SEG_DIM, _SafeLoadPlanner, _build, _param_names,
                         _reader, _stateful, _unsafe_global, fsdp_local, unwrap_module)
from ._dcp_save import PendingSave, async_save, save


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
