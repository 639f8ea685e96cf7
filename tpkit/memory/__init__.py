"""Per-rank memory of a training job, estimated analytically before anything runs.

``estimate_memory(job, config, rank=...)`` returns a :class:`MemoryEstimate`: the bytes
one rank holds, term by term (parameters, gradients and DDP's reduction buckets,
optimizer states, FSDP's gathered copy, the activations autograd keeps per layer for the
recompute policy, the pipeline schedule's in-flight micro-batches, fp8 copies and amax
histories, MoE dispatch buffers, the loss' softmax and the async-save staging copy), and
the peak: the largest sum of the terms alive together at one moment of a step (end of
the forward, end of the backward, the optimizer step). Everything is arithmetic on the
model's shape and the layout, so 65,536 ranks' roles take milliseconds
(``tpkit-launch --dry-run`` prints them; docs/launch.md "Memory").

The activation terms follow what tpkit's torch layers save for backward (tpkit.nn, read
op by op: the norms keep their input, the normalised input and rstd; QKV keeps its output
for V's view; RoPE'd q and k; the attention core q/k/v/out and its log-sum-exp; the MLP
keeps fc1's output and the activation's; the loss keeps the fp32 softmax). They are
checked against live-tensor bytes measured on CPU at launched layouts
(tests/memory/test_memory.py); the Transformer Engine backend keeps about the same tensors.

:class:`MemoryJob` is the input: the model's shape (:class:`ModelShape`, from launch/
train.py's arguments, a tpkit LlamaConfig or a Hugging Face config.json) and how it is
trained (micro-batch, sequence, precision, recompute, optimizer, ddp/fsdp, pipeline
schedule, packing, async save). ``suggest_layouts`` searches tp/cp/pp/dp, recompute and
fsdp at the same world size for layouts that fit a device, cheapest first.

The parts: ``job`` (MemoryJob, MemoryEstimate), ``estimate`` (per rank and per role),
``fit`` (step_cost, suggest_layouts), ``text`` (the report lines, the measured peak).
"""
from __future__ import annotations

from ..models.shape import ModelShape
from .job import GiB, PRECISIONS, MemoryEstimate, MemoryJob
from .estimate import estimate_memory, estimate_roles, role_ranks
from .fit import step_cost, suggest_layouts
from .text import (format_estimate, format_layout, format_measured, format_roles,
                   measured_peak_bytes)

__all__ = ["ModelShape", "MemoryJob", "MemoryEstimate", "estimate_memory", "role_ranks",
           "estimate_roles", "suggest_layouts", "format_estimate", "format_roles",
           "measured_peak_bytes", "format_measured", "GiB", "PRECISIONS"]
