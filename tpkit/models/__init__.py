"""Model families built from tpkit layers, and Hugging Face checkpoints in and out.

``tpkit.models.GPT`` (tpkit.models.gpt) is the small reference GPT that ``tpkit-train``
trains by default (every layout, pipeline stages, MoE, packed documents).

``tpkit.models.Llama`` (tpkit.models.llama) covers Llama 2/3, Qwen2 and Mistral without
sliding window; ``tpkit.models.hf.from_hf`` / ``save_hf`` (an adapter the models do not import) read and write Hugging Face safetensors
checkpoints at any layout (tpkit.models.hf). Both generate text with Hugging Face's
``generate`` arguments and a KV cache (tpkit.models.generate). docs/models.md is the
user's page.
"""
from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig"]
