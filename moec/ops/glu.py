"""``moec::glu``: a gated activation of a pre-activation ``h = [gate | up]`` in one op.

glu(h[..., 2H], activation, impl) -> a[..., H]      a = act(gate) * up   (activation: swiglu, ...)

The ``fuse_glu`` pass produces it for dense gated FFNs, whose gate and up projections become one
GEMM. Unfused, ``act(gate) * up`` runs one kernel forward per op and three backward, writing
and reading [T, H] intermediates; on CUDA this op runs the activation kernel the expert MLPs
use (one read of h, one write of a; backward reads h and d_a and writes d_h) for the
activations the kernels compute, the reference for others. The math is in
float32 (or wider) on values read in the storage dtype, as the reference
:func:`moec.ops.activations.activate`.

The backward is the internal op ``moec::glu_backward(h, d_a, activation, impl) -> d_h`` (h's
shape and dtype, contiguous), so AOTAutograd traces it as one opaque call instead of the
reference's nested autograd (and, on CUDA, instead of a kernel launch on fake tensors). Both
take a last ``impl`` (:mod:`moec.ops.binding`), a name of :data:`IMPLEMENTATIONS`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moec.kernels.arch import HAVE_TRITON, float_supported
from moec.ops.activations import (
    activate,
    activate_backward,
    is_gated,
    kernel_activation,
    known_activations,
)
from moec.ops.binding import resolve

if HAVE_TRITON:
    from moec.kernels.activation import act_forward, act_gradient


def _check(h: Tensor, activation: str) -> None:
    if not is_gated(activation) or h.shape[-1] % 2:
        gated = ", ".join(filter(is_gated, known_activations()))
        raise ValueError(
            f"moec::glu: needs a gated activation ({gated}) and an even last dimension; got "
            f"{activation!r} on h {tuple(h.shape)}"
        )


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _triton_forward(h: Tensor, activation: str) -> Tensor:
    """The activation kernel where it takes h (float data on its device, a kernel code)."""
    act = kernel_activation(activation)
    if act is None or not float_supported(h):
        return activate(h, activation)
    return act_forward(h, act)


def _triton_backward(h: Tensor, d_a: Tensor, activation: str) -> Tensor:
    act = kernel_activation(activation)
    if act is None or not float_supported(h):
        return activate_backward(h, d_a, activation)
    return act_gradient(h, d_a, act)


IMPLEMENTATIONS = {
    "reference": (activate, activate_backward),
    "triton": (_triton_forward, _triton_backward),
}
"""(forward, backward) of ``moec::glu`` by implementation name (:mod:`moec.ops.binding`)."""


@torch.library.custom_op("moec::glu", mutates_args=())
def glu(h: Tensor, activation: str, impl: str = "auto") -> Tensor:
    _check(h, activation)
    forward, _ = IMPLEMENTATIONS[resolve("glu", impl, h, IMPLEMENTATIONS)]
    a = forward(_rows(h.contiguous()), activation).contiguous()
    return a.view(*h.shape[:-1], h.shape[-1] // 2)


@glu.register_fake
def _fake(h, activation, impl="auto"):
    _check(h, activation)
    return h.new_empty((*h.shape[:-1], h.shape[-1] // 2))


def _setup(ctx, inputs, output):
    h, activation, impl = inputs
    ctx.save_for_backward(h)
    ctx.activation, ctx.impl = activation, impl


@torch.library.custom_op("moec::glu_backward", mutates_args=())
def glu_backward(h: Tensor, d_a: Tensor, activation: str, impl: str = "auto") -> Tensor:
    _check(h, activation)
    _, backward = IMPLEMENTATIONS[resolve("glu", impl, h, IMPLEMENTATIONS)]
    h = h.contiguous()  # the kernel writes d_h in h's layout
    d_h = backward(_rows(h), _rows(d_a.to(h.dtype)), activation).contiguous()
    return d_h.view(h.shape)


@glu_backward.register_fake
def _backward_fake(h, d_a, activation, impl="auto"):
    _check(h, activation)
    return h.new_empty(h.shape)


def _backward(ctx, d_a):
    (h,) = ctx.saved_tensors
    return torch.ops.moec.glu_backward(h, d_a, ctx.activation, ctx.impl), None, None


glu.register_autograd(_backward, setup_context=_setup)
