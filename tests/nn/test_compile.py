"""tpkit.compile_blocks / tpkit-train --compile (issue 41): each transformer block under
torch.compile(fullgraph=True), no graph break, the eager numbers.

What each test proves:
- test_compiled_blocks_match_eager (pool, 2 ranks, backend aot_eager: dynamo and
  AOTAutograd trace the whole block, no code generation, so the op order is eager's):
  the paths the launched test does not take, TP without SP (the TP sums, traced as
  functional all-reduces instead of the shm transport), CP all_gather and a2a+p2p (cp=4),
  are one graph each and give the eager block's output and every gradient bitwise;
- test_compile_refusals (pool): the combinations not compiled yet are ValueErrors naming
  them (dropout, CP p2p on the reference kernels, fp8_autocast with compiled blocks);
- test_launched_compile_train (tpkit-launch, 2 ranks, the user's road): tpkit-train
  --compile at ep=2 (inductor: C++ code generated on this CPU; the eager loss curve
  within 1e-4 relative for 20 steps; ep=2 because inductor, unlike aot_eager, needs MoE's
  unbacked counts declared sizes), (2,1,1)+SP, (1,2,1) p2p and a2a (with recompute) and
  pp=2 (aot_eager: the eager curve bitwise; a cold inductor compile of (2,1,1)+SP cost
  the suite 30-45 CPU-seconds): zero graph breaks
  (tests/launch_scripts/compile_train.py). Planted: a torch._dynamo.graph_break() in
  TransformerLayer.forward fails it (and the pool test); a 1 % error in the compiled
  ring's backward fails it at cp2-p2p; without moe._size_hints inductor fails to lower
  ep2's slices (GuardOnDataDependentSymNode).
On a GPU: tests/test_gpu.py::test_compiled_block_matches_eager_on_gpu (-m gpu).
"""
import copy
import os
import re

import pytest
import torch

from dist import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
S, B, H = 16, 2, 32


def _block(st, **kw):
    from tpkit.nn import TransformerLayer
    torch.manual_seed(0)
    return TransformerLayer(H, 2 * H, 4, num_gqa_groups=2, normalization="RMSNorm",
                            bias=False, state=st, **kw)


def _rank_match(tp, cp, comm, **extra):
    import tpkit
    from torch._dynamo.utils import counters
    st = tpkit.init_parallel(tp=tp, cp=cp, cp_comm_type=comm, **extra)
    st.last_sharded_len = S   # the inputs below are this rank's CP shard
    torch._dynamo.reset()
    counters.clear()
    eager = _block(st)
    compiled = tpkit.compile_blocks(copy.deepcopy(eager), backend="aot_eager")
    torch.manual_seed(1 + st.rank)
    x = torch.randn(S // cp, B, H)
    g = torch.randn(S // cp, B, H)
    outs = []
    for m in (eager, compiled):
        xi = x.clone().requires_grad_()
        y = m(xi)
        (y * g).sum().backward()
        outs.append([y.detach(), xi.grad] + [p.grad for p in m.parameters()])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    for a, b in zip(*outs):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("tp,cp,comm", [(2, 1, "p2p"), (1, 2, "all_gather")],
                         ids=["tp2-nosp", "cp2-all_gather"])
def test_compiled_blocks_match_eager(tp, cp, comm):
    run(_rank_match, 2, tp, cp, comm, timeout=300)


def test_compiled_a2a_p2p_matches_eager():
    """cp=4 as a2a (2) x p2p (2): the ring custom op inside the a2a's all-to-alls."""
    run(_rank_match, 4, 1, 4, "a2a+p2p", cp_a2a_size=2, timeout=300)


def _raises(fn, *words):
    try:
        fn()
    except ValueError as e:
        for w in words:
            assert w in str(e), (w, str(e))
        return
    raise AssertionError(f"no ValueError naming {words}")


def _rank_refusals():
    import tpkit
    from tpkit.fp8 import fp8_autocast
    from tpkit.nn import compile_blocks
    st = tpkit.init_parallel(cp=2, cp_comm_type="p2p")
    _raises(lambda: compile_blocks(_block(st, hidden_dropout=0.1)), "block 0", "dropout 0.1")
    _raises(lambda: compile_blocks(_block(st, attention_dropout=0.2)), "dropout 0.2")
    os.environ["TPKIT_FUSED_ATTN"] = "0"
    try:
        _raises(lambda: compile_blocks(_block(st)), "cp_comm_type='p2p'", "TPKIT_FUSED_ATTN")
    finally:
        del os.environ["TPKIT_FUSED_ATTN"]
    kept = compile_blocks(_block(st), backend="aot_eager")
    _raises(lambda: fp8_autocast(recipe="current").__enter__(), "compile_blocks", "fp8")
    _raises(lambda: fp8_autocast(False, "delayed", calibrating=True).__enter__(),
            "compile_blocks")
    del kept
    import gc
    gc.collect()
    with fp8_autocast(recipe="current"):   # no compiled block left: fp8 runs again
        pass


def test_compile_refusals():
    run(_rank_refusals, 2)


@pytest.mark.slow
def test_launched_compile_train():
    """tests/launch_scripts/compile_train.py under tpkit-launch on 2 gloo ranks, one launch
    for the five layouts. Inductor's cache is its default one (TORCHINDUCTOR_CACHE_DIR
    unset: /tmp/torchinductor_<user>), shared by every run, so the C++ compile is paid
    once per machine (about 60 s here), not once per suite."""
    from test_userpath import LAUNCH, finish, start
    script = os.path.join(ROOT, "tests", "launch_scripts", "compile_train.py")
    rc, out, err = finish(start([*LAUNCH, "--nproc-per-node", "2", script, "aot_eager",
                                 "ep2"]), timeout=600)
    assert rc == 0, f"exit {rc}\n{out[-3000:]}\n{err[-5000:]}"
    names = ("tp2-sp", "cp2-p2p", "cp2-a2a", "pp2", "ep2")
    assert sorted(re.findall(r"rank (\d) (\S+) OK", out)) == \
        sorted((str(r), n) for r in range(2) for n in names), out
