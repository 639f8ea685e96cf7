"""Bring your own model (issue 35): tpkit.parallelize with the ready plans against the
unparallelized model in one process (the reference: the same full weights, plain torch),
on the multi-rank pool. The launched, Fabric run of the same is test_byom_launch.py."""
import copy

import pytest
import torch

from dist import run

pytestmark = pytest.mark.slow


def _step_matches(kind: str, tp: int, cp: int, sp: bool, kv: int = 2) -> dict:
    """One forward/backward/SGD step of the parallelized model on this rank's share vs the
    reference on the whole batch; returns the largest differences."""
    import torch.distributed as dist
    import tpkit
    from tpkit.checkpoint import full_state_dict
    from tpkit.grads import sync_sequence_parallel_grads
    from byom_models import hf_llama, hf_qwen2, model_loss, nanogpt
    state = tpkit.init_parallel(tp=tp, cp=cp, sequence_parallel=sp)
    ref = {"gpt": nanogpt, "hf": lambda: hf_llama(kv_heads=kv), "qwen2": hf_qwen2}[kind]()
    model = tpkit.parallelize(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (4, 16), generator=g)
    y = torch.randint(0, 64, (4, 16), generator=g)
    rows = slice(state.dp_rank * 4 // state.dp_size, (state.dp_rank + 1) * 4 // state.dp_size)
    ref_loss = model_loss(ref, x, y)
    ref_loss.backward()
    loss = model_loss(model, x[rows], y[rows])
    loss.backward()
    sync_sequence_parallel_grads(model, state)
    for p in model.parameters():     # what DDP over dp x cp does
        if p.grad is not None:
            dist.all_reduce(p.grad, group=state.dp_cp_group)
            p.grad /= state.dp_cp_size
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=state.dp_cp_group)
    mean /= state.dp_cp_size
    for m in (ref, model):
        with torch.no_grad():
            for p in m.parameters():
                p -= 1.0 * p.grad
    full, want = full_state_dict(model, state), ref.state_dict()
    assert sorted(full) == sorted(want), (sorted(full), sorted(want))
    diff = max((full[k] - want[k]).abs().max().item() for k in want)
    return {"loss": abs(mean.item() - ref_loss.item()), "weights": diff,
            "sharded": sum(hasattr(p, "tp_partition_dim") for p in model.parameters())}


@pytest.mark.parametrize("kind", ["gpt", "hf", "qwen2"])
@pytest.mark.parametrize("tp,cp,sp", [(2, 2, True)])   # more layouts: test_byom_launch.py
def test_ready_plan_matches_the_unparallelized_model(kind, tp, cp, sp):
    for r in run(_step_matches, tp * cp, kind, tp, cp, sp):
        assert r["loss"] < 1e-5 and r["weights"] < 1e-5, r
        assert tp == 1 or r["sharded"] > 0, r


def test_gqa_with_fewer_kv_heads_than_tp():
    """tp=4 with 2 kv heads: each rank keeps the kv head its query heads use; the gradient
    of a kv head is the sum over the two ranks sharing it."""
    for r in run(_step_matches, 4, "hf", 4, 1, True, 2):
        assert r["loss"] < 1e-5 and r["weights"] < 1e-5, r


def _fabric_variants() -> dict:
    """The HF ready plan under Fabric with FSDP2 over dp and Hugging Face's own gradient
    checkpointing (recompute), and with TPKitPrecision("fp8"), against the reference."""
    from lightning.fabric import Fabric
    import tpkit
    from tpkit.fabric import TPKitPrecision, TPKitStrategy
    from byom_models import hf_llama, model_loss

    def batches():
        g = torch.Generator().manual_seed(3)
        return [torch.randint(0, 64, (4, 16), generator=g) for _ in range(3)]

    ref = hf_llama()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    want = []
    for x in batches():
        loss = model_loss(ref, x, None, "hf")
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    out = {"ref": want}
    for name, kw, plugins in (("fsdp+recompute", {"data_parallel": "fsdp"}, []),
                              ("fp8", {}, [TPKitPrecision("fp8")])):
        strategy = TPKitStrategy(tp=2, parallelize_fn=tpkit.parallelize, **kw)
        fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy, plugins=plugins)
        fabric.launch()
        state = strategy.parallel_state
        model = hf_llama()
        if name.startswith("fsdp"):
            model.gradient_checkpointing_enable()
        model = fabric.setup_module(model)
        opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
        got = []
        for x in batches():
            rows = x.chunk(state.dp_size)[state.dp_rank]
            loss = model_loss(model, rows, None, "hf")
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            got.append(fabric.all_reduce(loss.detach(), group=state.dp_cp_group).item())
        out[name] = got
        strategy.teardown()
    return out


def test_fsdp_recompute_and_fp8_under_fabric():
    for r in run(_fabric_variants, 4):
        assert max(abs(a - b) for a, b in zip(r["fsdp+recompute"], r["ref"])) < 1e-5, r
        rel = max(abs(a - b) / b for a, b in zip(r["fp8"], r["ref"]))
        assert 0 < rel < 2e-2, r    # emulated fp8 reached the swapped layers, and is close


def _tpkit_llama_gqa(work: str) -> float:
    """tpkit's own Llama (tpkit.models) from a Hugging Face checkpoint with 2 kv heads at
    tp=4 + SP: one SGD step against transformers' model; the stepped weights written back
    with save_hf must be transformers' stepped ones."""
    import os
    import torch.distributed as dist
    import torch.nn.functional as F
    import tpkit
    from safetensors.torch import load_file
    from tpkit.grads import sync_sequence_parallel_grads
    from tpkit.models.hf import from_hf, save_hf
    from byom_models import hf_llama
    state = tpkit.init_parallel(tp=4, sequence_parallel=True)
    hf = hf_llama(kv_heads=2)
    if state.rank == 0:
        hf.save_pretrained(os.path.join(work, "in"))
    dist.barrier()
    model = from_hf(os.path.join(work, "in"), state)
    assert model.layers[0].self_attention.replicated_kv
    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
    ref = F.cross_entropy(hf(input_ids=x).logits.flatten(0, 1), y.flatten())
    ref.backward()
    loss = model(x, y)
    loss.backward()
    sync_sequence_parallel_grads(model, state)
    with torch.no_grad():
        for m in (hf, model):
            for p in m.parameters():
                p -= 1.0 * p.grad
    save_hf(model, os.path.join(work, "out"))
    err = abs(loss.item() - ref.item())
    if state.rank == 0:
        got = load_file(os.path.join(work, "out", "model.safetensors"))
        want = hf.state_dict()
        assert sorted(got) == sorted(k for k in want if k in got) and len(got) >= 20, sorted(got)
        err = max(err, max((got[k] - want[k]).abs().max().item() for k in got))
    return err


def test_tpkit_llama_with_fewer_kv_heads_than_tp(tmp_path):
    for err in run(_tpkit_llama_gqa, 4, str(tmp_path)):
        assert err < 1e-5, err


def _batch_first_layer() -> float:
    """TransformerLayer(attn_input_format="bshd") at tp=2 + SP, cp=2 (GQA, RoPE) against
    the sequence-first layer with the same weights on the transposed input: outputs and
    input gradients agree."""
    import tpkit
    from tpkit.data import shard_position_ids, shard_sequence
    from tpkit.nn import RotaryEmbedding, TransformerLayer
    state = tpkit.init_parallel(tp=2, cp=2, sequence_parallel=True)
    sbhd = TransformerLayer(32, 64, 4, num_gqa_groups=2, normalization="RMSNorm",
                            activation="swiglu")
    bshd = TransformerLayer(32, 64, 4, num_gqa_groups=2, normalization="RMSNorm",
                            activation="swiglu", attn_input_format="bshd")
    bshd.load_state_dict(sbhd.state_dict())
    g = torch.Generator().manual_seed(7)
    full = torch.randn(16, 3, 32, generator=g)                  # [s, b, h]
    mine = shard_sequence(full, 0, state).chunk(2, 0)[state.tp_rank]   # CP shard, SP chunk
    freqs = RotaryEmbedding(8)(shard_position_ids(16, state))
    x1 = mine.clone().requires_grad_()
    x2 = mine.transpose(0, 1).contiguous().requires_grad_()
    y1, y2 = sbhd(x1, rotary_pos_emb=freqs), bshd(x2, rotary_pos_emb=freqs)
    (y1 * torch.arange(y1.numel()).view_as(y1).sin()).sum().backward()
    (y2.transpose(0, 1) * torch.arange(y1.numel()).view_as(y1).sin()).sum().backward()
    return max((y1 - y2.transpose(0, 1)).abs().max().item(),
               (x1.grad - x2.grad.transpose(0, 1)).abs().max().item())


def test_batch_first_transformer_layer():
    for err in run(_batch_first_layer, 4):
        assert err < 1e-5, err


def _group_timeouts() -> list:
    import torch.distributed as dist
    import tpkit

    def seconds(g):
        return g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    state = tpkit.init_parallel(tp=2, cp=2, ep=2, etp=1)
    return [seconds(dist.group.WORLD)] + sorted({seconds(g) for g in
                                                 state.all_groups().values() if g is not None})


def test_every_layout_group_times_out_like_the_default_group():
    """torch gives new groups 30 minutes whatever the default group's timeout: a collective
    some ranks never enter (fabric.clip_gradients on rank 0 only) hung that long."""
    for default, *groups in run(_group_timeouts, 4):
        assert groups == [default], (default, groups)


def _export_roads(work: str) -> dict:
    """Issue 51, one export road for every model tpkit trains: a Hugging Face Llama set up
    by Fabric at tp=2 x dp=2 through ``partial(tpkit.parallelize, plan=...)`` (DDP) and
    through tpkit.parallelize with FSDP2: ``full_state_dict`` of the Fabric-wrapped model
    (full shapes, the original values) and ``hf.save_hf`` of it. Then torch's own DTensor
    TP as parallelize_fn: refused at setup_module (a ValueError, no false warning)."""
    import functools
    import warnings

    from lightning.fabric import Fabric
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import tpkit
    from byom_models import hf_llama
    from tpkit.checkpoint import full_state_dict
    from tpkit.fabric import TPKitStrategy
    from tpkit.models import hf
    from tpkit.plans import ready_plan
    ref = hf_llama().state_dict()
    out = {}
    for name, kw in (("partial+ddp", {}), ("fsdp", {"data_parallel": "fsdp"})):
        fn = functools.partial(tpkit.parallelize, plan=ready_plan(hf_llama())) \
            if name == "partial+ddp" else tpkit.parallelize
        strategy = TPKitStrategy(tp=2, parallelize_fn=fn, **kw)
        fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
        fabric.launch()
        model = fabric.setup_module(hf_llama())
        full = full_state_dict(model)
        out[name] = {k: (tuple(v.shape), float((v - ref[k]).abs().max()) if k in ref else -1)
                     for k, v in full.items()}
        hf.save_hf(model, f"{work}/{name}")
        strategy.teardown()

    def torch_tp(module, state):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
        return parallelize_module(module, mesh, {"lm_head": ColwiseParallel()})

    strategy = TPKitStrategy(tp=2, parallelize_fn=torch_tp)
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fabric.setup_module(hf_llama())
            out["torch-tp"] = "SET UP"
        except ValueError as e:
            out["torch-tp"] = str(e)
    out["warnings"] = [str(w.message) for w in caught if "TP-sharded" in str(w.message)]
    strategy.teardown()
    return out


def test_export_roads_and_parallelize_fns_under_fabric(tmp_path):
    from transformers import LlamaForCausalLM

    from byom_models import hf_llama
    ref = hf_llama().state_dict()
    want = {k: tuple(v.shape) for k, v in ref.items()}
    for r in run(_export_roads, 4, str(tmp_path)):
        for name in ("partial+ddp", "fsdp"):
            assert {k: s for k, (s, _) in r[name].items()} == want, (name, r[name])
            assert max(d for _, d in r[name].values()) == 0.0, (name, r[name])
        assert "DTensors after parallelize_fn" in r["torch-tp"], r["torch-tp"]
        assert r["warnings"] == [], r["warnings"]
    for name in ("partial+ddp", "fsdp"):
        saved = LlamaForCausalLM.from_pretrained(str(tmp_path / name)).state_dict()
        assert saved.keys() == ref.keys()
        assert all(torch.equal(saved[k], ref[k]) for k in ref), name
