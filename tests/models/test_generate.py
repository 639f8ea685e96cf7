"""model.generate and tpkit-generate against ``transformers``' own ``generate``.

A small random Llama (GQA: 4 query heads, 2 kv heads) written by ``save_pretrained`` and
read with tpkit's import; three prompts of different lengths, left-padded with an
attention mask. The references are transformers' (float64, the same weights):

- tpkit-generate under tpkit-launch at tp=2 (``python -m tpkit.cli.generate``, gloo):
  the 32 greedy tokens of every prompt are transformers' greedy ``generate``'s.
- Pool, tp=2: greedy with ``eos_token_id`` (rows that stop are padded, as transformers
  pads them) equals transformers'; sampling with temperature/top-k/top-p from the same
  torch seed draws transformers' sampled tokens; the KV-cache decode's logits at every
  step equal the whole prefix recomputed without a cache, row by row without padding
  (float64, 1e-10), also with fewer kv heads than TP ranks (replicated k/v).
- tpkit-train's GPT saved at tp=2: tpkit-generate at tp=1 x dp=2 generates its text; its
  cached decode equals its recompute.
- One process: the sampling scores (temperature, top-k, top-p) equal transformers'
  logits warpers' on random logits, -inf pattern and values.
"""
import importlib.util
import json
import os

import pytest
import torch

from dist import run
from test_userpath import IN_CI, launched

if importlib.util.find_spec("transformers") is None:   # the reference: tpkit[test]'s extra
    if IN_CI:
        pytest.fail("CI=true and transformers is missing: pip install -e '.[test]'",
                    pytrace=False)
    pytest.skip("needs transformers (pip install 'tpkit[test]')", allow_module_level=True)

V, NEW = 256, 32
PROMPTS = [[5, 9, 200, 17, 3, 44, 81], [12, 7], [100, 101, 102, 103]]
EOS, PAD = 2, 0
SAMPLING = dict(temperature=0.7, top_k=20, top_p=0.8)


def left_padded(prompts=PROMPTS):
    w = max(map(len, prompts))
    ids = torch.full((len(prompts), w), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, w - len(p):] = torch.tensor(p)
        mask[i, w - len(p):] = 1
    return ids, mask


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    root = tmp_path_factory.mktemp("gen")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, rms_norm_eps=1e-5, eos_token_id=EOS))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5 if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(root / "llama")
    model = model.double().eval()
    ids, mask = left_padded()
    w = ids.shape[1]

    def hf(**kw):
        torch.manual_seed(7)
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=PAD,
                              **kw)[:, w:]
    refs = {"greedy": hf(do_sample=False, eos_token_id=None),
            "greedy_eos": hf(do_sample=False, eos_token_id=EOS),
            "sample": hf(do_sample=True, eos_token_id=None, **SAMPLING)}
    assert (refs["greedy_eos"] == PAD).any() and not (refs["greedy"] == EOS).all()
    return {"dir": str(root / "llama"), "refs": refs, "root": root}


@pytest.mark.slow
def test_tpkit_generate_cli_tp2_matches_transformers(llama):
    argv = ["--nproc-per-node", "2", "--tp", "2", "-m", "tpkit.cli.generate",
            "--hf", llama["dir"], "--dtype", "float64", "--max-new-tokens", str(NEW),
            "--pad-token-id", str(PAD)]
    for p in PROMPTS:
        argv += ["--ids", ",".join(map(str, p))]
    out, _ = launched(*argv)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in rows] == PROMPTS
    want = llama["refs"]["greedy"].tolist()
    assert [r["ids"] for r in rows] == want
    assert all(len(r) == NEW for r in want)


def _recompute_row(model, row: list[int]) -> torch.Tensor:
    """Full-vocab logits of the last position of ``row``, no cache, no padding (the
    model's training forward: vocab-parallel logits gathered over TP here)."""
    import torch.distributed as dist
    t = torch.tensor([row])
    if hasattr(model, "pp_stem"):    # the reference GPT: forward takes targets
        x = model.pp_stem(t)
        for layer in model.layers:
            x = model.pp_block(layer, x)
        logits = model.pp_head(x)[-1, 0]
    else:
        logits = model(t)[-1, 0]                                 # [V/tp]
    st = model.state
    parts = [torch.empty_like(logits) for _ in range(st.tp_size)]
    dist.all_gather(parts, logits.contiguous(), group=st.tp_group)
    return torch.cat(parts)


def _check_cache(model, ids, mask) -> float:
    out = model.generate(ids, mask, max_new_tokens=5, return_dict_in_generate=True,
                         output_logits=True)
    w, err = ids.shape[1], 0.0
    for r in range(ids.shape[0]):
        real = out.sequences[r, w - int(mask[r].sum()):].tolist()   # the row, unpadded
        p = int(mask[r].sum())
        for t, step in enumerate(out.logits):
            ref = _recompute_row(model, real[:p + t])
            err = max(err, (ref - step[r]).abs().max().item())
    return err


def _pool_generate(path):
    import tpkit
    from tpkit.models import Llama, LlamaConfig, hf
    st = tpkit.init_parallel(tp=2, seed=3)
    ids, mask = left_padded()
    w = ids.shape[1]
    model = hf.from_hf(path, st, dtype=torch.float64)
    res = {"greedy_eos": model.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS,
                                        pad_token_id=PAD)[:, w:]}
    torch.manual_seed(7)
    res["sample"] = model.generate(ids, mask, max_new_tokens=NEW, do_sample=True,
                                   **SAMPLING)[:, w:]
    res["cache_err"] = _check_cache(model, ids, mask)
    # fewer kv heads (1) than TP ranks: k/v replicated on both ranks (ReplicatedKV)
    torch.manual_seed(5)
    one_kv = Llama(LlamaConfig(vocab_size=64, hidden_size=32, ffn_hidden_size=64,
                               num_layers=2, num_heads=4, num_gqa_groups=1,
                               initializer_range=0.2), st, dtype=torch.float64).eval()
    res["cache_err_replicated_kv"] = _check_cache(one_kv, ids % 64, mask)
    tpkit.destroy_parallel()
    return res


def test_generate_tp2_greedy_eos_sampling_and_cache(llama):
    refs = llama["refs"]
    for rank, res in enumerate(run(_pool_generate, 2, llama["dir"])):
        assert torch.equal(res["greedy_eos"], refs["greedy_eos"]), (rank, res["greedy_eos"])
        assert torch.equal(res["sample"], refs["sample"]), (rank, res["sample"])
        assert res["cache_err"] <= 1e-10, (rank, res["cache_err"])
        assert res["cache_err_replicated_kv"] <= 1e-10, (rank, res["cache_err_replicated_kv"])


def test_sampling_scores_match_transformers_warpers():
    from transformers.generation.logits_process import (LogitsProcessorList,
                                                        TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    from tpkit.models.generate import process_logits
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 97, generator=g) * 3
    for temperature, top_k, top_p in [(1.0, 0, 0.5), (0.5, 10, 1.0), (1.3, 40, 0.9),
                                      (0.8, 5, 0.3), (1.0, 200, 0.95)]:
        procs = LogitsProcessorList(
            ([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else [])
            + ([TopKLogitsWarper(top_k)] if top_k else [])
            + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []))
        want = procs(None, logits.clone())
        got = process_logits(logits, temperature, top_k, top_p)
        kept = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), kept), (temperature, top_k, top_p)
        assert torch.equal(got[kept], want[kept]), (temperature, top_k, top_p)
        assert 0 < kept.sum() < logits.numel()
        # the draw: the same generator state gives the same tokens
        a = torch.multinomial(got.softmax(-1), 1, generator=torch.Generator().manual_seed(9))
        b = torch.multinomial(want.softmax(-1), 1, generator=torch.Generator().manual_seed(9))
        assert torch.equal(a, b)


TRAIN_FLAGS = ["--hidden", "64", "--layers", "1", "--heads", "4", "--gqa-groups", "2",
               "--ffn", "128", "--seq-len", "16", "--global-batch", "2"]
TEXTS = ["def ", "import os"]


def _pool_train_checkpoint(path):
    """tpkit-train's model (the reference GPT, its seeded init) at tp=2, saved as a
    sharded checkpoint, and its greedy generation from the texts' bytes (float64); then
    tpkit-generate's ``main`` at tp=1 x dp=2 on that checkpoint (its printed lines)."""
    import contextlib
    import io
    import tpkit
    from tpkit.checkpoint import save
    from tpkit.cli.generate import main
    from tpkit.train import parse
    from tpkit.train.trainer import build_model
    st = tpkit.init_parallel(tp=2, seed=3)
    job, _ = parse(TRAIN_FLAGS)
    model = build_model(job, st)
    save(path, {"model": model})
    prompts = [list(t.encode()) for t in TEXTS]
    w = max(map(len, prompts))
    ids = torch.tensor([[0] * (w - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (w - len(p)) + [1] * len(p) for p in prompts])
    want = model.double().eval().generate(ids, mask, max_new_tokens=8)[:, w:]
    cache_err = _check_cache(model, ids, mask)
    tpkit.destroy_parallel()
    with open(path + ".toml", "w") as f:
        f.write(job.to_toml())
    argv = ["--checkpoint", path, "--config", path + ".toml", "--dtype", "float64",
            "--max-new-tokens", "8"]
    for t in TEXTS:
        argv += ["--prompt", t]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0            # init_parallel(): tp=1, dp=2 in a world of 2
    return want, out.getvalue(), cache_err


def test_tpkit_generate_from_a_train_checkpoint_at_another_layout(tmp_path):
    """A tpkit-train checkpoint written at tp=2 generates the same text at tp=1 x dp=2
    through tpkit-generate's main (resharded on load), prompts as UTF-8 bytes; the
    reference GPT's cached decode equals its recompute (float64, 1e-10)."""
    (want, out, err), (_, out1, err1) = run(_pool_train_checkpoint, 2, str(tmp_path / "ckpt"))
    assert out1 == ""                     # rank 0 prints
    assert max(err, err1) <= 1e-10, (err, err1)   # the GPT's cache = its recompute
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in rows] == [list(t.encode()) for t in TEXTS]
    assert [r["ids"] for r in rows] == want.tolist()


def test_generate_cli_encodes_with_the_jobs_tokenizer():
    """--checkpoint + --config: --prompt is encoded with the job's data.tokenizer (it was
    ignored: UTF-8 bytes); a --tokenizer naming the same file is fine (issue 51)."""
    from types import SimpleNamespace

    from tpkit.cli.generate import _tokenizer
    job = SimpleNamespace(data=SimpleNamespace(tokenizer="data/tok.json"))
    args = SimpleNamespace(checkpoint="ck", config="job.toml", tokenizer=None)
    assert _tokenizer(args, job) == "data/tok.json"
    args.tokenizer = "./data/tok.json"
    assert _tokenizer(args, job) == "data/tok.json"
    args.tokenizer = "other.json"
    with pytest.raises(ValueError, match="not the tokenizer the job job.toml trained with"):
        _tokenizer(args, job)


def _padded_vocabulary(arch):
    import torch.nn.functional as F

    import tpkit
    from tpkit.models import GPT, GPTConfig, Llama, LlamaConfig
    st = tpkit.init_parallel(tp=1, seed=1)
    torch.manual_seed(0)
    cls, cfg = {"gpt": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}[arch]
    model = cls(cfg(vocab_size=250, hidden_size=32, num_layers=1, num_heads=4,
                    num_gqa_groups=2, ffn_hidden_size=64, vocab_multiple=128), st)
    rows = (model.output.weight.shape[0], model.embedding.weight.shape[0])
    with torch.no_grad():
        model.output.weight[250:] = 5 * model.final_norm.weight   # would win unmasked
    x = torch.randint(0, 250, (2, 8), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 250, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        h = model.embedding(x.t().contiguous())
        freqs = model.rope(8)
        for layer in model.layers:
            h = layer(h, rotary_pos_emb=freqs)
        logits = F.linear(model.final_norm(h), model.output.weight[:250])   # [s, b, 250]
        want = float(F.cross_entropy(logits.flatten(0, 1), y.t().flatten()))
        got = float(model(x, y))
    out = model.generate(x, max_new_tokens=4, return_dict_in_generate=True,
                         output_logits=True)
    tpkit.destroy_parallel()
    return rows, got, want, int(out.sequences[:, 8:].max()), tuple(out.logits[0].shape)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_padded_vocabulary_is_masked_in_the_loss_and_generation(arch):
    """GPTConfig/LlamaConfig(vocab_multiple=128) pads 250 ids to 256 rows (issue 51): the
    loss is the cross-entropy over the 250 real logits (torch's, on the same weights), and
    greedy generation never picks a padded id even where its row would win."""
    ((rows, got, want, top, shape),) = run(_padded_vocabulary, 1, arch)
    assert rows == (256, 256)
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert top < 250 and shape == (2, 250), (top, shape)
