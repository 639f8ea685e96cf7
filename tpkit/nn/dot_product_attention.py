"""DotProductAttention: TE's attention core, in torch, with context parallelism.

Same constructor shape as ``transformer_engine.pytorch.DotProductAttention`` (global head
counts: local heads = heads / tp) and the same ``set_context_parallel_group`` method, so a
model can swap between this and TE's module. Inputs are the local CP shard in the
load-balanced layout (``tpkit.data.shard_sequence``); without CP it is plain attention.

With CP, each call asks ``tpkit.nn.attention_ops.select`` for the fused block op of its
device and dtype (``self.kernel`` records the choice) and runs ``tpkit.nn.fused_cp``;
where there is none (CPU dropout, CUDA float64, ``TPKIT_FUSED_ATTN=0``) it runs the
reference kernels of ``tpkit.nn.context_parallel``.

Packed sequences (``qkv_format="thd"``, TE's ``cu_seqlens_*`` forward arguments) and
padding masks (``attn_mask_type="padding"/"padding_causal"`` with an ``attention_mask``)
run ``tpkit.nn.packed_attention`` (plain torch, ``self.kernel == "packed"``), with CP for
THD on every comm type (TE 2.x's support).

Attention dropout (training mode only) draws from the RNG tracker's model-parallel stream
for every comm type; the ring kernels replay their masks in backward from that stream.
"""
from __future__ import annotations

import math
import warnings
import weakref

import torch
import torch.nn.functional as F

from ..comm.collectives import group_rank, group_size
from ..layout.config import CP_COMM_TYPES
from ..layout.random import get_rng_tracker
from ..layout.topology import resolve_state
from ._backend import TEBackendMixin
from ._common import divide, local_kv_heads
from .attention_ops import select
from .context_parallel import context_parallel_attention
from .fused_cp import fused_context_parallel_attention
from .inference import InferenceParams, cached_attention, kv_padding_mask
from .packed_attention import packed_attention, padded_attention

MASK_TYPES = ("causal", "no_mask", "padding", "padding_causal")
QKV_FORMATS = ("sbhd", "bshd", "thd")
# TE's forward arguments of packed sequences (ParallelSelfAttention/TransformerLayer pass them)
THD_KWARGS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
              "max_seqlen_q", "max_seqlen_kv")


def _mask_type(name: str) -> str:
    """TE's spellings of a mask type ("padding,causal", "causal,padding") -> one name."""
    name = name.replace(",", "_")
    name = "padding_causal" if name == "causal_padding" else name
    if name not in MASK_TYPES:
        raise ValueError(f"attn_mask_type={name!r} is not supported by tpkit's torch "
                         f"DotProductAttention; use one of {MASK_TYPES} (arbitrary masks "
                         "need the TE backend)")
    return name


def _check_dropout(fmt: str, mask: str, p: float) -> None:
    if p > 0.0 and (fmt == "thd" or mask.startswith("padding")):
        raise ValueError(f"attention_dropout={p} with qkv_format={fmt!r} and "
                         f"attn_mask_type={mask!r} is not supported by tpkit's torch "
                         "DotProductAttention; use attention_dropout=0 or backend='te'")


# The last cu_seqlens validated: (weak references, their versions, host copies). Every
# layer of a model gets the same tensors in one step, so only the first layer copies them
# to the host and checks them (one device->host sync per batch, not per layer).
_THD_LAST: list = [None]


def _thd_host(cu_q, cu_kv, cup_q, cup_kv):
    """(cu_seqlens, cu_seqlens_padded, padded total) on the host, checked once per set of
    tensors (again when one is replaced or changed in place)."""
    given = (cu_q, cu_kv, cup_q, cup_kv)
    tensors = all(isinstance(x, torch.Tensor) for x in given)
    if tensors:
        last = _THD_LAST[0]
        versions = tuple(x._version for x in given)
        if last is not None and all(r() is x for r, x in zip(last[0], given)) \
                and last[1] == versions:
            return last[2]
    cu, cup = (torch.as_tensor(x).long().cpu() for x in (cu_q, cup_q))
    if not (torch.equal(cu, torch.as_tensor(cu_kv).long().cpu())
            and torch.equal(cup, torch.as_tensor(cup_kv).long().cpu())):
        raise ValueError("cu_seqlens_kv(_padded) differ from cu_seqlens_q(_padded); "
                         "tpkit's torch DotProductAttention is self-attention only")
    lens, plens = cu.diff(), cup.diff()
    if cu.dim() != 1 or cu.shape != cup.shape or len(cu) < 2 or cu[0] != 0 \
            or cup[0] != 0 or bool((lens < 0).any()) or bool((plens < lens).any()):
        raise ValueError(f"cu_seqlens={cu.tolist()} / cu_seqlens_padded={cup.tolist()} are "
                         "not cumulative lengths from 0 with every padded length >= the "
                         "real one; build them with tpkit.data.pack_sequences")
    out = (cu.tolist(), cup.tolist(), int(cup[-1]))   # host lists: no sync downstream
    if tensors:
        _THD_LAST[0] = (tuple(weakref.ref(x) for x in given), versions, out)
    return out


class DotProductAttention(TEBackendMixin, torch.nn.Module):
    """softmax(q k^T * scale [masked]) v over this rank's heads and CP shard."""
    _te_kind = "attention"  # backend="te": te.DotProductAttention (tpkit.nn._backend)

    def __init__(self, num_attention_heads: int, kv_channels: int, *,
                 num_gqa_groups: int | None = None, attn_mask_type: str = "causal",
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd",
                 cp_comm_type: str | None = None, softmax_scale: float | None = None,
                 state=None, backend: str = "torch"):
        super().__init__()
        state = resolve_state(state)
        attn_mask_type = _mask_type(attn_mask_type)
        if qkv_format not in QKV_FORMATS:
            raise ValueError(f"qkv_format={qkv_format!r} is not supported; use one of "
                             f"{QKV_FORMATS}")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"attention_dropout={attention_dropout} must be in [0, 1)")
        _check_dropout(qkv_format, attn_mask_type, attention_dropout)
        num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        divide(num_attention_heads, num_gqa_groups, "num_attention_heads", by="num_gqa_groups")
        self.num_heads_local = divide(num_attention_heads, state.tp_size, "num_attention_heads")
        self.num_gqa_local = local_kv_heads(num_gqa_groups, state.tp_size)
        # a bool fixed here: torch.compile makes ints that differ between compiled calls
        # (two models' head counts, shapes) symbolic, and SDPA refuses a SymBool enable_gqa
        self._gqa = bool(self.num_heads_local != self.num_gqa_local)
        self.kv_channels = kv_channels
        self.attn_mask_type = attn_mask_type
        self.attention_dropout = attention_dropout
        self.qkv_format = qkv_format
        self.softmax_scale = 1.0 / math.sqrt(kv_channels) if softmax_scale is None else softmax_scale
        self.state = state
        self.kernel: str | None = None  # the CP kernel of the last forward ("reference": math)
        comm = state.cp_comm_type if cp_comm_type is None else cp_comm_type
        if comm == "a2a+p2p" and state.cp_a2a_group is None:
            raise ValueError("cp_comm_type='a2a+p2p' needs the two CP levels: build the "
                             "state with init_parallel(cp_comm_type='a2a+p2p', cp_a2a_size=...) "
                             "or call set_context_parallel_group([a2a_group, p2p_group], ...)")
        if state.cp_size == 1:
            group, ranks = None, None
        else:
            group = [state.cp_a2a_group, state.cp_p2p_group] if comm == "a2a+p2p" \
                else state.cp_group
            ranks = state.cp_global_ranks
        self.set_context_parallel_group(group, ranks, None, comm)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type: str = "p2p",
                                   load_balancing_strategy="dual_chunk_swap") -> None:
        """TE's signature: ``cp_group`` is the CP group, or ``[a2a_group, p2p_group]`` for
        "a2a+p2p"; ``cp_stream`` is accepted for TE compatibility (unused on this path).
        ``load_balancing_strategy`` (TE >= 2.10) must be TE's DUAL_CHUNK_SWAP, the layout of
        tpkit.data.shard_sequence (the string or TE's enum member)."""
        lbs = str(getattr(load_balancing_strategy, "name", load_balancing_strategy)).lower()
        if lbs != "dual_chunk_swap":
            raise ValueError(f"load_balancing_strategy={load_balancing_strategy!r} is not "
                             "supported by tpkit's torch DotProductAttention; only "
                             "'dual_chunk_swap' (tpkit.data.shard_sequence's layout)")
        if cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type={cp_comm_type!r} is unknown; use one of "
                             f"{CP_COMM_TYPES}")
        if cp_comm_type == "a2a+p2p":
            if not isinstance(cp_group, (list, tuple)) or len(cp_group) != 2 \
                    or any(g is None for g in cp_group):
                raise ValueError("cp_comm_type='a2a+p2p' needs cp_group=[a2a_group, p2p_group] "
                                 f"(TE's convention), got {cp_group!r}")
            size = group_size(cp_group[0]) * group_size(cp_group[1])
        elif isinstance(cp_group, (list, tuple)):
            raise ValueError(f"cp_comm_type={cp_comm_type!r} takes one process group; a list "
                             "[a2a_group, p2p_group] is only for 'a2a+p2p'")
        else:
            size = 1 if cp_group is None else group_size(cp_group)
        if cp_global_ranks is not None and len(cp_global_ranks) != size:
            raise ValueError(f"cp_global_ranks={cp_global_ranks} has {len(cp_global_ranks)} "
                             f"ranks but the CP group(s) have {size}; pass the group's ranks")
        if cp_comm_type in ("a2a", "a2a+p2p") and size > 1:
            a = group_size(cp_group[0] if cp_comm_type == "a2a+p2p" else cp_group)
            for what, n in (("local attention heads", self.num_heads_local),
                            ("local gqa groups", self.num_gqa_local)):
                if n % a != 0:
                    raise ValueError(f"cp_comm_type={cp_comm_type!r} scatters heads over {a} "
                                     f"CP ranks, but there are {n} {what} (global count / tp);"
                                     f" use counts divisible by {a} or cp_comm_type='p2p'")
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type, self.cp_size = cp_stream, cp_comm_type, size

    # --- forward ---------------------------------------------------------------------------
    def _check(self, q, k, v, fmt) -> None:
        dims = 3 if fmt == "thd" else 4
        for name, t, heads in (("query", q, self.num_heads_local), ("key", k, self.num_gqa_local),
                               ("value", v, self.num_gqa_local)):
            if t.dim() != dims or t.shape[-2] != heads or t.shape[-1] != self.kv_channels:
                raise ValueError(f"{name}_layer has shape {tuple(t.shape)}; expected {dims}-D "
                                 f"{fmt} with {heads} local heads of "
                                 f"{self.kv_channels} channels")
        if k.shape != v.shape or q.shape[:dims - 2] != k.shape[:dims - 2]:
            raise ValueError(f"query/key/value shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                             f"{tuple(v.shape)} disagree on batch/sequence (self-attention only)")
        s = q.shape[1] if fmt == "bshd" else q.shape[0]
        if self.cp_size > 1 and fmt != "thd" and s % 2 != 0:
            raise ValueError(f"local sequence length {s} is odd, but a CP shard holds two "
                             "equal chunks; shard with tpkit.data.shard_sequence (the full "
                             f"length must divide by 2*cp = {2 * self.cp_size})")
        if self.cp_size > 1 and fmt != "thd":
            self._check_cp_shard(s)

    def _check_cp_shard(self, s: int) -> None:
        """A full-length input reaching CP attention runs (each rank attends to the whole
        sequence in the wrong layout) and trains silently wrong: refuse the full length
        last sharded in this layout; warn once when nothing was sharded through tpkit."""
        full = self.state.last_sharded_len
        if full is not None and s == full:
            raise ValueError(
                f"{type(self).__name__} under cp={self.cp_size} got the full sequence ({s} "
                f"tokens) where this CP rank's shard of {s // self.cp_size} belongs; shard "
                "the inputs with tpkit.data.shard_sequence(x, seq_dim) (or parallelize the "
                "model with tpkit.parallelize, which shards them)")
        if full is None and not getattr(self, "_cp_warned", False):
            self._cp_warned = True
            warnings.warn(
                f"{type(self).__name__} under cp={self.cp_size} got {s} local tokens but no "
                "sequence was sharded with tpkit.data.shard_sequence / shard_position_ids in "
                "this layout: if these are the full sequence, attention and loss are wrong; "
                "shard the inputs (tpkit.data.shard_sequence, or tpkit.parallelize)",
                stacklevel=3)

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None,
                qkv_format: str | None = None, cu_seqlens_q=None, cu_seqlens_kv=None,
                cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None,
                max_seqlen_kv=None, attn_mask_type: str | None = None,
                inference_params=None):
        """TE's forward (the subset tpkit implements): ``qkv_format`` and
        ``attn_mask_type`` override the constructor's for this call; ``"thd"`` takes
        ``[t, heads, d]`` tensors (this CP rank's shard of the packed row) and the *global*
        ``cu_seqlens_*`` of the row (``tpkit.data.PackedBatch.attention_kwargs()``).
        ``inference_params`` (TE's KV cache, tpkit.nn.inference): the call's keys and
        values are appended to this layer's cache at ``sequence_len_offset`` and the
        queries attend to every cached key; a padding mask then covers every key so far
        (``[b, 1, 1, offset + s]``). Not under context parallelism (ValueError)."""
        fmt = self.qkv_format if qkv_format is None else qkv_format
        if fmt not in QKV_FORMATS:
            raise ValueError(f"qkv_format={fmt!r} is not supported; use one of {QKV_FORMATS}")
        mask = self.attn_mask_type if attn_mask_type is None else _mask_type(attn_mask_type)
        _check_dropout(fmt, mask, self.attention_dropout)
        causal = mask in ("causal", "padding_causal")
        if inference_params is not None:
            return self._forward_cached(query_layer, key_layer, value_layer, fmt, mask,
                                        causal, attention_mask, inference_params)
        self._check(query_layer, key_layer, value_layer, fmt)
        if fmt == "thd":
            return self._forward_thd(query_layer, key_layer, value_layer, mask, causal,
                                     cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                                     cu_seqlens_kv_padded)
        if cu_seqlens_q is not None or cu_seqlens_kv is not None:
            raise ValueError(f"cu_seqlens_q/cu_seqlens_kv describe packed sequences; pass "
                             f"qkv_format='thd' (got {fmt!r}) with [t, heads, d] tensors")
        if mask.startswith("padding") != (attention_mask is not None):
            raise ValueError(f"attention_mask {'is missing' if attention_mask is None else 'is given'}"
                             f" with attn_mask_type={mask!r}: pass TE's padding mask [b, 1, 1, s]"
                             " (True: padding) exactly with 'padding'/'padding_causal'")
        # [s, b, h, d] / [b, s, h, d] -> [b, h, s, d]
        perm = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
        q, k, v = (t.permute(*perm) for t in (query_layer, key_layer, value_layer))
        dropout_p = self.attention_dropout if self.training else 0.0
        if attention_mask is not None:
            b, s = q.shape[0], q.shape[2]
            if self.cp_size > 1:
                raise ValueError(f"attn_mask_type={mask!r} with {fmt} under context "
                                 "parallelism is not supported (nor by TE); pack the "
                                 "sequences instead: qkv_format='thd' with cu_seqlens")
            if attention_mask.dtype != torch.bool or attention_mask.numel() != b * s \
                    or attention_mask.dim() != 4:
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} and "
                                 f"dtype {attention_mask.dtype}; expected TE's bool padding "
                                 f"mask [{b}, 1, 1, {s}] (True: padding)")
            self.kernel = "packed"
            out = padded_attention(q, k, v, attention_mask, causal=causal,
                                   scale=self.softmax_scale)
        elif self.cp_size > 1:
            kw = dict(comm_type=self.cp_comm_type, group=self.cp_group, causal=causal,
                      scale=self.softmax_scale, dropout_p=dropout_p)
            op = select(q.device, q.dtype, dropout_p)
            self.kernel = "reference" if op is None else op.name
            out = context_parallel_attention(q, k, v, **kw) if op is None \
                else fused_context_parallel_attention(q, k, v, op=op, **kw)
        else:  # no CP: PyTorch's fused kernel (saves q, k, v, out, lse like the ring)
            kw = dict(is_causal=causal, dropout_p=dropout_p, scale=self.softmax_scale,
                      enable_gqa=self._gqa)
            if dropout_p > 0.0:
                with get_rng_tracker().fork():
                    out = F.scaled_dot_product_attention(q, k, v, **kw)
            else:
                out = F.scaled_dot_product_attention(q, k, v, **kw)
        b, h, s, d = out.shape
        if fmt == "sbhd":
            return out.permute(2, 0, 1, 3).reshape(s, b, h * d)
        return out.permute(0, 2, 1, 3).reshape(b, s, h * d)

    def _forward_cached(self, q, k, v, fmt, mask, causal, attention_mask, params):
        who = f"{type(self).__name__}.forward(inference_params=...)"
        if not isinstance(params, InferenceParams):
            raise ValueError(f"{type(self).__name__}.forward(inference_params={params!r}): "
                             "not an InferenceParams; pass tpkit.te_api.InferenceParams("
                             "max_batch_size, max_sequence_length)")
        if self.cp_size > 1:
            raise ValueError(
                f"{who} under context parallelism (cp={self.cp_size}) is not supported: a "
                "decode step's one new token cannot be split over CP ranks, and each rank "
                "holds a load-balanced shard of the prefix, not a contiguous cache; generate "
                "on a layout with cp=1 (load the checkpoint there: tpkit reshards it)")
        if fmt == "thd":
            raise ValueError(f"{who} with qkv_format='thd' is not supported; use 'sbhd' or "
                             "'bshd' (TE's inference layouts)")
        self._check(q, k, v, fmt)
        if self.training and self.attention_dropout > 0.0:
            raise ValueError(f"{who} in training mode with attention_dropout="
                             f"{self.attention_dropout}: the KV cache is for inference; call "
                             "model.eval() first")
        if mask.startswith("padding") != (attention_mask is not None):
            raise ValueError(f"attention_mask {'is missing' if attention_mask is None else 'is given'}"
                             f" with attn_mask_type={mask!r}: pass a padding mask exactly with "
                             "'padding'/'padding_causal'")
        s, b = (q.shape[0], q.shape[1]) if fmt == "sbhd" else (q.shape[1], q.shape[0])
        kv_mask = None if attention_mask is None else kv_padding_mask(
            attention_mask, b, params.sequence_len_offset + s, who)
        self.kernel = "cached"
        out = cached_attention(self, params, q, k, v, fmt, causal, kv_mask, self.softmax_scale)
        b, h, s, d = out.shape
        if fmt == "sbhd":
            return out.permute(2, 0, 1, 3).reshape(s, b, h * d)
        return out.permute(0, 2, 1, 3).reshape(b, s, h * d)

    def _forward_thd(self, q, k, v, mask, causal, cu_q, cu_kv, cup_q, cup_kv):
        if not mask.startswith("padding"):
            raise ValueError(f"qkv_format='thd' needs attn_mask_type='padding' or "
                             f"'padding_causal' (TE's rule), got {mask!r}")
        if cu_q is None or cu_kv is None:
            raise ValueError("qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv (see "
                             "tpkit.data.pack_sequences)")
        if self.cp_size > 1 and (cup_q is None or cup_kv is None):
            raise ValueError("qkv_format='thd' under context parallelism needs "
                             "cu_seqlens_q_padded and cu_seqlens_kv_padded (TE's rule; "
                             "tpkit.data.pack_sequences gives them)")
        cup_q = cu_q if cup_q is None else cup_q
        cup_kv = cu_kv if cup_kv is None else cup_kv
        cu, cup, total = _thd_host(cu_q, cu_kv, cup_q, cup_kv)
        t = q.shape[0]
        if total != t * self.cp_size:
            raise ValueError(f"the packed row has {total} tokens (cu_seqlens_padded) "
                             f"but this rank holds {t} x cp={self.cp_size}; pass this rank's "
                             "shard (tpkit.data.shard_packed) and the global cu_seqlens")
        rank = 0 if self.cp_size == 1 else (
            group_rank(self.cp_group[1]) * group_size(self.cp_group[0])
            + group_rank(self.cp_group[0]) if self.cp_comm_type == "a2a+p2p"
            else group_rank(self.cp_group))
        self.kernel = "packed"
        qb, kb, vb = (x.permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))  # [1, h, t, d]
        out = packed_attention(qb, kb, vb, cu_seqlens=cu, cu_seqlens_padded=cup,
                               comm_type=self.cp_comm_type, group=self.cp_group,
                               cp_size=self.cp_size, cp_rank=rank, causal=causal,
                               scale=self.softmax_scale)
        return out[0].permute(1, 0, 2).reshape(t, -1)
