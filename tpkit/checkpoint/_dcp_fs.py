"""Checkpoints at fsspec URLs (``s3://``, ``gs://``, ``abfs://``, ``file://``,
``memory://``, ...): shared or object storage, where Ray's run storage and most
Kubernetes jobs keep them.

A path with ``://`` is a URL; anything else stays the local directory of ``_dcp`` and
``_dcp_verify`` (unchanged). Object stores have no atomic rename, so a URL checkpoint is
written in place at its final name (``DIR/stepNNNNNN``: any old one there is removed
first) and is *complete* only once rank 0 wrote the marker ``MARKER`` into it, after every
rank wrote its shards and rank 0 the ``.metadata``: the marker is the last write of a
save, as the rename is locally. A checkpoint without it is never loaded, listed or
picked by auto-resume (``verify_files`` refuses it, naming the save that did not
finish).

The loader's rules hold for URLs too: ``.metadata`` is unpickled by
``_dcp_verify.parse_metadata`` (DCP's classes only, no code runs), every shard path it
names must stay inside the checkpoint (no absolute path, no ``..``, no scheme), every
shard must be present and exactly as long as the metadata records, and plain entries are
read with ``torch.load(weights_only=True)`` (``_dcp``).
"""
from __future__ import annotations

import os
import posixpath
import shutil

from ._dcp_verify import METADATA, _name_key, checkpoint_dir as _local_dir, \
    inside, parse_metadata, verify_files as _verify_local

MARKER = ".tpkit-complete"

__all__ = ["MARKER", "is_url", "join", "verify_files", "checkpoint_dir", "listdir", "isdir",
           "remove_tree", "open_shard", "write_marker", "clear_for_save", "writer", "name"]


def is_url(path) -> bool:
    """Whether ``path`` is an fsspec URL (a ``str`` with ``scheme://``)."""
    return isinstance(path, str) and "://" in path


def _fs(url: str):
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise ValueError(f"checkpoint path {url} is a URL, which needs fsspec: pip install "
                         "fsspec (and the file system's package, e.g. s3fs)") from None
    try:
        return url_to_fs(url)
    except (ValueError, ImportError) as e:
        raise ValueError(f"checkpoint path {url}: fsspec cannot open it ({e}); install the "
                         "file system's package (e.g. s3fs for s3://) or pass a local "
                         "directory") from None


def join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


def name(path) -> str:
    """The last component of a local path or a URL."""
    return posixpath.basename(path.rstrip("/")) if is_url(path) \
        else os.path.basename(os.path.normpath(os.fspath(path)))


def isdir(path) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, p = _fs(path)
    return fs.isdir(p)


def listdir(path) -> list[str]:
    """The names in the directory ``path`` (local or URL); ``[]`` when it is none."""
    if not is_url(path):
        return os.listdir(path) if os.path.isdir(path) else []
    fs, p = _fs(path)
    if not fs.isdir(p):
        return []
    return sorted({posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False)} - {""})


def remove_tree(path) -> None:
    """Remove a checkpoint directory (local: never through a symbolic link), errors
    ignored."""
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, p = _fs(path)
    try:
        fs.rm(p, recursive=True)
    except (OSError, FileNotFoundError):
        pass


def clear_for_save(url: str) -> None:
    """Rank 0 before a save to ``url``: the marker first, then whatever is there, so a
    checkpoint being replaced is never complete while its files change."""
    fs, p = _fs(url)
    if fs.exists(posixpath.join(p, MARKER)):
        fs.rm(posixpath.join(p, MARKER))
    if fs.exists(p):
        fs.rm(p, recursive=True)


def write_marker(url: str) -> None:
    """Rank 0, after every rank wrote its part: the save's last write."""
    fs, p = _fs(url)
    with fs.open(posixpath.join(p, MARKER), "wb") as f:
        f.write(b"complete\n")


def writer(path):
    """DCP's storage writer for ``path``."""
    import torch.distributed.checkpoint as dcp
    if not is_url(path):
        return dcp.FileSystemWriter(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    _fs(path)   # the one-line error when fsspec cannot open it
    return FsspecWriter(path)


def _inside_url(rel) -> bool:
    if not isinstance(rel, str) or not rel or "\0" in rel or "://" in rel or "\\" in rel \
            or rel.startswith("/"):
        return False
    norm = posixpath.normpath(rel)
    return norm not in (".", "..") and not norm.startswith("../")


def open_shard(path: str, rel: str):
    """The shard file ``rel`` of the checkpoint ``path`` (checked to lie inside it when
    its metadata was read), opened for reading."""
    if not is_url(path):
        return open(inside(path, rel), "rb")
    fs, p = _fs(path)
    return fs.open(posixpath.join(p, rel), "rb")


def _load_metadata_url(url: str):
    fs, p = _fs(url)
    meta_file = join(url, METADATA)
    if not fs.isfile(posixpath.join(p, METADATA)):
        raise ValueError(f"{meta_file} is missing: the save did not finish, or {url} is not "
                         "a checkpoint directory")
    with fs.open(posixpath.join(p, METADATA), "rb") as f:
        md = parse_metadata(f, meta_file)
    for info in md.storage_data.values():
        if not _inside_url(info.relative_path):
            raise ValueError(f"{meta_file} names shard {info.relative_path!r}, which is "
                             f"outside {url} (a crafted .metadata); not read")
    return md


def _check_url(url: str):
    fs, p = _fs(url)
    if not fs.isfile(posixpath.join(p, MARKER)):
        raise ValueError(f"{join(url, MARKER)} is missing: the save did not finish (the "
                         "marker is its last write)")
    md = _load_metadata_url(url)
    extent: dict[str, int] = {}
    for info in md.storage_data.values():
        extent[info.relative_path] = max(extent.get(info.relative_path, 0),
                                         info.offset + info.length)
    for rel, need in sorted(extent.items()):
        try:
            size = fs.size(posixpath.join(p, rel))
        except (FileNotFoundError, OSError):
            size = None
        if size is None:
            raise ValueError(f"shard {join(url, rel)} is missing (the checkpoint's .metadata "
                             "names it)")
        if size != need:
            what = "truncated" if size < need else "longer than the save wrote"
            raise ValueError(f"shard {join(url, rel)} has {size} bytes but the checkpoint's "
                             f".metadata records {need} ({what})")
    return md


def _previous_url(url: str) -> str | None:
    parent, me = url.rstrip("/").rsplit("/", 1)
    series, number = _name_key(me)
    older = sorted((_name_key(n)[1], n) for n in listdir(parent)
                   if n != me and _name_key(n)[0] == series and _name_key(n)[1] < number)
    for _, n in reversed(older):
        try:
            _check_url(join(parent, n))
        except ValueError:
            continue
        return join(parent, n)
    return None


def checkpoint_dir(path) -> str:
    """``_dcp_verify.checkpoint_dir``, and for a URL: the URL, or ValueError when nothing
    is there."""
    if not is_url(path):
        return _local_dir(path)
    url = path.rstrip("/")
    if not isdir(url):
        newest = _previous_url(url)
        hint = f" (the newest next to it is {newest})" if newest else ""
        raise ValueError(f"no checkpoint at {url}: it does not exist{hint}; pass the "
                         "directory tpkit.checkpoint.save (or fabric.save) wrote")
    return url


def verify_files(path):
    """``_dcp_verify.verify_files`` for local paths and URLs: the checkpoint's DCP
    ``Metadata``, its files checked (for a URL also its completion marker), else
    ValueError naming the file and the checkpoint to use instead."""
    if not is_url(path):
        return _verify_local(path)
    url = checkpoint_dir(path)
    try:
        return _check_url(url)
    except ValueError as e:
        prev = _previous_url(url)
        todo = (f"resume from the previous checkpoint: {prev}" if prev else
                "no earlier complete checkpoint is next to it: load another checkpoint, or "
                "start without one")
        raise ValueError(f"checkpoint {url} is incomplete or damaged: {e}; {todo}") from None
