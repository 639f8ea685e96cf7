"""Every option of tpkit-train's job config TAKES EFFECT (issue 52): for each field of
tpkit.train.JobConfig's schema, ``EFFECTS`` names the test that measures a consequence of
setting it (a curve that differs from the default's, bytes offloaded, files written, steps
resumed or skipped, a metric column), not only that it parses.
``test_every_option_has_an_effect_test`` reads the schema, so a new option without an
entry (or with an entry naming a test that does not exist) fails.

Most options are measured here in ONE pool call of one process (``tpkit.train.main``, a
tiny model, 4 steps each; about a minute): ``RUNS`` is the table of runs, each an
override of ``BASE``, and ``CHECKS`` the measurement of each option against the default
run (or the run named). The layout options are measured by the launched tests named in
``EFFECTS`` (a layout keeps the curve by design: what they show is the layout reached).
"""
import ast
import csv
import dataclasses
import math
import os

import pytest

from dist import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--steps", "4", "--hidden", "32", "--layers", "2", "--heads", "4", "--gqa-groups",
        "2", "--ffn", "64", "--seq-len", "16", "--global-batch", "4", "--warmup", "2",
        "--log-every", "100"]
HERE = "tests/train/test_option_effects.py::test_options_take_effect_in_one_process"

# option -> the test that measures its effect (HERE: a CHECKS row of this file)
EFFECTS = {
    "parallelism.tp": "tests/train/test_train.py::test_layout_parity",
    "parallelism.cp": "tests/train/test_train.py::test_layout_parity",
    "parallelism.pp": "tests/distributed/test_pipeline.py::test_train_py_launched_parity",
    "parallelism.ep": "tests/checkpoint/test_moe_checkpoint.py::test_train_resume_at_another_ep",
    "parallelism.etp": "tests/checkpoint/test_moe_checkpoint.py::test_train_resume_at_another_ep",
    "parallelism.sequence_parallel": "tests/train/test_train.py::test_layout_parity",
    "parallelism.cp_comm_type": "tests/test_user_features.py::test_train_options",
    "parallelism.data_parallel": "tests/test_user_features.py::test_train_options",
    "model.impl": HERE,
    "model.hidden": HERE, "model.layers": HERE, "model.heads": HERE,
    "model.gqa_groups": HERE, "model.ffn": HERE, "model.dropout": HERE,
    "model.init_from_hf": "tests/models/test_models_hf.py::test_train_init_from_hf_and_export",
    "model.arch": "tests/train/test_train_data.py::"
                  "test_llama_from_scratch_takes_the_tokenizers_vocabulary",
    "model.hf_config": "tests/train/test_llama_scratch.py::"
                       "test_llama_from_scratch_matches_transformers",
    "model.rope_theta": "tests/train/test_llama_scratch.py::"
                        "test_llama_from_scratch_matches_transformers",
    "model.vocab_multiple": "tests/train/test_train_data.py::"
                            "test_odd_vocabulary_is_padded_and_trains_at_tp2",
    "parallelism.dp_replicate": "tests/train/test_compose.py::test_hsdp_2x2_with_tp2",
    "parallelism.fsdp_mixed_precision": "tests/train/test_compose.py::"
                                        "test_fsdp_bf16_policy_tracks_fp32",
    "checkpoint.resume_partial": "tests/test_bad_input.py::test_partial_resume_trains_on",
    "optimizer.impl": "tests/train/test_option_effects.py::test_optimizer_impl_takes_effect",
    "data.pack": "tests/train/test_train_data.py::test_own_data_packed_same_curves_at_tp2_cp2",
    "data.path": "tests/train/test_train_data.py::test_own_data_packed_same_curves_at_tp2_cp2",
    "data.tokenizer": "tests/train/test_train_data.py::test_own_data_packed_same_curves_at_tp2_cp2",
    "data.format": "tests/train/test_option_effects.py::test_data_format_takes_effect",
    "data.split": "tests/train/test_train_data.py::test_own_data_saved_at_dp2_resumed_at_dp4",
    "data.eval_every": "tests/train/test_train_data.py::test_own_data_saved_at_dp2_resumed_at_dp4",
    "data.eval_batches": "tests/train/test_train_data.py::test_own_data_saved_at_dp2_resumed_at_dp4",
    "training.steps": HERE, "training.global_batch": HERE, "training.seq_len": HERE,
    "training.seed": HERE, "training.recompute": HERE, "training.cpu_offload_layers": HERE,
    "training.verify": "tests/train/test_train_verify.py::test_a_difference_stops_the_launch",
    "training.compile": "tests/nn/test_compile.py::test_launched_compile_train",
    "training.compile_backend": "tests/nn/test_compile.py::test_launched_compile_train",
    "optimizer.lr": HERE, "optimizer.warmup": HERE, "optimizer.clip": HERE,
    "precision.mode": HERE, "precision.fp8_recipe": HERE, "precision.fp8_compute_dtype": HERE,
    "checkpoint.save": HERE, "checkpoint.save_every": HERE, "checkpoint.resume": HERE,
    "checkpoint.keep": HERE, "checkpoint.async_save": HERE,
    "checkpoint.export_hf": "tests/models/test_models_hf.py::test_train_init_from_hf_and_export",
    "recovery.auto_resume": HERE,
    "recovery.hang_timeout": "tests/recovery/test_recovery.py::test_hang_names_the_stuck_rank_and_its_frame",
    "pipeline.microbatches": "tests/distributed/test_pipeline.py::test_train_py_launched_parity",
    "pipeline.schedule": "tests/distributed/test_pipeline.py::test_train_py_launched_parity",
    "pipeline.virtual_stages": "tests/distributed/test_pipeline.py::test_train_py_launched_parity",
    "experts.num": HERE, "experts.topk": HERE, "experts.every": HERE,
    "experts.aux_coeff": HERE, "experts.capacity_factor": HERE,
    "logging.log_every": HERE, "logging.log_dir": HERE, "logging.peak_tflops": HERE,
    "logging.profile_steps": HERE,
    "logging.wandb": "tests/observe/test_observe_metrics.py::test_wandb_when_asked_gets_the_same_rows",
}


# options whose effect no test measures yet, each with the reason (reported in the issue)
GAPS: dict = {}


def _schema_fields():
    from tpkit.train import config
    out = []
    for sec in dataclasses.fields(config.JobConfig):
        typ = getattr(config, sec.type, None) if isinstance(sec.type, str) else sec.type
        if typ is None or not dataclasses.is_dataclass(typ):
            continue
        out += [f"{sec.name}.{f.name}" for f in dataclasses.fields(typ)]
    return out


def _test_names(path):
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def test_every_option_has_an_effect_test():
    fields = _schema_fields()
    assert len(fields) > 40, fields
    missing = [f for f in fields if f not in EFFECTS and f not in GAPS]
    assert not missing, (f"job-config options without a test of their effect: {missing}; "
                         "add a run to RUNS and a row to CHECKS (or name the test that "
                         "measures it) in EFFECTS")
    assert not set(EFFECTS) - set(fields), set(EFFECTS) - set(fields)
    for field, where in EFFECTS.items():
        path, _, name = where.partition("::")
        assert name in _test_names(path), (field, where)
    for field, why in GAPS.items():
        assert field in fields and field not in EFFECTS and len(why) > 40, field
    here = {f for f, w in EFFECTS.items() if w == HERE}
    assert here == set(CHECKS), (here ^ set(CHECKS))


# --- the runs: name -> extra arguments ({tmp}: a directory of the test) --------------------
MOE = ["--moe-experts", "4", "--moe-topk", "2"]
RUNS = {
    "default": [], "default-again": [],
    "hidden": ["--hidden", "48"], "layers": ["--layers", "3"], "heads": ["--heads", "8"],
    "gqa": ["--gqa-groups", "4"], "ffn": ["--ffn", "32"], "dropout": ["--dropout", "0.3"],
    "steps": ["--steps", "3"], "global-batch": ["--global-batch", "8"],
    "seq-len": ["--seq-len", "8"], "seed": ["--seed", "7"],
    "recompute": ["--recompute"], "offload": ["--cpu-offload-layers", "1"],
    "lr": ["--lr", "3e-2"], "warmup": ["--warmup", "0"], "clip": ["--clip", "1e-3"],
    "clip-off": ["--clip", "0"],
    "bf16": ["--precision", "bf16-mixed"], "fp8": ["--precision", "fp8"],
    "fp8-current": ["--precision", "fp8", "--fp8-recipe", "current"],
    "fp8-bf16": ["--precision", "fp8", "--fp8-compute-dtype", "bfloat16"],
    "save": ["--save", "{tmp}/save", "--save-every", "2"],
    "keep": ["--save", "{tmp}/keep", "--save-every", "1", "--keep", "2"],
    "async": ["--save", "{tmp}/async", "--save-every", "2", "--async-save"],
    "resume": ["--resume", "{tmp}/save/step000002"],
    "auto-resume": ["--save", "{tmp}/save", "--auto-resume", "--steps", "6"],
    "moe": MOE, "moe-topk": MOE[:2] + ["--moe-topk", "1"], "moe-every": MOE + ["--moe-every", "2"],
    "moe-aux": MOE + ["--moe-aux-coeff", "0.5"],
    "moe-capacity": MOE + ["--moe-capacity-factor", "0.5"],
    "log": ["--log-dir", "{tmp}/log", "--log-every", "2", "--peak-tflops", "0.5",
            "--profile-steps", "1:2"],
}


def _runs(tmp):
    """Every run of RUNS in order (resume after save) in this process; what each returned
    and the bytes each offloaded (tpkit.te.offload's handlers, counted here)."""
    import tpkit.checkpoint as ckpt
    import tpkit.te.offload as offload
    from tpkit.train import main
    handlers, background = [], []
    async_save = ckpt.async_save

    def counting_async(*a, **k):
        background.append(a[0])
        return async_save(*a, **k)
    ckpt.async_save = counting_async
    import tpkit.models.decoder as decoder
    import tpkit.models.gpt as gpt
    recomputed, checkpoint = [], gpt.checkpoint
    # every module that calls tpkit.recompute.checkpoint on the model's blocks
    users = (gpt, decoder)

    def counting_checkpoint(*a, **k):
        recomputed.append(1)
        return checkpoint(*a, **k)
    for m in users:
        m.checkpoint = counting_checkpoint
    init = offload.OffloadHandler.__init__

    def counting(self, *a, **k):
        init(self, *a, **k)
        handlers.append(self)
    offload.OffloadHandler.__init__ = counting
    out = {}
    try:
        for name, extra in RUNS.items():
            handlers.clear()
            background.clear()
            recomputed.clear()
            losses = main(BASE + [a.replace("{tmp}", tmp) for a in extra])
            out[name] = {"losses": losses,
                         "offloaded": sum(h.offloaded_bytes for h in handlers),
                         "async_saves": len(background), "recomputed": len(recomputed)}
    finally:
        offload.OffloadHandler.__init__ = init
        ckpt.async_save = async_save
        for m in users:
            m.checkpoint = checkpoint
    # the blocks' implementation reaches the model's config (TE's blocks need a GPU)
    from tpkit.train import parse
    from tpkit.train.build import gpt_config
    out["impl"] = tuple(gpt_config(parse(BASE + ["--model.impl", i], env={})[0]).backend
                        for i in ("te", "torch"))
    return out


def _differs(res, name, than="default"):
    a, b = res[name]["losses"], res[than]["losses"]
    assert len(a) == len(b) and a != b, (name, a, b)
    assert all(math.isfinite(x) for x in a), (name, a)


def _csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def _check_save(res, tmp):
    # named by the steps done: every 2nd and the last
    assert sorted(os.listdir(f"{tmp}/save"))[:2] == ["step000002", "step000004"], \
        os.listdir(f"{tmp}/save")


def _check_keep(res, tmp):
    assert sorted(os.listdir(f"{tmp}/keep")) == ["step000003", "step000004"], \
        os.listdir(f"{tmp}/keep")


def _check_async(res, tmp):
    assert sorted(os.listdir(f"{tmp}/async")) == ["step000002", "step000004"], \
        os.listdir(f"{tmp}/async")
    assert res["async"]["losses"] == res["default"]["losses"]
    # written in the background (tpkit.checkpoint.async_save), the plain save's are not
    assert res["async"]["async_saves"] >= 1 and res["save"]["async_saves"] == 0, \
        (res["async"]["async_saves"], res["save"]["async_saves"])


def _check_resume(res, tmp):
    # resumed after 2 steps: the losses of steps 2 and 3 (0-based), the uninterrupted run's
    assert res["resume"]["losses"] == res["default"]["losses"][2:], res["resume"]


def _check_auto_resume(res, tmp):
    # the newest checkpoint of {tmp}/save is step000004: steps 4 and 5 only
    assert len(res["auto-resume"]["losses"]) == 2, res["auto-resume"]


def _check_log(res, tmp):
    rows = [r for r in _csv(f"{tmp}/log/metrics.csv") if r.get("loss")]
    assert [int(r["step"]) for r in rows] == [2, 4], rows               # --log-every 2
    for r in rows:                                                       # --peak-tflops
        assert float(r["mfu"]) == pytest.approx(float(r["tflops_per_device"]) / 0.5)
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(f"{tmp}/log"))
    assert os.listdir(f"{tmp}/log/profile"), "no profiler trace"          # --profile-steps


CHECKS = {
    "model.impl": lambda r, t: r["impl"] == ("te", "torch"),
    "model.hidden": lambda r, t: _differs(r, "hidden"),
    "model.layers": lambda r, t: _differs(r, "layers"),
    "model.heads": lambda r, t: _differs(r, "heads"),
    "model.gqa_groups": lambda r, t: _differs(r, "gqa"),
    "model.ffn": lambda r, t: _differs(r, "ffn"),
    "model.dropout": lambda r, t: _differs(r, "dropout"),
    "training.steps": lambda r, t: r["steps"]["losses"] == r["default"]["losses"][:3],
    "training.global_batch": lambda r, t: _differs(r, "global-batch"),
    "training.seq_len": lambda r, t: _differs(r, "seq-len"),
    "training.seed": lambda r, t: _differs(r, "seed"),
    # the blocks run through activation checkpointing (2 blocks x 4 steps), same curve
    "training.recompute": lambda r, t: r["recompute"]["recomputed"] == 8 and
    r["default"]["recomputed"] == 0 and r["recompute"]["losses"] == r["default"]["losses"],
    "training.cpu_offload_layers": lambda r, t: r["offload"]["offloaded"] > 0 and
    r["default"]["offloaded"] == 0 and r["offload"]["losses"] == r["default"]["losses"],
    "optimizer.lr": lambda r, t: _differs(r, "lr"),
    "optimizer.warmup": lambda r, t: _differs(r, "warmup"),
    "optimizer.clip": lambda r, t: _differs(r, "clip") or _differs(r, "clip-off", "clip"),
    "precision.mode": lambda r, t: _differs(r, "bf16") or _differs(r, "fp8"),
    "precision.fp8_recipe": lambda r, t: _differs(r, "fp8-current", "fp8"),
    "precision.fp8_compute_dtype": lambda r, t: _differs(r, "fp8-bf16", "fp8"),
    "checkpoint.save": _check_save,
    "checkpoint.save_every": _check_save,
    "checkpoint.keep": _check_keep,
    "checkpoint.async_save": _check_async,
    "checkpoint.resume": _check_resume,
    "recovery.auto_resume": _check_auto_resume,
    "experts.num": lambda r, t: _differs(r, "moe"),
    "experts.topk": lambda r, t: _differs(r, "moe-topk", "moe"),
    "experts.every": lambda r, t: _differs(r, "moe-every", "moe"),
    "experts.aux_coeff": lambda r, t: _differs(r, "moe-aux", "moe"),
    "experts.capacity_factor": lambda r, t: _differs(r, "moe-capacity", "moe"),
    "logging.log_every": _check_log,
    "logging.log_dir": _check_log,
    "logging.peak_tflops": _check_log,
    "logging.profile_steps": _check_log,
}


@pytest.mark.slow
def test_options_take_effect_in_one_process(tmp_path):
    (res,) = run(_runs, 1, str(tmp_path))
    assert res["default"]["losses"] == res["default-again"]["losses"]   # deterministic
    failed = {}
    for field, check in CHECKS.items():
        try:
            ok = check(res, str(tmp_path))
        except AssertionError as e:
            failed[field] = str(e)[:300]
            continue
        if ok is False:
            failed[field] = "no effect measured"
    assert not failed, failed


def _formats(path, tok):
    from tpkit.train import main
    base = BASE + ["--data-path", path, "--tokenizer", tok]
    return {fmt: main(base + ["--data-format", fmt]) for fmt in ("auto", "text", "sft")}


@pytest.mark.slow
def test_data_format_takes_effect(tmp_path):
    """One JSON-lines file whose records hold both a "text" and a prompt/response pair:
    read as text (every token learnt) or as SFT (the response's tokens only), two curves;
    "auto" is one of them."""
    import json
    from test_datasets import _texts, make_tokenizer
    tok = make_tokenizer(tmp_path)
    path = tmp_path / "both.jsonl"
    with open(path, "w") as f:
        for t in _texts(60, seed=3):
            w = t.split()
            f.write(json.dumps({"text": t, "prompt": " ".join(w[:len(w) // 2]),
                                "response": " " + " ".join(w[len(w) // 2:])}) + "\n")
    (res,) = run(_formats, 1, str(path), tok)
    assert res["text"] != res["sft"], res
    assert res["auto"] in (res["text"], res["sft"]), res


def test_optimizer_impl_takes_effect():
    """optimizer.impl picks torch's AdamW kernel: fused (one kernel over every parameter)
    or foreach (multi-tensor); auto is fused on CUDA only. Its effect is the kernel the
    optimizer runs, read from torch's own AdamW defaults (the curves agree by design:
    tests/train/test_train_step.py::test_fused_adamw_trains_as_the_multi_tensor_one)."""
    import torch
    from tpkit.train import parse
    from tpkit.train.trainer import adamw
    p = [torch.nn.Parameter(torch.ones(3))]
    for impl, device, fused in (("fused", "cpu", True), ("foreach", "cpu", False),
                                ("auto", "cpu", False), ("auto", "cuda", True),
                                ("foreach", "cuda", False)):
        job, _ = parse(["--optimizer-impl", impl])
        opt = adamw(p, job, device)
        assert bool(opt.defaults["fused"]) is fused, (impl, device)
        assert bool(opt.defaults["foreach"]) is not fused, (impl, device)

