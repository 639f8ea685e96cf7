"""See what a job is doing (docs/observe.md): model FLOPs per token and MFU against the
datasheet peak (``flops``), per-step metrics to TensorBoard and CSV with the step-time
breakdown per rank and measured memory (``metrics``), ``torch.profiler`` traces of chosen
steps (``profile``) and the rank-0 progress line (``progress``).

A training loop builds one ``MetricsLogger`` and calls it once per step; tpkit's trainer
does the same."""
from .flops import (mfu, model_flops_per_token, peak_tflops, tflops_per_device,
                    transformer_flops_per_token)
from .metrics import PHASES, MetricsLogger, measured_memory, moe_scalars
from .profile import StepProfiler, parse_profile_steps
from .progress import ProgressLine

__all__ = ["mfu", "model_flops_per_token", "peak_tflops", "tflops_per_device",
           "transformer_flops_per_token", "MetricsLogger", "PHASES", "measured_memory",
           "moe_scalars", "StepProfiler", "parse_profile_steps", "ProgressLine"]
