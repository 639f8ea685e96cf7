"""tools/gpu/ on CPU: ``run``'s step sequencing (a failing or timed-out step is recorded and
the later ones still run) and ``fatbin.prune`` on a fatbin built here by hand."""
import importlib.machinery
import importlib.util
import json
import os
import struct
import subprocess
import sys

from paths import ROOT

GPU_TOOLS = os.path.join(ROOT, "tools", "gpu")


def load(name):
    path = os.path.join(GPU_TOOLS, name)
    loader = importlib.machinery.SourceFileLoader(f"gpu_tools_{name}", path)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_run_dry_run_lists_the_steps_in_order():
    out = subprocess.run([sys.executable, os.path.join(GPU_TOOLS, "run"), "--dry-run",
                          "--skip", "env"], capture_output=True, text=True, check=True).stdout
    names = [ln.split("\t")[0] for ln in out.splitlines() if "\t" in ln]
    assert names == ["install", "build", "import", "pytest", "bench"], out
    assert "-m gpu" in out and "bench.gpu" in out and "--junitxml=" in out


def test_run_records_failures_and_timeouts_and_goes_on(tmp_path):
    run = load("run")
    run.STEPS = [("ok", "a.log", 30, "echo first"),
                 ("fails", "a.log", 30, "echo second; exit 3"),
                 ("hangs", "b.log", 1, "sleep 60"),
                 ("after", "b.log", 30, "echo out={O}")]
    assert run.main(["--out", str(tmp_path), "--budget", "100"]) == 1
    rows = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert [(r["step"], r["rc"], r["timed_out"]) for r in rows] == [
        ("ok", 0, False), ("fails", 3, False), ("hangs", 124, True), ("after", 0, False)]
    assert rows[2]["seconds"] < 30
    assert "first" in (tmp_path / "a.log").read_text()
    assert f"out={tmp_path}" in (tmp_path / "b.log").read_text()


def fatbin(entries):
    """A fatbin of (kind, arch, payload) entries in the layout fatbin.py reads."""
    body = b""
    for kind, arch, payload in entries:
        header = struct.pack("<HHIQ", kind, 1, 64, len(payload)) + bytes(12)
        header += struct.pack("<I", arch)
        body += header + bytes(64 - len(header)) + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def test_prune_keeps_sm90_and_drops_the_rest():
    prune = load("fatbin.py").prune
    sm90 = [(2, 90, b"\x90" * 48), (2, 90, b"\x9a" * 16)]        # sm_90 and sm_90a
    kept = fatbin([(2, 80, b"\x80" * 40)] + sm90 + [(2, 100, b"\xa0" * 56)])
    whole = fatbin([(2, 100, b"\xb0" * 24)])        # nothing for sm_90: left as it is
    data = bytearray(b"ELF...12" + kept + b"host" + whole + b"end")
    stats = prune(data, 90)
    assert stats == {"fatbins": 2, "kept": 2, "dropped": 2, "freed_bytes": 2 * 64 + 96,
                     "left_whole": 1}
    pruned = fatbin(sm90)                   # what a build for sm_90 alone would hold
    expect = pruned + bytes(len(kept) - len(pruned))
    assert data == b"ELF...12" + expect + b"host" + whole + b"end"
