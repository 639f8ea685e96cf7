"""Fabric conformance: every Fabric call a user makes, under TPKitStrategy at tp=2 x dp=2,
with sequence parallelism on and off, against a single-process reference (plain torch,
computed in every process from the same seed).

Launched by tests/fabric/test_fabric_conformance.py as ``tpkit-launch --tp 2 --sequence-parallel
fabric_conformance.py OUT DIR`` and as ``python fabric_conformance.py OUT DIR`` (Fabric's
own launcher starts the other three ranks; TPKIT_TP and TPKIT_SEQUENCE_PARALLEL in the
environment). Layout "sp": ``Fabric(strategy="tpkit")`` (the layout from TPKIT_*);
layout "nosp": ``TPKitStrategy(sequence_parallel=False)``. Each check runs on its own
(model weights re-synced from the reference first), so one failing call does not hide
another; rank 0 writes ``{"sp/<check>": {rank: error}}`` (empty when every rank passed)
as JSON to OUT. The model: tpkit.nn layers (vocab-parallel embedding, LayerNorm, fused
gate/up column-parallel, row-parallel) and a plain ``nn.Linear`` head.

With ``CONFORMANCE_EXPERTS=1`` (the tpkit-launch run; one launch, not two) layout "ep"
follows, ``TPKitStrategy(ep=2, etp=1)`` beside tp=2 and SP from TPKIT_*: the same checks on
the same model plus a
``tpkit.nn.MoE`` block (4 experts, 2 per rank, replicated over edp=2) against the
single-process MoE reference of tests/nn/test_moe.py (under fp8: its expert GEMMs' operands
cast to E4M3 at scale 1, as every first-step delayed-scaling GEMM); FSDP is refused with
experts (checked), its other checks are left out there.
"""
import contextlib
import copy
import io
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

import tpkit.fabric  # noqa: F401  (registers "tpkit")
from tpkit.fabric import TPKitPrecision, TPKitStrategy
from tpkit.nn import ColumnParallelLinear, LayerNorm, RowParallelLinear, VocabParallelEmbedding
from tpkit.nn import MoE, mappings

V, H, FF, S, B, STEPS = 32, 16, 32, 8, 4, 5   # vocab, hidden, ffn, sequence, global batch
TOL = dict(rtol=1e-5, atol=1e-6)               # fp32
OUT, DIR = sys.argv[1], sys.argv[2]
STEP_OF = {"backward": 1, "clip_gradients_norm": 2, "clip_gradients_value": 3,
           "no_backward_sync": 4, "accumulate_without_no_backward_sync": 0}   # check: batch
CFG = {"lr": 0.01, "name": "x", "hist": {1: 0.5}, "betas": (0.9, 0.99)}
E, FE = 4, 8                                   # experts, expert ffn (layout "ep")
EXPERTS = dict(ep=2, etp=1)                    # layout "ep"'s sizes beside TPKIT_*'s


def sizes(run) -> dict:
    """The sizes a check's own TPKitStrategy needs for ``run``'s layout (TPKIT_* gives
    tp=2 and SP)."""
    return EXPERTS if run.layout == "ep" else {}


class Ref(nn.Module):
    """The single-process reference."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.norm = nn.Embedding(V, H), nn.LayerNorm(H)
        self.fc1, self.fc2 = nn.Linear(H, 2 * FF), nn.Linear(FF, H)   # fc1: [gate; up]
        self.head = nn.Linear(H, V)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, tokens, linear=F.linear):
        # the plain head too: TPKitPrecision("fp8") replaces plain nn.Linear layers by
        # default, as Lightning's TransformerEnginePrecision(replace_layers=None)
        return linear(self.body(tokens, linear), self.head.weight, self.head.bias)

    def body(self, tokens, linear=F.linear):
        x = self.emb(tokens)
        gate, up = linear(self.norm(x), self.fc1.weight, self.fc1.bias).chunk(2, -1)
        return x + linear(F.silu(gate) * up, self.fc2.weight) + self.fc2.bias


class RefMoE(Ref):
    """The reference with an MoE block after the MLP: every expert whole, in one process
    (tests/nn/test_moe.py's reference: each token's top-2 experts, dropless)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.moe = nn.Module()   # tpkit.nn.MoE's parameter names
        self.moe.router_weight = nn.Parameter(torch.randn(E, H, generator=g))
        self.moe.experts_fc1 = nn.Parameter(torch.randn(E, H, FE, generator=g) / 4)
        self.moe.experts_fc2 = nn.Parameter(torch.randn(E, FE, H, generator=g) / 4)

    def body(self, tokens, linear=F.linear):
        from test_moe import reference
        x = super().body(tokens, linear)
        w = {"router": self.moe.router_weight, "fc1": self.moe.experts_fc1,
             "fc2": self.moe.experts_fc2}
        y = reference(x.reshape(-1, H), w, top_k=2, score_func="softmax", normalize=False,
                      cf=None, aux_coeff=0.0, z_coeff=0.0, act="gelu",
                      q=q8 if linear is fp8_linear else None)[0]
        return x + y.reshape(x.shape)


class Net(nn.Module):
    """The same model of tpkit layers (SP from the layout) and a plain head, which sees the
    whole sequence (gathered forward, split backward): its gradient is complete per rank."""

    def __init__(self):
        super().__init__()
        self.emb = VocabParallelEmbedding(V, H)
        self.norm = LayerNorm(H)
        self.fc1 = ColumnParallelLinear(H, 2 * FF, partition_sizes=(FF, FF))
        self.fc2 = RowParallelLinear(FF, H)
        self.head = nn.Linear(H, V)

    def forward(self, tokens):
        x = self.body(tokens)
        if self.emb.sequence_parallel:
            x = mappings.gather_from_tp_region(x, self.emb.group, dim=0)
        return self.head(x)

    def body(self, tokens):
        x = self.emb(tokens)
        gate, up = self.fc1(self.norm(x)).chunk(2, -1)
        return x + self.fc2(F.silu(gate) * up)


class NetMoE(Net):
    """Net with tpkit.nn.MoE after the MLP (the layout's ep/etp, SP from the layout)."""

    def __init__(self):
        super().__init__()
        self.moe = MoE(H, FE, E, 2)

    def body(self, tokens):
        x = super().body(tokens)
        return x + self.moe(x)


class Counter:
    """A user object Fabric saves through its state_dict()/load_state_dict()."""

    def __init__(self, n):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def shard(name, full, st):
    """This rank's shard of the full tensor ``name``, written out (not tpkit's helper):
    TP shards by ``st.tp_rank``; expert weights: experts [ep_rank*E/ep, ...), then the
    etp_rank-th slice of fc1's columns / fc2's rows."""
    r, tp = st.tp_rank, st.tp_size
    if name.startswith("moe.experts_"):
        n, f = E // st.ep_size, FE // st.etp_size
        return full[st.ep_rank * n:(st.ep_rank + 1) * n].narrow(
            2 if name.endswith("fc1") else 1, st.etp_rank * f, f)
    if name.startswith("emb."):
        return full.chunk(tp, 0)[r]
    if name.startswith("fc1."):
        return torch.cat([seg.chunk(tp, 0)[r] for seg in full.chunk(2, 0)])
    if name == "fc2.weight":
        return full.chunk(tp, 1)[r]
    return full


def expect_error(exc_type, text, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` must raise ``exc_type`` with ``text`` in its message."""
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        assert text in str(e), e
    else:
        raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__}")


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def q8(t):
    return t.to(torch.float8_e4m3fn).float()   # fp8 E4M3 at scale 1 (the first step)


def fp8_linear(x, w, b=None):
    return F.linear(q8(x), q8(w), b)


# --- the run -------------------------------------------------------------------------------
class Run:
    def train_step(self, model, tok, tgt):
        """Forward and backward of this rank's batch; its loss (pp > 1: PPRun's
        pipeline_step)."""
        loss = loss_fn(model(tok), tgt)
        self.fabric.backward(loss)
        return loss.detach()

    def __init__(self, layout, fabric):
        self.layout, self.fabric = layout, fabric
        self.state = fabric.strategy.parallel_state
        self.errors = {}
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, V, (STEPS * B, S), generator=g)
        self.targets = torch.randint(0, V, (STEPS * B, S), generator=g)
        self.Ref, self.Net = {"ep": (RefMoE, NetMoE), "pp": (PPRef, PPNet)}.get(
            layout, (Ref, Net))
        self.ref = self.Ref()

    def check(self, name, fn, *args):
        t0 = time.perf_counter()
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - recorded by name, reported by the test
            tb = traceback.format_exc(limit=-3)
            self.errors[f"{self.layout}/{name}"] = f"{type(e).__name__}: {e}\n{tb}"[-3000:]
        else:
            self.errors.setdefault(f"{self.layout}/{name}", None)
        if os.environ.get("CONFORMANCE_TIMES") and self.state.rank == 0:
            print(f"{self.layout}/{name}: {time.perf_counter() - t0:.2f} s", file=sys.stderr)

    # helpers ---------------------------------------------------------------------------
    def sync(self, net, ref=None):
        """Copy the reference's weights into ``net``'s shards (by hand)."""
        ref = ref or self.ref
        full = ref.state_dict()
        with torch.no_grad():
            for n, p in net.named_parameters():
                p.copy_(shard(n, full[n], self.state))

    def expect(self, net, ref, what="weights", **tol):
        for n, p in net.named_parameters():
            want = dict(ref.named_parameters())[n]
            if what == "grads":
                got, want = p.grad, want.grad
            else:
                got = p.detach()
            torch.testing.assert_close(got, shard(n, want.detach(), self.state),
                                       **(tol or TOL), msg=lambda m: f"{what} {n}: {m}")

    def batch(self, step):
        """This rank's batch of ``step`` (sequence-first) and the global one."""
        b, s = B // self.state.dp_size, slice(step * B, (step + 1) * B)
        rows = [step * B + self.state.dp_rank + self.state.dp_size * j for j in range(b)]
        return ((self.tokens[rows].t(), self.targets[rows].t()),
                (self.tokens[s].t(), self.targets[s].t()))

    def new_model(self, opt_cls=torch.optim.SGD, lr=0.1, ref=None):
        net = self.Net()
        self.sync(net, ref)
        model = self.fabric.setup_module(net)
        return net, model, self.fabric.setup_optimizers(opt_cls(model.parameters(), lr=lr))

    def save_raw(self, obj, name):
        self.files = getattr(self, "files", 0) + 1   # a new file each time: others may still
        path = os.path.join(DIR, f"{self.layout}-{name}-{self.files}.pt")   # read (mmap) the last
        if self.fabric.global_rank == 0:
            torch.save(obj, path)
        self.fabric.barrier()
        return path

    # checks ----------------------------------------------------------------------------
    def setup_and_dataloaders(self):
        f = self.fabric
        net = self.Net()
        self.sync(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        model, opt, sched_back = f.setup(net, opt, scheduler=sched)
        assert sched_back is sched
        assert (f.world_size, f.global_rank, f.is_global_zero) == (
            dist.get_world_size(), self.state.rank, self.state.rank == 0)
        wrapped = model._forward_module
        assert isinstance(wrapped, nn.parallel.DistributedDataParallel), type(wrapped)
        assert wrapped.process_group is self.state.dp_cp_group
        ds = torch.utils.data.TensorDataset(self.tokens, self.targets)
        loader = f.setup_dataloaders(torch.utils.data.DataLoader(ds, batch_size=B // 2))
        sampler = loader.sampler
        assert (sampler.num_replicas, sampler.rank) == (self.state.dp_size, self.state.dp_rank)
        for step, (tok, tgt) in enumerate(loader):
            (want, want_t), _ = self.batch(step)
            assert torch.equal(tok.t(), want) and torch.equal(tgt.t(), want_t), step
        (tok, tgt), (gtok, gtgt) = self.batch(0)
        torch.testing.assert_close(model(tok), self.ref(tok), **TOL)   # forward
        self.model = (net, model, opt)

    def step_check(self, kind):
        """One optimizer step from the reference's weights (a stateless SGD, so that every
        check starts equal): loss, gradients where the user can read them, weights."""
        net, model, opt = self.model
        opt.zero_grad()   # a failed check before this one must not leave gradients behind
        self.sync(net)
        ref = copy.deepcopy(self.ref)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        (tok, tgt), (gtok, gtgt) = self.batch(STEP_OF[kind])
        ref_loss = loss_fn(ref(gtok), gtgt)
        ref_loss.backward()
        if kind in ("no_backward_sync", "accumulate_without_no_backward_sync"):
            for i, (t, y) in enumerate(zip(tok.chunk(2, 1), tgt.chunk(2, 1))):   # 2 micro-
                skip = kind == "no_backward_sync" and i == 0                      # batches
                with self.fabric.no_backward_sync(model, enabled=skip):
                    self.fabric.backward(loss_fn(model(t), y) / 2)
        else:
            loss = self.train_step(model, tok, tgt)
            reported = self.fabric.all_reduce(loss, group=self.state.dp_cp_group)
            torch.testing.assert_close(reported, ref_loss.detach(), **TOL)
        if kind == "clip_gradients_norm":
            big = 1e9   # no clipping: the inf norm (Fabric: norm_type may be 'inf')
            norm_inf = self.fabric.clip_gradients(model, opt, max_norm=big, norm_type="inf")
            ref_inf = torch.nn.utils.clip_grad_norm_(ref.parameters(), big, norm_type="inf")
            torch.testing.assert_close(norm_inf, ref_inf, **TOL)
            norm = self.fabric.clip_gradients(model, opt, max_norm=0.5)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            assert ref_norm > 0.5, "the norm clip must bite"
            torch.testing.assert_close(norm, ref_norm, **TOL)
        elif kind == "clip_gradients_value":
            assert max(p.grad.abs().max() for p in ref.parameters()) > 0.01
            assert self.fabric.clip_gradients(model, opt, clip_val=0.01) is None
            torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
        self.expect(net, ref, "grads")   # complete: SP sums included
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        self.expect(net, ref)

    def clip_nonfinite(self):
        """error_if_nonfinite (default True) raises as torch's clip_grad_norm_ does."""
        net, model, opt = self.model
        opt.zero_grad()
        self.sync(net)
        (tok, tgt), _ = self.batch(0)
        self.fabric.backward(loss_fn(model(tok), tgt))
        with torch.no_grad():
            net.head.bias.grad[0] = float("nan")
        try:
            self.fabric.clip_gradients(model, opt, max_norm=1.0)
        except RuntimeError as e:
            assert "nan" in str(e).lower(), e
        else:
            raise AssertionError("a NaN gradient norm did not raise")
        norm = self.fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
        assert torch.isnan(norm), norm
        opt.zero_grad()

    def collectives(self):
        f, s = self.fabric, self.state
        r, w = float(s.rank), dist.get_world_size()
        assert f.all_reduce(torch.tensor(r)).item() == sum(range(w)) / w            # mean
        assert f.all_reduce(torch.tensor(r), reduce_op="sum").item() == sum(range(w))
        tp_ranks = [s.rank - s.tp_rank + i for i in range(s.tp_size)]   # TP innermost
        tp_sum = f.all_reduce(torch.tensor(r), group=s.tp_group, reduce_op="sum").item()
        assert tp_sum == sum(tp_ranks), (tp_sum, tp_ranks)
        nested = f.all_reduce({"a": torch.tensor([r]), "b": [3.0]}, reduce_op="sum")
        assert nested["a"].item() == sum(range(w)) and nested["b"][0].item() == 3.0 * w
        assert torch.equal(f.all_gather(torch.tensor([r])), torch.arange(float(w)).view(w, 1))
        tp = f.all_gather(torch.tensor(r), group=s.tp_group)
        assert tp.tolist() == [float(x) for x in tp_ranks]
        assert f.all_gather({"x": torch.tensor(r)})["x"].tolist() == [float(i) for i in range(w)]
        x = torch.tensor([r], requires_grad=True)
        f.all_gather(x, sync_grads=True).sum().backward()   # every rank's output uses x once
        assert x.grad.tolist() == [float(w)], x.grad
        assert f.broadcast({"from": s.rank}, src=1) == {"from": 1}
        assert torch.equal(f.broadcast(torch.tensor([r]), src=3), torch.tensor([3.0]))
        f.barrier()
        f.barrier("named")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            f.print("hello", s.rank)
        assert out.getvalue() == ("hello 0\n" if f.local_rank == 0 else ""), out.getvalue()
        with f.rank_zero_first():
            pass
        assert f.to_device(torch.ones(1)).device == f.device
        with f.init_tensor():
            assert torch.empty(1).device == f.device

    def init_module(self):
        with self.fabric.init_module():
            net = self.Net()
        assert all(p.device == self.fabric.device and not p.is_meta for p in net.parameters())

    def init_module_empty(self):
        with self.fabric.init_module(empty_init=True):
            net = self.Net()
        assert net.head.weight.is_meta and not net.emb.weight.is_meta   # plain: meta
        before = {n: p.detach().clone() for n, p in net.named_parameters() if not p.is_meta}
        model = self.fabric.setup_module(net)
        for n, p in net.named_parameters():
            assert not p.is_meta and torch.isfinite(p).all(), n
            if n in before:   # tpkit's layers keep their real weights
                assert torch.equal(p.detach(), before[n]), f"{n} was overwritten"
        self.fabric.load_raw(self.save_raw(self.ref.state_dict(), "ref"), model)
        self.expect(net, self.ref)
        (tok, _), _ = self.batch(0)
        torch.testing.assert_close(model(tok), self.ref(tok), **TOL)

    def load_raw(self):
        raw = self.save_raw(self.ref.state_dict(), "ref")
        net = self.Net()
        model = self.fabric.setup_module(net)
        self.fabric.load_raw(raw, model)
        self.expect(net, self.ref)
        partial = {k: v for k, v in self.ref.state_dict().items() if k != "head.bias"}
        bad = self.save_raw(partial, "partial")
        try:
            self.fabric.load_raw(bad, model)
        except KeyError as e:              # Fabric's strict-loading exception type
            assert "head.bias" in str(e), e
        else:
            raise AssertionError("strict load_raw of a partial state dict did not raise")
        self.fabric.load_raw(bad, model, strict=False)

    def checkpoints(self):
        """Adam on both sides for optimizer state; save; load it every way Fabric offers;
        each resumed copy takes the reference's next step."""
        f = self.fabric
        ref = copy.deepcopy(self.ref)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
        net, model, opt = self.new_model(torch.optim.Adam, lr=0.01)
        (tok, tgt), (gtok, gtgt) = self.batch(0)
        self.train_step(model, tok, tgt)
        loss_fn(ref(gtok), gtgt).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        self.expect(net, ref)
        ckpt = os.path.join(DIR, f"{self.layout}-ckpt")
        f.save(ckpt, {"model": model, "optimizer": opt, "step": 4, "cfg": CFG,
                      "rng": torch.arange(3), "counter": Counter(7)})
        self.saved = (ckpt, copy.deepcopy(ref), copy.deepcopy(ref_opt.state_dict()))
        (tok, tgt), (gtok, gtgt) = self.batch(1)
        loss_fn(ref(gtok), gtgt).backward()
        ref_opt.step()
        self.next_ref = ref   # the reference one step after the save

    def resume_step(self, net, model, opt):
        (tok, tgt), _ = self.batch(1)
        self.train_step(model, tok, tgt)
        opt.step()
        opt.zero_grad()
        self.expect(net, self.next_ref)

    def saved_optimizer_loads(self, osd):
        """A full optimizer state dict must load into torch's Adam over the unsharded model
        and equal the reference's state there."""
        _, ref_at_save, ref_osd = self.saved
        plain = torch.optim.Adam(copy.deepcopy(ref_at_save).parameters(), lr=0.01)
        plain.load_state_dict(osd)
        want = torch.optim.Adam(copy.deepcopy(ref_at_save).parameters(), lr=0.01)
        want.load_state_dict(ref_osd)
        got, want = plain.state_dict(), want.state_dict()
        assert got["param_groups"] == want["param_groups"]
        assert sorted(got["state"]) == sorted(want["state"])
        for i, entry in want["state"].items():
            for k, v in entry.items():
                torch.testing.assert_close(got["state"][i][k], v, **TOL)

    def load_whole(self):
        ckpt, ref_at_save, ref_osd = self.saved
        full = self.fabric.load(ckpt)
        assert sorted(full) == ["cfg", "counter", "model", "optimizer", "rng", "step"], sorted(full)
        assert full["counter"] == {"n": 7}   # an object with state_dict(): its state
        assert full["step"] == 4 and full["cfg"] == CFG, (full["step"], full["cfg"])
        assert torch.equal(full["rng"], torch.arange(3))
        want = ref_at_save.state_dict()
        assert sorted(full["model"]) == sorted(want), sorted(full["model"])
        for k, v in want.items():
            torch.testing.assert_close(full["model"][k], v, **TOL)
        self.saved_optimizer_loads(full["optimizer"])

    def load_remainder(self):
        ckpt, ref_at_save, _ = self.saved
        net = self.Net()
        model = self.fabric.setup_module(net)
        rest = self.fabric.load(ckpt, {"model": model})
        self.expect(net, ref_at_save)
        assert sorted(rest) == ["cfg", "counter", "optimizer", "rng", "step"], sorted(rest)
        assert rest["cfg"] == CFG and rest["step"] == 4, rest["cfg"]
        self.saved_optimizer_loads(rest["optimizer"])

    def load_state(self):
        ckpt, ref_at_save, _ = self.saved
        net, model, opt = self.new_model(torch.optim.Adam, lr=0.01, ref=self.Ref())
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(0.5)   # not the saved weights
        counter = Counter(0)
        state = {"model": model, "optimizer": opt, "step": 0, "cfg": None, "counter": counter}
        rest = self.fabric.load(ckpt, state)
        assert state["step"] == 4 and state["cfg"] == CFG and sorted(rest) == ["rng"], rest
        assert state["counter"] is counter and counter.n == 7   # loaded in place
        self.expect(net, ref_at_save)
        self.resume_step(net, model, opt)

    def strict(self):
        ckpt, _, _ = self.saved
        net = self.Net()
        model = self.fabric.setup_module(net)
        state = {"model": model, "absent": 1}
        try:
            self.fabric.load(ckpt, state)
        except KeyError as e:
            assert "absent" in str(e), e
        else:
            raise AssertionError("strict load of a key the checkpoint lacks did not raise")
        rest = self.fabric.load(ckpt, state, strict=False)
        assert state["absent"] == 1 and "optimizer" in rest

    def refused(self):
        """What README lists as refused, each with its error."""
        ckpt, _, _ = self.saved
        model = self.fabric.setup_module(self.Net())
        expect_error(ValueError, "is not a file", self.fabric.load_raw, ckpt, model)
        expect_error(TypeError, "storage_options", self.fabric.strategy.save_checkpoint,
                     ckpt + "-x", {"model": model}, storage_options={})
        expect_error(ValueError, "only apply with pp > 1", TPKitStrategy, pp=1, microbatches=4)

    def load_raw_optimizer(self):
        _, ref_at_save, ref_osd = self.saved
        net, model, opt = self.new_model(torch.optim.Adam, lr=0.01, ref=ref_at_save)
        self.fabric.load_raw(self.save_raw(ref_osd, "adam"), opt)
        self.resume_step(net, model, opt)

    def load_full_file(self):
        _, ref_at_save, ref_osd = self.saved
        path = self.save_raw({"model": ref_at_save.state_dict(), "optimizer": ref_osd,
                              "step": 4}, "full")
        net, model, opt = self.new_model(torch.optim.Adam, lr=0.01, ref=self.Ref())
        rest = self.fabric.load(path, {"model": model, "optimizer": opt})
        assert rest == {"step": 4}, rest
        assert sorted(self.fabric.load(path)) == ["model", "optimizer", "step"]
        self.resume_step(net, model, opt)

    def save_filter(self):
        net, model, _ = self.new_model()
        path = os.path.join(DIR, f"{self.layout}-filtered")
        self.fabric.save(path, {"model": model, "step": 1},
                         filter={"model": lambda k, v: v.dim() > 0 and not k.startswith("head.")})
        full = self.fabric.load(path)
        assert sorted(full["model"]) == sorted(k for k in self.ref.state_dict()
                                               if not k.startswith("head.")), sorted(full)
        other, model2, _ = self.new_model(ref=self.Ref())
        head = other.head.weight.detach().clone()
        try:
            self.fabric.load(path, {"model": model2})
        except KeyError:
            pass
        else:
            raise AssertionError("strict load of a filtered checkpoint did not raise")
        self.fabric.load(path, {"model": model2}, strict=False)
        assert torch.equal(other.head.weight, head)
        other.head.load_state_dict(self.ref.head.state_dict())
        self.expect(other, self.ref)


def precision_checks(run, sp, precs=("bf16-mixed", "16-mixed", "fp8")):
    """A Fabric per TPKitPrecision over the same (reused) layout: fabric.autocast() and the
    model's forward against the reference under the same autocast."""
    dtypes = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
    tols = {"bf16-mixed": 2e-2, "16-mixed": 5e-3, "fp8": 1e-5}
    for prec in precs:
        def check(prec=prec):
            fabric = Fabric(strategy=TPKitStrategy(sequence_parallel=sp, **sizes(run)),
                            accelerator="cpu",
                            devices=dist.get_world_size(), plugins=[TPKitPrecision(prec)])
            fabric.launch()
            run.fabric, saved = fabric, run.fabric
            try:
                net, model, opt = run.new_model()
                (tok, tgt), (gtok, gtgt) = run.batch(0)
                loss = loss_fn(model(tok), tgt)
                if prec == "fp8":
                    ref_loss = loss_fn(run.ref(gtok, linear=fp8_linear), gtgt)
                else:
                    with fabric.autocast():
                        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == dtypes[prec]
                    with torch.autocast("cpu", dtype=dtypes[prec]):
                        ref_loss = loss_fn(run.ref(gtok), gtgt)
                reported = fabric.all_reduce(loss.detach(), group=run.state.dp_cp_group)
                torch.testing.assert_close(reported, ref_loss.detach().float(),
                                           rtol=tols[prec], atol=1e-6)
                fabric.backward(loss)
                fabric.clip_gradients(model, opt, max_norm=1.0)
                opt.step()
                assert all(torch.isfinite(p).all() for p in net.parameters())
            finally:
                run.fabric = saved
                fabric.strategy.teardown()
        run.check(f"autocast[{prec}]", check)


def fsdp_checks(run, sp):
    fabric = Fabric(strategy=TPKitStrategy(sequence_parallel=sp, data_parallel="fsdp"),
                    accelerator="cpu", devices=dist.get_world_size())
    fabric.launch()
    run.fabric, saved = fabric, run.fabric

    def optimizer_order():
        net = Net()
        early = torch.optim.Adam(net.parameters())
        fabric.setup_module(net)
        expect_error(ValueError, "after the module is sharded", fabric.setup_optimizers, early)
        net2 = Net()
        held = fabric.setup_optimizers(torch.optim.Adam(net2.parameters()))  # noqa: F841
        expect_error(ValueError, "after the module is sharded", fabric.setup_module, net2)

    def load_raw_and_resume():
        _, ref_at_save, ref_osd = run.saved
        model = fabric.setup_module(Net())
        fabric.load_raw(run.save_raw(ref_at_save.state_dict(), "ref-at-save"), model)
        opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
        fabric.load_raw(run.save_raw(ref_osd, "adam"), opt)
        (tok, tgt), _ = run.batch(1)
        fabric.backward(loss_fn(model(tok), tgt))
        opt.step()
        path = os.path.join(DIR, f"{run.layout}-fsdp")
        fabric.save(path, {"model": model})
        full = fabric.load(path)["model"]
        for k, v in run.next_ref.state_dict().items():
            torch.testing.assert_close(full[k], v, **TOL)

    try:
        run.check("fsdp_optimizer_order", optimizer_order)
        run.check("fsdp_load_raw_and_resume", load_raw_and_resume)
    finally:
        run.fabric = saved
        fabric.strategy.teardown()


# --- the pipeline layout: pp=2 x dp=2 (tp=1), a model of two blocks -----------------------
class RefBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc1, self.fc2 = nn.Linear(H, 2 * FF), nn.Linear(FF, H)   # fc1: [gate; up]
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        gate, up = self.fc1(self.norm(x)).chunk(2, -1)
        return x + self.fc2(F.silu(gate) * up)


class PPRef(nn.Module):
    """The single-process reference of the pipelined model (batch-first tokens)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([RefBlock(), RefBlock()])
        self.head = nn.Linear(H, V)

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = LayerNorm(H)
        self.fc1 = ColumnParallelLinear(H, 2 * FF, partition_sizes=(FF, FF))
        self.fc2 = RowParallelLinear(FF, H)

    def forward(self, x):
        gate, up = self.fc1(self.norm(x)).chunk(2, -1)
        return x + self.fc2(F.silu(gate) * up)


class PPNet(nn.Module):
    """The same model of tpkit layers with the pipeline protocol (docs/pipeline.md)."""
    pp_blocks, pp_stem_modules, pp_head_modules = "blocks", ("emb",), ("head",)

    def __init__(self):
        super().__init__()
        self.emb = VocabParallelEmbedding(V, H)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(H, V)

    def pp_stem(self, tokens):               # [b, s] -> [s, b, h]
        return self.emb(tokens.t().contiguous())

    def pp_block(self, block, x):
        return block(x)

    def pp_head(self, x):
        return self.head(x)

    def pp_loss(self, logits, targets):
        return loss_fn(logits, targets.t())


class PPRun(Run):
    """The checks that apply at pp > 1, with ``strategy.pipeline_step`` where pp=1 calls
    ``model(x)`` and ``fabric.backward`` (tp=1: a shard is the whole tensor)."""

    def train_step(self, model, tok, tgt):
        return self.fabric.strategy.pipeline_step(tok, target=tgt)

    def sync(self, net, ref=None):
        full = (ref or self.ref).state_dict()
        with torch.no_grad():
            for n, p in net.named_parameters():
                p.copy_(full[n])

    def expect(self, net, ref, what="weights", **tol):
        want = dict(ref.named_parameters())
        for n, p in net.named_parameters():
            got, w = (p.grad, want[n].grad) if what == "grads" else (p.detach(), want[n])
            torch.testing.assert_close(got, w.detach(), **(tol or TOL),
                                       msg=lambda m: f"{what} {n}: {m}")

    def batch(self, step):
        """This rank's rows of ``step`` (batch-first) and the global batch."""
        b = B // self.state.dp_size
        rows = slice(step * B + self.state.dp_rank * b, step * B + (self.state.dp_rank + 1) * b)
        s = slice(step * B, (step + 1) * B)
        return (self.tokens[rows], self.targets[rows]), (self.tokens[s], self.targets[s])

    def setup_and_dataloaders(self):
        f, st = self.fabric, self.state
        net = PPNet()
        early = torch.optim.SGD(net.parameters(), lr=0.1)
        other = pp_fabric()
        expect_error(ValueError, "optimizer must be created after the module is split",
                     other.setup, net, early)
        other.strategy.teardown()
        net, model, opt = self.new_model()
        mine = {n for n, _ in net.named_parameters()}
        want = {"emb.weight"} | {k for k in self.ref.state_dict() if k.startswith("blocks.0.")}
        if st.pp_rank == 1:
            want = {k for k in self.ref.state_dict() if k not in want}
        assert mine == want, (sorted(mine), sorted(want))   # this stage's parameters only
        expect_error(RuntimeError, "pipeline_step", model, self.tokens[:2])
        ds = torch.utils.data.TensorDataset(self.tokens, self.targets)
        loader = f.setup_dataloaders(torch.utils.data.DataLoader(ds, batch_size=B // 2))
        assert (loader.sampler.num_replicas, loader.sampler.rank) == (st.dp_size, st.dp_rank)
        self.model = (net, model, opt)

    def load_raw(self):
        net, model, opt = self.new_model(ref=self.Ref())
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(0.5)   # not the reference's weights
        self.fabric.load_raw(self.save_raw(self.ref.state_dict(), "ref"), model)
        self.expect(net, self.ref)   # the other stage's keys are not "unexpected"
        bogus = self.save_raw({**self.ref.state_dict(), "bogus": torch.zeros(1)}, "bogus")
        expect_error(KeyError, "bogus", self.fabric.load_raw, bogus, model)   # strict

    def saved_optimizer_loads(self, osd):
        """The per-parameter state of every stage, by name, equals the reference's (at
        pp > 1 the param groups' name lists are the writing rank's stage's: README)."""
        _, ref_at_save, ref_osd = self.saved
        names = [n for n, _ in ref_at_save.named_parameters()]
        assert sorted(osd["state"]) == sorted(names), sorted(osd["state"])
        assert osd["param_groups"][0]["lr"] == 0.01
        for i, entry in ref_osd["state"].items():
            for k, v in entry.items():
                torch.testing.assert_close(osd["state"][names[i]][k], v, **TOL)

    def refused(self):
        """What cannot apply at pp > 1, each with the error docs/integrations.md lists."""
        expect_error(RuntimeError, "pipeline_step needs TPKitStrategy(pp > 1)",
                     TPKitStrategy().pipeline_step, self.tokens[:2], target=self.targets[:2])
        expect_error(ValueError, "TPKitStrategy(pp > 1) pipelines one model",
                     self.fabric.setup_module, PPNet())


PP_CHECKS = ["setup", "pipeline_step", "clip_gradients_norm", "clip_gradients_value",
             "collectives", "save", "load_without_state", "load_remainder", "load_into_state",
             "load_strict", "load_raw_model", "refused"]


def pp_fabric():
    fabric = Fabric(strategy=TPKitStrategy(tp=1, pp=2, sequence_parallel=False,
                                           microbatches=2),
                    accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 4)),
                    plugins=[TPKitPrecision("32-true")])
    fabric.launch()
    return fabric


def pipeline_conformance():
    """pp=2 x dp=2 (1F1B, 2 micro-batches): each Fabric call that applies at pp > 1."""
    fabric = pp_fabric()
    run = PPRun("pp", fabric)
    s = run.state
    assert (s.pp_size, s.dp_size, s.tp_size) == (2, 2, 1), (s.pp_size, s.dp_size)

    def fresh(fn):   # TPKitStrategy(pp > 1) pipelines one model: a Fabric per model
        def check():
            run.fabric = pp_fabric()   # the same layout, reused
            try:
                fn()
            finally:
                run.fabric.strategy.teardown()
                run.fabric = fabric
        return check
    run.check("setup", run.setup_and_dataloaders)
    for kind, name in (("backward", "pipeline_step"), ("clip_gradients_norm",) * 2,
                       ("clip_gradients_value",) * 2):
        run.check(name, run.step_check, kind)
    run.check("collectives", run.collectives)
    run.check("save", fresh(run.checkpoints))
    if run.errors.get("pp/save", "failed") is None:
        for name, fn in (("load_without_state", run.load_whole),
                         ("load_remainder", fresh(run.load_remainder)),
                         ("load_into_state", fresh(run.load_state)),
                         ("load_strict", fresh(run.strict)),
                         ("load_raw_model", fresh(run.load_raw)),
                         ("refused", run.refused)):
            run.check(name, fn)
    fabric.strategy.teardown()
    return run.errors


def fsdp_experts(run):
    """data_parallel="fsdp" with expert weights (refused before issue 54): the expert
    weights become FSDP2 DTensors over the expert-data-parallel ranks, the dense ones over
    dp x cp (tpkit.distributed.fsdp)."""
    from torch.distributed.tensor import DTensor
    from tpkit.layout.param_tags import is_expert
    fabric = Fabric(strategy=TPKitStrategy(data_parallel="fsdp", **EXPERTS),
                    accelerator="cpu",
                    devices=dist.get_world_size())
    fabric.launch()
    try:
        model = fabric.setup_module(run.Net())
        s = fabric.strategy.parallel_state
        meshes = {is_expert(p): p.device_mesh for p in model.parameters()
                  if isinstance(p, DTensor)}
        assert set(meshes) == {True, False}, meshes
        assert meshes[True].size() == s.edp_size and meshes[False].size() == s.dp_cp_size
    finally:
        fabric.strategy.teardown()


def conformance(layout, strategy):
    fabric = Fabric(strategy=strategy, accelerator="cpu",
                    devices=int(os.environ.get("WORLD_SIZE", 4)),
                    plugins=[TPKitPrecision("32-true")])
    fabric.launch()
    run = Run(layout, fabric)
    s = run.state
    assert (s.tp_size, s.dp_size) == (2, 2), (s.tp_size, s.dp_size)
    assert s.sequence_parallel == (layout in ("sp", "ep"))
    assert (s.ep_size, s.etp_size, s.edp_size) == ((2, 1, 2) if layout == "ep" else (1, 2, 2))
    run.check("setup", run.setup_and_dataloaders)
    for kind in STEP_OF:
        run.check(kind, run.step_check, kind)
    for name, fn in (("clip_gradients_nonfinite", run.clip_nonfinite),
                     ("collectives", run.collectives), ("init_module", run.init_module),
                     ("init_module_empty_init", run.init_module_empty),
                     ("load_raw_model", run.load_raw), ("save", run.checkpoints)):
        run.check(name, fn)
    if f"{layout}/save" in run.errors and run.errors[f"{layout}/save"] is None:
        for name, fn in (("load_without_state", run.load_whole),
                         ("load_remainder", run.load_remainder),
                         ("load_into_state", run.load_state), ("load_strict", run.strict),
                         ("load_raw_optimizer", run.load_raw_optimizer),
                         ("refused", run.refused), ("load_full_file", run.load_full_file)):
            run.check(name, fn)
        if layout == "ep":
            run.check("fsdp_experts", fsdp_experts, run)
        else:
            fsdp_checks(run, layout == "sp")
    run.check("save_filter", run.save_filter)
    precision_checks(run, layout in ("sp", "ep"))   # fp8: expert GEMMs too at "ep"
    fabric.strategy.teardown()
    return run.errors


def main():
    errors = conformance("sp", "tpkit")
    errors.update(conformance("nosp", TPKitStrategy(sequence_parallel=False)))
    errors.update(pipeline_conformance())
    if os.environ.get("CONFORMANCE_EXPERTS") == "1":
        errors.update(conformance("ep", TPKitStrategy(**EXPERTS)))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, errors)
    if dist.get_rank() == 0:
        report = {k: {r: e[k] for r, e in enumerate(everyone) if e.get(k)} for k in errors}
        with open(OUT, "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
