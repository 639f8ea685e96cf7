"""A user's model for tpkit.verify's tests (tests/verifier/test_verify.py): a small
Llama-like decoder written the way users write them (batch-first, its own RMSNorm,
separate q/k/v projections with grouped-query attention, a gated MLP with dropout), its
plan, and the mistakes users make, each behind one switch. Used by the tests and by
``python -m tpkit.cli.verify verify_models:build`` (the CLI test)."""
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.data import shard_sequence
from tpkit.plans import Attention, Column, Norm, Plan, Row, Style, VocabEmbedding, VocabHead
from tpkit.layout.random import get_rng_tracker

VOCAB, ROWS, SEQ = 64, 4, 16


@dataclasses.dataclass
class Mistakes:
    tile_kv: bool = False            # kv heads tiled (.repeat) instead of grouped: a wrong KV split
    transposed_down: bool = False    # mlp.down uses its weight as [in, out]; Row() splits [out, in]
    same_dropout: bool = False       # the MLP's dropout outside the model-parallel RNG stream
    cached_params: bool = False      # configure_optimizers uses parameters listed at __init__
    fused_gate_up: bool = False      # one fused gate/up projection, chunked in the forward


class RMSNorm(nn.Module):
    def __init__(self, h, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TransposedLinear(nn.Linear):
    """An nn.Linear whose weight is used as [in, out] (x @ W), as GPT-2's Conv1D."""

    def forward(self, x):
        return x @ self.weight + self.bias


class SelfAttention(nn.Module):
    def __init__(self, h, heads, kv_heads, tile_kv):
        super().__init__()
        self.heads, self.kv_heads, self.d, self.tile_kv = heads, kv_heads, h // heads, tile_kv
        self.q_proj = nn.Linear(h, heads * self.d, bias=False)
        self.k_proj = nn.Linear(h, kv_heads * self.d, bias=False)
        self.v_proj = nn.Linear(h, kv_heads * self.d, bias=False)
        self.o_proj = nn.Linear(heads * self.d, h, bias=False)

    def forward(self, x):                                          # [b, s, h]
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.d).transpose(1, 2)
        g = self.heads // self.kv_heads
        if self.tile_kv:
            k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
        else:
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, h, ffn, m: Mistakes, dropout):
        super().__init__()
        if m.fused_gate_up:   # named as no ready plan and no name check would recognise
            self.proj_in = nn.Linear(h, 2 * ffn, bias=False)
        else:
            self.gate, self.up = nn.Linear(h, ffn, bias=False), nn.Linear(h, ffn, bias=False)
        self.down = (TransposedLinear if m.transposed_down else nn.Linear)(ffn, h)
        self.drop, self.same_dropout = nn.Dropout(dropout), m.same_dropout

    def forward(self, x):
        if hasattr(self, "proj_in"):
            gate, up = self.proj_in(x).chunk(2, -1)
            y = F.silu(gate) * up
        else:
            y = F.silu(self.gate(x)) * self.up(x)                  # split over TP
        if self.same_dropout:
            y = self.drop(y)
        else:
            with get_rng_tracker().fork():
                y = self.drop(y)
        return self.down(y)


class Block(nn.Module):
    def __init__(self, h, ffn, heads, kv_heads, m, dropout):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(h), SelfAttention(h, heads, kv_heads, m.tile_kv)
        self.mlp_norm, self.mlp = RMSNorm(h), MLP(h, ffn, m, dropout)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, h=32, ffn=64, heads=4, kv_heads=2, layers=2, dropout=0.1,
                 mistakes=Mistakes()):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, h)
        self.layers = nn.ModuleList(Block(h, ffn, heads, kv_heads, mistakes, dropout)
                                    for _ in range(layers))
        self.final_norm, self.head = RMSNorm(h), nn.Linear(h, VOCAB, bias=False)
        self.cached = mistakes.cached_params and list(self.parameters())

    def forward(self, ids, targets):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.final_norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.cached or self.parameters(), lr=0.1)


def shard_inputs(args, kwargs, state):
    return tuple(shard_sequence(t, 1, state) for t in args), kwargs


def no_shard(args, kwargs, state):       # a shard_inputs that forgets to shard
    return args, kwargs


class Keep(Style):
    """A user's own style keeping a module as it is (forgets the sequence-parallel tag)."""

    def apply(self, name, module, ctx):
        return module


def plan(*, qkv=("q_proj", "k_proj", "v_proj"), norm=None, shard=shard_inputs,
         fused=None):
    """The Decoder's plan; ``fused``: the style of a fused gate/up ``mlp.proj_in``."""
    mlp = {"layers.*.mlp.proj_in": fused} if fused is not None else {
        "layers.*.mlp.gate": Column(), "layers.*.mlp.up": Column()}
    return Plan({
        "embed": VocabEmbedding(),
        "*norm": norm or Norm(),
        "layers.*.attn": Attention(heads="heads", kv_heads="kv_heads", qkv=qkv, out="o_proj"),
        **mlp,
        "layers.*.mlp.down": Row(),
        "head": VocabHead(),
    }, batch_first=True, shard_inputs=shard, name="Decoder's plan")


def make_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
            torch.randint(0, VOCAB, (ROWS, SEQ), generator=g))


def build():
    return Decoder()


def optimizer(model):
    return model.configure_optimizers()


# what `tpkit-verify verify_models:build --plan verify_models:PLAN` reads
PLAN = plan()


def build_llama():
    """tpkit's own Llama (tpkit layers: built at each layout), 2 layers, small."""
    from tpkit.models import Llama, LlamaConfig
    return Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=32, ffn_hidden_size=64,
                             num_layers=2, num_heads=4, num_gqa_groups=2))


def build_transposed():
    """The Decoder whose mlp.down keeps its weight as [in, out] (a planted mistake)."""
    return Decoder(ffn=32, mistakes=Mistakes(transposed_down=True))
