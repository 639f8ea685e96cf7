"""A one-layer GPT of tpkit.nn layers with causal CP attention, for the Fabric tests.

Vocab-parallel embedding -> LayerNorm -> fused q/k/v column-parallel (partition_sizes) ->
DotProductAttention (CP ring over the load-balanced shard) -> row-parallel -> RMSNorm ->
gate/up column-parallel -> row-parallel -> LayerNorm -> column-parallel logits ->
vocab-parallel cross entropy, mean over this rank's tokens (the loss convention).
Full weights come from a generator keyed by parameter name, so every layout loads the
same model (tpkit.checkpoint.load_full_state_dict).
"""
import torch
import torch.nn.functional as F
import zlib
from torch import nn

from tpkit.checkpoint import full_shapes, load_full_state_dict
from tpkit.data import shard_sequence
from tpkit.nn import (ColumnParallelLinear, LayerNorm, RMSNorm, RowParallelLinear,
                      VocabParallelEmbedding, vocab_parallel_cross_entropy)
from tpkit.nn.dot_product_attention import DotProductAttention

V, H, HEADS, FFN, SEQ, BATCH = 16, 16, 4, 16, 8, 4


class TinyGPT(nn.Module):
    def __init__(self, state):
        super().__init__()
        kw = dict(state=state)
        self.state = state
        self.emb = VocabParallelEmbedding(V, H, **kw)
        self.norm1 = LayerNorm(H, **kw)
        self.qkv = ColumnParallelLinear(H, 3 * H, partition_sizes=(H, H, H), **kw)
        self.attn = DotProductAttention(HEADS, H // HEADS, attn_mask_type="causal", **kw)
        self.proj = RowParallelLinear(H, H, **kw)
        self.norm2 = RMSNorm(H, **kw)
        self.fc1 = ColumnParallelLinear(H, 2 * FFN, partition_sizes=(FFN, FFN), **kw)
        self.fc2 = RowParallelLinear(FFN, H, **kw)
        self.normf = LayerNorm(H, **kw)
        self.out = ColumnParallelLinear(H, V, bias=False, **kw)

    def forward(self, tokens, targets):
        """``tokens``/``targets`` ``[b, s]``: this DP slice, full sequence (CP shards here)."""
        s = self.state
        tokens = shard_sequence(tokens, 1, s).t().contiguous()   # [s_cp, b]
        targets = shard_sequence(targets, 1, s).t().contiguous()
        x = self.emb(tokens)
        q, k, v = self.qkv(self.norm1(x)).chunk(3, -1)
        heads = HEADS // s.tp_size
        q, k, v = (t.reshape(t.shape[0], t.shape[1], heads, H // HEADS) for t in (q, k, v))
        x = x + self.proj(self.attn(q, k, v))
        gate, up = self.fc1(self.norm2(x)).chunk(2, -1)
        x = x + self.fc2(F.silu(gate) * up)
        logits = self.out(self.normf(x))
        return vocab_parallel_cross_entropy(logits, targets).mean()


def build(state) -> TinyGPT:
    """TinyGPT at ``state``'s layout holding the same full weights at every layout."""
    model = TinyGPT(state)
    full = {}
    for name, shape in full_shapes(model, state).items():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        full[name] = (1.0 + 0.1 * torch.randn(shape, generator=g) if "norm" in name
                      else torch.randn(shape, generator=g) / shape[-1] ** 0.5)
    load_full_state_dict(model, full, state)
    return model


def batches(steps: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, (BATCH, SEQ), generator=g),
             torch.randint(0, V, (BATCH, SEQ), generator=g)) for _ in range(steps)]
