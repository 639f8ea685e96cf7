"""A small real-text corpus and a byte-level tokenizer, with no downloads.

The text is the documentation of Python's standard library (module, class and function
docstrings of a fixed list of modules, read from their source files), about 0.4 MB of
English prose and code, built at run time from the interpreter that runs the job. Tokens are bytes (vocabulary 256).

Parsing the ~90 source files costs about 1.3 s of CPU, paid by every rank of every job and
by every ``train.main`` call before anything trains. So the text is kept once read: in the
process (``corpus_text`` is memoized) and on disk, in ``$TPKIT_CACHE_DIR`` (default
``$XDG_CACHE_HOME/tpkit``, else ``~/.cache/tpkit``) under a name derived from the
interpreter's version and the path, size and modification time of every file read, so an
edited or other standard library gives another file. The file is written to a temporary
name and renamed into place (ranks starting together never read half a file); when the
directory cannot be written the text is read from the sources as before. ``read_corpus``
always reads the sources.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import os
import sys
import sysconfig
import tempfile

import torch

VOCAB_SIZE = 256
MODULES = (
    "json", "collections", "functools", "itertools", "argparse", "pathlib", "dataclasses",
    "asyncio", "logging", "re", "os", "subprocess", "threading", "unittest", "email",
    "http.client", "urllib.request", "csv", "sqlite3", "textwrap", "string", "random",
    "statistics", "decimal", "fractions", "datetime", "calendar", "heapq", "bisect", "shutil",
    "tempfile", "zipfile", "tarfile", "pickle", "copy", "pprint", "enum", "contextlib", "abc",
    "inspect", "ast", "tokenize", "difflib", "socket", "selectors", "queue",
    "multiprocessing", "concurrent.futures", "xml.etree.ElementTree", "html.parser",
    "urllib.parse", "base64", "hashlib", "hmac", "secrets", "uuid", "operator", "weakref",
    "traceback", "warnings", "types", "io", "codecs", "locale", "gettext", "sched", "struct",
    "timeit", "pdb", "doctest", "trace", "platform", "glob", "fnmatch", "filecmp", "shlex",
    "configparser", "plistlib", "mailbox", "mimetypes", "wave", "colorsys", "cmd", "ftplib",
    "smtplib", "http.server", "http.cookies", "ipaddress", "optparse", "getopt",
)


def corpus_text() -> str:
    """The corpus (``read_corpus``'s text), from this process' memo or the disk cache
    (module docstring); read from the sources and cached when neither has it."""
    paths = _source_files()
    key = hashlib.sha256(repr((_CACHE_FORMAT, sys.version, [
        (p, st.st_size, st.st_mtime_ns) for p, st in ((p, os.stat(p)) for p in paths)]))
        .encode()).hexdigest()[:32]
    return _cached_text(key, tuple(paths))


_CACHE_FORMAT = 1


def cache_dir() -> str:
    """Where the corpus cache lives: ``$TPKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/tpkit``,
    else ``~/.cache/tpkit``."""
    return os.environ.get("TPKIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "tpkit")


@functools.lru_cache(maxsize=4)
def _cached_text(key: str, paths: tuple[str, ...]) -> str:
    path = os.path.join(cache_dir(), f"corpus-{key}.txt")
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except OSError:
        pass
    text = _read(paths)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".corpus-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass   # a read-only home: the text is still right, only not kept for the next process
    return text


def _source_files() -> list[str]:
    """MODULES' source files, by their place in the standard library (not importlib's
    find_spec: that answers from sys.modules, which a library may have filled with
    something else); a module without a source file is skipped."""
    stdlib = sysconfig.get_paths()["stdlib"]
    out = []
    for name in MODULES:
        base = os.path.join(stdlib, *name.split("."))
        path = next((p for p in (base + ".py", os.path.join(base, "__init__.py"))
                     if os.path.isfile(p)), None)
        if path is not None:
            out.append(path)
    return out


def read_corpus() -> str:
    """The corpus read from the sources, no cache: ``_read`` of MODULES' files."""
    return _read(_source_files())


def _read(paths) -> str:
    """The modules' docstrings and those of the functions and classes each defines at
    top level, read from their source files (``ast``), names in sorted order. Read from
    the files, not from the imported modules: a library the process imported may have
    replaced a module's attribute (Lightning ``warnings.formatwarning``, Ray
    ``logging``'s record factory and ``inspect.isgenerator``), and the corpus, so the
    loss curve, must not depend on what else runs in the process (tpkit-launch and Ray
    Train workers train on the same bytes)."""
    parts = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        doc = ast.get_docstring(tree, clean=False)
        if doc:
            parts.append(doc)
        defs = {node.name: node for node in tree.body if isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        for _, node in sorted(defs.items()):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return "\n\n".join(parts)


def tokens() -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of byte values."""
    data = corpus_text().encode("utf-8", errors="replace")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def split(data: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    n = int(len(data) * (1 - val_fraction))
    return data[:n], data[n:]


def batch(data: torch.Tensor, step: int, global_batch: int, seq_len: int,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic global batch ``step``: inputs and next-byte targets, ``[B, S]`` each.
    Every rank computes the same global batch and keeps its DP slice."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq_len - 1, (global_batch,), generator=g)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


def documents(data: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, stop)`` of every document of the corpus: the text between blank lines
    (two newlines: the docstrings and their paragraphs), empty ones dropped."""
    nl = (data[:-1] == 10) & (data[1:] == 10)
    cuts = [0] + (nl.nonzero().flatten() + 2).tolist() + [len(data)]
    return [(a, b - 2 if b < len(data) else b) for a, b in zip(cuts[:-1], cuts[1:])
            if (b - 2 if b < len(data) else b) > a]


def doc_batch(data: torch.Tensor, docs: list[tuple[int, int]], step: int, global_batch: int,
              max_len: int, seed: int = 0) -> list[torch.Tensor]:
    """Deterministic global batch ``step`` of ``global_batch`` whole documents (each cut to
    at most ``max_len`` tokens); every rank computes the same list and keeps its DP slice."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    picks = torch.randint(0, len(docs), (global_batch,), generator=g).tolist()
    return [data[docs[i][0]:min(docs[i][1], docs[i][0] + max_len)] for i in picks]
