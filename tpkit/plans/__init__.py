"""Bring your own model: ``parallelize(model, plan)`` swaps an existing PyTorch model's
layers for tpkit's by a plan of module-name patterns -> styles, keeping its weights
(docs/byom.md). Ready plans: nanoGPT's GPT, Hugging Face's Llama / Qwen2 / Mistral."""
from .core import (READY_PLANS, Attention, Column, Norm, Plan, PositionEmbedding, Replicate,
                   Row, Style, VocabEmbedding, VocabHead, parallelize, ready_plan)
from .ready import hf_llama_plan, nanogpt_plan   # fills READY_PLANS

__all__ = ["parallelize", "Plan", "Style", "Column", "Row", "VocabEmbedding", "VocabHead",
           "PositionEmbedding", "Norm", "Attention", "Replicate", "ready_plan",
           "nanogpt_plan", "hf_llama_plan", "READY_PLANS"]
