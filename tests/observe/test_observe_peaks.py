"""The MFU denominator of every precision a job can run in (issue 52), on the GPUs tpkit's
tables name, against NVIDIA's datasheets written here (dense tensor-core figures: the
"with sparsity" ones halved), not against tpkit's table or Lightning's:

- ``MetricsLogger(precision=...)`` for each of the trainer's ``--precision`` choices
  (read from tpkit.train.config, so a new one is checked too) and the plain names: the
  peak ``mfu`` divides by is the compute dtype's dense peak, for fp8 runs the *bf16*
  one, with ``mfu_fp8`` against the fp8 peak (docs/observe.md); no ``mfu_fp8`` otherwise;
- a logged row's ``mfu`` / ``mfu_fp8`` are the row's TFLOP/s per device over those.

The device is a CUDA device by name (``torch.cuda.get_device_name`` patched): no GPU
needed, and nothing of the logger's own lookup is bypassed."""
import io

import pytest
import torch

# NVIDIA datasheets, TFLOP/s: (bf16 = fp16 dense, fp8 dense, fp32)
DATASHEET = {
    "NVIDIA H100 80GB HBM3": (1979 / 2, 3958 / 2, 67.0),      # H100 SXM5
    "NVIDIA H100 PCIe": (1513 / 2, 3026 / 2, 51.0),
    "NVIDIA H100 NVL": (1671 / 2, 3341 / 2, 60.0),
    "NVIDIA H200": (1979 / 2, 3958 / 2, 67.0),                 # H200 SXM
    "NVIDIA H200 NVL": (1671 / 2, 3341 / 2, 60.0),
}
REL = 7e-4      # tensor-core figures: halves of 4-digit datasheet numbers (Lightning: 756)
REL_FP32 = 0.01  # fp32: Lightning's 51.2 for the PCIe's 51


def _modes():
    from tpkit.train.config import PRECISIONS
    return list(PRECISIONS) + ["bf16", "fp16", "fp8", "fp32", "bf16-true", "16-true",
                               torch.bfloat16, torch.float16, torch.float32]


def _expected(name, mode):
    """(the peak mfu divides by, the fp8 peak or None) from the datasheet."""
    bf16, fp8, fp32 = DATASHEET[name]
    low = {"32-true": "fp32", "fp32": "fp32", torch.float32: "fp32"}.get(mode, "half")
    if mode == "fp8":
        return bf16, fp8
    return (fp32 if low == "fp32" else bf16), None


def _logger(monkeypatch, name, mode, **kw):
    from tpkit.observe import MetricsLogger
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: name)
    # a Hopper's compute capability (Lightning asks it for fp32: TF32 or not; torch's
    # default matmul precision "highest" means plain fp32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    return MetricsLogger(None, tokens_per_step=1024, flops_per_token=6e9, every=1,
                         device="cuda:0", precision=mode, synchronize=False, progress=False,
                         **kw)


@pytest.mark.parametrize("name", list(DATASHEET))
@pytest.mark.parametrize("mode", _modes(), ids=str)
def test_the_peak_of_every_precision_is_the_datasheets(monkeypatch, name, mode):
    log = _logger(monkeypatch, name, mode)
    peak, fp8 = _expected(name, mode)
    rel = REL_FP32 if peak == DATASHEET[name][2] else REL
    assert log.peak == pytest.approx(peak, rel=rel), (name, mode, log.peak, peak)
    if fp8 is None:
        assert log.peak_fp8 is None, (name, mode, log.peak_fp8)
    else:
        assert log.peak_fp8 == pytest.approx(fp8, rel=REL), (name, mode, log.peak_fp8)


@pytest.mark.parametrize("mode", ["fp8", "bf16-mixed", "32-true", "16-mixed"])
def test_a_rows_mfu_is_its_tflops_over_the_peak(monkeypatch, mode):
    """One window on a named H100: mfu (and mfu_fp8 for fp8) by hand from the row's own
    tokens/s, the flops per token and the datasheet; the measured memory of a CUDA device
    is stubbed (no GPU here)."""
    from tpkit.observe import metrics
    monkeypatch.setattr(metrics, "measured_memory", lambda device: {"memory_rss_gib": 1.0})
    name = "NVIDIA H100 80GB HBM3"
    log = _logger(monkeypatch, name, mode)
    row = log.step(0, loss=1.0)
    log.close()
    peak, fp8 = _expected(name, mode)
    tflops = row["tokens_per_s"] * 6e9 / 1e12
    assert row["tflops_per_device"] == pytest.approx(tflops)
    assert row["mfu"] == pytest.approx(tflops / peak, rel=REL_FP32 if mode == "32-true"
                                       else REL)
    if fp8 is None:
        assert "mfu_fp8" not in row
    else:
        assert row["mfu_fp8"] == pytest.approx(tflops / fp8, rel=REL)
        assert row["mfu_fp8"] == pytest.approx(row["mfu"] / 2, rel=REL)   # fp8 runs twice as fast


def test_overridden_peaks_win_and_an_unknown_gpu_warns(monkeypatch):
    log = _logger(monkeypatch, "NVIDIA H100 80GB HBM3", "fp8", peak_tflops=100.0,
                  peak_tflops_fp8=300.0)
    assert (log.peak, log.peak_fp8) == (100.0, 300.0)
    log = _logger(monkeypatch, "NVIDIA H100 80GB HBM3", "fp8", peak_tflops=100.0)
    assert log.peak == 100.0 and log.peak_fp8 == pytest.approx(3958 / 2, rel=REL)
    with pytest.warns(UserWarning, match="no dense bf16 peak is known for 'Acme X1'"):
        log = _logger(monkeypatch, "Acme X1", "fp8")
    assert log.peak is None and log.peak_fp8 is None
    cpu = __import__("tpkit.observe", fromlist=["MetricsLogger"]).MetricsLogger(
        None, tokens_per_step=8, device="cpu", precision="fp8", progress=False)
    assert cpu.peak is None and cpu.peak_fp8 is None


def test_fp32_by_name_is_the_dense_rate_whatever_the_matmul_precision():
    """The lookup by name means plain fp32 (flops.peak_tflops' doc), also with TF32 on."""
    from tpkit.observe import peak_tflops
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32") == pytest.approx(67.0, rel=REL_FP32)
        assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == pytest.approx(19.5)
    finally:
        torch.set_float32_matmul_precision(before)


def test_no_peak_off_cuda_and_the_size_checks():
    from tpkit.observe import peak_tflops, tflops_per_device, transformer_flops_per_token
    for dev in ("cpu", torch.device("meta"), torch.device("cpu")):
        assert peak_tflops(dev, "bf16") is None, dev
    kw = dict(hidden_size=8, num_layers=2, num_heads=2, seq_len=4, vocab_size=16,
              ffn_hidden_size=16)
    for bad in ({"hidden_size": -8}, {"num_layers": -1}, {"seq_len": 0}):
        with pytest.raises(ValueError, match="must be a positive integer"):
            transformer_flops_per_token(**{**kw, **bad})
    with pytest.raises(ValueError, match="1 <= moe_topk <= moe_experts"):
        transformer_flops_per_token(**kw, moe_experts=4, moe_topk=5, moe_layers=1)
    # top-k = every expert is allowed: each token visits all 4
    full = transformer_flops_per_token(**kw, moe_experts=4, moe_topk=4, moe_layers=2)
    mlp = 8 * 16 + 16 * 8
    attn = 8 * (8 + 2 * 8) + 8 * 8
    assert full == 6.0 * (2 * attn + 2 * (4 * mlp + 8 * 4) + 8 * 16) + 12.0 * 2 * 2 * 4 * 4
    assert tflops_per_device(2e12, 1.0, 2) == 1.0
