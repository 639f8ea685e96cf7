"""tpkit.train.JobConfig: every field declared once (type, default, one-line doc, flags),
defaults < TOML file < flags, --print-config's TOML read back as the same job, and the
messages of bad values naming field, value, origin and fix. No process group: the
launched runs are tests/train/test_train.py's (bit-identical curves from a file, flags and the
printed config) and the bad-input table's rows (tests/test_bad_input.py)."""
import dataclasses
import os
import re
import subprocess
import sys

import pytest

from jobs import refusal
from tpkit.train import SECTIONS, JobConfig, parse
from tpkit.train.config import build_parser, field_docs, markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_field_has_a_type_default_doc_and_flags():
    help_text = build_parser("tpkit-train").format_help()
    assert len(SECTIONS) >= 10
    for path, typ, default, doc, short in field_docs():
        assert default is not dataclasses.MISSING, path
        assert doc and "\n" not in doc and len(doc) < 200, (path, doc)
        assert re.search(rf"--{re.escape(path)}\b", help_text), path
        for flag in short:
            assert re.search(rf"{re.escape(flag)}\b", help_text), (path, flag)
        assert typ.split(" | ")[0] in ("int", "float", "str", "bool"), (path, typ)
    shorts = [f for *_, short in field_docs() for f in short]
    assert len(shorts) == len(set(shorts)), "a short flag names two fields"


def test_file_then_flags_and_where_each_value_came_from(tmp_path):
    job_file = tmp_path / "job.toml"
    job_file.write_text("[training]\nsteps = 50\nseq_len = 64\n\n[optimizer]\nlr = 1e-3\n")
    job, ns = parse(["--config", str(job_file), "--steps", "7", "--optimizer.warmup", "3"],
                    env={})
    assert (job.training.steps, job.training.seq_len, job.optimizer.lr,
            job.optimizer.warmup, job.model.hidden) == (7, 64, 1e-3, 3, 128)
    assert job.origin == {"training.steps": "--steps", "training.seq_len": f"{job_file}:3",
                          "optimizer.lr": f"{job_file}:6", "optimizer.warmup":
                          "--optimizer.warmup"}
    assert job.show("training.seq_len") == f"training.seq_len=64 ({job_file}:3)"
    assert job.show("model.hidden") == "model.hidden=128 (default)"
    # booleans: short flag, long flag with and without a value, and over a file's true
    job_file.write_text("[training]\nrecompute = true\n")
    for argv, want in ((["--recompute"], True), (["--training.recompute"], True),
                       (["--training.recompute", "false"], False),
                       (["--config", str(job_file)], True),
                       (["--config", str(job_file), "--training.recompute=false"], False)):
        assert parse(argv, env={})[0].training.recompute is want, argv


def test_the_environment_fills_only_the_hang_timeout():
    job, _ = parse([], env={"TPKIT_HANG_TIMEOUT": "900", "TPKIT_TP": "2"})
    assert job.recovery.hang_timeout == 900.0 and job.parallelism.tp is None
    assert job.layout({"TPKIT_TP": "2", "TPKIT_CP": "2"}).tp == 2   # the layout reads it
    assert parse(["--hang-timeout", "5"], env={"TPKIT_HANG_TIMEOUT": "900"}
                 )[0].recovery.hang_timeout == 5.0


ROUND_TRIP = [
    [],
    ["--tp", "2", "--cp", "2", "--sequence-parallel", "--cp-comm-type", "a2a", "--steps",
     "20", "--lr", "0.001", "--recompute", "--save", "/tmp/x y/\"q\"", "--save-every", "5",
     "--keep", "2", "--precision", "fp8", "--fp8-recipe", "current",
     "--fp8-compute-dtype", "bfloat16", "--hang-timeout", "12.5", "--dropout", "0.1"],
    ["--moe-experts", "4", "--ep", "2", "--moe-capacity-factor", "1.25", "--pp", "2",
     "--microbatches", "4", "--pp-schedule", "Interleaved1F1B", "--virtual-stages", "2",
     "--layers", "4", "--model.impl", "auto", "--data-parallel", "ddp"],
]


@pytest.mark.parametrize("argv", ROUND_TRIP, ids=["defaults", "dense", "moe-pp"])
def test_printed_config_reads_back_as_the_same_job(argv, tmp_path, capsys):
    """--print-config's text (from tpkit.train.main, as a user runs it) read back with
    --config is the same JobConfig, field for field (None fields stay unset)."""
    from tpkit.train import main
    assert main(argv + ["--print-config"]) == []
    printed = capsys.readouterr().out
    (tmp_path / "job.toml").write_text(printed)
    again, _ = parse(["--config", str(tmp_path / "job.toml")], env={})
    assert again == parse(argv, env={})[0]
    assert printed.count("\n# ") >= len(field_docs())    # every field with its doc
    for section in SECTIONS:
        assert f"\n[{section}]\n" in printed


@pytest.mark.parametrize("text,words", [
    ("[model]\nimpl = \"tensorrt\"\n", "model.impl='tensorrt' ({f}:2) is not one of"),
    ("[training]\nrecompute = 1\n", "training.recompute=1 ({f}:2) must be true or false"),
    ("[optimizer]\nlr = \"3e-3\"\n", "optimizer.lr='3e-3' ({f}:2) must be a number"),
    ("[training]\nsteps = 2.5\n", "training.steps=2.5 ({f}:2) must be an integer"),
    ("[experts]\nnum = 4\n[parallelism]\nep = 3\n", "experts.num=4 ({f}:2) is not divisible by"
                                                   " ep=3; use a multiple of 3"),
    ("[model]\n\n\ndropout = 1.0\n", "model.dropout=1.0 ({f}:4) must be in [0, 1)"),
    ("model = 3\n", "{f}:1: model must be a section"),
    ("[training]\ncpu_offload_layers = 2\n", "training.cpu_offload_layers=2 ({f}:2) must be "
                                              "from 0 to model.layers - 1 = 1"),
])
def test_bad_file_values_name_field_value_line_and_fix(text, words, tmp_path):
    f = tmp_path / "job.toml"
    f.write_text(text)
    assert words.format(f=f) in refusal(["--config", str(f)])


def test_flag_mistakes():
    assert "--model.impl torch" in refusal(["--backend", "torch"])   # the old spelling
    assert "unrecognized arguments: --step" in refusal(["--step", "5"])   # no abbreviations
    assert "invalid _parse_number value" not in refusal(["--steps", "x"])
    assert "'x' is not an integer" in refusal(["--steps", "x"])
    assert "invalid choice: 'bf16'" in refusal(["--precision", "bf16"])
    assert "--config nope.toml: No such file" in refusal(["--config", "nope.toml"])


def test_import_does_not_import_torch():
    """``--help`` and the config need no torch: tpkit.train and its config load without it."""
    code = ("import sys, tpkit.train, tpkit.train.config; "
            "tpkit.train.config.build_parser().format_help(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "PYTHONPATH": ROOT})


def test_docs_train_md_lists_every_field():
    """docs/train.md's field table is markdown_table(), the fields' own docs (regenerate it
    with ``tools/train_fields.py``)."""
    text = open(os.path.join(ROOT, "docs", "train.md")).read()
    m = re.search(r"<!-- fields: start -->\n(.*?)<!-- fields: end -->", text, re.S)
    assert m is not None, "docs/train.md has no field table"
    assert m.group(1) == markdown_table(), \
        "docs/train.md's field table is stale: run python tools/train_fields.py"
    assert JobConfig() == parse([], env={})[0]


def test_one_process_with_a_layout_asks_for_tpkit_launch(capsys, monkeypatch):
    """``python launch/train.py --tp 2`` (no launcher): exit 2, one line naming the
    command to run instead, before any process group."""
    import torch.distributed as dist
    from tpkit.train import main
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["--tp", "2", "--cp", "2"], prog="launch/train.py")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("launch/train.py: error: tp*cp*pp = 2*2*1 needs 4 processes")
    assert "tpkit-launch --nproc-per-node 4 --tp 2 --cp 2 launch/train.py" in err
    assert not dist.is_initialized()


def test_the_layout_is_resolved_once_and_handed_over(tmp_path):
    """JobConfig.layout: the parallelism section over tpkit-launch's TPKIT_* (values from
    the job win; a value given to tpkit-launch's own flags and to the job with two values
    is refused, naming both), its messages naming where each size came from;
    TPKitStrategy takes the resolved Layout as it is (and refuses sizes beside it)."""
    from tpkit.layout.config import Layout, ParallelConfig
    from tpkit.fabric import TPKitStrategy
    (tmp_path / "job.toml").write_text("[parallelism]\ncp = 2\n")
    job, _ = parse(["--config", str(tmp_path / "job.toml"), "--tp", "2"], env={})
    cfg = job.layout({"TPKIT_TP": "4", "TPKIT_SEQUENCE_PARALLEL": "1"}).validate(8)
    assert (cfg.tp, cfg.cp, cfg.dp, cfg.sequence_parallel) == (2, 2, 2, True)
    assert isinstance(cfg, Layout) and cfg.validate(8) is cfg   # resolved: not checked again
    with pytest.raises(ValueError, match="world size 16 is not this layout's"):
        cfg.validate(16)
    with pytest.raises(ValueError, match=rf"tp=2 from --tp; cp=2 from {tmp_path}/job.toml:2"):
        job.layout({}).validate(6)
    launcher = ParallelConfig.from_env({}, given_as="tpkit-launch --{flag}", tp=4)
    with pytest.raises(ValueError, match=r"--tp=2 \(parallelism.tp\) conflicts with tp=4 "
                                         r"from tpkit-launch --tp: one run has one layout"):
        job.layout(launcher)
    shell = ParallelConfig.from_env({"TPKIT_TP": "4", "TPKIT_DP": "1"})   # defaults: job wins
    assert job.layout(shell).validate(8) == ParallelConfig(tp=2, cp=2, dp=2)
    assert TPKitStrategy(layout=cfg).config is cfg
    with pytest.raises(ValueError, match="not both"):
        TPKitStrategy(layout=cfg, tp=2)


def test_a_flag_given_twice_takes_the_last_value():
    """docs/train.md: a repeated flag (any spelling of the field) takes the last value,
    and messages name that flag (issue 51: documented, not silent)."""
    job, _ = parse(["--steps", "5", "--training.steps", "7"], env={})
    assert job.training.steps == 7 and job.show("training.steps") == \
        "--training.steps=7 (training.steps)"
    job, _ = parse(["--training.steps", "7", "--steps", "5"], env={})
    assert job.training.steps == 5
