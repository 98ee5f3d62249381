"""Bundled dense models (the inputs moec compiles) and the short names the CLI accepts
(:mod:`moec.models.zoo`, which the command line's help reads: the models are imported on first
use, :mod:`moec.lazy`)."""

from moec.lazy import lazy_exports

__all__ = ["GPT2", "GPT2Config", "Llama", "LlamaConfig"]

__getattr__, __dir__ = lazy_exports(
    globals(),
    {
        "GPT2": "moec.models.gpt2",
        "GPT2Config": "moec.models.gpt2",
        "Llama": "moec.models.llama",
        "LlamaConfig": "moec.models.llama",
    },
)
