"""``moec::rope``: rotary position embedding in one op.

rope(x[..., D], cos, sin, out_dtype?, impl) -> out[..., D]

    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

``cos`` and ``sin`` broadcast to x's shape; the arithmetic runs in float32 (or wider) and the
result has ``out_dtype`` if given, else the promoted dtype of (x, cos, sin), as the unfused
expression. ``cos`` and ``sin`` get no gradient: they are tables computed from buffers (the
``fuse_rope`` pass checks it; the op refuses inputs that require one). The unfused expression
runs five elementwise kernels per tensor and writes float32 intermediates when the tables are
float32; the kernel reads x once and writes the result once.

The gradient w.r.t. x is the transposed rotation, the internal op
``moec::rope_backward(d_out, cos, sin, x_dtype, impl) -> d_x`` (d_out's shape, ``x_dtype``), so
that AOTAutograd traces the backward as one opaque call (on the kernels it runs the same one).
Both take a last ``impl`` (:mod:`moec.ops.binding`), a name of :data:`IMPLEMENTATIONS`.

Layout: both ops return ``torch.empty_like(x)``'s layout (x's strides when x is dense, else
dense in x's order), exactly as their fake implementations do (Inductor checks custom ops'
output strides). It is the layout the unfused expression gives: q and k arrive as transposed
views of the projections, and keeping their (B, S, H, D) memory order lets attention's output
go back to (B, S, H*D) as a view, not a copy the saved activations would hold (the pipeline
memory prediction counts the view). The kernel writes contiguous rows; it runs on x with its
leading dimensions in memory order, which is that layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from moec.kernels.arch import HAVE_TRITON, float_supported
from moec.ops.binding import resolve

if HAVE_TRITON:
    from moec.kernels import rope as rope_kernel


def _out_dtype(x: Tensor, cos: Tensor, sin: Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    return out_dtype or torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


def _check(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    if x.shape[-1] % 2 or torch.broadcast_shapes(x.shape, cos.shape, sin.shape) != x.shape:
        raise ValueError(
            f"moec::rope: x {tuple(x.shape)} needs an even last dimension and cos "
            f"{tuple(cos.shape)} / sin {tuple(sin.shape)} that broadcast to it"
        )


def rotate(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    """The reference arithmetic in float32 (or wider): the forward rotation, or its transpose
    (the gradient w.r.t. x) when ``backward``."""
    acc = torch.promote_types(x.dtype, torch.float32)
    x, cos, sin = x.to(acc), cos.to(acc), sin.to(acc)
    if backward:  # the transpose: d_lo = g_lo c_lo + g_hi s_hi, d_hi = g_hi c_hi - g_lo s_lo
        lo, hi = (x * sin).chunk(2, dim=-1)
        return x * cos + torch.cat((hi, -lo), dim=-1)
    lo, hi = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-hi, lo), dim=-1) * sin


def _layout(x: Tensor, dtype: torch.dtype) -> tuple[int, ...]:
    """The strides of the ops' results: ``empty_like(x)``'s (computed on the meta device)."""
    return torch.empty_like(x, dtype=dtype, device="meta").stride()


Rotation = Callable[[Tensor, Tensor, Tensor, torch.dtype, bool], Tensor]


def _triton(x: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype, backward: bool) -> Tensor:
    """The rope kernel's rotation (or its transpose when ``backward``) in ``dtype``; x of more
    than :data:`moec.kernels.rope.MAX_DIMS` dimensions in torch."""
    if x.dim() > rope_kernel.MAX_DIMS:
        return rotate(x, cos, sin, backward).to(dtype)
    return rope_kernel.rope(x, cos, sin, dtype, backward)


IMPLEMENTATIONS: dict[str, Rotation | None] = {"reference": None, "triton": _triton}
"""The kernel rotation of each implementation (None: :func:`rotate` in torch)."""


def _rope(
    x: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype, backward: bool, impl: str
) -> Tensor:
    strides = _layout(x, dtype)
    kernel = IMPLEMENTATIONS[resolve("rope", impl, x, IMPLEMENTATIONS)]
    if kernel is None or not float_supported(x):
        out = x.new_empty_strided(x.shape, strides, dtype=dtype)
        return out.copy_(rotate(x, cos, sin, backward))
    # leading dimensions by decreasing stride, the last one kept last: the result's memory order
    lead = sorted(range(x.dim() - 1), key=lambda d: -strides[d])
    order = (*lead, x.dim() - 1)
    permuted = tuple(strides[d] for d in order)
    out_shape = tuple(x.shape[d] for d in order)
    if strides[-1] != 1 or not _is_contiguous(out_shape, permuted):
        out = x.new_empty_strided(x.shape, strides, dtype=dtype)
        return out.copy_(kernel(x, cos, sin, dtype, backward))
    cos, sin = (t.expand(x.shape).permute(order) for t in (cos, sin))
    y = kernel(x.permute(order), cos, sin, dtype, backward).contiguous()
    return y.as_strided(x.shape, strides)  # y's elements, addressed in x's dimension order


def _is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    expected = 1
    for size, stride in reversed(tuple(zip(shape, strides, strict=True))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@torch.library.custom_op("moec::rope", mutates_args=())
def rope(
    x: Tensor, cos: Tensor, sin: Tensor, out_dtype: torch.dtype | None, impl: str = "auto"
) -> Tensor:
    _check(x, cos, sin)
    return _rope(x, cos, sin, _out_dtype(x, cos, sin, out_dtype), False, impl)


@rope.register_fake
def _fake(x, cos, sin, out_dtype, impl="auto"):
    _check(x, cos, sin)
    return torch.empty_like(x, dtype=_out_dtype(x, cos, sin, out_dtype))


def _setup(ctx, inputs, output):
    x, cos, sin, _, impl = inputs
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(
            "moec::rope: cos and sin must not require grad (the op gives them no gradient); "
            "compute the tables from buffers, or leave RoPE unfused"
        )
    ctx.save_for_backward(cos, sin)
    ctx.x_dtype, ctx.impl = x.dtype, impl


@torch.library.custom_op("moec::rope_backward", mutates_args=())
def rope_backward(
    d_out: Tensor, cos: Tensor, sin: Tensor, x_dtype: torch.dtype, impl: str = "auto"
) -> Tensor:
    _check(d_out, cos, sin)
    return _rope(d_out, cos, sin, x_dtype, True, impl)


@rope_backward.register_fake
def _backward_fake(d_out, cos, sin, x_dtype, impl="auto"):
    _check(d_out, cos, sin)
    return torch.empty_like(d_out, dtype=x_dtype)


def _backward(ctx, d_out):
    cos, sin = ctx.saved_tensors
    d_x = torch.ops.moec.rope_backward(d_out, cos, sin, ctx.x_dtype, ctx.impl)
    return d_x, None, None, None, None


rope.register_autograd(_backward, setup_context=_setup)
