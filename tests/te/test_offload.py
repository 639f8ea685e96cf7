"""Activation offload (tpkit.te.offload, TE's get_cpu_offload_context): gradients bitwise those
without offload; the bytes kept on the compute device between forward and backward go
down by what was offloaded, measured by a tensor-bytes tracker that knows nothing of
tpkit (tests/memcount.py's storages, each classified when measured: private memory is
the compute device's, shared memory the host pool); the trainer's
``training.cpu_offload_layers`` gives the same curve bitwise."""
import gc
import warnings
import weakref

import pytest
import torch

from memcount import LiveBytes
from tpkit.te.offload import get_cpu_offload_context

T, H, F, LAYERS, OFFLOADED = 6, 8, 24, 4, 2


class PoolBytes(LiveBytes):
    """LiveBytes that also keeps a weak reference to every storage, so that the live ones
    can be split when measured: shared memory (the host pool on CPU) or private."""

    def __init__(self):
        super().__init__()
        self.refs = {}

    def _add(self, st):
        if st.device.type != "meta" and st._cdata not in self.live:
            try:
                self.refs[st._cdata] = weakref.ref(st)
            except TypeError:
                pass
        super()._add(st)

    def split(self):
        gc.collect()
        private = shared = 0
        for key, n in self.live.items():
            st = self.refs.get(key, lambda: None)()
            if st is not None and st.is_shared():
                shared += st.nbytes()
            else:
                private += n
        return private, shared


def _stack():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(H, F), torch.nn.GELU(), torch.nn.Linear(F, H))
            for _ in range(LAYERS) if g is not None]


def _forward(layers, offload: bool):
    ctx, sync = get_cpu_offload_context(offload, OFFLOADED, LAYERS, offload_weights=False)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))   # held by autograd only
    for layer in layers:
        with ctx:
            x = layer(x)
        x = sync(x)
    return x.square().sum(), ctx


def test_gradients_bitwise_and_device_bytes_go_down_by_the_offloaded_ones():
    torch.manual_seed(0)
    layers = _stack()
    grads, kept = {}, {}
    for offload in (False, True):
        for p in (p for m in layers for p in m.parameters()):
            p.grad = None
        with PoolBytes() as mem:
            loss, ctx = _forward(layers, offload)
            kept[offload] = mem.split()                # between forward and backward
            loss.backward()
        grads[offload] = [p.grad.clone() for m in layers for p in m.parameters()]
        del loss
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    # what each offloaded block saves, counted by hand: its input [T, H] (fc1), fc1's
    # output [T, F] (GELU) and GELU's output [T, F] (fc2), float32; weights stay
    want = OFFLOADED * (T * H + 2 * T * F) * 4
    (priv0, shared0), (priv1, shared1) = kept[False], kept[True]
    assert shared0 == 0 and ctx.handler.offloaded_bytes == want
    assert shared1 == want                  # in the host pool
    assert priv0 - priv1 == want            # and no longer on the compute device


def test_views_of_one_storage_come_back_as_views_of_one_storage():
    w = torch.randn(4, 6, requires_grad=True)
    ctx, sync = get_cpu_offload_context(True, 1, 2, offload_weights=False)
    with ctx:
        h = (w * 2).view(6, 4)
        y = h[:3] * h[3:]                   # two views of h's storage saved
    y = sync(y)
    z = sync(y.sin()).sum()
    assert ctx.handler.offloaded_bytes == 4 * 6 * 4   # h's storage once
    z.backward()
    w2 = w.detach().clone().requires_grad_()
    h2 = (w2 * 2).view(6, 4)
    (h2[:3] * h2[3:]).sin().sum().backward()
    assert torch.equal(w.grad, w2.grad)


@pytest.mark.parametrize("kwargs,words", [
    (dict(enabled=True, num_layers=2, model_layers=2), "at most model_layers - 1 = 1"),
    (dict(enabled=True, num_layers=1, model_layers=True), "older positional order"),
    (dict(enabled=True, offload_activations=False, offload_weights=False), "offloads nothing"),
])
def test_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words):
        get_cpu_offload_context(**kwargs)


def test_in_place_changes_of_saved_tensors_are_refused_as_autograd_does():
    for layer in (0, 1):              # offloaded (checked at the synchronizer), kept
        ctx, sync = get_cpu_offload_context(True, 1, 2, offload_weights=False)
        a = torch.ones(3, requires_grad=True)
        h = a
        for i in range(2):
            with ctx:
                b = h * 2
                h = b.sin()                   # sin saves b
            if i == layer:
                b.add_(1)
                if layer == 0:
                    with pytest.raises(RuntimeError, match="in-place operation before its"):
                        sync(h)
                    break
            h = sync(h)
        else:
            with pytest.raises(RuntimeError, match="in-place operation before the backward"):
                h.sum().backward()


def test_more_layers_than_declared_and_disabled_is_identity():
    ctx, sync = get_cpu_offload_context(True, 1, 2, offload_weights=False)
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match="model_layers=2"):
        for _ in range(3):
            with ctx:
                x = sync(x * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctx, sync = get_cpu_offload_context(False, offload_weights=False)
    y = torch.ones(2)
    assert sync(y) is y
    with pytest.warns(DeprecationWarning, match="offload_weights"):
        get_cpu_offload_context(True, 1, 2, offload_weights=True)   # no effect, as TE


def _train(extra):
    from tpkit.train import main
    return main(["--steps", "3", "--hidden", "32", "--layers", "3", "--heads", "4",
                 "--gqa-groups", "2", "--ffn", "64", "--seq-len", "16", "--global-batch", "2",
                 "--log-every", "100"] + extra)


def test_trainer_cpu_offload_layers_gives_the_same_curve_bitwise():
    """The user's road: tpkit-train's main with --cpu-offload-layers (one process)."""
    from dist import run
    (ref,) = run(_train, 1, [])
    (got,) = run(_train, 1, ["--cpu-offload-layers", "2"])
    assert got == ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (python -m pytest -m gpu)")
def test_gpu_offload_lowers_max_memory_allocated_and_keeps_gradients():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                  torch.nn.Linear(4096, 1024)).to(dev) for _ in range(6)]
    peak, grads = {}, {}
    for offload in (False, True):
        for p in (p for m in layers for p in m.parameters()):
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ctx, sync = get_cpu_offload_context(offload, 4, 6, offload_weights=False)
        x = torch.randn(8192, 1024, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
        for layer in layers:
            with ctx:
                x = layer(x)
            x = sync(x)
        loss = x.float().square().mean()
        torch.cuda.synchronize()
        peak[offload] = torch.cuda.max_memory_allocated() - base
        loss.backward()
        torch.cuda.synchronize()
        grads[offload] = [p.grad.clone() for m in layers for p in m.parameters()]
        del x, loss
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    per_layer = 8192 * (1024 + 2 * 4096) * 4
    # four of six layers offloaded: at least two layers' worth less at the forward's peak
    assert peak[True] <= peak[False] - 2 * per_layer, (peak, per_layer)


def _offload_fp8_weights():
    import tpkit
    import tpkit.te_api as te
    from tpkit import fp8
    tpkit.init_parallel()
    torch.manual_seed(0)
    with fp8.fp8_model_init():
        layers = [te.Linear(H, H, bias=False) for _ in range(3)]
    out = []
    for offload in (False, True):
        ctx, sync = get_cpu_offload_context(offload, 2, 3, offload_weights=False)
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
        h = x
        with fp8.fp8_autocast(recipe="current"):
            for layer in layers:
                with ctx:
                    h = layer(h)
                h = sync(h)
        h.square().sum().backward()
        out.append([x.grad] + [m.weight.grad for m in layers])
        for m in layers:
            m.weight.grad = None
    same = all(torch.equal(a, b) for a, b in zip(*out))
    # the fp8 GEMM saves its input's codes (T x H bytes) and 1/scale (float32) per
    # offloaded layer, and the weight's codes and scale_inv, which stay (mark_not_offload:
    # the module holds them)
    return same, ctx.handler.offloaded_bytes, 2 * (T * H + 4)


def test_fp8_weights_under_fp8_autocast_offload_only_activations():
    from dist import run
    ((same, got, want),) = run(_offload_fp8_weights, 1)
    assert same and got == want, (got, want)
