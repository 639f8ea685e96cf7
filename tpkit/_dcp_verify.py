"""Checking a checkpoint directory before anything is restored from it.

``verify_files(path)`` reads the directory's ``.metadata`` and checks every shard file it
names against the metadata (present, and exactly as long as the byte ranges the metadata
records in it), without a process group and without reading tensor data: a missing or
unreadable ``.metadata``, a missing shard, a truncated shard or one whose size disagrees
with the metadata is a ``ValueError`` naming the file and the checkpoint to use instead
(the previous complete one next to it, when there is one). ``tpkit.checkpoint.verify``
(in ``_dcp``) adds the check against a model's keys and global shapes; ``load`` runs both
before it touches a tensor.

What it cannot see: bytes damaged in place (a shard of the right length whose content was
overwritten), since DCP stores no checksums.
"""
from __future__ import annotations

import os
import pickle
import re

METADATA = ".metadata"

__all__ = ["verify_files", "checkpoint_dir", "previous_checkpoint", "agree", "dir_problem"]


def _name_key(name: str):
    """``step000040`` -> ("step#", (40,)): siblings of one series share the first part."""
    return re.sub(r"\d+", "#", name), tuple(int(n) for n in re.findall(r"\d+", name))


def _read_metadata(path: str):
    """The DCP ``Metadata`` of ``path``; ValueError (without the suggestion) if missing or
    unreadable."""
    meta_file = os.path.join(path, METADATA)
    if not os.path.isfile(meta_file):
        raise ValueError(f"{meta_file} is missing: the save did not finish, or {path} is not "
                         "a checkpoint directory")
    try:
        with open(meta_file, "rb") as f:
            md = pickle.load(f)
        storage = md.storage_data
        assert isinstance(storage, dict) and isinstance(md.state_dict_metadata, dict)
    except Exception as e:  # noqa: BLE001 (truncated pickle, garbage, another format)
        why = f"{type(e).__name__}: {e}".strip().rstrip(":")
        raise ValueError(f"{meta_file} cannot be read ({why}): the file is damaged or "
                         "truncated") from None
    return md


def _check_shards(path: str, md) -> None:
    extent: dict[str, int] = {}
    for info in md.storage_data.values():
        end = info.offset + info.length
        extent[info.relative_path] = max(extent.get(info.relative_path, 0), end)
    for rel, need in sorted(extent.items()):
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            raise ValueError(f"shard {file} is missing (the checkpoint's .metadata names it)")
        size = os.path.getsize(file)
        if size != need:
            what = "truncated" if size < need else "longer than the save wrote"
            raise ValueError(f"shard {file} has {size} bytes but the checkpoint's .metadata "
                             f"records {need} ({what})")


def _check(path: str):
    md = _read_metadata(path)
    _check_shards(path, md)
    return md


def previous_checkpoint(path: str) -> str | None:
    """The newest complete checkpoint next to ``path`` that sorts before it in the same
    series (``DIR/step000030`` for ``DIR/step000040``); None when there is none. A
    ``path`` that does not exist yields the newest of its series."""
    parent, name = os.path.split(os.path.abspath(path))
    series, number = _name_key(name)
    try:
        names = os.listdir(parent)
    except OSError:
        return None
    older = sorted((_name_key(n)[1], n) for n in names
                   if n != name and _name_key(n)[0] == series and _name_key(n)[1] < number
                   and os.path.isdir(os.path.join(parent, n)))
    for _, n in reversed(older):
        try:
            _check(os.path.join(parent, n))
        except ValueError:
            continue
        return os.path.join(parent, n)
    return None


def _what_to_do(path: str) -> str:
    prev = previous_checkpoint(path)
    if prev is not None:
        return f"resume from the previous checkpoint: {prev}"
    return ("no earlier complete checkpoint is next to it: load another checkpoint, or start "
            "without one")


def checkpoint_dir(path) -> str:
    """``path`` as an absolute directory, or ValueError saying what was passed instead and
    what to pass."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        parent = os.path.dirname(path)
        fix = (f"pass its directory {parent}" if os.path.isfile(os.path.join(parent, METADATA))
               else "pass the directory tpkit.checkpoint.save (or fabric.save) wrote, the one "
                    f"that holds {METADATA}")
        raise ValueError(f"checkpoint path {path} is a file, not a checkpoint directory; {fix}")
    newest = previous_checkpoint(path)
    hint = f" (the newest next to it is {newest})" if newest else ""
    raise ValueError(f"no checkpoint at {path}: it does not exist{hint}; pass the directory "
                     "tpkit.checkpoint.save (or fabric.save) wrote")


def verify_files(path) -> object:
    """Check the checkpoint directory ``path`` (its ``.metadata`` and every shard file it
    names) and return its DCP ``Metadata``; ValueError naming the file and the checkpoint
    to use instead. Reads no tensor data and needs no process group."""
    path = checkpoint_dir(path)
    try:
        return _check(path)
    except ValueError as e:
        raise ValueError(f"checkpoint {path} is incomplete or damaged: {e}; "
                         f"{_what_to_do(path)}") from None


def dir_problem(path) -> str | None:
    """Why files cannot be written in a directory at ``path`` (created if missing): the
    path or its nearest existing ancestor is a file, or is not writable. None when they
    can. Used before a save starts, and by tpkit-launch for ``--log-dir``."""
    path = os.path.abspath(os.fspath(path))
    near = path
    while not os.path.exists(near):
        near = os.path.dirname(near)
    if not os.path.isdir(near):
        return f"{near} is a file, not a directory"
    if not os.access(near, os.W_OK | os.X_OK):
        return f"{near} is not writable"
    return None


def agree(error: ValueError | None) -> None:
    """Raise on every rank when any rank found ``error`` (one collective), so that no rank
    goes on into DCP's collectives while another has stopped."""
    import torch.distributed as dist
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else str(error))
        errors = [e if e is None or isinstance(e, ValueError) else ValueError(e)
                  for e in errors]
    if error is not None:
        raise error  # this rank's own (its type kept: a MissingKeyError is a KeyError too)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise ValueError(str(first)) from None
