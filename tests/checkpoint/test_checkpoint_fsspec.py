"""Checkpoints at fsspec URLs (tpkit/checkpoint/_dcp_fs.py): save, resume and auto-resume through
``file://`` (fsspec's local file system, 2 ranks sharing it) and ``memory://`` (fsspec's
in-memory one: per process, so 1 rank) give the curve of a local directory bit for bit;
a checkpoint without its completion marker is never picked; the loader's checks (no code
from ``.metadata``, shard paths inside, shard sizes) hold for URLs.

The reference is the uninterrupted run of the same loop (no checkpoint at all) and the
same save/resume through a local directory, the format tpkit had before URLs."""
import pickle
import warnings

import pytest
import torch

from dist import run

STEPS, SAVE_EVERY = 6, 2


def _loop(save_dir, tp: int, seed: int, steps: int, resume: bool):
    """A tp-sharded MLP under tpkit.recovery: resume (auto), train to ``steps``, save every
    2. Returns {step: loss} of the steps it ran."""
    import tpkit
    from tpkit.nn import ColumnParallelLinear, RowParallelLinear
    from tpkit.recovery import Recovery
    tpkit.init_parallel(tp=tp)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(ColumnParallelLinear(8, 32), torch.nn.GELU(),
                                RowParallelLinear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": opt}
    losses = {}
    with Recovery(save_dir, save_every=SAVE_EVERY if save_dir else 0, signals=()) as rec:
        start = rec.resume(state) if resume else 0
        for step in range(start, steps):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[step] = loss.item()
            if save_dir:
                rec.step_end(step, state, last=step == steps - 1)
    tpkit.destroy_parallel()
    return losses


def _cycle(save_dir, tp):
    """Uninterrupted reference, then 4 steps saved + a fresh model (other seed) that
    auto-resumes and runs to the end; and the marker rule at that directory."""
    from tpkit.checkpoint import _dcp_fs as fs
    from tpkit.recovery import latest_checkpoint, skipped_checkpoints
    ref = _loop(None, tp, 0, STEPS, False)
    first = _loop(save_dir, tp, 0, 4, False)
    again = _loop(save_dir, tp, 123, STEPS, True)          # resumes after step 3
    out = {"ref": ref, "first": first, "again": again}
    # a newer checkpoint whose save did not finish (no marker): never picked
    import torch.distributed as dist
    if dist.get_rank() == 0:
        src, dst = f"{save_dir}/step000006", f"{save_dir}/step000008"
        fsys, _ = fs._fs(src)
        fsys.copy(fs._fs(src)[1], fs._fs(dst)[1], recursive=True)
        fsys.rm(fs._fs(fs.join(dst, fs.MARKER))[1])
        out["latest"] = latest_checkpoint(save_dir)
        out["skipped"] = skipped_checkpoints(save_dir)
        out["listing"] = fs.listdir(save_dir)
    dist.barrier()
    return out


def _check(out, save_dir):
    ref, first, again = out["ref"], out["first"], out["again"]
    assert sorted(again) == [4, 5]                          # resumed after the step-4 save
    for step, loss in {**first, **again}.items():
        assert loss == ref[step], (step, loss, ref[step])   # bit for bit
    assert out["latest"] == f"{save_dir}/step000006"
    (path, why), = out["skipped"]
    assert path == f"{save_dir}/step000008" and ".tpkit-complete is missing" in why


def test_file_url_two_ranks_same_curve_as_local(tmp_path):
    url = f"file://{tmp_path}/url"
    local = str(tmp_path / "local")
    by_url = run(_cycle, 2, url, 2)[0]
    by_dir = run(_loop, 2, local, 2, 0, 4, False)[0]
    by_dir.update(run(_loop, 2, local, 2, 123, STEPS, True)[0])
    _check(by_url, url)
    assert {**by_url["first"], **by_url["again"]} == by_dir
    assert sorted(p.name for p in (tmp_path / "url").iterdir()) == \
        ["step000002", "step000004", "step000006", "step000008"]
    assert (tmp_path / "url" / "step000006" / ".tpkit-complete").is_file()


def test_memory_url_one_rank_same_curve():
    url = "memory://tpkit-test/ckpt"
    _check(run(_cycle, 1, url, 1)[0], url)


# --- the loader's rules at a URL (no process group needed: verify reads no tensor) -------
@pytest.fixture
def mem_ckpt():
    """A complete checkpoint at memory://..., written as tpkit.checkpoint.save writes it
    (DCP's fsspec writer, then the marker)."""
    import fsspec
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from tpkit.checkpoint import _dcp_fs as fs
    url = "memory://tpkit-test/sec/step000002"
    mem = fsspec.filesystem("memory")
    if mem.exists("/tpkit-test/sec"):
        mem.rm("/tpkit-test/sec", recursive=True)
    with warnings.catch_warnings():   # DCP says it saves in one process: it does
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(8.0)}, storage_writer=FsspecWriter(url), no_dist=True)
    fs.write_marker(url)
    return url, mem, "/tpkit-test/sec/step000002"


def _md(mem, path):
    from tpkit.checkpoint._dcp_verify import parse_metadata
    with mem.open(f"{path}/.metadata", "rb") as f:
        return parse_metadata(f, "x")


def _put_md(mem, path, md):
    with mem.open(f"{path}/.metadata", "wb") as f:
        pickle.dump(md, f)


def test_url_checks_hold(mem_ckpt):
    from tpkit.checkpoint import verify
    url, mem, path = mem_ckpt
    verify(url)                                                # complete: passes
    shard = next(p for p in mem.ls(path, detail=False) if p.endswith(".distcp"))
    data = mem.cat_file(shard)
    mem.pipe_file(shard, data[:-3])                            # truncated shard
    with pytest.raises(ValueError, match=r"has \d+ bytes but .* \(truncated\)"):
        verify(url)
    mem.pipe_file(shard, data)
    md = _md(mem, path)
    for info in md.storage_data.values():                      # a path out of the checkpoint
        info.relative_path = "../other/" + info.relative_path
    _put_md(mem, path, md)
    with pytest.raises(ValueError, match=r"outside memory://.*crafted"):
        verify(url)

    class Evil:
        def __reduce__(self):
            return (print, ("ran code from the checkpoint",))
    with mem.open(f"{path}/.metadata", "wb") as f:              # code in the metadata
        pickle.dump(Evil(), f)
    with pytest.raises(ValueError, match="builtins.print, which DCP metadata never holds"):
        verify(url)


def test_url_without_marker_is_refused(mem_ckpt):
    from tpkit.checkpoint import _dcp_fs as fs
    from tpkit.checkpoint import verify
    from tpkit.recovery import is_complete, latest_checkpoint
    url, mem, path = mem_ckpt
    assert is_complete(url) and latest_checkpoint(url.rsplit("/", 1)[0]) == url
    mem.rm(f"{path}/{fs.MARKER}")
    assert not is_complete(url) and latest_checkpoint(url.rsplit("/", 1)[0]) is None
    with pytest.raises(ValueError, match=r"\.tpkit-complete is missing: the save did not finish"):
        verify(url)
