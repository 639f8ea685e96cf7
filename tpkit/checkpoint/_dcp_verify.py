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

Reading never runs code from the files (the checkpoint may come from someone else):
``.metadata`` is unpickled by ``load_metadata``, which resolves only the classes DCP's
metadata holds (``torch.distributed.checkpoint.metadata``'s dataclasses, ``_StorageInfo``,
``torch.Size``, dtypes, layouts, paths) and refuses any other global, so a crafted file
cannot call a function; every shard path it names must resolve (symbolic links followed)
inside the checkpoint directory (``inside``). ``replace_dir`` is the one way tpkit puts a
finished directory at its final path (DCP saves and ``save_hf``): an atomic exchange,
never ``rmtree`` through a symbolic link, the parent directory fsynced.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import importlib
import os
import pickle
import re
import shutil
import socket
import uuid

METADATA = ".metadata"

__all__ = ["verify_files", "checkpoint_dir", "previous_checkpoint", "agree", "dir_problem",
           "load_metadata", "parse_metadata", "inside", "replace_dir", "fsync_dir", "link_problem", "job_token",
           "staging_path", "STAGING", "set_mode", "check_mode"]

# ``<final name>.tmp-<job token>-<random>``: a directory being written (DCP saves, save_hf)
STAGING = re.compile(r"\.tmp-([0-9a-f]{8})-[0-9a-f]{8}$")

_DCP_MD = "torch.distributed.checkpoint.metadata"
# Every global a .metadata written by DCP refers to (torch 2.4 - 2.13); dtypes and layouts
# are checked by value in _MetadataUnpickler.find_class.
_METADATA_GLOBALS = {
    *((_DCP_MD, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                             "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                             "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's Unpickler that resolves only the globals of DCP's metadata: anything else
    (``os.system``, ``builtins.eval``, a class with a ``__reduce__``) is an
    UnpicklingError before it is looked up, so nothing from the file can be called."""

    def find_class(self, module, name):
        if (module, name) in _METADATA_GLOBALS:
            return getattr(importlib.import_module(module), name)
        if module == "torch":
            import torch
            value = getattr(torch, name, None) if isinstance(name, str) else None
            if isinstance(value, (torch.dtype, torch.layout)):
                return value
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP metadata never "
                                     "holds (a crafted file: unpickling it could run code)")


def inside(root: str, rel, *, links: bool = True) -> str | None:
    """``root/rel`` if it lies inside ``root``, else None: an absolute ``rel`` or a ``..``
    escapes. ``links=True`` (DCP shards): the real path, symbolic links followed, must be
    inside the real ``root``; False (Hugging Face directories, whose files are links into
    the hub cache's blobs): the path as written."""
    if not isinstance(rel, str) or not rel or "\0" in rel or os.path.isabs(rel):
        return None
    if not links:
        norm = os.path.normpath(rel)
        return None if norm == ".." or norm.startswith(".." + os.sep) or norm == "." \
            else os.path.join(root, norm)
    base = os.path.realpath(root)
    full = os.path.realpath(os.path.join(base, rel))
    # containment by path components (/x/ckpt-evil is not in /x/ckpt; all is in /)
    return full if full != base and os.path.commonpath([base, full]) == base else None


def load_metadata(path: str):
    """The DCP ``Metadata`` in ``path/.metadata``, unpickled without running code from it
    and checked: its types, and every shard file it names inside ``path``. ValueError
    (without a suggestion) if missing, unreadable or crafted."""
    meta_file = os.path.join(path, METADATA)
    if not os.path.isfile(meta_file):
        raise ValueError(f"{meta_file} is missing: the save did not finish, or {path} is not "
                         "a checkpoint directory")
    with open(meta_file, "rb") as f:
        md = parse_metadata(f, meta_file)
    for info in md.storage_data.values():
        if inside(path, info.relative_path) is None:
            raise ValueError(f"{meta_file} names shard {info.relative_path!r}, which is "
                             f"outside {path} (a crafted .metadata); not read")
    return md


def parse_metadata(f, meta_file: str):
    """The DCP ``Metadata`` unpickled from the open file ``f`` without running code from
    it, its types checked (``meta_file`` names it in errors); the shard paths are the
    caller's to check (``load_metadata``; ``tpkit.checkpoint._dcp_fs`` for URLs)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata,
                                                       TensorStorageMetadata)
    try:
        md = _MetadataUnpickler(f).load()
        storage = md.storage_data
        assert isinstance(storage, dict) and isinstance(md.state_dict_metadata, dict)
        assert isinstance(md, Metadata)
        assert all(isinstance(v, (TensorStorageMetadata, BytesStorageMetadata))
                   for v in md.state_dict_metadata.values())
        assert all(isinstance(v, _StorageInfo) and isinstance(v.offset, int)
                   and isinstance(v.length, int) and v.offset >= 0 and v.length >= 0
                   for v in storage.values())
    except pickle.UnpicklingError as e:
        if not str(e).startswith("it refers to"):
            raise ValueError(f"{meta_file} cannot be read (UnpicklingError: {e}): the file "
                             "is damaged or truncated") from None
        raise ValueError(f"{meta_file} was not written by torch.distributed.checkpoint: "
                         f"{e}; not read") from None
    except Exception as e:  # noqa: BLE001 (truncated pickle, garbage, another format)
        why = f"{type(e).__name__}: {e}".strip().rstrip(":")
        raise ValueError(f"{meta_file} cannot be read ({why}): the file is damaged or "
                         "truncated") from None
    return md


def _name_key(name: str):
    """``step000040`` -> ("step#", (40,)): siblings of one series share the first part."""
    return re.sub(r"\d+", "#", name), tuple(int(n) for n in re.findall(r"\d+", name))


def _check_shards(path: str, md) -> None:
    extent: dict[str, int] = {}
    for info in md.storage_data.values():
        end = info.offset + info.length
        extent[info.relative_path] = max(extent.get(info.relative_path, 0), end)
    for rel, need in sorted(extent.items()):
        file = os.path.join(path, rel)   # inside path: load_metadata checked it
        if not os.path.isfile(file):
            raise ValueError(f"shard {file} is missing (the checkpoint's .metadata names it)")
        size = os.path.getsize(file)
        if size != need:
            what = "truncated" if size < need else "longer than the save wrote"
            raise ValueError(f"shard {file} has {size} bytes but the checkpoint's .metadata "
                             f"records {need} ({what})")


def _check(path: str):
    md = load_metadata(path)
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


# --- writing: staging names, the atomic swap, modes --------------------------------------
def job_token() -> str:
    """8 hex digits naming this job: the elastic run id every restart of a tpkit-launch /
    torchrun job shares (``TORCHELASTIC_RUN_ID``), else this process (host, boot, pid).
    Staging directories carry it, so that ``tpkit.recovery.prune`` removes only its own
    job's leftovers, never another job's save in progress."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        ident = f"run:{run}"
    else:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            boot = ""
        ident = f"process:{socket.gethostname()}:{boot}:{os.getpid()}"
    return hashlib.sha256(ident.encode()).hexdigest()[:8]


def staging_path(path: str) -> str:
    """Where a directory for ``path`` is written before ``replace_dir`` puts it there."""
    return f"{path}.tmp-{job_token()}-{uuid.uuid4().hex[:8]}"


def link_problem(path: str) -> str | None:
    """Why ``path`` cannot be replaced by a save: it is a symbolic link (a save would swap
    the link, not what it points to, and removing the old one must never follow it)."""
    if os.path.islink(path):
        return (f"{path} is a symbolic link (to {os.readlink(path)}); save to the directory "
                "it points to, or remove the link")
    return None


def fsync_dir(path: str) -> None:
    """Flush ``path``'s directory entries (a rename inside it) to disk, where the file
    system allows it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Swap the entries ``a`` and ``b`` in one step (Linux renameat2 RENAME_EXCHANGE);
    False where the kernel, libc or file system cannot."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def _remove(path: str) -> None:
    """Remove ``path``; a symbolic link is unlinked, never followed."""
    if os.path.islink(path) or not os.path.isdir(path):
        os.remove(path)
    else:
        shutil.rmtree(path)


def replace_dir(tmp: str, path: str) -> None:
    """Put the finished directory ``tmp`` at ``path``: an atomic exchange where the file
    system offers one (so ``path`` always holds the old or the new directory, whenever the
    process dies), else two renames (the old one kept at ``<path>.old-<id>`` in between);
    then the parent directory is fsynced and the old directory removed. OSError (nothing
    changed at ``path``) when ``path`` became a symbolic link."""
    problem = link_problem(path)
    if problem is not None:
        raise OSError(errno.ELOOP, problem)
    old = None
    if os.path.lexists(path) and _exchange(tmp, path):
        old = tmp                       # holds the previous directory now
    else:
        if os.path.lexists(path):
            old = f"{path}.old-{uuid.uuid4().hex[:8]}"
            os.rename(path, old)
        os.rename(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    if old is not None:
        _remove(old)


def check_mode(mode) -> int | None:
    """``mode`` for saved files (None: the umask's), or ValueError."""
    if mode is None:
        return None
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777 \
            or mode & 0o600 != 0o600:
        shown = oct(mode) if isinstance(mode, int) and not isinstance(mode, bool) else repr(mode)
        raise ValueError(f"mode={shown} is not a file mode for checkpoints; pass e.g. 0o600 "
                         "(owner only) or 0o640 (owner, and the group reads), with the "
                         "owner's read and write bits set")
    return mode


def set_mode(root: str, mode: int) -> None:
    """Give every file under ``root`` ``mode`` and every directory the same with an execute
    bit wherever it reads (0o640 -> 0o750), ``root`` included; links are left alone."""
    dir_mode = mode | ((mode & 0o444) >> 2)
    for top, dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(top, name)
            if not os.path.islink(p):
                os.chmod(p, mode)
        for name in dirs:
            p = os.path.join(top, name)
            if not os.path.islink(p):
                os.chmod(p, dir_mode)
    os.chmod(root, dir_mode)
