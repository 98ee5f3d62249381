"""Expert activation functions, by name, shared by the ops, the kernels and the ``moe`` pass.

A gated ("GLU") activation reads a pre-activation ``h = [gate | up]`` of width 2H and returns
``act(gate) * up`` of width H; a plain one maps width H to H.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}
_GATED = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh", "reglu": "relu"}

ACTIVATIONS: tuple[str, ...] = tuple(_UNARY) + tuple(_GATED)


def is_gated(activation: str) -> bool:
    check_activation(activation)
    return activation in _GATED


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}; known: {ACTIVATIONS}")


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """Apply ``activation`` to the pre-activation ``h`` (R, H) or (R, 2H) for gated ones."""
    if activation in _GATED:
        gate, up = h.chunk(2, dim=-1)
        return _UNARY[_GATED[activation]](gate) * up
    return _UNARY[activation](h)


def activate_backward(h: torch.Tensor, grad: torch.Tensor, activation: str) -> torch.Tensor:
    """Gradient of :func:`activate` at ``h`` for the output gradient ``grad``."""
    with torch.enable_grad():
        leaf = h.detach().requires_grad_(True)
        (dh,) = torch.autograd.grad(activate(leaf, activation), leaf, grad)
    return dh


def gated_from_unary(unary: str) -> str:
    """The gated activation whose gate uses ``unary`` (``silu`` -> ``swiglu``)."""
    for gated, inner in _GATED.items():
        if inner == unary:
            return gated
    raise ValueError(f"no gated form of activation {unary!r}; known unary: {tuple(_UNARY)}")


def unary_candidates() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    return dict(_UNARY)
