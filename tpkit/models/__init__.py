"""Model families built from tpkit layers, and Hugging Face checkpoints in and out.

``tpkit.models.GPT`` (tpkit.models.gpt) is the small reference GPT that ``tpkit-train``
trains by default (every layout, pipeline stages, MoE, packed documents).

``tpkit.models.Llama`` (tpkit.models.llama) covers Llama 2/3, Qwen2 and Mistral without
sliding window; ``tpkit.models.hf.from_hf`` / ``save_hf`` (an adapter the models do not import) read and write Hugging Face safetensors
checkpoints at any layout (tpkit.models.hf). Both generate text with Hugging Face's
``generate`` arguments and a KV cache (tpkit.models.generate). docs/models.md is the
user's page.
"""
import importlib

# name -> its module. Imported when first asked for (PEP 562): the families import torch and
# tpkit.nn, which tpkit.models.shape's readers (tpkit-launch's memory check, every launch)
# do not need.
_FAMILIES = {"GPT": "gpt", "GPTConfig": "gpt", "Llama": "llama", "LlamaConfig": "llama"}
__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig"]


def __getattr__(name: str):
    if name in _FAMILIES:
        return getattr(importlib.import_module(f".{_FAMILIES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
