"""Expert activation functions, by name, shared by the ops, the kernels and the ``moe`` pass.

A plain activation maps a pre-activation ``h`` of width H to H; a gated ("GLU") one reads
``h = [gate | up]`` of width 2H and returns ``act(gate) * up`` of width H. Every plain activation
has exactly one gated form: ``swiglu``, ``geglu``, ``geglu_tanh``, ``reglu`` for the four with
established names, ``<name>_glu`` for the others.

Built-in plain activations: ``gelu`` (erf), ``gelu_tanh``, ``silu``, ``relu``, ``quick_gelu``
(``x * sigmoid(1.702 x)``, CLIP's) and ``relu2`` (``relu(x) ** 2``, squared ReLU). The names and
meanings of built-ins never change (the kernels key their codes on them).

:func:`register_activation` adds a plain activation (and its gated form) for this process: a
function of one tensor that is elementwise and differentiable, checked on sample values when
registered. The ``moe`` pass identifies an FFN's activation by comparing values, so a registered
function is recognised however the model writes it. Ops run a registered activation through
this reference; the CUDA kernels cover the built-ins they have codes for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moec.errors import MoecError
from moec.kernels.arch import HAVE_TRITON

if HAVE_TRITON:
    from moec.kernels.activation import UNARY_CODES, KernelActivation

Unary = Callable[[torch.Tensor], torch.Tensor]
aten = torch.ops.aten

_BUILTIN_UNARY: dict[str, Unary] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
    "quick_gelu": lambda h: h * torch.sigmoid(1.702 * h),
    "relu2": lambda h: F.relu(h).square(),
}
_NAMED_GATED = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh", "relu": "reglu"}
"""Gated forms with established names; any other plain activation ``a`` gates as ``a_glu``."""


def _gated_name(unary: str) -> str:
    return _NAMED_GATED.get(unary, f"{unary}_glu")


_unary: dict[str, Unary] = dict(_BUILTIN_UNARY)
_gated: dict[str, str] = {_gated_name(u): u for u in _BUILTIN_UNARY}

ACTIVATIONS: tuple[str, ...] = tuple(_unary) + tuple(_gated)
"""The built-in activations (plain, then gated); :func:`known_activations` adds registered ones."""

REGISTER_HINT = (
    "register another with moec.register_activation(name, fn) or the plan field "
    "moe.activations ({name: 'module.path:function'})"
)


class ActivationError(MoecError, ValueError):
    """An unknown activation name, or a function that cannot be registered as one."""


def known_activations() -> tuple[str, ...]:
    """Every activation name this process knows: built-in and registered, plain and gated."""
    return tuple(_unary) + tuple(_gated)


def supported_text() -> str:
    """One line naming the supported activations and how to add another (for messages)."""
    return (
        f"supported: {', '.join(_unary)} and their gated forms ({', '.join(_gated)}); "
        f"{REGISTER_HINT}"
    )


def check_activation(activation: str) -> None:
    if activation not in _unary and activation not in _gated:
        raise ActivationError(f"unknown expert activation {activation!r}; {supported_text()}")


def is_gated(activation: str) -> bool:
    check_activation(activation)
    return activation in _gated


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """Apply ``activation`` to the pre-activation ``h`` (R, H) or (R, 2H) for gated ones."""
    if activation in _gated:
        gate, up = h.chunk(2, dim=-1)
        return _unary[_gated[activation]](gate) * up
    check_activation(activation)
    return _unary[activation](h)


def activate_backward(h: torch.Tensor, grad: torch.Tensor, activation: str) -> torch.Tensor:
    """Gradient of :func:`activate` at ``h`` for the output gradient ``grad``.

    It runs inside custom ops' kernels (the backward ops), where autograd is off whatever the
    grad mode: built-ins use ATen's backward formulas (the ops autograd runs, so the result is
    autograd's), registered activations ``torch.func.vjp``, which brings its own autograd."""
    if activation in _gated:
        unary = _gated[activation]
        gate, up = h.chunk(2, dim=-1)
        d_gate = _unary_backward(unary, gate, grad * up)
        return torch.cat((d_gate, grad * _unary[unary](gate)), dim=-1)
    check_activation(activation)
    return _unary_backward(activation, h, grad)


def _quick_gelu_backward(grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(1.702 * h)
    return grad * s + aten.sigmoid_backward(grad * h, s) * 1.702


_BUILTIN_BACKWARD: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "gelu": lambda grad, h: aten.gelu_backward(grad, h),
    "gelu_tanh": lambda grad, h: aten.gelu_backward(grad, h, approximate="tanh"),
    "silu": aten.silu_backward,
    "relu": lambda grad, h: aten.threshold_backward(grad, h, 0),
    "quick_gelu": _quick_gelu_backward,
    "relu2": lambda grad, h: aten.threshold_backward(grad * (2 * F.relu(h)), h, 0),
}
"""``(grad, h) -> grad * act'(h)`` of the built-in plain activations, as autograd computes it."""


def _unary_backward(unary: str, h: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    builtin = _BUILTIN_BACKWARD.get(unary)
    if builtin is not None:
        return builtin(grad, h)
    _, vjp = torch.func.vjp(_unary[unary], h)
    return vjp(grad)[0]


def gated_from_unary(unary: str) -> str:
    """The gated activation whose gate uses ``unary`` (``silu`` -> ``swiglu``)."""
    if unary not in _unary:
        raise ActivationError(f"unknown plain activation {unary!r}; {supported_text()}")
    return _gated_name(unary)


def unary_candidates() -> dict[str, Unary]:
    """Plain activations by name, built-ins first (the order the structure analysis tries)."""
    return dict(_unary)


def register_activation(name: str, fn: Unary) -> None:
    """Make ``fn`` the plain activation ``name`` (and ``<name>_glu`` its gated form).

    ``fn`` must map a floating tensor to one of the same shape, elementwise and differentiably;
    this is checked on sample values. Built-in names cannot be replaced; registering a name
    again replaces the earlier function of that name.
    """
    gated = _gated_name(name)
    if not isinstance(name, str) or not name.isidentifier():
        raise ActivationError(f"activation name {name!r} must be a Python identifier")
    builtin = set(_BUILTIN_UNARY) | {_gated_name(u) for u in _BUILTIN_UNARY}
    if name in builtin or gated in builtin or name in _gated or gated in _unary:
        raise ActivationError(
            f"activation name {name!r} (gated form {gated!r}) is taken by a built-in or gated "
            f"name; choose another ({supported_text()})"
        )
    _check_elementwise(name, fn)
    _unary[name] = fn
    _gated[gated] = name


def _check_elementwise(name: str, fn: Unary) -> None:
    """``fn`` maps a float64 tensor to one of the same shape, commutes with a permutation and
    reshape of its input (it is elementwise) and carries a gradient."""
    where = f"activation {name!r} ({getattr(fn, '__qualname__', repr(fn))})"
    if not callable(fn):
        raise ActivationError(f"{where} is not callable; give a function of one tensor")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    x.requires_grad_(True)
    order = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))
    try:
        y = fn(x)
        permuted = fn(x.detach().reshape(-1)[order].reshape(16, 8))
    except Exception as exc:
        raise ActivationError(
            f"{where} failed on a float64 tensor: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or not y.is_floating_point():
        raise ActivationError(
            f"{where} must return a floating tensor of its input's shape {tuple(x.shape)}"
        )
    if not y.requires_grad:
        raise ActivationError(f"{where} must be differentiable (its output carries no gradient)")
    expected = y.detach().reshape(-1)[order].reshape(16, 8)
    if not (
        isinstance(permuted, torch.Tensor)
        and permuted.shape == expected.shape
        and torch.allclose(permuted.double(), expected.double(), equal_nan=True)
    ):
        raise ActivationError(
            f"{where} is not elementwise: each output element must depend only on the input "
            "element at its position"
        )


def kernel_activation(activation: str):
    """The kernels' form of ``activation`` (:class:`moec.kernels.activation.KernelActivation`:
    the code of its unary function and whether it is gated); None where no kernel computes it
    (or Triton is missing)."""
    if not HAVE_TRITON:
        return None
    gated = is_gated(activation)
    for unary, code in UNARY_CODES.items():
        if (gated_from_unary(unary) if gated else unary) == activation:
            return KernelActivation(code, gated)
    return None
