"""README.md and docs/*.md are executed, so the docs cannot rot: every ```python block and
every ``tpkit-launch`` command of the ```bash blocks runs, as docs/testing.md describes
(the markers, and how each kind runs). Blocks must be complete: none may use a name it
does not define or import.

Batched, because a process start costs ~1.5 s here: all single-process blocks run in one
subprocess, all blocks of the launch commands that start 4 ranks in one launch (each block
with the ``TPKIT_*`` variables tpkit-launch exports for its own command), the others' per
command, and all commands that start no worker in one process (tests/doc_runner.py runs
them); only commands that start workers run one by one.
"""
from __future__ import annotations

import builtins
import dataclasses
import glob
import json
import os
import re
import shlex
import subprocess
import symtable
import sys

import pytest

import paths
from shared import launch_plan
from test_launch_run import launch_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "tests", "doc_runner.py")
DOC_FILES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                                   for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
README_MAX_LINES = 200
TIMEOUT = 280

MARKER = re.compile(r"^<!--\s*([a-z-]+)\s*(?::\s*(.*?))?\s*-->$")
MARKERS = {"python": {"launch", "gpu-only"}, "bash": {"dry-run", "exit"}}
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclasses.dataclass
class Block:
    path: str
    line: int            # line of the opening fence, 1-based
    lang: str
    code: str
    markers: dict        # marker name -> value ("" when it has none)
    bad_markers: list    # HTML comments before the fence that are not markers

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def parse(path: str) -> list[Block]:
    """The fenced blocks of one Markdown file, with the marker comments right above them."""
    with open(os.path.join(ROOT, path)) as f:
        lines = f.read().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        markers, bad, k = {}, [], start - 1
        while k >= 0 and lines[k].startswith("<!--"):
            mm = MARKER.match(lines[k].strip())
            if mm:
                markers[mm.group(1)] = mm.group(2) or ""
            else:
                bad.append(lines[k])
            k -= 1
        out.append(Block(path, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n",
                         markers, bad))
        i = j + 1
    return out


BLOCKS = [b for path in DOC_FILES for b in parse(path)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def tpkit_launch_commands(block: Block) -> list[dict]:
    """Every ``tpkit-launch ...`` of a shell block: its arguments and ``VAR=value`` prefixes
    (``&&``/``;``/``||`` separate commands; ``#`` starts a comment)."""
    out = []
    for line in block.code.replace("\\\n", " ").splitlines():
        words, seg = shlex.split(line, comments=True), []
        for w in words + ["&&"]:
            if w not in ("&&", ";", "||"):
                seg.append(w)
                continue
            env = {}
            while seg and re.match(r"^[A-Za-z_]\w*=", seg[0]):
                k, v = seg.pop(0).split("=", 1)
                env[k] = v
            if seg and seg[0] == "tpkit-launch":
                out.append({"where": f"{block.where}: {shlex.join(seg)}", "argv": seg[1:],
                            "env": env, "exit": int(block.markers.get("exit") or 0),
                            "dry_run": "dry-run" in block.markers})
            seg = []
    return out


COMMANDS = [c for b in BLOCKS if b.lang in ("bash", "sh", "shell")
            for c in tpkit_launch_commands(b)]
for c in COMMANDS:
    if c["dry_run"] and "--dry-run" not in c["argv"]:
        c["argv"] = ["--dry-run", *c["argv"]]
IN_PROCESS = [c for c in COMMANDS if "--dry-run" in c["argv"] or c["exit"] == 2]
REAL = list({c["where"].split(": ", 1)[1]: c for c in COMMANDS
             if c not in IN_PROCESS}.values())   # a command shown twice runs once


def undefined_names(code: str) -> set[str]:
    """Names a block uses but never binds (module level or in its functions and classes)."""
    top = symtable.symtable(code, "<block>", "exec")
    bound = {s.get_name() for s in top.get_symbols()
             if s.is_assigned() or s.is_imported() or s.is_namespace()}
    known = bound | set(dir(builtins))
    used = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    todo = list(top.get_children())
    while todo:
        t = todo.pop()
        used |= {s.get_name() for s in t.get_symbols() if s.is_global() and s.is_referenced()}
        todo += t.get_children()
    return used - known


def env_for_blocks() -> dict:
    env = launch_env()   # no TPKIT_*/SLURM_*/rendezvous variables; this checkout's tpkit
    env["PYTHONPATH"] = paths.PYTHONPATH
    env["TPKIT_PG_TIMEOUT"] = "120"   # a hang fails in two minutes, naming the rank
    return env


def run(cmd, *, cwd, env, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{shlex.join(cmd)} did not finish in {timeout} s:\n{e.stdout}\n{e.stderr}")


# --- static checks -----------------------------------------------------------------------
def test_readme_is_short():
    with open(os.path.join(ROOT, "README.md")) as f:
        n = len(f.read().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move reference text to docs/"


def test_extraction_finds_every_kind():
    # a broken extractor must not pass by finding nothing
    assert {b.path for b in PYTHON} >= {"README.md", "docs/layers.md"}
    assert {"launch", "gpu-only"} <= {m for b in PYTHON for m in b.markers}
    assert any(not b.markers for b in PYTHON)
    assert IN_PROCESS and REAL


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.where)
def test_block_is_complete_and_marked(block):
    assert not block.bad_markers, f"{block.where}: not a marker: {block.bad_markers}"
    allowed = MARKERS.get(block.lang, set())
    assert set(block.markers) <= allowed, \
        f"{block.where}: markers {sorted(block.markers)}; a {block.lang} block takes {allowed}"
    if "launch" in block.markers:
        assert block.markers["launch"].startswith("tpkit-launch "), block.where
    if "exit" in block.markers:
        assert block.markers["exit"].isdigit(), block.where
    if block.lang == "python":
        code = compile(block.code, block.where, "exec")
        assert code is not None
        missing = undefined_names(block.code)
        assert not missing, f"{block.where} uses {sorted(missing)} without defining them"


# --- running -------------------------------------------------------------------------------
def _entry(block: Block, env: dict | None = None) -> dict:
    """A block as tests/doc_runner.py reads it (``env``: its launch command's TPKIT_*)."""
    return {"where": block.where, "code": block.code, **({"env": env} if env else {})}


def _as_json(entries: list[dict], path) -> str:
    with open(path, "w") as f:
        json.dump(entries, f)
    return str(path)


@pytest.mark.slow
def test_single_process_blocks(tmp_path):
    blocks = [b for b in PYTHON if not b.markers]
    result = tmp_path / "result.json"
    proc = run([sys.executable, RUNNER, "blocks",
                _as_json([_entry(b) for b in blocks], tmp_path / "b.json"),
                str(result)], cwd=tmp_path, env=env_for_blocks())
    assert result.exists(), proc.stderr[-4000:]
    out = json.loads(result.read_text())
    assert out["ran"] == len(blocks)
    assert not out["failures"], "\n".join(f"{f['where']}:\n{f['error']}" for f in out["failures"])


LAUNCHES = sorted({b.markers["launch"] for b in PYTHON if "launch" in b.markers})


def _plan(launch: str):
    """tpkit-launch's own plan for a block's launch command (its world and exports)."""
    return launch_plan([*shlex.split(launch)[1:], RUNNER], env_for_blocks())


def _launch_blocks(argv: list[str], entries: list[dict], tmp_path) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "tpkit.cli.launch", *argv, RUNNER, "blocks",
                _as_json(entries, tmp_path / "b.json"), "-"], cwd=tmp_path, env=env_for_blocks(),
               timeout=2 * TIMEOUT)


@pytest.fixture(scope="module")
def four_rank_launch(tmp_path_factory):
    """The blocks of every 4-rank launch command in one ``tpkit-launch --nproc-per-node 4``
    (a launch of 4 ranks costs ~20 CPU-seconds before its first block): each block runs
    with the ``TPKIT_*`` tpkit-launch exports for its own command (its ``resolve``)."""
    plans = {launch: _plan(launch) for launch in LAUNCHES}
    mine = [launch for launch, plan in plans.items() if plan.nproc_per_node == 4]
    blocks = [_entry(b, dict(plans[launch].exports))
              for launch in mine for b in PYTHON if b.markers.get("launch") == launch]
    proc = _launch_blocks(["--nproc-per-node", "4"], blocks,
                          tmp_path_factory.mktemp("four_rank_blocks"))
    return mine, proc


@pytest.mark.slow
@pytest.mark.parametrize("launch", LAUNCHES)
def test_launched_blocks(launch, request, tmp_path):
    blocks = [b for b in PYTHON if b.markers.get("launch") == launch]
    if _plan(launch).nproc_per_node == 4:
        shared, proc = request.getfixturevalue("four_rank_launch")
        assert launch in shared
        what = f"{shared} (one launch)"
    else:
        proc = _launch_blocks(shlex.split(launch)[1:], [_entry(b) for b in blocks], tmp_path)
        what = launch
    assert proc.returncode == 0, \
        f"{what} over {[b.where for b in blocks]} exited {proc.returncode}:\n" \
        f"{proc.stderr[-6000:]}"


@pytest.mark.slow
def test_commands_that_start_nothing(tmp_path):
    result = tmp_path / "result.json"
    with open(tmp_path / "c.json", "w") as f:
        json.dump(IN_PROCESS, f)
    proc = run([sys.executable, RUNNER, "commands", str(tmp_path / "c.json"), str(result)],
               cwd=ROOT, env=env_for_blocks())
    assert result.exists(), proc.stderr[-4000:]
    bad = []
    for cmd, res in zip(IN_PROCESS, json.loads(result.read_text())):
        if res["rc"] != cmd["exit"] or res["script_error"]:
            bad.append(f"{cmd['where']}: exit {res['rc']} (expected {cmd['exit']})\n"
                       f"{res['stderr'][-2000:]}{res['script_error'] or ''}")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
@pytest.mark.parametrize("cmd", REAL, ids=lambda c: c["where"])
def test_command_runs(cmd):
    env = dict(launch_env(), **cmd["env"])
    proc = run([sys.executable, "-m", "tpkit.cli.launch", *cmd["argv"]], cwd=ROOT, env=env)
    assert proc.returncode == cmd["exit"], \
        f"{cmd['where']}: exit {proc.returncode}, expected {cmd['exit']}:\n{proc.stderr[-4000:]}"
