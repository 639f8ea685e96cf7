"""Packed rows (THD, TE's ``qkv_format="thd"``): several documents in one row, described
by ``cu_seqlens`` (cumulative real lengths) and ``cu_seqlens_padded`` (cumulative lengths
after padding every document to the layout's divisibility rule, applied per document:
``tpkit.cp.sequence_multiple``). ``pack_sequences`` builds the row; under CP each rank
takes its per-document share with ``PackedBatch.shard`` (the layout is CP's:
``tpkit.cp.shard_packed`` / ``unshard_packed`` / ``packed_cp_indices``).
"""
from __future__ import annotations

import dataclasses

import torch

from ..cp.sharding import sequence_multiple, shard_packed


@dataclasses.dataclass
class PackedBatch:
    """One packed row (or a CP rank's shard of it, from :meth:`shard`).

    ``tokens``, ``labels``, ``position_ids``: ``[T]`` (the row) or ``[T / cp]`` (a shard).
    ``labels`` is the next token inside each document; the last token of a document and
    every padding token get ``ignore_index`` (no prediction across a boundary, no loss on
    padding). ``position_ids`` restart at 0 in every document (and run on through its
    padding, as TE's ``generate_positional_ids_for_cp``). ``cu_seqlens`` /
    ``cu_seqlens_padded`` (int32, ``[n_docs + 1]``) always describe the *whole* row, also
    in a shard: TE's attention takes the global ones under CP."""
    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    ignore_index: int = -100

    def attention_kwargs(self) -> dict:
        """The THD keyword arguments of ``DotProductAttention.forward`` (TE's names)."""
        return dict(cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                    cu_seqlens_q_padded=self.cu_seqlens_padded,
                    cu_seqlens_kv_padded=self.cu_seqlens_padded,
                    max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    def shard(self, state=None) -> "PackedBatch":
        """This CP rank's tokens, labels and positions (per-document load balancing)."""
        return dataclasses.replace(self, **{
            name: shard_packed(getattr(self, name), self.cu_seqlens_padded, 0, state)
            for name in ("tokens", "labels", "position_ids")})


def pack_sequences(sequences, *, state=None, multiple: int | None = None, pad_id: int = 0,
                   ignore_index: int = -100, loss_masks=None) -> PackedBatch:
    """Pack documents (1-D integer tensors or lists, any lengths >= 1) into one THD row,
    each padded at its end to a multiple of ``multiple`` (default: the layout's rule,
    :func:`sequence_multiple`: ``2*cp``, times ``tp`` under SP) with ``pad_id``.

    ``loss_masks``: one per document (its length; 1: the token is a target, 0: it is not,
    as an SFT prompt): the label predicting a token of mask 0 is ``ignore_index``."""
    docs = [torch.as_tensor(d) for d in sequences]
    if not docs:
        raise ValueError("pack_sequences got no documents; pass a non-empty list of 1-D "
                         "token sequences")
    for i, d in enumerate(docs):
        if d.dim() != 1 or d.numel() == 0 or d.is_floating_point():
            raise ValueError(f"document {i} has shape {tuple(d.shape)} and dtype {d.dtype}; "
                             "every document must be a non-empty 1-D integer sequence")
    if multiple is None:
        multiple = sequence_multiple(state)
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"multiple={multiple!r} must be a positive integer (the padding "
                         "multiple of every document; default: the layout's 2*cp[*tp])")
    lens = [d.numel() for d in docs]
    if loss_masks is not None:
        loss_masks = [torch.as_tensor(m).bool() for m in loss_masks]
        if len(loss_masks) != len(docs) or any(m.shape != (n,) for m, n in
                                               zip(loss_masks, lens)):
            raise ValueError(f"loss_masks: {len(loss_masks)} masks of lengths "
                             f"{[tuple(m.shape) for m in loss_masks]} for {len(docs)} "
                             f"documents of lengths {lens}; give one mask per document, "
                             "of its length")
    padded = [-(-n // multiple) * multiple for n in lens]
    tokens, labels, positions = [], [], []
    for i, (d, n, p) in enumerate(zip(docs, lens, padded)):
        d = d.long()
        tokens += [d, d.new_full((p - n,), pad_id)]
        target = d[1:] if loss_masks is None else \
            d[1:].masked_fill(~loss_masks[i][1:], ignore_index)
        labels += [target, d.new_full((p - n + 1,), ignore_index)]
        positions.append(torch.arange(p))
    cum = lambda xs: torch.tensor([0] + xs, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PackedBatch(torch.cat(tokens), torch.cat(labels), torch.cat(positions),
                       cum(lens), cum(padded), max(padded), ignore_index)
