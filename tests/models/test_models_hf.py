"""tpkit.models.llama and Hugging Face checkpoints, against ``transformers`` itself.

Three small random models are written by ``save_pretrained`` (every parameter redrawn, so
biases and norm scales are not their zero/one inits): a Llama with Llama-3 RoPE scaling
(all three frequency bands in use), biases on every linear layer, untied, saved in
several shards with an index; a Qwen2 with q/k/v biases and tied embeddings; a Mistral
with linear RoPE scaling and no GQA. The reference is transformers' fp32 logits and the
mean cross entropy computed from them.

- Launched (tests/launch_scripts/hf_layouts.py, tpkit-launch, 4 ranks, the public API):
  (tp, cp, dp) = (2,2,1), (4,1,1)+SP, (1,2,2) in one process, plus (1,1,1) in the pool:
  loss within 1e-5 relative and gathered logits within 1e-5 of transformers'; save_hf at
  (2,2,1) loaded by ``AutoModelForCausalLM.from_pretrained``: identical tensors and
  logits; read back at (4,1,1)+SP and written again: the same bytes.
- Pool: every rank reads exactly the elements of its own shard (an analytical count);
  save_hf of an FSDP2-sharded model (tp=2 x dp=2) writes transformers' tensors back.
- launch/train.py --init-from-hf / --export-hf under tpkit-launch: the first step's loss
  is transformers' on that batch, and transformers loads the trained export.
- Bad input: each a ValueError naming the value, before any weight is read.
"""
import importlib.util
import json
import os

import pytest
import torch

from dist import run
from test_userpath import IN_CI, ROOT, SCRIPTS, launched, printed_losses

if importlib.util.find_spec("transformers") is None:   # the reference: tpkit[test]'s extra
    if IN_CI:
        pytest.fail("CI=true and transformers is missing: pip install -e '.[test]'",
                    pytrace=False)
    pytest.skip("needs transformers (pip install 'tpkit[test]')", allow_module_level=True)

pytestmark = pytest.mark.slow
B, S, V = 4, 32, 256
REL = 1e-5


def _randomise(model) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _hf_models() -> dict:
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)
    common = dict(vocab_size=V, num_hidden_layers=2, rms_norm_eps=1e-5)
    return {
        # head_dim 16: inv_freq 1, 0.32, 0.1, ... -> kept (wavelength < 8), smoothed
        # (8..32) and divided by 8 (> 32)
        "llama": LlamaForCausalLM(LlamaConfig(
            hidden_size=128, intermediate_size=256, num_attention_heads=8,
            num_key_value_heads=4, attention_bias=True, mlp_bias=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                             "original_max_position_embeddings": 64}, **common)),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(
            hidden_size=64, intermediate_size=128, num_attention_heads=8,
            num_key_value_heads=4, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)),
        "mistral": MistralForCausalLM(MistralConfig(
            hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=4, sliding_window=None,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            **common)),
    }


def hf_logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


def hf_loss(logits: torch.Tensor, y: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             y.reshape(-1)).item()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    tokens = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(2))
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = {"x": x, "y": y, "root": root, "models": {}}
    for name, model in _hf_models().items():
        _randomise(model)
        model.eval()
        path = root / name
        model.save_pretrained(path, max_shard_size="200KB" if name == "llama" else "50MB")
        logits = hf_logits(model, x)
        out["models"][name] = {"dir": str(path), "model": model, "logits": logits,
                               "loss": hf_loss(logits, y)}
    assert os.path.exists(root / "llama" / "model.safetensors.index.json")   # sharded input
    return out


def _close(got: dict, ref: dict, where: str) -> None:
    assert abs(got["loss"] - ref["loss"]) <= REL * abs(ref["loss"]), (where, got["loss"],
                                                                      ref["loss"])
    err = (got["logits"] - ref["logits"]).abs().max().item()
    assert got["logits"].shape == ref["logits"].shape and err <= REL, (where, err)


def _one_process(dirs, x, y):
    from launch_scripts.hf_layouts import check_layout
    return check_layout(dirs, x, y, 1, 1, False)


def _tensors(path) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def test_layouts_exports_and_round_trip_match_transformers(ckpts):
    work = ckpts["root"] / "work"
    work.mkdir()
    models = ckpts["models"]
    dirs = {n: m["dir"] for n, m in models.items()}
    torch.save({"dirs": dirs, "x": ckpts["x"], "y": ckpts["y"]}, work / "inputs.pt")
    out, _ = launched("--nproc-per-node", "4", os.path.join(SCRIPTS, "hf_layouts.py"),
                      str(work))
    assert "HF LAYOUTS OK" in out
    (single,) = run(_one_process, 1, dirs, ckpts["x"], ckpts["y"])
    for rank in range(4):   # every rank's gathered logits and loss, not rank 0's only
        results = torch.load(work / f"results{rank}.pt")
        results[(1, 1, False)] = single
        assert len(results) == 4
        for layout, res in results.items():
            for name, got in res.items():
                _close(got, models[name.removesuffix("-a")], f"{name} at {layout} rank {rank}")
    from transformers import AutoModelForCausalLM
    for name, m in models.items():
        a, b = work / f"{name}-a", work / f"{name}-b"
        back = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
        assert type(back) is type(m["model"])
        want, got = m["model"].state_dict(), back.state_dict()
        assert sorted(got) == sorted(want), name
        assert all(torch.equal(got[k], want[k]) for k in want), name
        assert torch.equal(hf_logits(back, ckpts["x"]), m["logits"]), name
        files = sorted(os.listdir(a))
        assert files == sorted(os.listdir(b)), (files, os.listdir(b))
        for f in files:   # the round trip at another layout: the same bytes
            assert (a / f).read_bytes() == (b / f).read_bytes(), (name, f)
        ta = _tensors(a)
        assert ta.keys() == _tensors(m["dir"]).keys()   # HF's own file names and layout


def _count_reads(path, tp, cp, sp):
    import tpkit
    from tpkit.models import hf
    state = tpkit.init_parallel(tp=tp, cp=cp, sequence_parallel=sp)
    read, counted = hf.CheckpointIndex.read, []

    def counting(self, *args, **kwargs):
        t = read(self, *args, **kwargs)
        counted.append(t.numel())
        return t
    hf.CheckpointIndex.read = counting
    try:
        model = hf.from_hf(path, state)
    finally:
        hf.CheckpointIndex.read = read
    return sum(counted), sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_each_rank_reads_only_its_shard(ckpts, name):
    """Analytical: every rank reads exactly as many elements as its parameters hold (tied
    embeddings once), i.e. never a whole sharded tensor."""
    for read, own in run(_count_reads, 4, ckpts["models"][name]["dir"], 4, 1, True):
        assert read == own, (read, own)
    total = sum(p.numel() for p in ckpts["models"][name]["model"].parameters())
    assert own < total / 2


def _fsdp_export(dirs: dict, out: str) -> None:
    from fabric_helpers import launch_fabric
    from tpkit.models import hf
    fabric, state = launch_fabric(tp=2, data_parallel="fsdp")   # FSDP2 over dp=2
    for name, path in dirs.items():
        model = fabric.setup_module(hf.from_hf(path, state))
        assert all(hasattr(p, "to_local") for p in model.parameters())   # DTensors
        hf.save_hf(model.module, os.path.join(out, name))


def test_fsdp_sharded_export_is_the_original_checkpoint(ckpts, tmp_path):
    """save_hf of a model sharded by FSDP2 (over dp) on top of TP: the tensors
    transformers wrote, bit for bit (untied with biases, and tied)."""
    names = ("llama", "qwen2")
    run(_fsdp_export, 4, {n: ckpts["models"][n]["dir"] for n in names}, str(tmp_path))
    for name in names:
        want, got = _tensors(ckpts["models"][name]["dir"]), _tensors(tmp_path / name)
        assert got.keys() == want.keys(), name
        assert all(torch.equal(got[k], want[k]) for k in want), name


# --- bad input --------------------------------------------------------------------------------
def _copy(src, dst, edit=None, drop=None):
    """A copy of checkpoint ``src`` with config.json edited and one tensor dropped."""
    from safetensors.torch import load_file, save_file
    os.makedirs(dst)
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            t = load_file(os.path.join(src, f))
            t.pop(drop, None)
            save_file(t, os.path.join(dst, f), metadata={"format": "pt"})
        elif f.endswith(".json"):
            with open(os.path.join(src, f)) as fh:
                d = json.load(fh)
            if f == "config.json" and edit:
                d.update(edit)
            with open(os.path.join(dst, f), "w") as fh:
                json.dump(d, fh)
    return dst


BAD = [
    ("qwen2", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, None, 1,
     r"model_type='gpt2'"),
    ("qwen2", {"hidden_act": "gelu"}, None, 1, r"hidden_act='gelu'"),
    ("qwen2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, None, 1,
     r"rope_type='yarn'"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, None, 1,
     r"sliding_window=16"),
    ("llama", {"mlp_bias": False}, None, 1, r"attention_bias=True .*mlp_bias=False"),
    ("llama", {"head_dim": 32}, None, 1, r"head_dim=32"),
    ("mistral", None, None, 8, r"num_heads \(num_attention_heads\)=4 is not divisible by "
                               r"the tensor-parallel size tp=8"),
    ("qwen2", None, "model.layers.1.mlp.up_proj.weight", 1,
     r"missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    ("llama", None, "model.layers.0.self_attn.k_proj.bias", 1,
     r"missing tensor 'model.layers.0.self_attn.k_proj.bias'"),
    ("qwen2", {"intermediate_size": 96}, None, 1,
     r"'model.layers.0.mlp.gate_proj.weight' has shape \[128, 64\] .* implies \[96, 64\]"),
]


@pytest.mark.parametrize("name,edit,drop,tp,match", BAD,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_checkpoints_are_value_errors(ckpts, tmp_path, name, edit, drop, tp, match):
    from tpkit import ParallelConfig
    from tpkit.models import hf
    from tpkit.layout.planning import fake_state
    path = _copy(ckpts["models"][name]["dir"], tmp_path / "bad", edit, drop)
    with fake_state(ParallelConfig(tp=tp), tp) as state:
        with pytest.raises(ValueError, match=match):
            hf.from_hf(str(path), state)


def test_bad_arguments_are_value_errors(ckpts, tmp_path):
    from tpkit import ParallelConfig
    from tpkit.models import Llama, LlamaConfig, hf
    from tpkit.layout.planning import fake_state
    path = ckpts["models"]["qwen2"]["dir"]
    with fake_state(ParallelConfig(), 1) as state:
        with pytest.raises(ValueError, match=r"from_hf\(hidden_size=...\) is not a training"):
            hf.from_hf(path, state, hidden_size=32)
        with pytest.raises(ValueError, match=r"has no config.json"):
            hf.from_hf(str(tmp_path), state)
        with pytest.raises(ValueError, match=r"qkv_bias=True, bias=True cannot be written as "
                                             r"architecture='qwen2'"):
            Llama(LlamaConfig(64, 64, 128, 1, 4, architecture="qwen2", bias=True), state)
        with pytest.raises(ValueError, match=r"rope scaling type 'dynamic'"):
            LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}).validate()
        with pytest.raises(ValueError, match=r"max_shard_size=0"):
            hf.save_hf(hf.from_hf(path, state), str(tmp_path / "x"), max_shard_size=0)


# --- launch/train.py ----------------------------------------------------------------------------
TRAIN = os.path.join(ROOT, "launch", "train.py")
TRAIN_ARGS = ["--steps", "3", "--seq-len", "32", "--global-batch", "4", "--warmup", "1",
              "--log-every", "1"]


def test_train_init_from_hf_and_export(ckpts, tmp_path):
    """tp=2 x cp=2 with recompute from the tied, biased Qwen2: step 0's printed loss (4
    decimals) is transformers' on the same corpus batch; the export after 3 steps loads
    into transformers, trained (every matrix moved) and with the original names."""
    from tpkit.train import corpus
    import lightning.fabric  # noqa: F401  (it replaces warnings.formatwarning, whose
    # docstring is corpus text: train.py's workers read the corpus after importing it)
    m = ckpts["models"]["qwen2"]
    out_dir = tmp_path / "trained"
    out, _ = launched("--tp", "2", "--cp", "2", TRAIN, *TRAIN_ARGS, "--recompute",
                      "--init-from-hf", m["dir"], "--export-hf", str(out_dir))
    first = dict(printed_losses(out))[0]
    x, y = corpus.batch(corpus.split(corpus.tokens())[0], 0, 4, 32, seed=1234)
    assert abs(first - hf_loss(hf_logits(m["model"], x), y)) <= 1e-4, out
    from transformers import AutoModelForCausalLM
    trained = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    before, after = m["model"].state_dict(), trained.state_dict()
    assert sorted(after) == sorted(before)
    assert all(not torch.equal(after[k], before[k]) for k in before if after[k].dim() == 2)


def test_train_refuses_bad_hf_arguments(ckpts, tmp_path):
    """Option clashes: the JobConfig's checks (one line); a directory tpkit cannot use:
    a ValueError from the Trainer before any process group exists."""
    import torch.distributed as dist
    from jobs import refusal
    from tpkit.train import Trainer, parse
    for argv, message in [
            (["--export-hf", str(tmp_path / "o")], "(checkpoint.export_hf) needs a Llama "
             "(--arch llama, --hf-config or --init-from-hf)"),
            (["--init-from-hf", ckpts["models"]["qwen2"]["dir"], "--hidden", "32"],
             "--hidden=32 (model.hidden) cannot be combined with --init-from-hf")]:
        assert message in refusal(argv), argv
    small = _copy(ckpts["models"]["qwen2"]["dir"], tmp_path / "small", {"vocab_size": 128})
    for argv, message in [(["--init-from-hf", str(tmp_path)], "has no config.json"),
                          (["--init-from-hf", str(small)],
                           "vocab_size=128 cannot hold the corpus' 256")]:
        with pytest.raises(ValueError, match=message):
            Trainer(parse(argv)[0])
        assert not dist.is_initialized()


# --- vocabulary padding (issue 51) ------------------------------------------------------------
ODD = 301   # tp=2 cannot split it (GPT-2's 50,257 neither)


def _odd_vocab(path, x, out):
    """from_hf of an odd-vocabulary checkpoint at tp=2, padded to 128 rows: its gathered
    logits on the real ids, the padded rows of this rank and its export."""
    from fabric_helpers import launch_fabric
    from tpkit.models import hf
    from tpkit.nn.mappings import gather_from_tp_region
    fabric, state = launch_fabric(tp=2)
    with pytest.raises(ValueError, match=f"vocab_size={ODD} is not divisible by the "
                                         "tensor-parallel size tp=2"):
        hf.from_hf(path, state)
    with pytest.raises(ValueError, match=f"vocab_size={ODD} padded to a multiple of "
                                         "vocab_multiple=3 is 303, which the tensor-parallel "
                                         "size tp=2 does not divide; use vocab_multiple=6"):
        hf.from_hf(path, state, vocab_multiple=3)
    model = hf.from_hf(path, state, vocab_multiple=128)
    assert model.embedding.weight.shape[0] == 384 // 2
    with torch.no_grad():
        logits = gather_from_tp_region(model(x), state.tp_group).transpose(0, 1)
    pad = model.embedding.weight[ODD - 192:] if state.tp_rank == 1 else None
    hf.save_hf(model, out)
    return logits, None if pad is None else (pad.abs().max().item(), pad.shape[0])


def _train_odd(src, out):
    from tpkit.train import Trainer, parse
    job, _ = parse(TRAIN_ARGS + ["--steps", "2", "--tp", "2", "--init-from-hf", src,
                                 "--export-hf", out])
    return Trainer(job).fit()


def test_odd_vocabulary_is_padded_on_load_and_exported_unpadded(tmp_path):
    """An HF Llama (untied) and Qwen2 (tied) of 301 tokens at tp=2: from_hf pads the
    embedding and lm_head to 384 rows (zero), the logits on the real ids are transformers',
    the padded ids' are masked (the dtype's lowest), and save_hf writes back exactly the
    tensors and vocab_size transformers wrote."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    common = dict(vocab_size=ODD, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
    x = torch.randint(0, ODD, (2, 16), generator=torch.Generator().manual_seed(3))
    model_llama = None
    for name, model in (("llama", LlamaForCausalLM(LlamaConfig(**common))),
                        ("qwen2", Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True,
                                                               **common)))):
        _randomise(model)
        model.eval()
        model_llama = model if name == "llama" else model_llama
        src, out = str(tmp_path / name), str(tmp_path / f"{name}-out")
        model.save_pretrained(src)
        ref = hf_logits(model, x)
        (logits, none), (_, (pad_max, pad_rows)) = run(_odd_vocab, 2, src, x, out)
        assert none is None and pad_max == 0.0 and pad_rows == 384 - ODD, name
        assert logits.shape[-1] == 384
        err = (logits[..., :ODD] - ref).abs().max().item()
        assert err <= REL, (name, err)
        assert (logits[..., ODD:] == torch.finfo(logits.dtype).min).all(), name
        want, got = _tensors(src), _tensors(out)
        assert got.keys() == want.keys(), name
        assert all(torch.equal(got[k], want[k]) for k in want), name
        with open(os.path.join(out, "config.json")) as f:
            assert json.load(f)["vocab_size"] == ODD
    # tpkit-train --init-from-hf at tp=2 (--vocab-multiple 128, the default): step 0's
    # loss is transformers' on the corpus batch; the trained export loads in transformers
    from transformers import AutoModelForCausalLM
    from tpkit.train import corpus
    trained = str(tmp_path / "trained")
    first = run(_train_odd, 2, str(tmp_path / "llama"), trained)[0][0]
    x, y = corpus.batch(corpus.split(corpus.tokens())[0], 0, 4, 32, seed=1234)
    assert abs(first - hf_loss(hf_logits(model_llama, x), y)) <= 1e-5 * first
    back = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32)
    assert back.model.embed_tokens.weight.shape[0] == back.lm_head.weight.shape[0] == ODD
