"""Checking a checkpoint directory's files (tpkit.checkpoint._dcp_verify), single process: checkpoints
written by torch.distributed.checkpoint itself, and metadata built from DCP's own classes
with shard files of sizes the test chooses; then damaged one way at a time."""
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from tpkit.checkpoint._dcp_verify import (agree, checkpoint_dir, dir_problem, previous_checkpoint,
                               verify_files)


def _made(path, files):
    """A checkpoint directory whose .metadata records ``files``: name -> [(offset,
    length)], and shard files exactly as long as the furthest range in each."""
    os.makedirs(path, exist_ok=True)
    storage = {}
    for name, ranges in files.items():
        for i, (off, length) in enumerate(ranges):
            storage[MetadataIndex(f"{name}.{i}")] = _StorageInfo(name, off, length)
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"x" * max(o + n for o, n in ranges))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Metadata(state_dict_metadata={}, storage_data=storage), f)
    return str(path)


def _size(path):
    return os.path.getsize(path)


def test_a_dcp_checkpoint_verifies_and_every_damage_is_named(tmp_path):
    ck = str(tmp_path / "step000010")
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"a": torch.arange(10.0), "b": torch.ones(3, 4)}, checkpoint_id=ck)
    md = verify_files(ck)
    assert {k.fqn for k in md.storage_data} == {"a", "b"}
    assert verify_files(tmp_path / "step000010").storage_data == md.storage_data   # PathLike
    shard = os.path.join(ck, "__0_0.distcp")
    need = _size(shard)
    with open(shard, "ab") as f:
        f.write(b"!")
    with pytest.raises(ValueError, match=rf"checkpoint {ck} is incomplete or damaged: shard "
                                         rf"{shard} has {need + 1} bytes but the checkpoint's "
                                         rf"\.metadata records {need} \(longer than the save "
                                         r"wrote\); no earlier complete checkpoint is next to "
                                         r"it: load another checkpoint, or start without one"):
        verify_files(ck)
    os.truncate(shard, need - 1)
    with pytest.raises(ValueError, match=rf"has {need - 1} bytes but .* records {need} "
                                         r"\(truncated\)"):
        verify_files(ck)
    os.remove(shard)
    with pytest.raises(ValueError, match=rf"shard {shard} is missing \(the checkpoint's "
                                         r"\.metadata names it\)"):
        verify_files(ck)


def test_extent_is_the_furthest_range_of_each_file(tmp_path):
    files = {"s0": [(0, 5), (5, 7), (30, 2)], "s1": [(0, 3)], "s2": [(9, 1), (0, 4)],
             "empty": [(0, 0)]}   # a file of zero bytes, as the metadata says
    ck = _made(tmp_path / "ck", files)
    assert len(verify_files(ck).storage_data) == 7
    for name, want in (("s0", 32), ("s1", 3), ("s2", 10)):
        os.truncate(os.path.join(ck, name), want - 1)
        with pytest.raises(ValueError, match=rf"{name} has {want - 1} bytes but the "
                                             rf"checkpoint's \.metadata records {want} "):
            verify_files(ck)
        os.truncate(os.path.join(ck, name), want)
    verify_files(ck)


@pytest.mark.parametrize("damage, why", [
    (lambda m: os.remove(m), r"\.metadata is missing: the save did not finish, or .* is not "
                             "a checkpoint directory"),
    (lambda m: os.truncate(m, 10), r"\.metadata cannot be read \(\w+Error: .*\): the file "
                                   "is damaged or truncated"),
    (lambda m: open(m, "wb").write(pickle.dumps({"storage_data": 1})),
     r"\.metadata cannot be read \(AttributeError: .*\): the file is damaged or truncated"),
    (lambda m: open(m, "wb").write(pickle.dumps(Metadata({}, storage_data=[]))),
     r"\.metadata cannot be read \(AssertionError\): the file is damaged or truncated"),
    (lambda m: open(m, "wb").write(pickle.dumps(Metadata([], storage_data={}))),
     r"\.metadata cannot be read \(AssertionError\): the file is damaged or truncated"),
])
def test_bad_metadata_names_the_previous_checkpoint(tmp_path, damage, why):
    prev = _made(tmp_path / "step000030", {"s": [(0, 4)]})
    _made(tmp_path / "step000010", {"s": [(0, 4)]})
    ck = _made(tmp_path / "step000040", {"s": [(0, 4)]})
    damage(os.path.join(ck, ".metadata"))
    with pytest.raises(ValueError, match=rf"checkpoint {ck} is incomplete or damaged: "
                                         rf"{ck}/{why}; resume from the previous checkpoint: "
                                         rf"{prev}$"):
        verify_files(ck)


def test_previous_checkpoint_picks_the_newest_complete_older_one_of_the_series(tmp_path):
    mk = lambda n: _made(tmp_path / n, {"s": [(0, 2)]})
    for n in ("step000005", "step000030", "step000100", "other000020", "step000020_b"):
        mk(n)
    (tmp_path / "step000035").write_text("a file, not a checkpoint")
    broken = mk("step000038")
    os.remove(os.path.join(broken, "s"))
    at = lambda n: os.path.join(tmp_path, n)
    assert previous_checkpoint(at("step000040")) == at("step000030")   # 38 is incomplete
    assert previous_checkpoint(at("step000030")) == at("step000005")   # not itself
    assert previous_checkpoint(at("step000005")) is None
    assert previous_checkpoint(at("step000999")) == at("step000100")   # absent: the newest
    assert previous_checkpoint(at("other000030")) == at("other000020")
    assert previous_checkpoint(at("step000030_b")) == at("step000020_b")  # two numbers
    assert previous_checkpoint(at("nowhere/step000010")) is None       # no such parent
    os.remove(os.path.join(at("step000030"), "s"))
    assert previous_checkpoint(at("step000040")) == at("step000005")
    # numbers compare as numbers (step9 is older than step10), and another spelling of
    # the same number is not older
    for n in ("step8", "step9", "step0010", "step30"):
        mk(n)
    assert previous_checkpoint(at("step10")) == at("step9")
    assert previous_checkpoint(at("step000030")) == at("step0010")


def test_checkpoint_dir_and_dir_problem(tmp_path):
    ck = _made(tmp_path / "step000010", {"s": [(0, 2)]})
    assert checkpoint_dir(tmp_path / "step000010") == ck
    assert checkpoint_dir(os.path.relpath(ck)) == ck
    meta = os.path.join(ck, ".metadata")
    with pytest.raises(ValueError, match=rf"checkpoint path {meta} is a file, not a checkpoint"
                                         rf" directory; pass its directory {ck}$"):
        checkpoint_dir(meta)
    loose = tmp_path / "notes.txt"
    loose.write_text("x")
    with pytest.raises(ValueError, match=r"notes.txt is a file, not a checkpoint directory; "
                                         r"pass the directory tpkit.checkpoint.save \(or "
                                         r"fabric.save\) wrote, the one that holds \.metadata"):
        checkpoint_dir(loose)
    missing = os.path.join(tmp_path, "step000020")
    with pytest.raises(ValueError, match=rf"no checkpoint at {missing}: it does not exist "
                                         rf"\(the newest next to it is {ck}\); pass the "):
        checkpoint_dir(missing)
    with pytest.raises(ValueError, match=r"it does not exist; pass the directory"):
        checkpoint_dir(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"elsewhere/step000001 is incomplete|it does not "
                                         r"exist; pass"):
        verify_files(tmp_path / "elsewhere" / "step000001")
    # dir_problem: writable (existing or to be created), or the ancestor that is a file
    assert dir_problem(tmp_path) is None
    assert dir_problem(tmp_path / "new" / "deeper") is None
    assert dir_problem(loose) == f"{loose} is a file, not a directory"
    assert dir_problem(loose / "sub" / "dir") == f"{loose} is a file, not a directory"
    assert not os.path.exists(tmp_path / "new")   # nothing is created


def test_dir_problem_asks_for_write_and_search_permission(tmp_path, monkeypatch):
    """(Tests run as root here, where every directory is writable: the permission check
    is answered by the test.)"""
    asked = []
    monkeypatch.setattr(os, "access", lambda p, mode: asked.append((p, mode)) or False)
    assert dir_problem(tmp_path / "a" / "b") == f"{tmp_path} is not writable"
    assert asked == [(str(tmp_path), 3)] and os.W_OK | os.X_OK == 3


def test_agree_without_a_process_group():
    agree(None)
    err = KeyError("k")
    with pytest.raises(ValueError, match="mine"):
        agree(ValueError("mine"))
    # this rank's own error keeps its type
    e = type("MissingKeyError", (ValueError, KeyError), {})("missing")
    with pytest.raises(KeyError):
        agree(e)
    assert err.args == ("k",)


@pytest.mark.parametrize("world", [2, 3])
def test_agree_raises_on_every_rank_when_one_rank_failed(monkeypatch, world):
    """Rank 0's view of a world where rank ``world - 1`` found a problem: the collective
    is the test's (every rank's message, in rank order)."""
    import torch.distributed as dist
    others = {world - 1: "rank's own problem"}
    sent = []

    def all_gather_object(out, obj):
        assert len(out) == world
        sent.append(obj)
        for r in range(world):
            out[r] = obj if r == 0 else others.get(r)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: world)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    with pytest.raises(ValueError, match=r"^rank's own problem$") as e:
        agree(None)
    assert type(e.value) is ValueError and sent == [None]
    with pytest.raises(KeyError):   # this rank's own error first, its type kept
        agree(type("MissingKeyError", (ValueError, KeyError), {})("mine"))
    assert sent == [None, "'mine'"]
    others.clear()
    agree(None)   # nobody failed
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    others[0] = "never asked"
    agree(None)   # one rank: no collective
    assert len(sent) == 3
