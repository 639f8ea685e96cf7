"""Reading a file never runs code, saving never loses or leaks (issue 39).

``CRAFTED`` is the table of crafted inputs: each is refused with one line naming the
file, value or path (or, for another job's staging directory, left alone), and for
each a sentinel proves that no code from the file ran (the crafted pickles hold a
``__reduce__`` calling ``os.mkdir(SENTINEL)``) and a snapshot that no file outside the
checkpoint directory was touched. The reference is the filesystem itself: what exists,
with which size, mtime and mode, before and after.

Beside the table, each with a real process where the behaviour is a process's:
- ``save_hf`` killed with SIGKILL in the middle of writing (a real subprocess, stopped
  after its first shards): the previous export is intact and loads with the weights it
  had;
- 2 ranks (tests/dist.py pool): a symbolic link at the save path is refused on both
  ranks, and a swap that fails on rank 0 alone is raised on both (no rank left in a
  barrier, no staging directory left); Fabric's ``load(weights_only=...)`` is honoured for
  checkpoint directories (default: refused; False, the user's explicit trust: it runs);
- ``save(mode=0o600 / 0o640)``: the files' and directories' modes;
- a plain value that would need code to load is refused at save, before any write;
- shm: a leftover segment of another pid namespace is never swept, one of ours is;
- tpkit-launch's worker wrapper ignores an inherited ``TPKIT_HANG_REPORTED``.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import pickle
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import warnings
from typing import Callable

import pytest
import torch

import paths
from dist import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict({k: v for k, v in os.environ.items()   # a fresh world of one, not the pool's
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                         "MASTER_ADDR", "MASTER_PORT") and not k.startswith("TPKIT_")},
           PYTHONPATH=paths.PYTHONPATH)


class Evil:
    """Unpickling this calls ``os.mkdir(path)`` (``os.makedirs(path, exist_ok=True)`` with
    ``again``): the sentinel that code from a file ran."""

    def __init__(self, path, again=False):
        self.path, self.again = str(path), again

    def __reduce__(self):
        return (os.makedirs, (self.path, 0o777, True)) if self.again else \
            (os.mkdir, (self.path,))


class Sampler:
    """A user object saved as it is (not its state_dict()): loading it needs its class."""

    def __init__(self):
        self.position = 3


def _one_rank(body, *args):
    """``body(*args)`` on a pool worker of a world of one with a tpkit layout: a save or an
    export is collective, and the default group it needs must not outlive the test in
    pytest's own process (build_fake_state refuses a process that has one)."""
    import tpkit
    tpkit.init_parallel()
    body(*args)


def _linear(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 4)


def _tiny_llama(seed=0):
    from tpkit.models.llama import Llama, LlamaConfig
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                      num_heads=4, num_gqa_groups=2)
    model = Llama(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
    return model


def _dcp_save(state_dict, path) -> None:
    """What DCP itself writes (its plain entries: pickles loaded with weights_only=False)."""
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(str(path)))


def _tree(root, skip=None) -> dict:
    """path -> (size, mtime_ns, mode) of everything under ``root`` but ``skip``."""
    out = {}
    for top, dirs, files in os.walk(root):
        if skip is not None:
            dirs[:] = [d for d in dirs if os.path.join(top, d) != str(skip)]
        for name in dirs + files:
            p = os.path.join(top, name)
            if skip is not None and p == str(skip):
                continue
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return out


# --- the crafted inputs ----------------------------------------------------------------------
def _malicious_metadata(tmp, sentinel):
    """A checkpoint whose .metadata is DCP's Metadata with a reduce-to-mkdir object in it,
    as the newest of a save directory: resume's scan and load both meet it."""
    from tpkit.checkpoint import load, save
    from tpkit.recovery import latest_checkpoint
    save_dir = tmp / "save"
    save(save_dir / "step000004", {"model": _linear()})
    ck = save_dir / "step000005"
    save(ck, {"model": _linear()})
    meta = ck / ".metadata"
    with open(meta, "rb") as f:
        md = pickle.load(f)
    md.planner_data = {"model.weight": Evil(sentinel)}
    meta.write_bytes(pickle.dumps(md))

    def action():
        assert latest_checkpoint(save_dir) == str(save_dir / "step000004")
        load(ck, {"model": _linear()})
    return save_dir, action


def _malicious_plain_entry(tmp, sentinel):
    """A DCP checkpoint whose plain entry "step" is a pickle that calls mkdir."""
    from tpkit.checkpoint import load
    ck = tmp / "ck"
    _dcp_save({"step": Evil(sentinel), "w": torch.ones(2)}, ck)
    return ck, lambda: load(ck, {"step": None})


def _malicious_index(tmp, sentinel):
    """An exported model whose index names a shard outside its directory (the shard
    moved there, so without the check it would load)."""
    from tpkit.models.hf import from_hf, save_hf
    out = tmp / "hf"
    save_hf(_tiny_llama(), str(out), max_shard_size=20_000)
    index = out / "model.safetensors.index.json"
    text = index.read_text()
    (tmp / "outside").mkdir()
    shutil.move(out / "model-00001-of-00006.safetensors", tmp / "outside")
    index.write_text(text.replace('"model-00001-of-00006.safetensors"',
                                  '"../outside/model-00001-of-00006.safetensors"'))
    return out, lambda: from_hf(str(out))


def _escaping_relative_path(tmp, sentinel):
    """A checkpoint whose .metadata (DCP's own classes only) names a shard file outside
    the directory (the shard moved there, so without the check it would load)."""
    from tpkit.checkpoint import load, save
    ck = tmp / "ck"
    save(ck, {"model": _linear()})
    (tmp / "outside").mkdir()
    shutil.move(ck / "__0_0.distcp", tmp / "outside")
    with open(ck / ".metadata", "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        info.relative_path = "../outside/__0_0.distcp"
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    return ck, lambda: load(ck, {"model": _linear(1)})


def _symlinked_step(tmp, sentinel):
    """save/step000010 is a link to someone's directory: a save there is refused, before
    anything is written, and the directory linked to keeps its files."""
    from tpkit.checkpoint import save
    victim = tmp / "victim"
    victim.mkdir()
    (victim / "precious").write_text("data")
    save_dir = tmp / "save"
    save_dir.mkdir()
    os.symlink(victim, save_dir / "step000010")

    def action():
        try:
            save(save_dir / "step000010", {"model": _linear()})
        finally:
            assert os.listdir(save_dir) == ["step000010"]   # no staging, no .old left
    return save_dir, action


def _other_jobs_staging(tmp, sentinel):
    """Another job's save in progress in the same save directory (its token differs from
    this job's): prune leaves it, with its files, and removes this job's own leftover."""
    from tpkit.checkpoint._dcp_verify import staging_path
    from tpkit.checkpoint import save
    from tpkit.recovery import prune
    save_dir = tmp / "save"
    for step in (1, 2, 3):
        save(save_dir / f"step{step:06d}", {"model": _linear()})
    other = tmp / "other-save"     # outside the snapshot's skip: must stay as it is
    other.mkdir()
    ours = staging_path(str(save_dir / "step000004"))
    os.mkdir(ours)
    theirs = save_dir / f"step000004.tmp-{'f00d' * 2}-{'ab' * 4}"
    if os.path.basename(ours).split("-")[1] == "f00df00d":   # (a token clash: 1 in 4e9)
        theirs = save_dir / f"step000004.tmp-{'beef' * 2}-{'ab' * 4}"
    theirs.mkdir()
    (theirs / "__0_0.distcp").write_text("being written")

    def action():
        gone = prune(save_dir, keep=1)
        assert sorted(os.path.basename(p) for p in gone) == [
            "step000001", "step000002", os.path.basename(ours)]
        assert sorted(os.listdir(save_dir)) == ["step000003", theirs.name]
        assert (theirs / "__0_0.distcp").read_text() == "being written"
    return save_dir, action


@dataclasses.dataclass
class Crafted:
    id: str
    make: Callable          # make(tmp, sentinel) -> (the input's directory, action)
    refused: str | None     # the one-line message (regex); None: the action succeeds


CRAFTED = [
    Crafted("malicious-metadata", _malicious_metadata,
            r"step000005/\.metadata was not written by torch\.distributed\.checkpoint: it "
            r"refers to posix\.mkdir, which DCP metadata never holds \(a crafted file: "
            r"unpickling it could run code\); not read; resume from the previous "
            r"checkpoint: .*/save/step000004$"),
    Crafted("malicious-plain-entry", _malicious_plain_entry,
            r"checkpoint .*/ck: entry 'step' refers to posix\.mkdir, which loads only by "
            r"running code from the file; not read \(.*weights_only=False only for a "
            r"checkpoint you trust\)$"),
    Crafted("malicious-index-paths", _malicious_index,
            r"model\.safetensors\.index\.json: weight_map\['[\w.]+'\] = "
            r"'\.\./outside/model-00001-of-00006\.safetensors' is outside .*/hf \(a "
            r"crafted index\); not read$"),
    Crafted("relative-path-escape", _escaping_relative_path,
            r"ck/\.metadata names shard '\.\./outside/__0_0\.distcp', which is outside "
            r".*/ck \(a crafted \.metadata\); not read"),
    Crafted("symlinked-step-dir", _symlinked_step,
            r"^cannot save checkpoint .*/save/step000010: .*/save/step000010 is a symbolic "
            r"link \(to .*/victim\); save to the directory it points to, or remove the link$"),
    Crafted("other-jobs-staging", _other_jobs_staging, None),
]


@pytest.mark.parametrize("row", CRAFTED, ids=[r.id for r in CRAFTED])
def test_crafted_input_is_refused_and_runs_nothing(row, tmp_path):
    run(_one_rank, 1, _crafted, row.id, tmp_path)


def _crafted(row_id, tmp_path):
    row = next(r for r in CRAFTED if r.id == row_id)
    sentinel = tmp_path / "code-ran"
    where, action = row.make(tmp_path, sentinel)
    before = _tree(tmp_path, skip=where)
    if row.refused is None:
        action()
    else:
        with pytest.raises(ValueError) as e:
            action()
        msg = str(e.value)
        assert "\n" not in msg and re.search(row.refused, msg), msg
    assert not sentinel.exists(), "code from the file ran"
    assert _tree(tmp_path, skip=where) == before, "a file outside the directory changed"


# --- save_hf killed mid-write ----------------------------------------------------------------
_KILLED_SAVE = """
import time
import tpkit
from tpkit.models import hf
from test_security import _tiny_llama
tpkit.init_parallel()
model = _tiny_llama(seed=1)
gather, calls = hf._full_tensor, [0]
def held(*args, **kwargs):      # after some shards are written: tell, then wait for the kill
    calls[0] += 1
    if calls[0] == 6:
        open({ready!r}, "w").close()
        time.sleep(600)
    return gather(*args, **kwargs)
hf._full_tensor = held
hf.save_hf(model, {out!r}, max_shard_size=20_000)
"""


def test_save_hf_killed_with_sigkill_leaves_the_previous_export(tmp_path):
    run(_one_rank, 1, _save_hf_killed, tmp_path)


def _save_hf_killed(tmp_path):
    from tpkit.models.hf import from_hf, save_hf
    out, ready = str(tmp_path / "export"), str(tmp_path / "ready")
    before = _tiny_llama(seed=0)
    save_hf(before, out, max_shard_size=20_000)
    (tmp_path / "export" / "tokenizer.json").write_text("{}")      # a file of the user's
    files = sorted(os.listdir(out))
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE.format(
        ready=ready, out=out)], env=ENV,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(1200):
            if os.path.exists(ready) or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert os.path.exists(ready), proc.communicate(timeout=60)[0][-3000:]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert sorted(os.listdir(out)) == files
    loaded = from_hf(out)
    for (name, a), b in zip(before.named_parameters(), loaded.parameters()):
        assert torch.equal(a, b), name
    left = [n for n in os.listdir(tmp_path) if n.startswith("export.tmp-")]
    assert len(left) == 1   # the killed save's staging directory, at its own name
    save_hf(_tiny_llama(seed=2), out)                 # the next export replaces it whole
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]


# --- two ranks: a link at the save path; Fabric's weights_only ------------------------------
def _two_ranks(tmp):
    import torch.distributed as dist
    from fabric_helpers import launch_fabric
    from tpkit.checkpoint import save
    fabric, _ = launch_fabric(tp=2)
    out = {}
    try:
        save(os.path.join(tmp, "save", "step000010"), {"model": _linear()})
    except ValueError as e:
        out["link"] = str(e)
    import tpkit.checkpoint._dcp_save as impl   # the swap fails on rank 0 alone (a link raced in, EXDEV...)
    swap = impl.replace_dir
    if dist.get_rank() == 0:
        def fail(tmp, path):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        impl.replace_dir = fail
    try:
        save(os.path.join(tmp, "ck2"), {"model": _linear()})
    except ValueError as e:
        out["commit"] = str(e)
    finally:
        impl.replace_dir = swap
    for weights_only in (None, True, False):
        try:
            loaded = {"step": "not loaded"}
            fabric.load(os.path.join(tmp, "ck"), loaded, weights_only=weights_only)
            out[weights_only] = loaded["step"]
        except ValueError as e:
            out[weights_only] = str(e)
        dist.barrier()
        if dist.get_rank() == 0 and os.path.isdir(os.path.join(tmp, "code-ran")):
            os.rmdir(os.path.join(tmp, "code-ran"))
            out[f"ran {weights_only}"] = True
        dist.barrier()
    return out


def test_two_ranks_refuse_a_link_together_and_fabric_honours_weights_only(tmp_path):
    (tmp_path / "victim").mkdir()
    (tmp_path / "save").mkdir()
    os.symlink(tmp_path / "victim", tmp_path / "save" / "step000010")
    _dcp_save({"step": Evil(tmp_path / "code-ran", again=True)}, tmp_path / "ck")
    res = run(_two_ranks, 2, str(tmp_path))
    for rank, out in enumerate(res):
        assert "is a symbolic link" in out["link"], (rank, out)
        assert re.fullmatch(r"cannot save checkpoint .*/ck2: Invalid cross-device link; the "
                            r"previous one \(if any\) is unchanged", out["commit"]), (rank, out)
        for weights_only in (None, True):
            assert re.search(r"entry 'step' refers to os\.makedirs, which loads only by running "
                             "code", out[weights_only]), (rank, out)
        assert out[False] is None, (rank, out)   # makedirs' return value: it ran, as asked
    assert res[0].get("ran False") and not any(res[0].get(f"ran {w}") for w in (None, True))
    assert os.listdir(tmp_path / "victim") == [] and os.listdir(tmp_path / "save") == [
        "step000010"]
    assert sorted(os.listdir(tmp_path)) == ["ck", "save", "victim"]   # no ck2, no staging


# --- saving: file modes, plain values ------------------------------------------------------
@pytest.mark.parametrize("mode, dir_mode", [(0o600, 0o700), (0o640, 0o750)])
def test_save_mode(tmp_path, mode, dir_mode):
    run(_one_rank, 1, _save_mode, tmp_path, mode, dir_mode)


def _save_mode(tmp_path, mode, dir_mode):
    from tpkit.checkpoint import read, save
    ck = tmp_path / "ck"
    save(ck, {"model": _linear(), "step": 3}, mode=mode)
    assert stat.S_IMODE(os.stat(ck).st_mode) == dir_mode
    names = os.listdir(ck)
    assert ".metadata" in names and len(names) >= 2
    assert {n: stat.S_IMODE(os.stat(ck / n).st_mode) for n in names} == dict.fromkeys(names, mode)
    assert read(ck)["step"] == 3
    with pytest.raises(ValueError, match=r"mode=0o444 is not a file mode for checkpoints"):
        save(ck, {"step": 3}, mode=0o444)


def test_a_plain_value_that_needs_code_to_load_is_refused_before_writing(tmp_path):
    run(_one_rank, 1, _plain_value_refused, tmp_path)


def _plain_value_refused(tmp_path):
    from tpkit.checkpoint import save
    with pytest.raises(ValueError, match=r"^checkpoint entry 'sampler' refers to "
                                         r"test_security\.Sampler, which torch\.load\("
                                         r"weights_only=True\) cannot read back; store tensors"):
        save(tmp_path / "ck", {"model": _linear(), "sampler": Sampler()})
    assert os.listdir(tmp_path) == []


# --- shared memory: liveness across pid namespaces -------------------------------------------
def test_shm_sweep_judges_only_its_own_pid_namespace(tmp_path):
    from tpkit.comm import shm
    ns, boot = shm._where()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    ours = f"tpkit-{dead}-{ns}-{boot}-{'ab' * 6}"
    other_ns = f"tpkit-{dead}-{int(ns) + 1}-{boot}-{'cd' * 6}"     # pid means nothing here
    other_boot = f"tpkit-{dead}-{ns}-{'0' * 8 if boot != '0' * 8 else '1' * 8}-{'ef' * 6}"
    for name in (ours, other_ns, other_boot):
        (tmp_path / name).write_bytes(b"")
    assert shm.sweep_stale(str(tmp_path)) == [ours]
    assert sorted(os.listdir(tmp_path)) == sorted([other_ns, other_boot])


# --- the worker wrapper ---------------------------------------------------------------------
def test_worker_ignores_an_inherited_hang_reported(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("raise ValueError('a user error')\n")
    err = tmp_path / "error.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tpkit", "cli", "_worker.py"),
                           str(script)], env=dict(ENV, TPKIT_HANG_REPORTED="1",
                                                  TORCHELASTIC_ERROR_FILE=str(err)),
                          capture_output=True, text=True, timeout=45)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "a user error" in err.read_text()   # recorded, not slept over
