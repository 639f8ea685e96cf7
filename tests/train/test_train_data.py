"""tpkit-train on your own data (issue 36): jsonl -> tpkit-data -> tpkit.train's Trainer
with --data-path/--tokenizer --pack --eval-every, the same loss and validation-loss curves
at tp=2 x cp=2 as at (1,1,1), and a run saved at dp=2 and resumed at dp=4 continuing the
uninterrupted curves (the data order is step-indexed and layout-free:
tpkit.data.Loader.at). Pool (tests/dist.py), as test_train.py."""
import json
import os

import pytest

from dist import run
from test_datasets import _texts, make_tokenizer

SMALL = ["--steps", "8", "--hidden", "32", "--layers", "2", "--heads", "4",
         "--gqa-groups", "2", "--ffn", "64", "--seq-len", "32", "--global-batch", "4",
         "--warmup", "2", "--log-every", "100", "--pack", "--split", "80,20",
         "--eval-every", "4", "--eval-batches", "2"]
REL = 1e-5


def _train(layout, extra=()):
    """(losses, validation losses) of tpkit-train's Trainer on this pool's ranks."""
    from tpkit.train import Trainer, parse
    tp, cp = layout
    job, _ = parse(SMALL + ["--tp", str(tp), "--cp", str(cp)] + list(extra))
    trainer = Trainer(job)
    return trainer.fit(), trainer.val_losses


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return _data(tmp_path_factory.mktemp("data"), 300)


@pytest.fixture(scope="module")
def odd_data(tmp_path_factory):
    return _data(tmp_path_factory.mktemp("odd"), 301)


def _data(d, vocab_size):
    from tpkit.data.preprocess import parse_args, run as run_cli
    tok = make_tokenizer(d, vocab_size)
    with open(d / "c.jsonl", "w") as f:
        for t in _texts(200, seed=3):
            f.write(json.dumps({"text": t}) + "\n")
    run_cli(parse_args(["--input", str(d / "c.jsonl"), "--output-prefix", str(d / "c"),
                        "--tokenizer", tok, "--append-eod"]))
    return ["--data-path", str(d / "c_text_document"), "--tokenizer", tok]


@pytest.fixture(scope="module")
def reference(data):
    ((losses, val),) = run(_train, 1, (1, 1), data)
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    assert [s for s, _ in val] == [3, 7] and val[1][1] < val[0][1], val   # it learns
    return losses, val


def _same(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= REL * abs(y), f"step {i}: {x} vs {y}"


def test_own_data_packed_same_curves_at_tp2_cp2(reference, data):
    """Training losses and val_loss (every 4 steps, 2 held-out global batches)."""
    for losses, val in run(_train, 4, (2, 2), data):
        _same(losses, reference[0])
        assert [s for s, _ in val] == [3, 7]
        _same([v for _, v in val], [v for _, v in reference[1]])


def test_own_data_saved_at_dp2_resumed_at_dp4(reference, data, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    (first, _), _ = run(_train, 2, (1, 1), data + ["--save", ckpt, "--save-every", "4"])
    _same(first, reference[0])
    resumed = run(_train, 4, (1, 1), data + ["--resume", os.path.join(ckpt, "step000004")])
    for losses, val in resumed:
        _same(losses, reference[0][4:])   # step000004: 4 steps done
        _same([v for _, v in val], [reference[1][1][1]])


def test_odd_vocabulary_is_padded_and_trains_at_tp2(odd_data):
    """Issue 51: a 301-token vocabulary (GPT-2's 50,257 is odd too) cannot split over tp=2;
    --vocab-multiple 128 (the default) pads it to 384 rows and masks the padded logits out
    of the loss. Reference: the one-process curve of the unpadded model (--vocab-multiple 1,
    the same weights: the padded rows extend the drawn tensors); tp=2 follows it."""
    from tpkit.data import Tokenizer
    assert Tokenizer(odd_data[-1]).vocab_size == 301
    ((reference, val_ref),) = run(_train, 1, (1, 1), odd_data + ["--vocab-multiple", "1"])
    for losses, val in run(_train, 2, (2, 1), odd_data):
        _same(losses, reference)
        _same([v for _, v in val], [v for _, v in val_ref])


def _llama_odd(tp, extra):
    """A Llama from scratch (--arch llama) at tp: its losses, validation losses and its
    gathered logits ``[b, s, V]`` (the padded vocabulary's included) on fixed ids."""
    import torch
    from tpkit.nn.mappings import gather_from_tp_region
    from tpkit.train import Trainer, parse
    job, _ = parse([a for a in SMALL if a != "--pack"] +
                   ["--arch", "llama", "--tp", str(tp)] + list(extra))
    trainer = Trainer(job)
    losses = trainer.fit()
    model = trainer.raw_model.eval()
    x = torch.arange(2 * 32).reshape(2, 32) * 7 % 301   # ids 0..300
    with torch.no_grad():
        logits = gather_from_tp_region(model(x), trainer.state.tp_group).transpose(0, 1)
    return losses, trainer.val_losses, logits


def test_odd_vocabulary_llama_is_padded_at_tp2_and_exported_unpadded(odd_data, tmp_path):
    """Issue 51 for tpkit's Llama (--arch llama): the 301-token vocabulary padded to 384
    rows at tp=2 follows the one-process curve of the unpadded model (--vocab-multiple 1);
    the padded logits are masked; --export-hf writes the 301 real rows, which transformers'
    LlamaForCausalLM loads (vocab_size 301) and runs to tpkit's logits on the real ids."""
    import torch
    from transformers import LlamaForCausalLM
    ((ref, val_ref, ref_logits),) = run(_llama_odd, 1, 1,
                                        odd_data + ["--vocab-multiple", "1"])
    out = str(tmp_path / "hf")
    for losses, val, logits in run(_llama_odd, 2, 2, odd_data + ["--export-hf", out]):
        _same(losses, ref)
        _same([v for _, v in val], [v for _, v in val_ref])
        assert ref_logits.shape[-1] == 301 and logits.shape[-1] == 384
        assert (logits[..., 301:] == torch.finfo(logits.dtype).min).all()
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["vocab_size"] == 301
    hf = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float64).eval()
    assert hf.model.embed_tokens.weight.shape[0] == hf.lm_head.weight.shape[0] == 301
    x = torch.arange(2 * 32).reshape(2, 32) * 7 % 301
    with torch.no_grad():
        want = hf(x).logits
    err = (logits[..., :301].double() - want).abs().max().item()
    assert err <= 1e-4, err


def _llama(data):
    """A Llama from scratch (--arch llama) on the dataset: its vocabulary and losses."""
    from tpkit.data import Tokenizer
    from tpkit.train import Trainer, parse
    args = [a for a in SMALL if a != "--pack"] + ["--arch", "llama"] + data
    job, _ = parse(args)
    trainer = Trainer(job)
    tok = data[data.index("--tokenizer") + 1]
    return trainer.raw_model.cfg.vocab_size, Tokenizer(tok).vocab_size, trainer.fit()


def test_llama_from_scratch_takes_the_tokenizers_vocabulary(data):
    """issue 50: the vocabulary of a Llama from scratch is the tokenizer's, not the
    corpus' 256 byte ids, and it learns on the dataset's token windows."""
    ((vocab, tok_vocab, losses),) = run(_llama, 1, data)
    assert vocab == tok_vocab != 256
    assert losses[-1] < losses[0], losses


def _plan_and_count(data):
    """(tokenizer vocabulary, the model's vocabulary, parameter bytes built, the memory
    plan's, FLOPs per token counted by FlopCounterMode, the MFU's count, the plan's) of a
    tokenized-dataset job on one rank."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from tpkit.data import Tokenizer
    from tpkit.memory import estimate_memory
    from tpkit.observe import model_flops_per_token
    from tpkit.train import Trainer, parse
    from tpkit.train.trainer import memory_job
    args = [a for a in SMALL if a != "--pack"]
    job, _ = parse(args[:args.index("--split")] + data)
    trainer = Trainer(job)
    model, seq = trainer.raw_model, job.training.seq_len
    plan = memory_job(job, trainer.layout)
    built = sum(p.numel() * p.element_size() for p in model.parameters())
    planned = estimate_memory(plan, trainer.layout, rank=0).terms["parameters"]
    x = torch.randint(0, model.cfg.vocab_size, (2, seq))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        model(x, torch.roll(x, -1, 1)).backward()
    return (Tokenizer(job.data.tokenizer).vocab_size, model.cfg.vocab_size, built, planned,
            counter.get_total_flops() / x.numel(), model_flops_per_token(model, seq),
            plan.model.flops_per_token(seq))


def test_memory_plan_and_flops_of_a_tokenized_job(data):
    """One model description (tpkit.models.shape.ModelShape) behind the model, its MFU and
    its memory plan: on a tokenized dataset (a 300-token BPE) the plan's vocabulary is the
    tokenizer's (it once assumed the corpus' 256), its parameter bytes are those the
    trainer built, and the FLOPs per token MFU divides by match torch's FlopCounterMode."""
    ((tok_vocab, vocab, built, planned, counted, mfu_count, planned_flops),) = \
        run(_plan_and_count, 1, data)
    assert vocab == tok_vocab == 300
    assert planned == built, (planned, built)
    assert mfu_count == planned_flops
    assert abs(mfu_count - counted) <= 0.02 * counted, (mfu_count, counted)
