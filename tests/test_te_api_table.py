"""The seed table of docs/te_api.md against the five pages tpkit answers to: every class,
function and method the pages document has a row; every row's tpkit name exists and
takes every documented parameter, unless the row names that parameter after "not yet".

The pages are read from ``$TPKIT_SEEDS`` or the first ``shared/seeds`` directory above
the repository (``../shared/seeds`` of the project); they are not part of the repository.
"""
import importlib
import inspect
import os
import re

import pytest

from paths import ROOT

DOC = os.path.join(ROOT, "docs", "te_api.md")
PAGES = {"000": "TransformerEnginePrecision", "001": "transformer_engine.pytorch",
         "002": "recipe", "003": "MixedPrecision", "004": "Precision"}


def _seed_dir():
    env = os.environ.get("TPKIT_SEEDS")
    if env:
        return env
    d = os.path.abspath(ROOT)
    while d != os.path.dirname(d):
        cand = os.path.join(d, "shared", "seeds")
        if os.path.isdir(cand):
            return cand
        d = os.path.dirname(d)
    return None


def _split_top(s: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out, cur = out + [cur], ""
        else:
            cur += ch
    return [x.strip() for x in out + [cur] if x.strip()]


def _names(sig: str) -> list[str]:
    names = [re.split(r"[:=]", p)[0].strip() for p in _split_top(sig)]
    return [n for n in names if n and not n.startswith("*")]


def parse_page(text: str) -> dict[str, list[str]]:
    """{item: documented parameter names}: ``Class``, ``Class.method``, ``function``."""
    items: dict[str, list[str]] = {}
    cur = cls = None
    for line in text.splitlines():
        m = re.match(r"^(?:- )?class [\w.]+\.(\w+)(?:\((.*?)\))?(?:\[source\])?¶?\s*$", line)
        if m:
            cls = cur = m.group(1)
            items[cur] = _names(m.group(2) or "")
            continue
        m = re.match(r"^transformer_engine\.pytorch\.(\w+)\((.*)\)\s*$", line)
        if m:
            cls, cur = None, m.group(1)
            items[cur] = _names(m.group(2))
            continue
        m = re.match(r"^(\w+)\((.*)\)(?:\[source\])?¶?\s*$", line)
        if m and cls:
            cur = f"{cls}.{m.group(1)}"
            items[cur] = _names(m.group(2))
            continue
        if cls:   # a page with its methods inline: "- name(args)[source]"
            for m in re.finditer(r"- (\w+)\(([^)]*)\)\[source\]", line):
                items[f"{cls}.{m.group(1)}"] = _names(m.group(2))
        m = re.match(r"^\s+• (\w+) \(", line)
        if m and cur and m.group(1) not in items[cur]:
            items[cur].append(m.group(1))
    return items


def parse_table(text: str) -> dict[tuple[str, str], dict]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"\d{3}", cells[0]):
            page, item, name, torch_status, te_status = cells
            rows[(page, item.strip("`"))] = {"tpkit": name.strip("`"), "torch": torch_status,
                                              "te": te_status}
    return rows


def resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _params(obj) -> set[str]:
    if not callable(obj):
        return set()
    target = obj.__init__ if inspect.isclass(obj) else obj
    return set(inspect.signature(target).parameters)


def table_problems(pages: dict[str, str], table_text: str) -> list[str]:
    rows = parse_table(table_text)
    bad = []
    for page, text in sorted(pages.items()):
        for item, params in parse_page(text).items():
            row = rows.get((page, item))
            if row is None:
                bad.append(f"page {page}: {item} has no row in docs/te_api.md")
                continue
            try:
                obj = resolve(row["tpkit"])
            except (ImportError, AttributeError) as e:
                bad.append(f"page {page}: {item} -> {row['tpkit']} does not exist ({e})")
                continue
            have = _params(obj)
            not_yet = row["torch"].split("not yet", 1)[1] if "not yet" in row["torch"] else ""
            for p in params:
                if p not in have and f"`{p}`" not in not_yet:
                    bad.append(f"page {page}: {row['tpkit']} lacks the parameter {p!r} of "
                               f"{item}, and the row does not say 'not yet' for it")
    return bad


def _pages():
    d = _seed_dir()
    if d is None:
        msg = "the seed pages (../shared/seeds) are not here; set TPKIT_SEEDS"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true and {msg}")   # CI has shared/ beside the clone
        pytest.skip(msg)
    files = sorted(f for f in os.listdir(d) if f.endswith(".txt"))
    return {f[:3]: open(os.path.join(d, f), encoding="utf-8").read() for f in files}


def test_seed_table_covers_every_documented_item():
    pages = _pages()
    assert set(pages) == set(PAGES), sorted(pages)
    items = {p: parse_page(t) for p, t in pages.items()}
    # the parser sees what the README says each page documents
    assert {"Linear", "TransformerLayer", "InferenceParams", "fp8_autocast",
            "get_cpu_offload_context", "CudaRNGStatesTracker.fork"} <= set(items["001"])
    assert "parallel_mode" in items["001"]["Linear"]
    assert "fuse_qkv_params" in items["001"]["TransformerLayer"]
    assert {"TransformerEnginePrecision", "TransformerEnginePrecision.convert_module"} \
        <= set(items["000"])
    assert {"Format", "DelayedScaling"} <= set(items["002"])
    assert table_problems(pages, open(DOC, encoding="utf-8").read()) == []


def test_table_check_catches_gaps():
    """The check fails on a missing row, a missing tpkit name and an undeclared missing
    parameter."""
    pages = _pages()
    table = open(DOC, encoding="utf-8").read()
    dropped = "\n".join(line for line in table.splitlines()
                        if not line.startswith("| 001 | `onnx_export`"))
    assert any("onnx_export has no row" in b for b in table_problems(pages, dropped))
    renamed = table.replace("`tpkit.te_api.LayerNormMLP`", "`tpkit.te_api.LayerNormMlp`")
    assert any("LayerNormMlp does not exist" in b for b in table_problems(pages, renamed))
    hidden = table.replace("a `Format` enum (`value`)", "a `Format` enum (value)")
    assert hidden != table
    assert any("lacks the parameter 'value'" in b for b in table_problems(pages, hidden))
