"""tpkit.recompute.checkpoint: bitwise-equal gradients with RNG restore (tp 1, 2, 4, with
and without sequence parallelism) through tpkit.nn layers, distributed saved activations
(sizes not divisible by tp), measured saved bytes."""
import pytest
import torch

from dist import run

HIDDEN, FFN, SHAPE = 7, 8, (3, 5, 7)  # 105 elements: divisible by neither 2 nor 4
SP_SHAPE = (4, 3, 7)  # sequence parallel: [4/tp, 3, 7] per rank; 21 elements at tp=4
LAYOUTS = ((1, False), (2, False), (4, False), (2, True), (4, True))


class _ForgetfulTracker:
    """The real tracker, except that get/set_states do nothing: the recompute then draws
    other dropout masks. The negative control showing the comparison can fail."""

    def __init__(self, tracker):
        self.tracker = tracker

    def fork(self, *a, **k):
        return self.tracker.fork(*a, **k)

    def get_states(self):
        return {}

    def set_states(self, states):
        pass


def _run_mode(block, x0, mode, rng0):
    import torch.nn.functional as F  # noqa: F401
    from torch.autograd.graph import saved_tensors_hooks
    from tpkit.layout.random import get_rng_tracker
    from tpkit.recompute import checkpoint

    cpu0, tracker0 = rng0
    torch.set_rng_state(cpu0)
    get_rng_tracker().set_states(tracker0)
    block.zero_grad(set_to_none=True)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    grads, nbytes = [], []
    for _ in range(2):  # two steps: the RNG must also continue identically
        x = x0.clone().requires_grad_()
        saved.clear()
        with saved_tensors_hooks(pack, lambda t: t):
            if mode == "plain":
                y = block(x)
            elif mode == "ckpt":
                y = checkpoint(block, x)
            elif mode == "ckpt_dist":
                y = checkpoint(block, x, distribute_saved_activations=True)
            elif mode == "ckpt_nonreentrant":
                y = checkpoint(block, x, use_reentrant=False)
            elif mode == "ckpt_forgetful":
                tr = _ForgetfulTracker(get_rng_tracker())
                y = checkpoint(block, x, get_rng_state_tracker=lambda: tr)
        nbytes.append(sum(saved))
        (y * torch.arange(y.numel()).view_as(y).float().cos()).sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in block.parameters()])
    return grads, nbytes[0], torch.get_rng_state(), get_rng_tracker().get_states()


def _recompute_worker(layouts):
    import tpkit
    from tpkit.layout.random import get_rng_tracker
    from tpblock import TPBlock
    out = {}
    for tp, sp in layouts:
        state = tpkit.init_parallel(tp=tp, sequence_parallel=sp, seed=11)
        block = TPBlock(HIDDEN, FFN, state, sequence_parallel=sp)
        x0 = torch.randn(SP_SHAPE if sp else SHAPE, generator=torch.Generator().manual_seed(3))
        if sp:  # this rank's sequence shard [s/tp, b, h]
            x0 = x0.chunk(tp)[state.tp_rank].clone()
        rng0 = (torch.get_rng_state(), get_rng_tracker().get_states())
        modes = ["plain", "ckpt", "ckpt_dist", "ckpt_nonreentrant", "ckpt_forgetful"]
        if sp:  # the input is already sharded: distributing it is refused
            modes.remove("ckpt_dist")
            try:
                _run_mode(block, x0, "ckpt_dist", rng0)
            except ValueError as e:
                assert "sequence_parallel" in str(e)
            else:
                raise AssertionError("distribute_saved_activations under SP was accepted")
        res = {m: _run_mode(block, x0, m, rng0) for m in modes}
        out[(tp, sp)] = res
        tpkit.destroy_parallel()
    return out


def _equal(a, b):
    return all(torch.equal(u, v) for u, v in zip(a, b)) and len(a) == len(b)


def test_checkpoint_bitwise_grads_and_saved_bytes():
    results = run(_recompute_worker, 4, LAYOUTS)
    for rank, out in enumerate(results):
        for (tp, sp), res in out.items():
            numel = 4 // tp * 3 * 7 if sp else 3 * 5 * 7
            ref_grads, ref_bytes, ref_cpu, ref_tracker = res["plain"]
            for mode in ("ckpt", "ckpt_nonreentrant") + (() if sp else ("ckpt_dist",)):
                grads, _, cpu, tracker = res[mode]
                for step in range(2):
                    assert _equal(grads[step], ref_grads[step]), (rank, tp, sp, mode, step)
                assert torch.equal(cpu, ref_cpu), (rank, tp, sp, mode)
                assert _equal(list(tracker.values()), list(ref_tracker.values()))
            # negative control: without restoring the tracker the forked dropout differs
            bad = res["ckpt_forgetful"][0][0]
            assert not _equal(bad, ref_grads[0]), (rank, tp)
            # saved bytes: the whole input, or this rank's padded 1/tp slice of it
            assert res["ckpt"][1] == numel * 4
            if not sp:
                assert res["ckpt_dist"][1] == -(-numel // tp) * 4
            assert ref_bytes > res["ckpt"][1]  # the plain forward keeps more
    # the forked dropout really differs across TP ranks (tp=2: ranks 0, 1)
    g0, g1 = results[0][(2, False)]["plain"][0][0], results[1][(2, False)]["plain"][0][0]
    assert not torch.equal(g0[1], g1[1])


def test_checkpoint_single_process_options():
    """Errors, kwargs pass-through, non-tensor arguments, default tracker."""
    from tpkit.recompute import checkpoint

    def f(a, scale, b=None):
        return torch.nn.functional.dropout(a * scale + b, 0.5)

    a = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(4, 3)
    torch.manual_seed(5)
    ref = f(a, 2.0, b=b)
    ref.sum().backward()
    ga = a.grad.clone()
    a.grad = None
    torch.manual_seed(5)
    out = checkpoint(f, a, 2.0, b=b)
    assert torch.equal(out, ref)
    out.sum().backward()
    assert torch.equal(a.grad, ga)
    with pytest.raises(ValueError, match="use_reentrant=True"):
        checkpoint(f, a, 2.0, b=b, use_reentrant=False, distribute_saved_activations=True)
    with pytest.raises(TypeError, match="callable"):
        checkpoint(f, a, 2.0, b=b, get_rng_state_tracker=object())
    out = checkpoint(lambda t: t.detach() * 2, a)
    with pytest.raises(RuntimeError, match="requires grad"):
        out.sum().backward()


@pytest.mark.parametrize("reentrant", [True, False])
def test_context_fn_entered_in_forward_and_recompute(reentrant):
    import contextlib
    from tpkit.recompute import checkpoint
    seen = []

    def ctx(tag):
        @contextlib.contextmanager
        def c():
            seen.append(tag)
            yield
        return c()

    a = torch.randn(3, requires_grad=True)
    out = checkpoint(lambda t: t.sin() * 2, a, use_reentrant=reentrant,
                     context_fn=lambda: (ctx("forward"), ctx("recompute")))
    assert seen == ["forward"]
    out.sum().backward()
    assert seen == ["forward", "recompute"]
    assert torch.allclose(a.grad, 2 * a.detach().cos())


def test_te_hook_defaults_to_false():
    from tpkit.te import holds_te_modules
    assert holds_te_modules(torch.nn.Linear(2, 2)) is False
