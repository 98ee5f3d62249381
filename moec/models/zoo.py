"""Models by name, for the CLI and tests: ``load_model(spec) -> (model, args, kwargs)``.

A spec is a short name or ``path/to/file.py:factory``:

- ``llama``, ``gpt2``: the bundled :class:`~moec.models.Llama` / :class:`~moec.models.GPT2` with
  their default small configs;
- ``hf-llama``, ``hf-qwen2``, ``hf-gpt2``: transformers' ``LlamaForCausalLM``,
  ``Qwen2ForCausalLM``, ``GPT2LMHeadModel`` from tiny configs (hidden 64, 2 layers) with random
  weights and ``use_cache=False``;
- ``file.py:factory``: ``factory()`` returns ``(model, example_inputs)`` or a model with an
  ``example_inputs()`` method.

The named models' vocabulary is 256 (byte tokens), or ``load_model``'s ``vocab_size`` (``moec
train --data`` of a corpus ``moec data build`` wrote passes its tokenizer's); a factory's model
keeps its own.

The example input of the named models is random token ids of shape (2, 64).
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

from moec.errors import MoecError
from moec.imports import load_object

if typing.TYPE_CHECKING:  # torch is imported when a model is built: SHORT_NAMES needs none
    import torch
    from torch import nn

VOCAB = 256
EXAMPLE_SHAPE = (2, 64)

Loaded = tuple["nn.Module", tuple, dict]


class ModelSpecError(MoecError, ValueError):
    """A model spec that names no known model or no loadable factory."""


def example_tokens(vocab: int = VOCAB) -> torch.Tensor:
    import torch

    return torch.randint(0, vocab, EXAMPLE_SHAPE, generator=torch.Generator().manual_seed(0))


def _bundled(name: str) -> Callable[[int], nn.Module]:
    def build(vocab: int) -> nn.Module:
        from moec.models import GPT2, GPT2Config, Llama, LlamaConfig

        if name == "gpt2":
            return GPT2(GPT2Config(vocab_size=vocab))
        return Llama(LlamaConfig(vocab_size=vocab))

    return build


def _hf(name: str) -> Callable[[int], nn.Module]:
    def build(vocab: int) -> nn.Module:
        import torch
        import transformers as tf

        common = dict(vocab_size=vocab, use_cache=False, bos_token_id=1, eos_token_id=2)
        if name == "gpt2":
            config = tf.GPT2Config(
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=128,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                **common,
            )
            model_cls = tf.GPT2LMHeadModel
        else:
            config_cls, model_cls = {
                "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            }[name]
            config = config_cls(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=128,
                **common,
            )
        torch.manual_seed(0)
        return model_cls(config).eval()

    return build


SHORT_NAMES: dict[str, Callable[[int], nn.Module]] = {
    "llama": _bundled("llama"),
    "gpt2": _bundled("gpt2"),
    "hf-llama": _hf("llama"),
    "hf-qwen2": _hf("qwen2"),
    "hf-gpt2": _hf("gpt2"),
}


def load_model(spec: str, vocab_size: int | None = None) -> Loaded:
    """The model ``spec`` names, with its example positional and keyword inputs (see module);
    ``vocab_size`` sizes a named model's vocabulary (None: 256); a factory's model keeps its
    own."""
    if spec in SHORT_NAMES:
        vocab = vocab_size or VOCAB
        return SHORT_NAMES[spec](vocab), (example_tokens(vocab),), {}
    path, sep, _ = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise ModelSpecError(
            f"unknown model {spec!r}: use one of {sorted(SHORT_NAMES)} or path/to/file.py:factory"
        )
    try:
        factory = load_object(spec)
    except ValueError as exc:
        raise ModelSpecError(f"model {spec!r}: {exc}") from exc
    if not callable(factory):
        raise ModelSpecError(f"model {spec!r}: {type(factory).__name__} is not callable")
    return _from_factory(factory, spec)


def _from_factory(factory: Callable[[], Any], spec: str) -> Loaded:
    from torch import nn

    made = factory()
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        model, inputs = made
    elif isinstance(made, nn.Module) and callable(getattr(made, "example_inputs", None)):
        model, inputs = made, made.example_inputs()
    else:
        raise ModelSpecError(
            f"{spec} must return (model, example_inputs) or a model with an example_inputs() "
            f"method; got {type(made).__name__}"
        )
    if isinstance(inputs, dict):
        return model, (), inputs
    return model, inputs if isinstance(inputs, tuple) else (inputs,), {}
