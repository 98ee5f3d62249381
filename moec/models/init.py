"""The initialization moec's bundled models share: GPT-2's (weights normal with std 0.02,
biases zero), as each model's ``_init_weights(module)``, the name transformers uses and
``moec train --init-from fresh`` draws each module of a meta model with."""

from __future__ import annotations

from torch import nn


def normal_init(module: nn.Module) -> None:
    """One module's initial weights: linear and embedding weights normal with std 0.02, linear
    biases zero; other modules keep their own."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
