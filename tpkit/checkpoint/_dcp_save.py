"""Writing a sharded checkpoint: ``save`` (staged in a sibling directory, verified, then swapped
in), ``async_save`` and its ``PendingSave``."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from . import _dcp_fs as fs
from ._dcp_fs import is_url
from ._dcp_verify import (agree, check_mode, dir_problem, link_problem, replace_dir, set_mode,
                          staging_path)
from ._dcp_views import _SavePlanner, _Whole, _build, _check_filter, _plain_bytes


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
