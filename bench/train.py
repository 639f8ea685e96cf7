"""Reference-GPT training step at tp=2: tpkit layers vs torch DTensor TP; collectives per step.

``python -m bench.train`` spawns its own 2 gloo processes (1 thread each) and, per size:
- loads the SAME full weights into tpkit/models/gpt.py's GPT (tpkit.nn layers) and into a plain
  torch GPT of the same math (pre-norm RMSNorm blocks, GQA attention with RoPE, GELU MLP,
  untied head, causal) parallelised with ``parallelize_module``: q/k/v and fc1
  ColwiseParallel, proj and fc2 RowwiseParallel, the embedding RowwiseParallel
  (vocab-sharded) and the head ColwiseParallel with ``loss_parallel`` (vocab-parallel CE);
- checks both give the same loss on one batch, and again after one AdamW step;
- times the training step (fwd + bwd + AdamW step), interleaved in rounds.
Then it counts the collectives tpkit issues in one fwd+bwd step (+ the SP norm-gradient
sync) without and with sequence parallelism and compares with ``analytical_collectives``.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [  # name, GPT sizes, seq, batch, target of the tpkit / DTensor step-time ratio
    ("default (launch/train.py)", dict(hidden_size=128, num_layers=2, num_heads=8,
                                       num_gqa_groups=4, ffn_hidden_size=512), 128, 8, 1.0),
    ("compute-bound", dict(hidden_size=512, num_layers=2, num_heads=8, num_gqa_groups=4,
                           ffn_hidden_size=2048), 256, 4, 1.0),
]


def analytical_collectives(num_layers: int, sequence_parallel: bool) -> dict[str, int]:
    """Collectives of one GPT fwd+bwd step at tp>1 (cp=dp=1), derived layer by layer.
    No SP: embedding g (1 fwd all-reduce); per layer qkv f + fc1 f (2 bwd all-reduces) and
    proj g + fc2 g (2 fwd); head f (1 bwd); vocab-parallel CE 2 fwd (max; packed target
    logit + sum of exps), none bwd. SP: every f/g becomes an all-gather/reduce-scatter pair
    (embedding RS fwd / AG bwd; per layer qkv, fc1 AG fwd / RS bwd and proj, fc2 RS fwd /
    AG bwd; head AG fwd / RS bwd), CE keeps its 2 all-reduces, and the norm weights'
    gradients are summed by one flattened all-reduce (sync_sequence_parallel_grads)."""
    L = num_layers
    if not sequence_parallel:
        return {"all_reduce": 1 + 4 * L + 1 + 2}
    return {"all_gather_into_tensor": 1 + 4 * L + 1, "reduce_scatter_tensor": 1 + 4 * L + 1,
            "all_reduce": 2 + 1}


def _count_collectives():
    """tests/commcount.py's counter, loaded by path (bench runs without pytest)."""
    import sys
    mod = sys.modules.get("_tpkit_commcount")
    if mod is None:
        spec = importlib.util.spec_from_file_location(
            "_tpkit_commcount", os.path.join(ROOT, "tests", "commcount.py"))
        mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod.count_collectives()


def count_step_collectives(cfg, seq: int, batch: int, sequence_parallel: bool,
                           state=None) -> dict[str, int]:
    """Collectives of one GPT fwd + bwd + SP norm-grad sync, by op, on ``state``'s groups
    with ``sequence_parallel`` switched on or off (a copy of the state: no new groups)."""
    from tpkit.models.gpt import GPT
    import tpkit
    from tpkit.nn import sync_sequence_parallel_grads
    state = state or tpkit.get_parallel_state()
    state = dataclasses.replace(state, config=dataclasses.replace(
        state.config, sequence_parallel=sequence_parallel))
    model = GPT(cfg, state=state)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (batch, seq), generator=g) for _ in range(2))
    with _count_collectives() as calls:
        model(x, y).backward()
        sync_sequence_parallel_grads(model, state)
    out: dict[str, int] = {}
    for c in calls:   # a call on any group but TP is named with its size (it should not be)
        key = c.op if c.group_size == state.tp_size else f"{c.op} (group of {c.group_size})"
        out[key] = out.get(key, 0) + 1
    return out


# --- the same GPT in plain torch modules, for DTensor tensor parallelism ---------------
class _Attention(nn.Module):
    def __init__(self, h, heads, groups):
        super().__init__()
        self.d = d = h // heads
        self.linear_q = nn.Linear(h, heads * d, bias=False)
        self.linear_k = nn.Linear(h, groups * d, bias=False)
        self.linear_v = nn.Linear(h, groups * d, bias=False)
        self.linear_proj = nn.Linear(heads * d, h, bias=False)

    def forward(self, x, freqs):
        from tpkit.nn import apply_rotary_pos_emb
        s, b, _ = x.shape                       # -1 heads: the local heads under TP
        q, k, v = (f(x).view(s, b, -1, self.d) for f in (self.linear_q, self.linear_k,
                                                          self.linear_v))
        q, k = apply_rotary_pos_emb(q, freqs), apply_rotary_pos_emb(k, freqs)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return self.linear_proj(o.permute(2, 0, 1, 3).reshape(s, b, -1))


class _MLP(nn.Module):
    def __init__(self, h, ffn):
        super().__init__()
        self.linear_fc1 = nn.Linear(h, ffn, bias=False)
        self.linear_fc2 = nn.Linear(ffn, h, bias=False)

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class _Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=1e-5)
        self.self_attention = _Attention(c.hidden_size, c.num_heads, c.num_gqa_groups)
        self.pre_mlp_layernorm = nn.RMSNorm(c.hidden_size, eps=1e-5)
        self.mlp = _MLP(c.hidden_size, c.ffn_hidden_size)

    def forward(self, x, freqs):
        x = x + self.self_attention(self.input_layernorm(x), freqs)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class PlainGPT(nn.Module):
    """tpkit/models/gpt.py's GPT (cp=1, no dropout) with nn.Linear / nn.Embedding / nn.RMSNorm;
    same parameter names except q/k/v, which tpkit fuses into linear_qkv."""

    def __init__(self, c):
        super().__init__()
        from tpkit.nn import RotaryEmbedding
        self.embedding = nn.Embedding(c.vocab_size, c.hidden_size)
        self.rope = RotaryEmbedding(c.hidden_size // c.num_heads)
        self.layers = nn.ModuleList(_Block(c) for _ in range(c.num_layers))
        self.final_norm = nn.RMSNorm(c.hidden_size, eps=1e-5)
        self.output = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, tokens, targets):
        x = self.embedding(tokens.t())                              # [s, b, h]
        freqs = self.rope(tokens.shape[1])
        for layer in self.layers:
            x = layer(x, freqs)
        logits = self.output(self.final_norm(x))                    # DTensor, Shard(-1)
        return F.cross_entropy(logits.flatten(0, 1), targets.t().flatten())

    def tp_plan(self) -> dict:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        plan = {"embedding": RowwiseParallel(input_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        for i in range(len(self.layers)):
            p = f"layers.{i}."
            plan.update({p + "self_attention.linear_q": ColwiseParallel(),
                         p + "self_attention.linear_k": ColwiseParallel(),
                         p + "self_attention.linear_v": ColwiseParallel(),
                         p + "self_attention.linear_proj": RowwiseParallel(),
                         p + "mlp.linear_fc1": ColwiseParallel(),
                         p + "mlp.linear_fc2": RowwiseParallel()})
        return plan


def to_tpkit_names(sd: dict) -> dict:
    """PlainGPT's full state dict in GPT's names (q, k, v fused as [Q; K; V])."""
    out = {}
    for name, t in sd.items():
        if ".linear_q." in name:
            base = name.replace(".linear_q.", ".linear_{}.")
            out[name.replace("linear_q", "linear_qkv")] = torch.cat(
                [sd[base.format(c)] for c in "qkv"], 0)
        elif ".linear_k." not in name and ".linear_v." not in name:
            out[name] = t
    return out


def _measure(cfg, seq, batch, quick):
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    import tpkit
    from tpkit.train import corpus
    from tpkit.models.gpt import GPT
    from tpkit.checkpoint import load_full_state_dict

    st = tpkit.get_parallel_state()
    torch.manual_seed(0)
    plain = PlainGPT(cfg)
    with torch.no_grad():
        plain.embedding.weight.mul_(0.02)
    tp_model = GPT(cfg)
    load_full_state_dict(tp_model, to_tpkit_names(plain.state_dict()))
    parallelize_module(plain, st.tp_mesh, plain.tp_plan())
    data = corpus.tokens()
    batches = [corpus.batch(data, i, batch, seq) for i in range(4)]
    opts = {"tpkit": torch.optim.AdamW(tp_model.parameters(), lr=1e-3),
            "dtensor": torch.optim.AdamW(plain.parameters(), lr=1e-3)}

    def fwd_bwd(name, x, y):
        if name == "tpkit":
            loss = tp_model(x, y)
            loss.backward()
            return loss.item()
        with loss_parallel():
            loss = plain(x, y)
            loss.backward()
        return loss.full_tensor().item()

    def step(name, i):
        opts[name].zero_grad(set_to_none=True)
        loss = fwd_bwd(name, *batches[i % len(batches)])
        opts[name].step()
        return loss

    # the peer's collectives in one fwd+bwd (DTensor's own counter sees functional ones)
    from torch.distributed.tensor.debug import CommDebugMode
    mode = CommDebugMode()
    with mode, loss_parallel(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # its module hooks see int inputs
        plain(*batches[0]).backward()
    peer_calls = {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
    # same loss from the same weights, and again after one AdamW step on the same batch
    losses = {n: [step(n, 0), step(n, 0)] for n in opts}
    diffs = [abs(a - b) for a, b in zip(losses["tpkit"], losses["dtensor"])]

    rounds, per_round, warmup = (2, 2, 1) if quick else (5, 3, 2)
    counter = [0]

    def timed(name):
        counter[0] += 1
        step(name, counter[0])

    for n in opts:
        for _ in range(warmup):
            timed(n)
    times = {n: [] for n in opts}
    for _ in range(rounds):
        for n in opts:
            dist.barrier()
            for _ in range(per_round):
                t0 = time.perf_counter()
                timed(n)
                times[n].append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(times[n]) for n in opts], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX, group=st.tp_group)   # the slower rank's
    return dict(tpkit=med[0].item(), dtensor=med[1].item(), loss=losses["tpkit"][0],
                loss_diff=max(diffs), steps=len(times["tpkit"]), peer_calls=peer_calls)


def _all(quick: bool) -> dict:
    from tpkit.models.gpt import GPTConfig
    res = {}
    for name, sizes, seq, batch, _ in SIZES:
        res[name] = _measure(GPTConfig(**sizes), seq, batch, quick)
    cfg = GPTConfig(**SIZES[0][1])
    res["collectives"] = {sp: count_step_collectives(cfg, SIZES[0][2], SIZES[0][3], sp)
                          for sp in (False, True)}
    return res


def measure(quick: bool = False) -> dict:
    from bench.common import run_tp2
    return run_tp2(_all, quick)


def main(quick: bool = False) -> dict:
    from bench.common import fmt, table, write_section
    res = measure(quick)
    rows, notes = [], []
    for name, sizes, seq, batch, target in SIZES:
        r = res[name]
        shape = (f"h={sizes['hidden_size']}, ffn={sizes['ffn_hidden_size']}, "
                 f"L={sizes['num_layers']}, s={seq}, b={batch}")
        rows.append(dict(what=f"{name} ({shape}): tpkit GPT train step",
                         figure=fmt(r["tpkit"], "ms"),
                         peer_name="same GPT, nn modules + parallelize_module",
                         peer=fmt(r["dtensor"], "ms"), ratio=r["tpkit"] / r["dtensor"],
                         target=f"<= {target}x"))
        notes.append(f"{name}: loss {r['loss']:.4f}, |tpkit - DTensor| <= {r['loss_diff']:.1e}")
    L = SIZES[0][1]["num_layers"]
    for sp, calls in res["collectives"].items():
        expect = analytical_collectives(L, sp)
        got, want = sum(calls.values()), sum(expect.values())
        rows.append(dict(what=f"collectives per fwd+bwd step, {L} layers, tp=2, "
                              f"{'SP' if sp else 'no SP'}",
                         figure=f"{got} ({_fmt_calls(calls)})", peer_name="analytical",
                         peer=f"{want} ({_fmt_calls(expect)})",
                         ratio=got / want if calls == expect else float("nan"),  # ops differ
                         target="1.0, same ops"))
    body = ("Training step of tpkit/models/gpt.py's GPT (forward + backward + AdamW step, fp32) at "
            "tp=2 on gloo, 2 processes with 1 thread each, median over interleaved rounds; "
            "the peer is the same architecture in plain torch modules parallelised with "
            "`parallelize_module` (Colwise q/k/v/fc1, Rowwise proj/fc2, vocab-sharded "
            "embedding and head with `loss_parallel`), loaded with the same full weights. "
            "Loss agreement (first batch, and after one AdamW step): "
            + "; ".join(notes) + ". Collectives counted at the default size; SP adds the "
            "one flattened norm-gradient all-reduce of `sync_sequence_parallel_grads`. "
            f"The DTensor peer issues {_fmt_calls(res[SIZES[0][0]]['peer_calls'])} per "
            "fwd+bwd without SP (CommDebugMode): its q/k/v are three Colwise layers (3 "
            "backward all-reduces per layer where tpkit's fused QKV has 1) and "
            "`loss_parallel`'s cross entropy all-reduces 3 times forward (tpkit packs 2).\n\n"
            + table(rows))
    write_section("train", "GPT training step", body)
    print(table(rows))
    return res


def _fmt_calls(calls: dict) -> str:
    short = {"all_reduce": "AR", "all_gather_into_tensor": "AG", "reduce_scatter_tensor": "RS"}
    return ", ".join(f"{short.get(k, k)} {v}" for k, v in sorted(calls.items()))


if __name__ == "__main__":
    main()
