"""Model families built from tpkit layers, and Hugging Face checkpoints in and out.

``tpkit.models.Llama`` (tpkit.models.llama) covers Llama 2/3, Qwen2 and Mistral without
sliding window; ``Llama.from_hf`` / ``save_hf`` read and write Hugging Face safetensors
checkpoints at any layout (tpkit.models.hf). docs/models.md is the user's page.
"""
from .llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
