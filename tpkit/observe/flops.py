"""Model FLOPs per token, device peaks and MFU: what "TFLOP/s per device" and "MFU" mean
in tpkit's logs and BENCHMARKS.md.

*Model FLOPs* (the peers' convention: torchtitan's ``6 * N + 12 * L * heads * head_dim *
S``, PaLM's appendix B, Megatron-LM's formula without its causal option): per token of a
training step (forward + backward),

- ``6 x`` every matmul weight a token passes through: q/k/v and output projections, the
  MLP (``fc1`` twice as wide when gated: SwiGLU), the MoE router and the ``top_k`` experts
  a token is routed to (not all experts), the output head (also when tied to the
  embedding; the embedding lookup itself is no matmul);
- ``12 x layers x heads x head_dim x S`` for attention's two matmuls (scores and
  weighted values, 2 FLOPs per multiply-add, 3x for forward + backward) over the *full*
  ``S x S`` square: the causal mask's skipped half is counted as done, as the peers count
  it, so MFU figures compare across codebases (the FLOPs actually executed by a causal
  kernel are about half of this term);
- nothing for recompute (activation checkpointing and flash attention's backward
  recompute are not model FLOPs), norms, softmax, RoPE and elementwise work.

``S`` is the global sequence length (under context parallelism too): a token attends to
the whole sequence wherever its shard lives.

*Peaks*: the datasheet's *dense* tensor-core rate of one device for the compute dtype,
from Lightning's table (``lightning.fabric.utilities.throughput``) where it has the
device, with the corrections below where its entry is not the dense figure; fp8 rates
(which Lightning's table lacks) from NVIDIA's datasheets. bf16 and fp8 runs are both
reported against the bf16 peak (``mfu``), fp8 runs also against the fp8 peak
(``mfu_fp8``). A CPU has no honest peak: MFU is None there (TFLOP/s is still reported).
"""
from __future__ import annotations

from ..models.shape import ModelShape, transformer_flops_per_token

__all__ = ["model_flops_per_token", "transformer_flops_per_token", "peak_tflops",
           "mfu", "tflops_per_device"]


def model_flops_per_token(model, seq_len: int) -> float:
    """Model FLOPs per token (forward + backward, the module docstring's convention) of a
    tpkit model or its config at sequence length ``seq_len`` (global, not the CP shard):
    ``tpkit.models.Llama``/``LlamaConfig`` (SwiGLU), the reference GPT/``GPTConfig``
    (GELU MLPs, every ``moe_every``-th one a top-k MoE when ``moe_experts``) or a
    ``ModelShape`` (``ModelShape.flops_per_token``). Another model: call
    ``transformer_flops_per_token`` with its sizes, or count it with
    ``torch.utils.flop_counter.FlopCounterMode`` (Lightning's ``measure_flops``)."""
    return ModelShape.of(model).flops_per_token(seq_len)


# --- device peaks ----------------------------------------------------------------------
_DTYPES = ("bf16", "fp16", "fp8", "fp32")
# Dense tensor-core TFLOP/s by (chip, dtype) where Lightning's table has none or lists a
# figure with 2:4 sparsity; NVIDIA's datasheets give "with sparsity" figures, halved here.
#   H100 SXM / PCIe: fp8 3958 / 3026 sparse (bf16 989.4 / 756 dense: Lightning's).
#   H100 NVL (94 GB): bf16 1671, fp8 3341 sparse (Lightning lists 1978.8: the sparse
#     figure of the earlier two-board NVL).
#   H200 SXM / NVL: bf16 1979 / 1671, fp8 3958 / 3341 sparse (Lightning lists the sparse
#     bf16 figures, under names no driver reports).
#   fp32 (no tensor cores, no sparsity): H100 NVL 60 (Lightning's 133.8 is the two-board
#     NVL's), H200 SXM 67, H200 NVL 60 (Lightning has no H200).
_DENSE_TFLOPS = {
    ("h100 sxm", "fp8"): 1978.9, ("h100 pcie", "fp8"): 1513.0,
    ("h100 nvl", "bf16"): 835.5, ("h100 nvl", "fp16"): 835.5, ("h100 nvl", "fp8"): 1670.5,
    ("h100 nvl", "fp32"): 60.0,
    ("h200 sxm", "bf16"): 989.4, ("h200 sxm", "fp16"): 989.4, ("h200 sxm", "fp8"): 1978.9,
    ("h200 sxm", "fp32"): 67.0,
    ("h200 nvl", "bf16"): 835.5, ("h200 nvl", "fp16"): 835.5, ("h200 nvl", "fp8"): 1670.5,
    ("h200 nvl", "fp32"): 60.0,
}


def _dtype_name(dtype) -> str:
    import torch
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    if isinstance(dtype, torch.dtype):
        if dtype not in names:
            raise ValueError(f"dtype={dtype} has no peak; use one of {_DTYPES}")
        return names[dtype]
    d = str(dtype).lower().replace("-mixed", "").replace("-true", "").replace("bfloat16", "bf16")
    d = {"float16": "fp16", "16": "fp16", "float32": "fp32", "32": "fp32"}.get(d, d)
    if d not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} has no peak; use one of {_DTYPES} (or a "
                         "torch dtype, or a Lightning precision such as 'bf16-mixed')")
    return d


def _hopper_chip(name: str) -> str | None:
    """Lightning's naming of the Hopper chips, and the H200s as the driver names them."""
    n = name.lower()
    if "h200" in n:
        return "h200 nvl" if "nvl" in n else "h200 sxm"
    if "h100" in n:
        if "nvl" in n:
            return "h100 nvl"
        if "pcie" in n or "hbm2e" in n:
            return "h100 pcie"
        return "h100 sxm"   # "NVIDIA H100 80GB HBM3" (Lightning: hbm3 -> sxm)
    return None


def peak_tflops(device, dtype) -> float | None:
    """The datasheet dense peak (TFLOP/s) of one ``device`` (a ``torch.device``, or a CUDA
    device name as ``torch.cuda.get_device_name`` gives it) for ``dtype`` ("bf16", "fp16",
    "fp8", "fp32" or a torch dtype); None on CPU and for a device no table has (pass
    ``peak_tflops=`` to the logger then)."""
    import torch
    d = _dtype_name(dtype)
    if isinstance(device, str) and device.split(":")[0] in ("cpu", "cuda"):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(device)
    else:
        name = str(device)
    chip = _hopper_chip(name)
    if (chip, d) in _DENSE_TFLOPS:
        return _DENSE_TFLOPS[(chip, d)]
    if d == "fp8":
        return None
    from lightning.fabric.utilities.throughput import get_available_flops
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[d]
    if isinstance(device, torch.device):
        flops = get_available_flops(device, tdtype)
    else:
        # Lightning's lookup reads the name of a device: hand it the name asked about
        # (fp32 then means the dense fp32 rate, not TF32's).
        from unittest import mock
        with mock.patch("torch.cuda.get_device_name", return_value=name), \
                mock.patch("lightning.fabric.accelerators.cuda._is_ampere_or_later",
                           return_value=False):
            flops = get_available_flops(torch.device("cuda"), tdtype)
    return None if flops is None else flops / 1e12


def tflops_per_device(tokens_per_s: float, flops_per_token: float, devices: int) -> float:
    """Model TFLOP/s of one device: the job's tokens/s x FLOPs per token over its devices
    (every device of the job: TP, CP, PP and DP ranks alike)."""
    if devices < 1:
        raise ValueError(f"devices={devices} must be >= 1")
    return tokens_per_s * flops_per_token / devices / 1e12


def mfu(tflops: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved TFLOP/s per device over the peak; None without a
    peak (CPU)."""
    return None if not peak else tflops / peak
