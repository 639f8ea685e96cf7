"""The repository's structure, checked: imports follow the layer table of docs/design.md,
and no file refers to a repository file that does not exist.

Both read the code as text (ast and regular expressions): nothing is imported or run."""
import ast
import io
import os
import re
import subprocess
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN = os.path.join(ROOT, "docs", "design.md")


# --- layers -------------------------------------------------------------------------------
def _block(text: str, name: str) -> list[str]:
    m = re.search(rf"^```{re.escape(name)}\n(.*?)^```", text, re.S | re.M)
    assert m is not None, f"docs/design.md has no ```{name} block"
    lines = [line.split("#", 1)[0].strip() for line in m.group(1).splitlines()]
    return [line for line in lines if line]


def layer_table(text: str):
    """({unit: line index}, {(importer, imported)}) from the two blocks of design.md."""
    order = {}
    for level, line in enumerate(_block(text, "layers")):
        for unit in line.split():
            assert unit not in order, f"{unit} is on two lines of the layer table"
            order[unit] = level
    exceptions = set()
    for line in _block(text, "layer-exceptions"):
        m = re.fullmatch(r"([\w.]+)\s*->\s*([\w.]+)", line)
        assert m is not None, f"bad layer exception line {line!r}; write 'a -> b  # reason'"
        exceptions.add((m.group(1), m.group(2)))
    return order, exceptions


def _unit(rel: str) -> str:
    """The table name of tpkit/<rel>: its first component without .py."""
    return rel.split(os.sep)[1].removesuffix(".py")


def tpkit_imports(path: str, rel: str):
    """(line, imported tpkit unit) for every import in the file, at any depth."""
    pkg = ".".join(os.path.dirname(rel).split(os.sep))   # the package relative imports start at
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            mods = [f"{mod}.{a.name}" for a in node.names] if mod == "tpkit" or \
                node.module is None else [mod]
        else:
            continue
        for m in mods:
            parts = m.split(".")
            if parts[0] == "tpkit" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def layer_violations(order, exceptions, root=ROOT):
    """Upward imports not excepted, modules missing from the table, and unused exceptions."""
    bad, used = [], set()
    for dirpath, _, files in os.walk(os.path.join(root, "tpkit")):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, root)
            if rel == os.path.join("tpkit", "__init__.py"):
                continue  # the package's lazy façade
            unit = _unit(rel)
            if unit not in order:
                bad.append(f"{rel}: {unit!r} is not in the layer table of docs/design.md")
                continue
            for line, target in tpkit_imports(path, rel):
                if target == unit:
                    continue
                if target not in order:
                    bad.append(f"{rel}:{line} imports tpkit.{target}, not in the layer table")
                elif order[target] >= order[unit]:
                    if (unit, target) in exceptions:
                        used.add((unit, target))
                    else:
                        bad.append(f"{rel}:{line}: {unit} (line {order[unit]}) imports "
                                   f"{target} (line {order[target]}), not below it")
    bad += [f"layer exception {a} -> {b} matches no import; remove it"
            for a, b in sorted(exceptions - used)]
    return bad


def test_imports_follow_the_layer_table():
    order, exceptions = layer_table(open(DESIGN).read())
    assert layer_violations(order, exceptions) == []


def test_layer_check_catches_an_upward_import(tmp_path):
    """A planted nn -> fabric import, and an unknown module, are reported."""
    order, exceptions = layer_table(open(DESIGN).read())
    (tmp_path / "tpkit" / "nn").mkdir(parents=True)
    (tmp_path / "tpkit" / "nn" / "x.py").write_text(
        "def f():\n    from ..fabric import strategy\n    from ..config import ParallelConfig\n")
    (tmp_path / "tpkit" / "brand_new.py").write_text("import os\n")
    bad = layer_violations(order, set(), root=str(tmp_path))
    assert any("tpkit/nn/x.py:2: nn" in b and "imports fabric" in b for b in bad), bad
    assert not any(":3:" in b for b in bad), bad      # config is below nn: fine
    assert any("'brand_new' is not in the layer table" in b for b in bad), bad
    assert len([b for b in bad if "matches no import" in b]) == 0


# --- references to repository files -----------------------------------------------------
REPO_DIRS = ("tpkit", "tests", "docs", "launch", "bench", "slurm", ".ci")
PLACEHOLDERS = {"script.py"}   # "python script.py": any user script, in prose
_EXT = r"(?:py|md|sh|sbatch|toml)"
_PATH = re.compile(r"(?<![\w/-])((?:\.{1,3}/)?(?:[\w.-]+/)+[\w.-]+\." + _EXT + r")(?![\w/])")
_BARE = re.compile(r"(?<![\w./-])([\w-]+(?:\.[\w-]+)*\." + _EXT + r")(?![\w/])")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _repo_files(root):
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=root, capture_output=True, text=True, check=True).stdout
    return [f for f in out.split("\n") if f and os.path.exists(os.path.join(root, f))]


def _prose_py(src: str):
    """(line, text) of comments and docstrings: file names in code strings are data."""
    out, prev = [], None
    starts = (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT,
              tokenize.ENCODING)
    for t in tokenize.generate_tokens(io.StringIO(src).readline):
        if t.type == tokenize.COMMENT or (t.type == tokenize.STRING and
                                          (prev is None or prev.type in starts)):
            out.append((t.start[0], t.string))
        if t.type not in (tokenize.COMMENT, tokenize.NL):
            prev = t
    return out


def _prose_md(src: str):
    """(line, text) outside fenced blocks (a command's file names are checked as paths),
    link targets taken out (they are checked as links)."""
    out, fence = [], False
    for i, line in enumerate(src.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence:
            out.append((i, _LINK.sub("]", line)))
    return out


def dangling_references(root=ROOT):
    """``file:line: name`` for every reference to a repository file that does not exist:
    a path starting at a top-level folder (``tpkit/nn/linear.py``, ``docs/x.md``), a path
    relative to the referring file's folder (``nn/linear.py`` inside tpkit/), a bare
    ``NAME.md``/``NAME.py`` in prose (docstrings, comments, Markdown text) that names no
    file of the repository, and a relative Markdown link. Paths into other projects
    (``transformer_engine/...``) are not the repository's and are skipped."""
    files = _repo_files(root)
    known = set(files)
    basenames = {os.path.basename(f) for f in files}
    top = set(REPO_DIRS) | {f for f in files if "/" not in f}
    bad = []

    def exists(rel):
        return rel in known or os.path.isdir(os.path.join(root, rel))

    for f in files:
        if not f.endswith((".py", ".md")) or f.startswith("tests/fake_te/") or \
                f == "tests/test_structure.py":   # TE's own paths; planted examples
            continue
        src = open(os.path.join(root, f), errors="replace").read()
        here = os.path.dirname(f)
        for i, line in enumerate(src.split("\n"), 1):
            for m in _PATH.finditer(line):
                parts = m.group(1).split("/")
                k = next((k for k, p in enumerate(parts) if p in top), None)
                if k is not None:
                    target = "/".join(parts[k:])
                elif parts[0] not in (".", "..", "...") and \
                        os.path.isdir(os.path.join(root, here, parts[0])):
                    target = os.path.normpath(os.path.join(here, m.group(1)))
                else:
                    continue   # another project's path
                if not exists(target):
                    bad.append(f"{f}:{i}: {m.group(1)}")
            if f.endswith(".md"):
                for m in _LINK.finditer(line):
                    t = m.group(1)
                    if "://" not in t and not t.startswith("mailto:") and \
                            not exists(os.path.normpath(os.path.join(here, t))):
                        bad.append(f"{f}:{i}: link {t}")
        for i, text in (_prose_md(src) if f.endswith(".md") else _prose_py(src)):
            for k, line in enumerate(text.split("\n")):
                for m in _BARE.finditer(line):
                    name = m.group(1)
                    if name not in basenames and name not in PLACEHOLDERS:
                        bad.append(f"{f}:{i + k}: {name}")
    return bad


def test_no_reference_to_a_missing_file():
    assert dangling_references() == []


def test_reference_check_catches_missing_files(tmp_path):
    """Planted: a design note that is not in the repo, a moved module, a broken link."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "tpkit" / "nn").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "tpkit" / "nn" / "linear.py").write_text("x = 1\n")
    (tmp_path / "tpkit" / "nn" / "attention.py").write_text(
        '"""See sdpa.py for the contract and DESIGN.md §4; linear.py is here."""\n'
        "# tpkit/nn/linear.py exists, tpkit/nn/gone.py does not\n"
        "NAME = 'hello.py'  # data, not a reference\n"
        "# transformer_engine/pytorch/module/linear.py is another project's\n")
    (tmp_path / "docs" / "a.md").write_text(
        "[ok](../tpkit/nn/linear.py) [bad](b.md) see nn/linear.py\n\n"
        "```\ntpkit-launch launch/train.py\n```\n")
    bad = dangling_references(str(tmp_path))
    assert sorted(b.split(": ", 1)[1] for b in bad) == sorted(
        ["sdpa.py", "DESIGN.md", "tpkit/nn/gone.py", "link b.md", "launch/train.py"]), bad


# --- old import paths (docs/design.md, "Old import paths") ------------------------------
OLD_PATHS = [  # (old module, name, new module)
    ("tpkit.topology", "init_parallel", "tpkit.parallel_state"),
    ("tpkit.topology", "destroy_parallel", "tpkit.parallel_state"),
    ("tpkit.topology", "build_fake_state", "tpkit.planning"),
    ("tpkit.topology", "destroy_fake_state", "tpkit.planning"),
    ("tpkit.topology", "format_rank_table", "tpkit.planning"),
    ("tpkit.cli.plan", "planned_rank_table", "tpkit.planning"),
    ("tpkit.config", "shm_allreduce_enabled", "tpkit.shm"),
    ("tpkit.fabric.grads", "sync_sequence_parallel_grads", "tpkit.grads"),
    ("tpkit.fabric.grads", "grad_norm", "tpkit.grads"),
    ("tpkit.fabric.grads", "clip_grad_norm", "tpkit.grads"),
    ("tpkit.nn.norm", "sync_sequence_parallel_grads", "tpkit.grads"),
    ("tpkit.nn", "sync_sequence_parallel_grads", "tpkit.grads"),
    ("tpkit.nn.norm", "all_reduce_flat", "tpkit.collectives"),
    ("tpkit.nn.mappings", "all_reduce_sum", "tpkit.collectives"),
    ("tpkit.nn.mappings", "group_size", "tpkit.collectives"),
    ("tpkit.nn.mappings", "group_rank", "tpkit.collectives"),
    ("tpkit.nn.context_parallel", "COMM_TYPES", "tpkit.config", "CP_COMM_TYPES"),
    ("tpkit.nn.context_parallel", "lb_positions", "tpkit.data", "cp_positions"),
    ("tpkit", "init_parallel", "tpkit.parallel_state"),
    ("tpkit", "destroy_parallel", "tpkit.parallel_state"),
]


@pytest.mark.parametrize("entry", OLD_PATHS, ids=lambda e: f"{e[0]}.{e[1]}")
def test_old_import_paths_still_work(entry):
    import importlib
    old, name, new = entry[:3]
    new_name = entry[3] if len(entry) > 3 else name
    assert getattr(importlib.import_module(old), name) is \
        getattr(importlib.import_module(new), new_name)
