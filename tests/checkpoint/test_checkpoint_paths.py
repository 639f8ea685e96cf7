"""Path containment of the checkpoint readers (issue 52): a file a checkpoint's metadata
names must lie inside the checkpoint's directory, with containment meaning
``os.path.commonpath([root, path]) == root`` (``pathlib``'s ``is_relative_to``), not a
string prefix: ``/x/ckpt-evil/f`` and ``/x/ckpt.old/f`` are *not* inside ``/x/ckpt``.
Hostile names: a sibling that shares the checkpoint's name as a prefix, ``..`` in any
position, absolute paths, NUL, the directory itself, symbolic links out of it (DCP shards
are resolved; Hugging Face directories, whose files are links into the hub cache, are
judged as written).

The reference is pathlib's ``Path.is_relative_to`` on the resolved paths, written here;
the readers are driven end to end: DCP's ``.metadata`` (tpkit.checkpoint.load) and a
Hugging Face index (tpkit.models.hf.from_hf)."""
import os
import pathlib
import pickle
import shutil

import pytest
import torch

from dist import run
from tpkit.checkpoint._dcp_verify import inside


def _tree(tmp):
    """x/ckpt (the checkpoint: a file, a subdirectory, links), and its neighbours."""
    x = tmp / "x"
    root = x / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "f").write_text("in")
    (root / "sub" / "g").write_text("in")
    for sibling in ("ckpt-evil", "ckpt.old", "ckptx", "ck"):
        (x / sibling).mkdir()
        (x / sibling / "f").write_text("out")
    os.symlink(x / "ckpt-evil", root / "to-evil")                 # a link out of it
    os.symlink(x / "ckpt-evil" / "f", root / "evil-file")
    os.symlink(root / "sub" / "g", root / "to-g")                 # a link that stays inside
    os.symlink(root, tmp / "alias")                               # the root reached by a link
    return root


def _reference(root, rel, links):
    """What ``inside`` must return, from pathlib (None: outside or not a file name)."""
    if not isinstance(rel, str) or not rel or "\0" in rel or os.path.isabs(rel):
        return None
    if links:
        base = pathlib.Path(os.path.realpath(root))
        full = pathlib.Path(os.path.realpath(os.path.join(base, rel)))
    else:   # as written: a name that leaves the directory at all is refused
        if os.path.normpath(rel).split(os.sep)[0] == "..":
            return None
        base = pathlib.Path(root)
        full = pathlib.Path(os.path.normpath(os.path.join(root, rel)))
    return str(full) if full.is_relative_to(base) and full != base else None


RELS = ["f", "sub/g", "sub/../f", "../ckpt/f", "./f", "to-g",
        "../ckpt-evil/f", "../ckpt.old/f", "../ckptx/f", "../ck/f", "sub/../../ckpt-evil/f",
        "to-evil/f", "evil-file", "..", ".", "../ckpt", "sub/../..", "", "/etc/passwd",
        "f\0", None, 3]


@pytest.mark.parametrize("links", [True, False])
def test_inside_is_pathlib_containment(tmp_path, links):
    root = _tree(tmp_path)
    for base in (str(root), str(root) + os.sep, str(tmp_path / "alias")):
        for rel in RELS:
            if not links and rel in ("to-evil/f", "evil-file"):
                continue          # as written: inside (the hub cache's links are allowed)
            want = _reference(base.rstrip(os.sep), rel, links)
            got = inside(base, rel, links=links)
            if got is not None:
                got = os.path.normpath(got)
            assert got == want, (base, rel, links, got, want)
    # the ones that matter, spelled out
    assert inside(str(root), "../ckpt-evil/f") is None
    assert inside(str(root), "../ckpt-evil/f", links=False) is None
    assert inside(str(root), "to-evil/f") is None and inside(str(root), "evil-file") is None
    assert inside(str(root), "to-g") == str(root / "sub" / "g")
    assert inside(str(tmp_path / "alias"), "f") == str(root / "f")


def test_inside_a_root_directory():
    """The file system's root holds everything below it ('/' + os.sep is '//', which no
    real path starts with)."""
    assert inside("/", "etc") == os.path.realpath("/etc")
    assert inside("/", "etc", links=False) == "/etc"
    assert inside("/", "..") is None


def _sibling_shard(tmp):
    """A DCP checkpoint whose .metadata names its shard in a sibling directory that shares
    the checkpoint's name as a prefix (the shard moved there: without the check it loads)."""
    from tpkit.checkpoint import load, save
    ck = tmp / "ckpt"
    torch.manual_seed(0)
    save(ck, {"model": torch.nn.Linear(4, 4)})
    (tmp / "ckpt-evil").mkdir()
    shutil.move(ck / "__0_0.distcp", tmp / "ckpt-evil")
    with open(ck / ".metadata", "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        info.relative_path = "../ckpt-evil/__0_0.distcp"
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    return lambda: load(ck, {"model": torch.nn.Linear(4, 4)})


def _linked_shard(tmp):
    """The shard file itself a symbolic link into the sibling directory."""
    from tpkit.checkpoint import load, save
    ck = tmp / "ckpt"
    torch.manual_seed(0)
    save(ck, {"model": torch.nn.Linear(4, 4)})
    (tmp / "ckpt-evil").mkdir()
    shutil.move(ck / "__0_0.distcp", tmp / "ckpt-evil")
    os.symlink(tmp / "ckpt-evil" / "__0_0.distcp", ck / "__0_0.distcp")
    return lambda: load(ck, {"model": torch.nn.Linear(4, 4)})


def _sibling_hf(tmp):
    """An exported model whose index names a shard in hf-evil, a sibling of hf."""
    from tpkit.models.hf import from_hf, save_hf
    from tpkit.models.llama import Llama, LlamaConfig
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, hidden_size=32, ffn_hidden_size=64,
                              num_layers=2, num_heads=4, num_gqa_groups=2))
    out = tmp / "hf"
    save_hf(model, str(out), max_shard_size=20_000)
    index = out / "model.safetensors.index.json"
    (tmp / "hf-evil").mkdir()
    shutil.move(out / "model-00001-of-00006.safetensors", tmp / "hf-evil")
    index.write_text(index.read_text().replace(
        '"model-00001-of-00006.safetensors"', '"../hf-evil/model-00001-of-00006.safetensors"'))
    return lambda: from_hf(str(out))


CASES = {"dcp-sibling-prefix": (_sibling_shard, "names shard '../ckpt-evil/__0_0.distcp', "
                                                "which is outside"),
         "dcp-linked-shard": (_linked_shard, "outside"),
         "hf-sibling-prefix": (_sibling_hf, "'../hf-evil/model-00001-of-00006.safetensors' "
                                            "is outside")}


def _refused(case, tmp):
    import tpkit
    tpkit.init_parallel()
    make, words = CASES[case]
    action = make(tmp)
    with pytest.raises(ValueError) as e:
        action()
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("case", list(CASES))
def test_a_sibling_sharing_the_name_is_outside(case, tmp_path):
    run(_refused, 1, case, tmp_path)
