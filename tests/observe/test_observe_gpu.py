"""tpkit.observe on a GPU (``python -m pytest -m gpu tests/observe/test_observe_gpu.py``; skipped
without CUDA): MFU is the logged TFLOP/s over Lightning's table's dense peak for this
device, peak memory is torch.cuda's, and a profiled range leaves a CUDA memory snapshot
beside the trace. No Transformer Engine needed."""
import os
import pickle

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs an NVIDIA GPU")]


def test_mfu_memory_and_snapshot_on_cuda(tmp_path):
    from lightning.fabric.utilities.throughput import get_available_flops
    from tpkit.observe import MetricsLogger
    dev = torch.device("cuda", 0)
    model = torch.nn.Linear(1024, 1024, device=dev, dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fpt = 6 * 1024 * 1024
    log = MetricsLogger(str(tmp_path), tokens_per_step=4096, flops_per_token=fpt,
                        total_steps=4, every=2, precision="bf16-mixed", profile_steps="2:3")
    rows = []
    for step in range(4):
        with log.phase("data"):
            x = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16)
        with log.phase("fwd_bwd"):
            model(x).float().square().mean().backward()
        with log.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        rows.append(log.step(step))
    log.close()
    row = rows[-1]
    name = torch.cuda.get_device_name(dev)
    peak = get_available_flops(dev, torch.bfloat16)
    if "H200" in name or "NVL" in name:      # Lightning lists sparse figures there
        assert row["mfu"] == pytest.approx(row["tflops_per_device"] / log.peak)
    else:
        assert peak, f"Lightning's table lacks {name!r}"
        assert row["mfu"] == pytest.approx(row["tflops_per_device"] * 1e12 / peak)
    assert row["tflops_per_device"] == pytest.approx(row["tokens_per_s"] * fpt / 1e12)
    # 4096 x 1024 bf16 input + output + grads: at least 16 MiB at the peak
    assert row["memory_peak_allocated_gib"] > 16 / 1024
    assert row["memory_peak_reserved_gib"] >= row["memory_peak_allocated_gib"]
    snap = os.path.join(tmp_path, "profile", "rank0.memory.pickle")
    with open(snap, "rb") as f:
        assert "segments" in pickle.load(f)
    assert os.path.exists(os.path.join(tmp_path, "profile", "rank0.pt.trace.json"))
