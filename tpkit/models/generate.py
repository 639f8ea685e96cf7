"""Text generation for tpkit's models: ``model.generate`` with Hugging Face's arguments.

``GenerationMixin.generate(input_ids, attention_mask=None, max_new_tokens=...,
do_sample=False, temperature=1.0, top_k=50, top_p=1.0, eos_token_id=None,
pad_token_id=None)`` takes ``[batch, seq]`` token ids (the same on every TP rank; each DP
rank generates its own batch) and returns ``[batch, seq + new]`` ids, the prompt first,
as ``transformers``' ``generate`` does for a decoder-only model. Prompts of different
lengths are left-padded with an ``attention_mask`` (1: token, 0: padding); positions
come from the mask (``cumsum(mask) - 1``, Hugging Face Llama's rule), so a padded row
generates what it would alone.

The prompt runs once through every layer with a KV cache (``tpkit.nn.inference.
InferenceParams``: TE's), then each new token alone; the last position's logits are
gathered over TP (``[batch, vocab]`` on every TP rank). Greedy picks the arg-max;
sampling applies temperature, top-k and top-p in Hugging Face's order (their
``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper`` semantics) and
draws with ``torch.multinomial`` from ``generator`` (default: torch's), and TP rank 0's
draw is broadcast to its TP group so every rank continues the same text. Rows that
emitted ``eos_token_id`` continue with ``pad_token_id`` (default: the first eos id), and
generation stops when every row has.

Layouts: any tp and dp; cp=1 (a decode step's one token cannot be split over CP ranks:
load the checkpoint at cp=1, tpkit reshards it) and no sequence parallelism (the same
reason over TP); tpkit's torch blocks (``backend="torch"``).
"""
from __future__ import annotations

import dataclasses

import torch

from ..comm.collectives import broadcast
from ..nn.inference import InferenceParams
from ..nn.mappings import gather_from_tp_region

__all__ = ["GenerationMixin", "GenerateOutput", "process_logits", "left_padding_positions"]


@dataclasses.dataclass
class GenerateOutput:
    """``generate(..., return_dict_in_generate=True)``: the ids and, with
    ``output_logits=True``, the raw logits of each step (``[batch, vocab]``, the model's
    dtype), Hugging Face's field names."""
    sequences: torch.Tensor
    logits: tuple | None = None


def process_logits(scores: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor:
    """Sampling scores ``[b, V]``: divided by ``temperature``, then every token below the
    ``top_k``-th largest score set to -inf (ties kept; 0: off), then the least likely
    tokens whose total probability is at most ``1 - top_p`` set to -inf (the most likely
    token always stays; 1.0: off)."""
    if temperature != 1.0:
        scores = scores / temperature
    if top_k and top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        order = scores.argsort(dim=-1, descending=True)
        probs = scores.gather(-1, order).softmax(-1)
        before = probs.cumsum(-1) - probs                 # mass of the likelier tokens
        drop = 1.0 - before <= 1.0 - top_p                # this and the rest: the tail
        drop[..., 0] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores


def left_padding_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``[b, s]`` of a left-padded batch: ``cumsum(mask) - 1`` on tokens, 1 on
    padding (Hugging Face Llama's ``prepare_inputs_for_generation``)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)


def _check_args(input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k,
                top_p, eos_token_id):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 \
            or input_ids.dtype not in (torch.long, torch.int, torch.int32) \
            or input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else input_ids
        raise ValueError(f"generate(input_ids={got}): pass integer token ids [batch, seq] "
                         "with at least one token per row (Hugging Face's layout)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens <= 0:
        raise ValueError(f"generate(max_new_tokens={max_new_tokens!r}): must be a positive "
                         "integer")
    if do_sample:
        if not temperature > 0:
            raise ValueError(f"generate(temperature={temperature!r}) with do_sample=True: must "
                             "be > 0 (for greedy decoding pass do_sample=False)")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"generate(top_k={top_k!r}): must be an integer >= 0 (0: off)")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"generate(top_p={top_p!r}): must be in (0, 1] (1.0: off)")
    if attention_mask is not None:
        m = attention_mask
        if not isinstance(m, torch.Tensor) or tuple(m.shape) != tuple(input_ids.shape) \
                or not bool(((m == 0) | (m == 1)).all()):
            got = tuple(m.shape) if isinstance(m, torch.Tensor) else m
            raise ValueError(f"generate(attention_mask={got}): must be 0/1 of input_ids' "
                             f"shape {tuple(input_ids.shape)} (1: token, 0: padding)")
        m = m.long()
        if bool((m[:, 1:] < m[:, :-1]).any()) or not bool(m[:, -1].all()):
            rows = sorted(set(torch.nonzero((m[:, 1:] < m[:, :-1]).any(-1)
                                            | (m[:, -1] == 0)).flatten().tolist()))
            raise ValueError(f"generate(attention_mask=...): rows {rows} are padded on the "
                             "right or empty; decoder-only generation pads on the left "
                             "(tokenizer.padding_side = 'left')")
    ids = [] if eos_token_id is None else (
        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    if any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in ids):
        raise ValueError(f"generate(eos_token_id={eos_token_id!r}): token ids are integers "
                         ">= 0 (one, or a list)")
    return ids


class GenerationMixin:
    """``generate`` for a model with tpkit's stem/blocks/head: ``embedding``
    (VocabParallelEmbedding), ``layers`` (tpkit.nn.TransformerLayer), ``final_norm``,
    ``output`` (ColumnParallelLinear without gather), ``rope`` (RotaryEmbedding), ``state``."""

    def _check_generation_layout(self) -> None:
        s = self.state
        name = type(self).__name__
        if s.cp_size > 1:
            raise ValueError(
                f"{name}.generate at cp={s.cp_size}: a decode step's one new token cannot be "
                "split over context-parallel ranks; generate on a layout with cp=1 (load "
                "the checkpoint there: tpkit reshards it; tp and dp as you like)")
        if s.sequence_parallel and s.tp_size > 1:
            raise ValueError(
                f"{name}.generate with sequence_parallel=True (tp={s.tp_size}): a decode "
                "step's one new token cannot be split over tensor-parallel ranks; build the "
                "model on a layout without sequence parallelism")
        if getattr(self, "_te_blocks", False):
            raise ValueError(f"{name}.generate with Transformer Engine blocks (backend='te'): "
                             "tpkit's KV cache runs in its torch blocks; build the model "
                             "with backend='torch' for generation")

    def _check_vocab(self, input_ids, attention_mask, pad: int, eos: list) -> None:
        """Every prompt token, the pad and eos ids inside the vocabulary (a sharded
        embedding reads an id beyond it as zeros, silently)."""
        v = self.cfg.vocab_size
        ids = input_ids if attention_mask is None else input_ids[attention_mask.bool()]
        if ids.numel() and (int(ids.max()) >= v or int(ids.min()) < 0):
            bad = int(ids.max()) if int(ids.max()) >= v else int(ids.min())
            raise ValueError(f"generate(input_ids=...): token id {bad} is outside the model's "
                             f"vocabulary (vocab_size={v}: ids 0..{v - 1}); encode the prompt "
                             "with the tokenizer the model was trained with")
        for what, i in (("pad_token_id", pad), *(("eos_token_id", e) for e in eos)):
            if i >= v:
                raise ValueError(f"generate({what}={i}) is outside the model's vocabulary "
                                 f"(vocab_size={v}: ids 0..{v - 1}); pass an id below {v}")

    def _step_logits(self, ids: torch.Tensor, params: InferenceParams, freqs: torch.Tensor,
                     kv_mask: torch.Tensor | None) -> torch.Tensor:
        """The full-vocabulary logits ``[b, V]`` of the last of ``ids [b, s]`` (this call's
        tokens, written to the cache at ``params.sequence_len_offset``)."""
        x = self.embedding(ids.t().contiguous())                    # [s, b, h]
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=freqs, attention_mask=kv_mask,
                      inference_params=params)
        logits = self.output(self.final_norm(x[-1:]))               # [1, b, V/tp]
        if isinstance(logits, tuple):
            logits = logits[0]
        logits = gather_from_tp_region(logits, self.state.tp_group)[0]
        return logits[..., :self.cfg.vocab_size]   # a padded vocabulary's rows never win

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int = 50, top_p: float = 1.0, eos_token_id=None,
                 pad_token_id: int | None = None, generator: torch.Generator | None = None,
                 return_dict_in_generate: bool = False, output_logits: bool = False):
        """Hugging Face's ``generate`` (the arguments above; module docstring). Returns the
        ids ``[b, s + new]`` (fewer new when every row stopped at an eos), or a
        ``GenerateOutput`` with ``return_dict_in_generate=True``."""
        self._check_generation_layout()
        eos = _check_args(input_ids, attention_mask, max_new_tokens, do_sample, temperature,
                          top_k, top_p, eos_token_id)
        pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
        self._check_vocab(input_ids, attention_mask, pad, eos)
        dev = self.state.device
        ids = input_ids.to(dev, torch.long)
        b, p = ids.shape
        total = p + max_new_tokens
        was_training = self.training
        self.eval()
        try:
            params = InferenceParams(b, total)
            if attention_mask is None or bool(attention_mask.all()):
                kv_full, freqs = None, self.rope(total)
            else:
                mask = torch.cat([attention_mask.to(dev, torch.long),
                                  torch.ones(b, max_new_tokens, dtype=torch.long, device=dev)],
                                 dim=1)
                kv_full = (mask == 0)[:, None, None, :]             # [b, 1, 1, total]
                freqs = self.rope(left_padding_positions(mask).t())  # [total, b, 1, d]
            out, step_logits = ids, []
            unfinished = torch.ones(b, dtype=torch.bool, device=dev)
            new = ids
            for _ in range(max_new_tokens):
                end = params.sequence_len_offset + new.shape[1]
                kv = None if kv_full is None else kv_full[..., :end]
                logits = self._step_logits(new, params, freqs, kv)
                params.sequence_len_offset = end                    # after the full forward
                if output_logits:
                    step_logits.append(logits)
                scores = logits.float()                            # Hugging Face's
                if do_sample:
                    scores = process_logits(scores, temperature, top_k, top_p)
                    nxt = _draw(scores.softmax(-1), generator)
                    if self.state.tp_size > 1:                      # one text per TP group
                        nxt = broadcast(nxt.contiguous(), self.state.tp_group, 0)
                else:
                    nxt = scores.argmax(-1)
                if eos:
                    nxt = torch.where(unfinished, nxt, torch.full_like(nxt, pad))
                    unfinished &= ~torch.isin(nxt, torch.tensor(eos, device=dev))
                out = torch.cat([out, nxt[:, None]], dim=1)
                new = nxt[:, None]
                if eos and not bool(unfinished.any()):
                    break
        finally:
            self.train(was_training)
        if return_dict_in_generate:
            return GenerateOutput(out, tuple(step_logits) if output_logits else None)
        return out


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from ``probs``, drawn on the generator's device (a CPU generator
    with a CUDA model draws the CPU's numbers, the same text as on CPU; multinomial
    refuses a generator of another device), returned on ``probs``' device."""
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.to(generator.device), 1,
                                 generator=generator)[:, 0].to(probs.device)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
