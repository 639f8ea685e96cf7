"""Ready plans for the layouts users bring: nanoGPT's ``GPT`` and Hugging Face's
``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM`` (the ``transformers``
modules themselves), registered in ``core.READY_PLANS`` where ``core.ready_plan(model)``
finds them by the model's class name; no import of nanoGPT or transformers happens here.

Both take the full sequences the user passes, batch-first, and under CP give the model
this rank's load-balanced shard (tpkit.data.shard_sequence): nanoGPT's ``(idx, targets)``;
Hugging Face's ``input_ids``/``labels`` with the labels shifted *before* sharding
(``shift_labels``), the global ``position_ids`` of the shard (RoPE), and
``num_items_in_batch`` so that every CP rank's loss is its share of the sequence mean.
"""
from __future__ import annotations

import torch

from ..cp import shard_position_ids, shard_sequence
from .core import (READY_PLANS, Attention, Column, Norm, Plan, PositionEmbedding, Row,
                   VocabEmbedding, VocabHead)

__all__ = ["nanogpt_plan", "hf_llama_plan"]


def _nanogpt_inputs(args, kwargs, state):
    """``GPT.forward(idx, targets=None)``: both ``[b, t]``, sharded along t."""
    args = list(args)
    for i in range(len(args)):
        if isinstance(args[i], torch.Tensor):
            args[i] = shard_sequence(args[i], 1, state)
    for k in ("idx", "targets"):
        if isinstance(kwargs.get(k), torch.Tensor):
            kwargs[k] = shard_sequence(kwargs[k], 1, state)
    return tuple(args), kwargs


def nanogpt_plan() -> Plan:
    """nanoGPT's ``GPT`` (karpathy/nanoGPT's model file): wte/wpe, blocks ``transformer.h.<i>``
    of ``ln_1, attn(c_attn, c_proj), ln_2, mlp(c_fc, c_proj)``, ``ln_f``, ``lm_head`` tied
    to ``wte``. The model's own cross entropy sees gathered logits."""
    return Plan({
        "transformer.wte": VocabEmbedding(),
        "transformer.wpe": PositionEmbedding(),
        "transformer.h.*.ln_*": Norm(kind="layernorm"),
        "transformer.h.*.attn": Attention(heads="n_head", qkv="c_attn", out="c_proj",
                                          dropout="dropout", output_dropout="resid_dropout"),
        "transformer.h.*.mlp.c_fc": Column(),
        "transformer.h.*.mlp.c_proj": Row(),
        "transformer.ln_f": Norm(kind="layernorm"),
        "lm_head": VocabHead(),
    }, batch_first=True, shard_inputs=_nanogpt_inputs, name="the nanoGPT plan")


def _hf_inputs(args, kwargs, state):
    """``XForCausalLM.forward(input_ids, attention_mask, position_ids, ..., labels)``."""
    names = ("input_ids", "attention_mask", "position_ids")
    for name, value in zip(names, args):
        kwargs.setdefault(name, value)
    args = ()
    ids = kwargs.get("input_ids")
    if ids is None:
        raise ValueError("the Hugging Face plan needs input_ids (inputs_embeds are not "
                         "sharded for you)")
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool((mask != 0).all()):
        raise ValueError("attention_mask with padding is not supported by tpkit's Hugging "
                         "Face plan (its attention is causal over whole rows); pack the "
                         "sequences or drop the padding")
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        raise ValueError("a KV cache is not supported by tpkit's Hugging Face plan (training "
                         "only); call the unparallelized model to generate")
    kwargs["use_cache"] = False
    seq = ids.shape[1]
    pos = kwargs.get("position_ids")
    if pos is None:
        pos = shard_position_ids(seq, state, device=ids.device).unsqueeze(0)
    else:
        pos = shard_sequence(pos, pos.dim() - 1, state)
    kwargs["position_ids"] = pos
    kwargs["input_ids"] = shard_sequence(ids, 1, state)
    labels = kwargs.get("labels")
    if labels is not None and state.cp_size > 1:
        shifted = kwargs.get("shift_labels")
        if shifted is None:
            shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        count = kwargs.get("num_items_in_batch")
        if count is None:
            count = (shifted != -100).sum()
        mine = shard_sequence(shifted, 1, state)
        kwargs["labels"] = mine
        kwargs["shift_labels"] = mine
        # every CP rank's loss is its share of the sequence's sum over the whole count:
        # their average (what DDP over dp x cp takes) is the unsharded mean
        kwargs["num_items_in_batch"] = count / state.cp_size
    return args, kwargs


def _hf_window(attn) -> int | None:
    """The sliding window of a Hugging Face attention module: Qwen2 keeps it on the module
    (None on full-attention layers), Mistral in its config."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(getattr(attn, "config", None), "sliding_window", None)


def hf_llama_plan() -> Plan:
    """Hugging Face's Llama-family ``*ForCausalLM`` (Llama, Qwen2, Mistral): ``model.
    embed_tokens``, ``model.layers.<i>.{input_layernorm, self_attn(q/k/v/o_proj),
    post_attention_layernorm, mlp(gate/up/down_proj)}``, ``model.norm``, ``lm_head``.
    RoPE is Hugging Face's own (the ``cos, sin`` its model computes from the position ids
    this plan passes); fewer kv heads than TP ranks are replicated."""
    return Plan({
        "model.embed_tokens": VocabEmbedding(),
        "model.layers.*.self_attn": Attention(
            heads="config.num_attention_heads", kv_heads="config.num_key_value_heads",
            qkv=("q_proj", "k_proj", "v_proj"), out="o_proj", rope="hf",
            dropout="attention_dropout", returns="tuple", window=_hf_window),
        "model.layers.*.mlp.gate_proj": Column(),
        "model.layers.*.mlp.up_proj": Column(),
        "model.layers.*.mlp.down_proj": Row(),
        "model.layers.*.*layernorm": Norm(kind="rmsnorm"),
        "model.norm": Norm(kind="rmsnorm"),
        "lm_head": VocabHead(),
    }, batch_first=True, shard_inputs=_hf_inputs, name="the Hugging Face Llama plan")


# nanoGPT's GPT, not another class named GPT (tpkit.models.GPT is built from tpkit's layers)
nanogpt_plan.fits = lambda model: hasattr(getattr(model, "transformer", None), "wte")

# class name -> plan factory (the model's class or any base class), in core's registry
READY_PLANS.update({
    "GPT": nanogpt_plan,
    "LlamaForCausalLM": hf_llama_plan,
    "Qwen2ForCausalLM": hf_llama_plan,
    "MistralForCausalLM": hf_llama_plan,
})
