"""tools/gpu/ on CPU: ``run``'s step sequencing (a failing or timed-out step is recorded and
the later ones still run), its install step (one pip call, every wheel's files checked, the
prebuilt wheel used only when its tags and torch match), its time plan, the whole call
rehearsed at a tiny size (``--rehearse``: every step, bench.gpu's rows and parsers, the
JSON), ``prepare``'s copy of the prebuilt wheel, and ``fatbin.prune`` on a fatbin built
here by hand."""
import importlib.machinery
import importlib.util
import json
import os
import struct
import subprocess
import sys

import pytest

from paths import ROOT

GPU_TOOLS = os.path.join(ROOT, "tools", "gpu")


def load(name):
    path = os.path.join(GPU_TOOLS, name)
    loader = importlib.machinery.SourceFileLoader(f"gpu_tools_{name}", path)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_run_dry_run_lists_the_steps_in_order_within_one_call():
    out = subprocess.run([sys.executable, os.path.join(GPU_TOOLS, "run"), "--dry-run"],
                         capture_output=True, text=True, check=True).stdout
    names = [ln.split("\t")[0] for ln in out.splitlines() if "\t" in ln]
    assert names == ["env", "install", "bench", "pytest"], out   # the benchmark first
    assert "-m gpu" in out and "bench.gpu --budget" in out and "--junitxml=" in out
    head = json.loads(out.splitlines()[-1])
    plan, run = head["plan_s"], load("run")
    assert head["setup_s"] == plan["env"] + plan["install"] <= 60
    assert sum(plan.values()) + run.MARGIN_S * len(plan) <= head["budget_s"] <= 590
    assert plan["bench"] >= 400 and plan["pytest"] >= run.PYTEST_S


def test_plan_with_a_build_says_setup_is_over_its_minute():
    run = load("run")
    names = [s[0] for s in run.STEPS]
    plain, build = run.plan(570, names), run.plan(570, names, build=True)
    assert build["install"] == plain["install"] + run.BUILD_S
    assert build["bench"] == plain["bench"] - run.BUILD_S   # the tests keep their share
    assert build["pytest"] == plain["pytest"] == run.PYTEST_S


def _wheel(folder, name, version, tag, files):
    """A wheel of ``files`` (path -> text) as pip installs it."""
    import zipfile
    dist = f"{name}-{version}.dist-info"
    files = dict(files)
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    files[f"{dist}/WHEEL"] = (f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: "
                              f"{'true' if tag.endswith('any') else 'false'}\nTag: {tag}\n")
    files[f"{dist}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{dist}/RECORD,,\n"
    path = os.path.join(folder, f"{name}-{version}-{tag}.whl")
    with zipfile.ZipFile(path, "w") as z:
        for n, text in files.items():
            z.writestr(n, text)
    return path


def stand_in_wheels(folder, *, tag=None, torch_version=None):
    """TE's three wheels as stand-ins sharing the ``transformer_engine/`` folder as the
    real ones do (the torch extension in transformer_engine/wheel_lib/), and
    prebuilt.json; the extension wheel tagged for this interpreter unless ``tag``."""
    import torch
    from packaging.tags import sys_tags
    os.makedirs(folder, exist_ok=True)
    _wheel(folder, "transformer_engine", "2.20.2", "py3-none-any", {
        "transformer_engine/__init__.py": "__version__ = '2.20.2'\n",
        "transformer_engine/pytorch/__init__.py": "STAND_IN = True\n"})
    _wheel(folder, "transformer_engine_cu13", "2.20.2", "py3-none-manylinux_2_28_x86_64",
           {"transformer_engine/libtransformer_engine.so": "core\n"})
    _wheel(folder, "transformer_engine_torch", "2.20.2", tag or str(next(iter(sys_tags()))),
           {"transformer_engine/wheel_lib/transformer_engine_torch.so": "ext\n"})
    with open(os.path.join(folder, "prebuilt.json"), "w") as f:
        json.dump({"torch": torch_version or torch.__version__}, f)


def test_install_puts_every_wheel_in_one_folder_and_imports_te(tmp_path):
    """Two ``pip install --target --upgrade`` calls (the defect of issue 50) leave only the
    last wheel's transformer_engine/: the step would fail its file check (seen failing
    with the wheels installed one call each)."""
    wheels, site = tmp_path / "w", tmp_path / "site"
    stand_in_wheels(str(wheels))
    site.mkdir()
    (site / "stale.txt").write_text("from an earlier run")   # the folder is emptied first
    out = subprocess.run([sys.executable, os.path.join(GPU_TOOLS, "run"), "--install",
                          "--rehearse", "--wheels", str(wheels), "--site", str(site),
                          "--cache", str(tmp_path / "cache")],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "using the prebuilt transformer_engine_torch wheel" in out.stdout
    assert out.stdout.count("$ ") == 1 and "pip install" in out.stdout   # one pip call
    for f in ("transformer_engine/pytorch/__init__.py", "transformer_engine/libtransformer_"
              "engine.so", "transformer_engine/wheel_lib/transformer_engine_torch.so"):
        assert (site / f).exists(), f
    assert not (site / "stale.txt").exists()
    assert f"TE 2.20.2 from {site}" in out.stdout and "no CUDA: kernels not run" in out.stdout


def test_prebuilt_wheel_is_used_only_when_tags_and_torch_match(tmp_path):
    run = load("run")
    stand_in_wheels(str(tmp_path / "ok"))
    assert run.prebuilt_mismatch(str(tmp_path / "ok")) is None
    stand_in_wheels(str(tmp_path / "tag"), tag="cp39-cp39-win_amd64")
    assert "are not this interpreter's" in run.prebuilt_mismatch(str(tmp_path / "tag"))
    stand_in_wheels(str(tmp_path / "torch"), torch_version="2.11.0+cu130")
    assert "built against torch 2.11.0+cu130" in run.prebuilt_mismatch(str(tmp_path / "torch"))
    os.remove(tmp_path / "ok" / "prebuilt.json")
    assert "prebuilt.json is missing" in run.prebuilt_mismatch(str(tmp_path / "ok"))
    # the real one: Python 3.12 and the GPU image's torch
    real = "transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl"
    tags312 = {"cp312-cp312-linux_x86_64", "py3-none-any"}
    assert run.wheel_tags(real) == {"cp312-cp312-linux_x86_64"}
    stand_in_wheels(str(tmp_path / "gpu"), tag="cp312-cp312-linux_x86_64",
                    torch_version="2.11.0+cu130")
    assert run.prebuilt_mismatch(str(tmp_path / "gpu"), "2.11.0+cu130", tags312) is None


def test_prepare_copies_the_prebuilt_wheel_from_the_shared_folder(tmp_path, monkeypatch):
    prepare = load("prepare")
    rel, torch_version = prepare.PREBUILT
    shared = tmp_path / "shared"
    (shared / os.path.dirname(rel)).mkdir(parents=True)
    (shared / rel).write_bytes(b"wheel")
    dest = tmp_path / "gpu"
    dest.mkdir()
    monkeypatch.delenv("TPKIT_SHARED", raising=False)
    assert prepare.copy_prebuilt(str(dest), str(shared)) == str(dest / os.path.basename(rel))
    meta = json.loads((dest / "prebuilt.json").read_text())
    assert meta["torch"] == torch_version == "2.11.0+cu130"
    monkeypatch.setenv("TPKIT_SHARED", str(shared))   # found through the variable too
    assert prepare.copy_prebuilt(str(tmp_path / "gpu")) is not None
    monkeypatch.setenv("TPKIT_SHARED", str(tmp_path / "nowhere"))
    assert str(tmp_path / "nowhere") in prepare.shared_dirs(None)


@pytest.mark.slow
def test_the_whole_gpu_call_rehearsed_on_cpu(tmp_path):
    """``tools/gpu/run --rehearse``: every step runs, the benchmark's rows at a tiny Llama
    (the TE and CUDA rows recorded as failed, the torch ones parsed), bench.json and
    summary.json as the GPU session gets them."""
    wheels, out = tmp_path / "w", tmp_path / "out"
    stand_in_wheels(str(wheels))
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, os.path.join(GPU_TOOLS, "run"), "--rehearse",
                        "--out", str(out), "--wheels", str(wheels),
                        "--site", str(tmp_path / "site"), "--cache", str(tmp_path / "c"),
                        "--budget", "570", "--pytest-files", "tests/test_gpu.py"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    steps = {r["step"]: r for r in summary["steps"]}
    assert list(steps) == ["env", "install", "bench", "pytest"], p.stdout
    assert steps["install"]["rc"] == 0 and steps["bench"]["rc"] == 0, (out / "setup.log",
                                                                        p.stdout)
    assert summary["setup_s"] <= 60 and summary["prebuilt_unused"] is None
    assert steps["pytest"]["rc"] in (0, 5), (out / "pytest.log").read_text()[-2000:]
    assert (out / "pytest.xml").exists()
    bench = json.loads((out / "bench.json").read_text())
    rows = bench["rows"]
    assert list(rows) == list(load_bench().ROWS), rows
    for name in ("matmul", "tpkit te bf16", "hand te bf16", "tpkit te fp8 current"):
        assert "error" in rows[name], rows[name]        # no CUDA: recorded, the rest ran
    assert all("needs CUDA" in rows[n]["error"] for n in (
        "matmul", "tpkit te bf16", "hand te bf16", "tpkit te fp8 current")), rows
    for name in ("tpkit torch compiled", "hand loop tpkit llama te bf16"):
        r = rows[name]
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["mfu"] is None, r
        assert r["memory"]["estimate"] > 0
    assert rows["tpkit torch compiled"]["memory"]["after_step"] == 1
    assert bench["size"]["vocab"] == 512 and bench["global_batch"] == 8
    est = bench["memory_estimate"]["bf16-mixed"]
    assert set(est["phases_gib"]) == {"forward", "backward", "end of backward", "optimizer"}
    assert est["peak_gib"] == max(est["phases_gib"].values())


def load_bench():
    import importlib
    return importlib.import_module("bench.gpu")


def test_bench_starts_every_row_where_cuda_and_te_are():
    """A row is recorded as failed without its process only where it needs CUDA or TE and
    this machine lacks it: on the GPU machine every row runs."""
    gpu = load_bench()
    for name, (kind, args, _) in gpu.ROWS.items():
        assert gpu.unavailable(kind, args, True, "2.20.2") is None, name
    cpu = {n for n, (k, a, _) in gpu.ROWS.items() if gpu.unavailable(k, a, False, "2.20.2")}
    assert cpu == set(gpu.ROWS) - {"tpkit torch compiled", "hand loop tpkit llama te bf16"}
    no_te = {n for n, (k, a, _) in gpu.ROWS.items()
             if gpu.unavailable(k, a, True, "unavailable: ModuleNotFoundError")}
    assert no_te == {"tpkit te bf16", "hand te bf16", "tpkit te fp8 current",
                     "tpkit te fp8 delayed", "hand te fp8 delayed",
                     "tpkit te bf16 foreach adamw"}, no_te


def test_bench_parsers_read_what_the_trainer_writes(tmp_path):
    gpu = load_bench()
    line = ("memory after step 1: estimated peak 3.43 MiB per rank, measured 512 MiB "
            "(14926% of the estimate)")
    assert gpu.parse_memory_line("x\n" + line + "\n") == {
        "after_step": 1, "estimate_gib": 3.43 / 1024, "measured_gib": 0.5}
    assert gpu.parse_memory_line("memory after step 1: estimated peak 7.50 GiB per rank "
                                 "(no allocator statistics on this device)") == {
        "after_step": 1, "estimate_gib": 7.5}
    (tmp_path / "metrics.csv").write_text(
        "step,loss,tokens_per_s,time_fwd_bwd_s,val_loss\n4,5.0,100.0,0.5,\n"
        "6,,,,4.0\n8,4.5,200.0,0.25,\n")
    assert gpu.parse_metrics(str(tmp_path / "metrics.csv"), 8) == {
        "loss": 4.5, "tokens_per_s": 200.0, "time_fwd_bwd_s": 0.25}
    with pytest.raises(KeyError, match="at step 6"):
        gpu.parse_metrics(str(tmp_path / "metrics.csv"), 6)


def test_bench_layers_fill_the_gpu_by_the_memory_plan():
    """The Llama-3-8B-shaped model has the most blocks whose estimate fits 90 % of 80 GiB
    at bf16 and fp8, and one more would not fit."""
    gpu = load_bench()
    n = gpu.layers()
    assert n >= 4
    s = dict(gpu.LLAMA3_8B, layers=n)
    fits = 0.9 * 80
    assert max(gpu.memory_estimate(s, p)["peak_gib"] for p in ("bf16-mixed", "fp8")) <= fits
    s["layers"] = n + 1
    assert max(gpu.memory_estimate(s, p)["peak_gib"] for p in ("bf16-mixed", "fp8")) > fits


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
