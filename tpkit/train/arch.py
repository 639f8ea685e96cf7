"""The trainer's Llama from scratch: ``[model] arch = "llama"`` (sizes from the ``[model]``
fields) or ``[model] hf_config = FILE`` (a Hugging Face config.json, no weights), trained
from a layout-independent random init (tpkit.train.build.full_init), with the vocabulary
of data.tokenizer (or the corpus' 256 byte ids) unless the config.json names a larger one.

``llama_config(job)`` is the one place a JobConfig becomes a tpkit.models.LlamaConfig;
``check(job)`` refuses what the Llama job cannot do yet, naming the option.
"""
from __future__ import annotations

import json
import os

__all__ = ["ARCHS", "is_llama", "llama_config", "check", "hf_config_path", "vocab_size",
           "num_layers"]

ARCHS = ("gpt", "llama")


def is_llama(job) -> bool:
    """A Llama trained from scratch (not --init-from-hf's fine-tune)."""
    return job.model.arch == "llama" or job.model.hf_config is not None


def hf_config_path(path: str) -> str:
    """model.hf_config's config.json (a directory holding one, or the file)."""
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def num_layers(job) -> int:
    """The job's transformer blocks: model.hf_config's or model.init_from_hf's
    num_hidden_layers (the latter's config.json once it is there: a dry run may plan a
    download), else model.layers (read without torch: the pipeline plan checks it before
    any worker)."""
    path = None if job.model.hf_config is None else hf_config_path(job.model.hf_config)
    if job.model.init_from_hf:
        path = os.path.join(job.model.init_from_hf, "config.json")
    if path is not None and os.path.isfile(path):
        with open(path) as f:
            return int(json.load(f)["num_hidden_layers"])
    return job.model.layers


def vocab_size(job) -> int:
    """The model's vocabulary: data.tokenizer's size with data.path, else the corpus'."""
    if job.data.path is None:
        from . import corpus
        return corpus.VOCAB_SIZE
    from tpkit.data import Tokenizer
    return Tokenizer(job.data.tokenizer).vocab_size


def llama_config(job, impl: str | None = None):
    """The job's LlamaConfig: model.hf_config's (its vocabulary at least the tokenizer's)
    or Llama's blocks at model.hidden/layers/heads/gqa_groups/ffn; the training fields
    (backend, recompute, dropout) from the job."""
    from tpkit.models import LlamaConfig
    from tpkit.models.hf import config_from_hf
    m, t = job.model, job.training
    train = dict(backend=impl or m.impl, recompute=t.recompute, hidden_dropout=m.dropout,
                 attention_dropout=m.dropout, vocab_multiple=m.vocab_multiple,
                 cpu_offload_layers=t.cpu_offload_layers)
    vocab = vocab_size(job)
    if m.hf_config is not None:
        with open(hf_config_path(m.hf_config)) as f:
            cfg = config_from_hf(json.load(f))
        if cfg.vocab_size < vocab:
            raise ValueError(f"{job.show('model.hf_config')}: vocab_size={cfg.vocab_size} "
                             f"cannot hold the {vocab} ids of the data's vocabulary; raise "
                             "vocab_size in that config.json")
        for k, v in train.items():
            setattr(cfg, k, v)
        return cfg.validate()
    return LlamaConfig(vocab_size=vocab, hidden_size=m.hidden, ffn_hidden_size=m.ffn,
                       num_layers=m.layers, num_heads=m.heads, num_gqa_groups=m.gqa_groups,
                       rope_theta=m.rope_theta, max_position_embeddings=t.seq_len,
                       **train).validate()


def check(job) -> None:
    """ValueError (one line, naming the option) for what a Llama job cannot do yet."""
    m = job.model
    if m.hf_config is not None:
        path = hf_config_path(m.hf_config)
        if not os.path.isfile(path):
            raise job.bad("model.hf_config", f"has no {path}; pass a Hugging Face "
                                             "config.json or the directory holding one")
        given = [job.show(f"model.{n}") for n in ("hidden", "layers", "heads", "gqa_groups",
                                                   "ffn", "rope_theta")
                 if not job.is_default(f"model.{n}")]
        if given:
            raise ValueError(f"{', '.join(given)} cannot be combined with "
                             f"{job.show('model.hf_config')} (the sizes come from that "
                             "config.json); drop them")
        try:
            with open(path) as f:
                from tpkit.models.hf import config_from_hf
                config_from_hf(json.load(f)).validate()
        except (ValueError, KeyError, json.JSONDecodeError) as e:
            raise job.bad("model.hf_config", f"is refused: {e}") from None
    if not is_llama(job):
        if not job.is_default("model.rope_theta"):
            raise job.bad("model.rope_theta", "applies to --arch llama (the reference GPT's "
                                              "RoPE base is 10000); add --arch llama or drop it")
        return
    if m.init_from_hf:
        raise ValueError(f"{job.show('model.init_from_hf')} fine-tunes a checkpoint; "
                         f"{job.show('model.arch')} / --hf-config train one from scratch: "
                         "drop one")
    for path, bad, why in (
            ("experts.num", job.experts.num > 0, "MoE blocks are the reference GPT's"),
            ("data.pack", job.data.pack, "packed documents run the reference GPT")):
        if bad:
            raise ValueError(f"{job.show(path)} with a Llama ({job.show('model.arch')}): "
                             f"{why} so far; drop it or use --arch gpt")
