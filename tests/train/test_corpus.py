"""The built-in corpus (tpkit/train/corpus.py): the same text whatever else runs in the
process, and the same text whether read from the sources or from its caches (the process'
memo, the file in TPKIT_CACHE_DIR), with a new cache file when a source file changes."""
import os
import shutil
import subprocess
import sys

from tpkit.train import corpus


def test_corpus_does_not_depend_on_patched_modules(monkeypatch):
    """The built-in corpus (so every loss curve) is the same in a process where a library
    replaced standard-library functions, as Ray's workers do (logging's record factory,
    inspect.isgenerator) and Lightning (warnings.formatwarning)."""
    import inspect
    import logging
    import types
    import warnings

    before = corpus.read_corpus()
    monkeypatch.setattr(logging, "_logRecordFactory", lambda *a, **k: None)
    monkeypatch.setattr(inspect, "isgenerator", lambda obj: False)
    monkeypatch.setattr(warnings, "formatwarning", lambda *a, **k: "")
    monkeypatch.setitem(sys.modules, "http.client", types.ModuleType("http.client"))
    assert corpus.read_corpus() == before
    assert "A LogRecord instance represents an event being logged." in before


def test_cached_text_is_the_sources_text(tmp_path):
    """A fresh process with an empty cache directory writes one file holding exactly the
    text read from the sources; another fresh process reads that file (a planted file
    under the same name is what comes back)."""
    env = dict(os.environ, TPKIT_CACHE_DIR=str(tmp_path / "cache"))
    code = ("import sys; from tpkit.train import corpus; "
            "sys.stdout.buffer.write(corpus.corpus_text().encode('utf-8'))")

    def fresh():
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              check=True).stdout.decode("utf-8")

    got = fresh()
    files = os.listdir(tmp_path / "cache")
    assert len(files) == 1 and files[0].startswith("corpus-"), files
    with open(tmp_path / "cache" / files[0], encoding="utf-8", newline="") as f:
        assert f.read() == got == corpus.read_corpus()
    (tmp_path / "cache" / files[0]).write_text("planted", encoding="utf-8")
    assert fresh() == "planted"   # so a later process reads the file, not the sources


def test_changed_source_gives_another_cache_file(tmp_path, monkeypatch):
    """The cache key covers each source file's size and modification time: a changed file
    is read again (not served from the memo or the old file), and an unwritable cache
    directory still gives the sources' text."""
    src = tmp_path / "src"
    src.mkdir()
    paths = []
    for p in corpus._source_files()[:3]:
        paths.append(str(src / os.path.basename(p)))
        shutil.copy(p, paths[-1])
    monkeypatch.setattr(corpus, "_source_files", lambda: list(paths))
    monkeypatch.setenv("TPKIT_CACHE_DIR", str(tmp_path / "cache"))
    first = corpus.corpus_text()
    assert first == corpus._read(paths)
    with open(paths[0], "a", encoding="utf-8") as f:
        f.write('\n\ndef zz_added():\n    """A docstring added after the first read."""\n')
    second = corpus.corpus_text()
    assert second == corpus._read(paths) and "added after the first read" in second
    assert len(os.listdir(tmp_path / "cache")) == 2
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("TPKIT_CACHE_DIR", str(tmp_path / "not-a-dir"))
    with open(paths[1], "a", encoding="utf-8") as f:
        f.write('\n\ndef zz_other():\n    """Another."""\n')
    assert corpus.corpus_text() == corpus._read(paths)
