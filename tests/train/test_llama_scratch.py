"""A Llama trained from scratch by tpkit's trainer (``--arch llama`` / ``--hf-config``),
against ``transformers``' LlamaForCausalLM built from the same config and weights.

Launched (tests/launch_scripts/llama_scratch.py under tpkit-launch, the public API): one
process (``--arch llama`` sizes, two micro-batches accumulated) and tp=2 with sequence
parallelism (``--hf-config``: a config.json with Llama 3's RoPE scaling, all three of its
frequency bands in use, and a vocabulary larger than the corpus'). The reference is
transformers' float32 loss on step 0's batch and its gradients: tpkit's initial weights
and step-0 gradients are written in Hugging Face's names by ``save_hf`` (each gradient
put in its parameter's place), read by transformers, and compared name by name. Then the
trained ``--export-hf`` loads in transformers with the job's config.
"""
import importlib.util
import json
import os

import pytest
import torch

from paths import SCRIPTS
from test_userpath import IN_CI, launched

if importlib.util.find_spec("transformers") is None:   # the reference: tpkit[test]'s extra
    if IN_CI:
        pytest.fail("CI=true and transformers is missing: pip install -e '.[test]'",
                    pytrace=False)
    pytest.skip("needs transformers (pip install 'tpkit[test]')", allow_module_level=True)

pytestmark = pytest.mark.slow
COMMON = ["--seq-len", "32", "--global-batch", "4", "--steps", "2", "--lr", "1e-3",
          "--warmup", "0", "--log-every", "1"]
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
             "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 320, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "max_position_embeddings": 64,
             # head_dim 16: wavelengths 1 ... 5e5: kept, smoothed and divided by 8
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 16},
             "tie_word_embeddings": False, "hidden_act": "silu"}


def _reference(path: str, x: torch.Tensor, y: torch.Tensor):
    """transformers' mean loss and gradients (by name) at the weights in ``path``."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32,
                                             attn_implementation="eager")
    logits = model(x).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             y.reshape(-1))
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}, model


def _grads(path: str) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


@pytest.mark.parametrize("layout", ["one process", "tp2 sp"])
def test_llama_from_scratch_matches_transformers(tmp_path, layout):
    if layout == "one process":
        launch = ["--nproc-per-node", "1"]
        model = ["--arch", "llama", "--hidden", "64", "--layers", "2", "--heads", "4",
                 "--gqa-groups", "2", "--ffn", "96", "--rope-theta", "500000",
                 "--microbatches", "2"]
    else:
        cfg = tmp_path / "config.json"
        cfg.write_text(json.dumps(HF_CONFIG))
        launch = ["--nproc-per-node", "2", "--tp", "2", "--sequence-parallel"]
        model = ["--hf-config", str(cfg)]
    export = tmp_path / "export"
    out, _ = launched(*launch, os.path.join(SCRIPTS, "llama_scratch.py"), str(tmp_path),
                      *COMMON, *model, "--export-hf", str(export))
    assert "LLAMA SCRATCH OK" in out, out
    step0 = torch.load(tmp_path / "step0.pt")
    loss, grads, _ = _reference(str(tmp_path / "init"), step0["x"], step0["y"])
    assert step0["loss"] == pytest.approx(loss, rel=1e-5)
    mine = _grads(str(tmp_path / "grads"))
    assert set(mine) == set(grads)
    for name, g in grads.items():
        scale = float(g.abs().max()) + 1e-12
        assert (mine[name] - g).abs().max() <= 1e-4 * scale, name
    # the vocabulary: the corpus' 256 byte ids, or the config.json's (larger)
    vocab = 256 if layout == "one process" else HF_CONFIG["vocab_size"]
    assert grads["lm_head.weight"].shape[0] == vocab
    from transformers import LlamaForCausalLM
    trained = LlamaForCausalLM.from_pretrained(str(export), torch_dtype=torch.float32)
    init = LlamaForCausalLM.from_pretrained(str(tmp_path / "init"), torch_dtype=torch.float32)
    assert trained.config.num_key_value_heads == 2 and not trained.config.tie_word_embeddings
    if layout == "tp2 sp":
        assert trained.config.rope_scaling["rope_type"] == "llama3"
    moved = [n for n, p in trained.named_parameters()
             if not torch.equal(p, dict(init.named_parameters())[n])]
    assert len(moved) == len(list(init.parameters()))   # every weight trained
