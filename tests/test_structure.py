"""The repository's structure, checked: imports follow the layer table of docs/design.md,
and no file refers to a repository file that does not exist.

Both read the code as text (ast and regular expressions): nothing is imported or run."""
import ast
import io
import os
import re
import subprocess
import tokenize

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


def tpkit_files(root=ROOT):
    """(path, path relative to ``root``) of every .py file under root/tpkit, in order."""
    for dirpath, _, files in sorted(os.walk(os.path.join(root, "tpkit"))):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield path, os.path.relpath(path, root)


def layer_violations(order, exceptions, root=ROOT):
    """Upward imports not excepted, modules missing from the table, and unused exceptions."""
    bad, used = [], set()
    for path, rel in tpkit_files(root):
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
        "def f():\n    from ..fabric import strategy\n    from ..layout.config import ParallelConfig\n")
    (tmp_path / "tpkit" / "brand_new.py").write_text("import os\n")
    bad = layer_violations(order, set(), root=str(tmp_path))
    assert any("tpkit/nn/x.py:2: nn" in b and "imports fabric" in b for b in bad), bad
    assert not any(":3:" in b for b in bad), bad      # layout is below nn: fine
    assert any("'brand_new' is not in the layer table" in b for b in bad), bad
    assert len([b for b in bad if "matches no import" in b]) == 0


# --- references to repository files -----------------------------------------------------
REPO_DIRS = ("tpkit", "tests", "docs", "launch", "bench", "slurm", ".ci")
PLACEHOLDERS = {"script.py", "job.toml"}   # any user script / job file, in prose
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


# --- import cycles ----------------------------------------------------------------------
def _module_file(root: str, mod: str) -> str | None:
    """tpkit/a/b.py or tpkit/a/b/__init__.py for the dotted name ``mod``, else None."""
    p = os.path.join(root, *mod.split("."))
    if os.path.isdir(p):
        return os.path.join(p, "__init__.py")
    return p + ".py" if os.path.exists(p + ".py") else None


def import_graph(root=ROOT) -> dict[str, set[str]]:
    """{file: files it imports} over tpkit/, at file level and at any depth (imports inside
    functions count: a lazy import that closes a circle is still a circle). ``from a import
    b`` is an edge to a/b.py when that module exists, else to a's own file."""
    graph = {}
    for path, rel in tpkit_files(root):
        pkg = ".".join(os.path.dirname(rel).split(os.sep))
        out = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] +
                                    ([node.module] if node.module else []))
                mods = [f"{base}.{a.name}" if _module_file(root, f"{base}.{a.name}")
                        else base for a in node.names]
            else:
                continue
            for m in mods:
                target = _module_file(root, m) if m.split(".")[0] == "tpkit" else None
                if target is not None and os.path.relpath(target, root) != rel:
                    out.add(os.path.relpath(target, root))
        graph[rel] = out
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert import_cycles(import_graph()) == []


def test_cycle_check_catches_a_lazy_circle(tmp_path):
    """Planted: a model that imports its converter inside a method, which imports the model
    at the top (the models/hf <-> models/llama circle issue 34 removed), and a package
    __init__ that only re-exports (no circle)."""
    m = tmp_path / "tpkit" / "models"
    m.mkdir(parents=True)
    (m / "__init__.py").write_text("from .llama import Llama\n")
    (m / "llama.py").write_text("class Llama:\n    def f(self):\n        from .hf import g\n")
    (m / "hf.py").write_text("from .llama import Llama\n")
    (tmp_path / "tpkit" / "config.py").write_text("import os\n")
    assert import_cycles(import_graph(str(tmp_path))) == [
        ["tpkit/models/hf.py", "tpkit/models/llama.py"]]
    (m / "llama.py").write_text("class Llama:\n    pass\n")
    assert import_cycles(import_graph(str(tmp_path))) == []


# --- subsystems as packages (issue 49) ------------------------------------------------------
SUBSYSTEMS = {   # package -> the modules that live in it, never at tpkit's root
    "checkpoint": ("_dcp", "_dcp_verify"),
    "comm": ("collectives", "shm"),
    "cp": ("sharding", "ring"),
    "layout": ("config", "param_tags", "topology", "random", "planning", "parallel_state"),
    "memory": ("job", "estimate", "fit", "text"),
    "distributed": ("pipeline", "fsdp"),
    "te": ("offload",),
}


def test_subsystems_are_packages():
    """Each subsystem is one package (one unit of the layer table), its modules inside it:
    a module of one at the root again would be a second home for the concept."""
    order, _ = layer_table(open(DESIGN).read())
    for package, modules in SUBSYSTEMS.items():
        folder = os.path.join(ROOT, "tpkit", package)
        assert os.path.isfile(os.path.join(folder, "__init__.py")), package
        assert package in order, f"{package} is not a unit of docs/design.md's layer table"
        for name in modules:
            assert os.path.isfile(os.path.join(folder, f"{name}.py")), (package, name)
            assert not os.path.exists(os.path.join(ROOT, "tpkit", f"{name}.py")), \
                f"tpkit/{name}.py: it lives in tpkit/{package}/"
            assert name not in order, f"{name} is inside {package}, not a unit of its own"


# --- the package's shape (issue 49) ---------------------------------------------------------
MAX_ROOT_MODULES = 6     # tpkit/*.py: the rest lives in the subsystems' packages
MAX_MODULE_LINES = 600   # a longer module is split by job into siblings of its package


def shape_problems(root=ROOT, max_root=MAX_ROOT_MODULES, max_lines=MAX_MODULE_LINES):
    """Too many modules at tpkit's root, and every module over ``max_lines`` lines."""
    bad = []
    at_root = sorted(f for f in os.listdir(os.path.join(root, "tpkit")) if f.endswith(".py"))
    if len(at_root) > max_root:
        bad.append(f"{len(at_root)} modules at tpkit's root (at most {max_root}): {at_root}")
    for path, rel in tpkit_files(root):
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > max_lines:
            bad.append(f"{rel}: {n} lines (at most {max_lines}); split it by job")
    return bad


def test_few_root_modules_and_no_long_module():
    assert shape_problems() == []


def test_shape_check_catches_a_long_module_and_a_crowded_root(tmp_path):
    (tmp_path / "tpkit").mkdir()
    for i in range(3):
        (tmp_path / "tpkit" / f"m{i}.py").write_text("x = 1\n" * (5 if i else 12))
    bad = shape_problems(str(tmp_path), max_root=2, max_lines=10)
    assert any("3 modules at tpkit's root" in b for b in bad), bad
    assert any(b.startswith(os.path.join("tpkit", "m0.py") + ": 12 lines") for b in bad), bad
    assert len(bad) == 2, bad


def test_long_modules_are_test_modules():
    """conftest.LONG_MODULES (the modules xdist starts first) and shared.READERS (the
    modules of the shared launch's unit of work) name existing test modules, each once: a
    renamed module would silently lose its place."""
    import conftest
    tests = os.path.join(ROOT, "tests")
    found = {f[:-3] for _, _, files in os.walk(tests) for f in files
             if f.startswith("test_") and f.endswith(".py")}
    assert len(set(conftest.LONG_MODULES)) == len(conftest.LONG_MODULES)
    assert set(conftest.LONG_MODULES) <= found, set(conftest.LONG_MODULES) - found
    from shared import READERS   # one unit of work: a misspelt one would run elsewhere
    assert len(set(READERS)) == len(READERS) and set(READERS) <= found, set(READERS) - found
    assert not set(READERS) & set(conftest.LONG_MODULES)
