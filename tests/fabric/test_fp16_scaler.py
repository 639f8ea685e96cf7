"""16-mixed loss scaling at tp=2 (issue 48 item 4): with a forced huge initial scale, the
overflowing steps are skipped by every rank together, with gradient clipping on and off,
and the loss curve after the last skipped step equals a run that never overflowed (a fresh
run started at that step with the scale the first run reached; skipped steps change no
parameter and no optimizer state, so the two must agree bitwise).

The model (tests/fabric_helpers.Block) gets rank 1's fc2 columns 64x larger, so rank 1's
fc1 gradients (fp16 under autocast) overflow at scales where rank 0's do not: each rank's
GradScaler alone would skip different steps (Megatron all-reduces found_inf over the
model-parallel group; TPKitPrecision over every rank). Clip on: clipping an inf norm must
not raise (torch's error_if_nonfinite) but let the scaler skip the step.
Planted: without the found_inf all-reduce the ranks' skipped steps differ (and the
replicated weights drift apart); without the clip change the first step raises
"the total gradient norm ... is inf".
"""
from dist import run

STEPS = 14


def _train(clip, init_scale, start=0):
    import torch
    import torch.nn.functional as F

    import torch.distributed as dist
    from lightning.fabric import Fabric

    from fabric_helpers import Block, data, full_model, shard_into
    from tpkit.fabric import TPKitPrecision, TPKitStrategy
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=10 ** 6)
    strategy = TPKitStrategy(tp=2)
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy,
                    plugins=[TPKitPrecision("16-mixed", scaler=scaler)])
    fabric.launch()
    state = strategy.parallel_state
    full = full_model()
    with torch.no_grad():
        full.fc2.weight[:, full.fc2.weight.shape[1] // 2:] *= 64.0   # rank 1's columns
    model = shard_into(Block(state), full, state)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    scales, losses = [], []
    for x, y in data(STEPS)[start:]:
        loss = F.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        if clip:
            fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        losses.append(loss.item())
    head = model.module.head.weight.detach().clone() if hasattr(model, "module") else \
        model.head.weight.detach().clone()
    fabric.strategy.teardown()
    return scales, losses, head


def _worker(clip):
    import torch
    import torch.distributed as dist
    huge = 2.0 ** 17
    scales, losses, head = _train(clip, huge)
    skipped = [s < (scales[i - 1] if i else huge) for i, s in enumerate(scales)]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (skipped, head))
    same_skips = all(s == skipped for s, _ in every)
    same_head = all(torch.equal(h, head) for _, h in every)
    k = len(skipped) - skipped[::-1].index(True) if any(skipped) else 0   # first kept step
    fresh = _train(clip, scales[k - 1], start=k)[1] if 0 < k < STEPS else None
    return skipped, same_skips, same_head, losses[k:], fresh


def test_fp16_overflow_skipped_together_tp2():
    for clip in (True, False):
        for skipped, same_skips, same_head, after, fresh in run(_worker, 2, clip, timeout=300):
            assert same_skips and same_head, (clip, skipped)
            assert 3 <= sum(skipped) < STEPS - 3, skipped      # overflowed, then trained
            assert after == fresh, (clip, after, fresh)
