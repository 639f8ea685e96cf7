"""Checkpoint directories for auto-resume: which checkpoints are complete, the newest one,
and keeping the last K.

A save directory holds one checkpoint per save, ``DIR/stepNNNNNN`` (the number: steps
done), each written by ``tpkit.checkpoint.save`` / ``async_save`` under a staging name
(``stepNNNNNN.tmp-<job>-<id>``, ``<job>``: ``_dcp_verify.job_token``, the same for every
restart of one job) and renamed into place by rank 0 once every rank wrote its part; at an fsspec URL
(``s3://bucket/run``, ``memory://``...) it is written in place and complete once its
marker is there (``tpkit.checkpoint._dcp_fs``). Everything here is local to the calling process (no collectives): rank 0 decides
and broadcasts (:mod:`tpkit.recovery.manager`).
"""
from __future__ import annotations

import os
import re

from ..checkpoint import _dcp_fs as fs
from ..checkpoint._dcp_fs import is_url, verify_files
from ..checkpoint._dcp_verify import STAGING, job_token

STEP_DIR = re.compile(r"^step(\d+)$")


def checkpoint_path(save_dir: str | os.PathLike, steps_done: int) -> str:
    """``save_dir/stepNNNNNN``: where the checkpoint after ``steps_done`` steps goes."""
    if is_url(save_dir):
        return fs.join(save_dir, f"step{steps_done:06d}")
    return os.path.join(os.fspath(save_dir), f"step{steps_done:06d}")


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint whose save finished and whose files are all
    there: saves are atomic (written under a staging name, renamed once every rank wrote
    its files and rank 0 the metadata), so a staging directory never is; a directory at
    its final name is, when ``verify_files`` finds its ``.metadata`` readable and every
    shard file it names present and of the recorded length (a checkpoint damaged or
    truncated since the save is not). The one definition auto-resume and ``keep`` use."""
    path = path if is_url(path) else os.fspath(path)
    if STAGING.search(fs.name(path)) is not None:
        return False
    try:
        verify_files(path)
    except ValueError:
        return False
    return True


def skipped_checkpoints(save_dir: str | os.PathLike) -> list[tuple[str, str]]:
    """``(path, why)`` of every ``stepN`` directory in ``save_dir`` newer than its newest
    complete checkpoint that is not complete itself (what auto-resume passes over)."""
    found = list_checkpoints(save_dir)
    newest = found[-1][0] if found else -1
    out = []
    for name in fs.listdir(save_dir):
        m = STEP_DIR.match(name)
        path = _child(save_dir, name)
        if m and int(m.group(1)) > newest and fs.isdir(path):
            try:
                verify_files(path)
            except ValueError as e:
                out.append((path, str(e)))
    return out


def list_checkpoints(save_dir: str | os.PathLike) -> list[tuple[int, str]]:
    """``(steps done, path)`` of every complete ``stepN`` checkpoint in ``save_dir``,
    oldest first; ``[]`` when the directory does not exist."""
    out = []
    for name in fs.listdir(save_dir):
        m = STEP_DIR.match(name)
        path = _child(save_dir, name)
        if m and is_complete(path):
            out.append((int(m.group(1)), path))
    return sorted(out)


def latest_checkpoint(save_dir: str | os.PathLike) -> str | None:
    """The newest complete checkpoint in ``save_dir`` (most steps done), or None."""
    found = list_checkpoints(save_dir)
    return found[-1][1] if found else None


def unfinished_saves(save_dir: str | os.PathLike) -> list[str]:
    """Staging directories of saves that never finished (the job died while writing)."""
    return sorted(_child(save_dir, n) for n in fs.listdir(save_dir) if STAGING.search(n))


def _child(save_dir, name: str) -> str:
    return fs.join(save_dir, name) if is_url(save_dir) else os.path.join(os.fspath(save_dir), name)


def _same(path) -> str:
    return path.rstrip("/") if is_url(path) else os.path.abspath(path)


def prune(save_dir: str | os.PathLike, keep: int, *, protect=()) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints in ``save_dir``, never one
    in ``protect`` (e.g. the one this run resumed from), and the staging directories of
    this job's unfinished saves (those named with ``job_token()``: another job's save in
    progress in the same directory is left alone). A ``stepN`` that is a symbolic link
    is never deleted, nor anything it points to. Call it on one rank, with no save of
    this job in flight. Returns the deleted paths."""
    if keep < 1:
        raise ValueError(f"keep={keep} would delete every checkpoint; pass keep >= 1")
    protect = {_same(p) for p in protect if p}
    found = list_checkpoints(save_dir)
    mine = job_token()
    doomed = [p for _, p in found[:max(0, len(found) - keep)]
              if _same(p) not in protect and not os.path.islink(p)]
    doomed += [p for p in unfinished_saves(save_dir) if not os.path.islink(p)
               and STAGING.search(p).group(1) == mine]
    for path in doomed:
        fs.remove_tree(path)
    return doomed
