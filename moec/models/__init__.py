"""Bundled dense models (the inputs moec compiles) and the short names the CLI accepts."""

from moec.models.gpt2 import GPT2, GPT2Config
from moec.models.llama import Llama, LlamaConfig

__all__ = ["GPT2", "GPT2Config", "Llama", "LlamaConfig"]
