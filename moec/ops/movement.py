"""``moec::dispatch`` and ``moec::combine``: moving token rows to experts and back.

dispatch(x[*, D], rows[*, K]) -> buffer[T*K, D]
    buffer[rows[t, k]] = x[t] for every accepted route; unwritten rows are unspecified
    (the reference writes zeros; kernels may leave garbage).
combine(y[R, D], weights[*, K], rows[*, K]) -> out[*, D]
    out[t] = sum over accepted k of weights[t, k] * y[rows[t, k]], accumulated in >= float32.
    Rows of y that no route points at are never read, so garbage there cannot leak.

Each is the other's backward (dispatch's is an unweighted combine; combine's grad w.r.t. y is a
weighted dispatch), so both share :func:`gather_sum` and :func:`scatter_rows`.

The backwards are internal ops, so AOTAutograd traces each as one opaque call (never a kernel
launch on fake tensors)::

    dispatch_backward(d_buffer[R, D], rows[*, K], impl) -> d_x[T, D]   (T = rows.numel() / K)
    combine_backward(y[R, D], weights[*, K], rows[*, K], d_out[*, D], impl)
        -> (d_y[R, D] in d_out's dtype, d_weights in weights' shape and dtype)

Every op takes a last ``impl`` (:mod:`moec.ops.binding`), a name of :data:`IMPLEMENTATIONS`:
``reference`` (the functions here) or ``triton`` (the kernels of :mod:`moec.kernels.movement`
where they take the operands: float data on their device). Every output is contiguous, as the
fake implementations promise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from moec.kernels.arch import HAVE_TRITON, KERNEL_DTYPES, float_supported
from moec.ops.binding import resolve

if HAVE_TRITON:
    from moec.kernels import movement as kernels


def scatter_rows(x: Tensor, rows: Tensor, num_rows: int, weights: Tensor | None = None) -> Tensor:
    """(T, D) token rows -> (num_rows, D) buffer: row ``rows[t, k]`` = weights[t, k] * x[t].

    Dropped routes (-1) land in an extra dump row that is cut off.
    """
    tokens, top_k = rows.shape
    src = x[:, None, :].expand(tokens, top_k, x.shape[-1])
    if weights is not None:
        src = src.to(_accumulation_dtype(x)) * weights[..., None]
    target = torch.where(rows >= 0, rows, num_rows).reshape(-1)
    buffer = x.new_zeros(num_rows + 1, x.shape[-1])
    buffer.index_copy_(0, target, src.reshape(-1, x.shape[-1]).to(x.dtype))
    return buffer[:num_rows]


def gather_sum(y: Tensor, rows: Tensor, weights: Tensor | None = None) -> Tensor:
    """(R, D) buffer -> (T, D): sum over accepted k of weights[t, k] * y[rows[t, k]]."""
    acc = _accumulation_dtype(y)
    valid = rows >= 0
    picked = y[rows.clamp(min=0)].to(acc)  # (T, K, D)
    scale = valid.to(acc) if weights is None else torch.where(valid, weights.to(acc), 0.0)
    picked = torch.where(valid[..., None], picked, 0.0)  # garbage rows may hold NaN
    return (picked * scale[..., None]).sum(1).to(y.dtype)


def _accumulation_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _flat(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def dispatch_reference(x: Tensor, rows: Tensor) -> Tensor:
    """The oracle implementation of ``moec::dispatch``."""
    return scatter_rows(_flat(x), _flat(rows), rows.numel())


def block_output(out: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``out`` (a fresh tensor) as ``shape``, not as a view of it: a combine's result is the
    FFN output, which a model may update in place (Falcon's ``mlp_output += ...``), and
    autograd refuses that on a view made inside a custom op."""
    return torch.ops.aten._unsafe_view(out, shape)


def combine_reference(y: Tensor, weights: Tensor, rows: Tensor) -> Tensor:
    """The oracle implementation of ``moec::combine``."""
    out = gather_sum(y, _flat(rows), _flat(weights))
    return block_output(out, (*rows.shape[:-1], y.shape[-1]))


def dispatch_backward_reference(d_buffer: Tensor, rows: Tensor) -> Tensor:
    """The oracle backward of ``moec::dispatch``: the unweighted sum of each token's rows."""
    return gather_sum(d_buffer, _flat(rows))


def combine_backward_reference(
    y: Tensor, weights: Tensor, rows: Tensor, d_out: Tensor
) -> tuple[Tensor, Tensor]:
    """The oracle backward of ``moec::combine``: (d_y, d_weights)."""
    flat_rows, flat_w, flat_d = _flat(rows), _flat(weights), _flat(d_out)
    d_y = scatter_rows(flat_d, flat_rows, y.shape[0], flat_w)
    valid = flat_rows >= 0
    acc = _accumulation_dtype(y)
    picked = torch.where(valid[..., None], y[flat_rows.clamp(min=0)].to(acc), 0.0)
    d_weights = (picked * flat_d.to(acc)[:, None, :]).sum(-1)
    return d_y, d_weights.view(weights.shape).to(weights.dtype)


def _taken(first: Tensor, *others: Tensor) -> bool:
    """Whether the movement kernels take these operands (float data on their device)."""
    return float_supported(first, *others) and all(
        t.dtype in KERNEL_DTYPES for t in (first, *others) if t.is_floating_point()
    )


def _dispatch_triton(x: Tensor, rows: Tensor) -> Tensor:
    return kernels.dispatch(x, rows) if _taken(x, rows) else dispatch_reference(x, rows)


def _dispatch_backward_triton(d_buffer: Tensor, rows: Tensor) -> Tensor:
    if not _taken(d_buffer, rows):
        return dispatch_backward_reference(d_buffer, rows)
    return kernels.combine(d_buffer, None, rows)


def _combine_triton(y: Tensor, weights: Tensor, rows: Tensor) -> Tensor:
    if not _taken(y, weights, rows):
        return combine_reference(y, weights, rows)
    return kernels.combine(y, weights, rows)


def _combine_backward_triton(y: Tensor, weights: Tensor, rows: Tensor, d_out: Tensor):
    if not _taken(d_out, y, weights, rows):
        return combine_backward_reference(y, weights, rows, d_out)
    return kernels.combine_backward(y, weights, rows, d_out)


class Movement(NamedTuple):
    """One implementation of the two ops and their backwards."""

    dispatch: Callable[[Tensor, Tensor], Tensor]
    dispatch_backward: Callable[[Tensor, Tensor], Tensor]
    combine: Callable[[Tensor, Tensor, Tensor], Tensor]
    combine_backward: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


IMPLEMENTATIONS: dict[str, Movement] = {
    "reference": Movement(
        dispatch_reference, dispatch_backward_reference, combine_reference,
        combine_backward_reference,
    ),
    "triton": Movement(
        _dispatch_triton, _dispatch_backward_triton, _combine_triton, _combine_backward_triton
    ),
}  # fmt: skip
"""``moec::dispatch`` and ``moec::combine`` (and their backwards) by implementation name."""


def _implementation(op: str, impl: str, tensor: Tensor) -> Movement:
    if impl == "auto" or impl not in IMPLEMENTATIONS:
        impl = resolve(op, impl, tensor, IMPLEMENTATIONS)
    return IMPLEMENTATIONS[impl]


@torch.library.custom_op("moec::dispatch", mutates_args=())
def dispatch(x: Tensor, rows: Tensor, impl: str = "auto") -> Tensor:
    return _implementation("dispatch", impl, x).dispatch(x, rows).contiguous()


@dispatch.register_fake
def _dispatch_fake(x, rows, impl="auto"):
    return x.new_empty((rows.numel(), x.shape[-1]))


def _dispatch_setup(ctx, inputs, output):
    x, rows, impl = inputs
    ctx.save_for_backward(rows)
    ctx.x_shape, ctx.impl = x.shape, impl


def _tokens(rows: Tensor):
    """T: the tokens of ``rows[*, K]`` (a SymInt while tracing with dynamic shapes)."""
    return math.prod(rows.shape[:-1])


@torch.library.custom_op("moec::dispatch_backward", mutates_args=())
def dispatch_backward(d_buffer: Tensor, rows: Tensor, impl: str = "auto") -> Tensor:
    d_x = _implementation("dispatch", impl, d_buffer).dispatch_backward(d_buffer, rows)
    return d_x.reshape(-1, d_buffer.shape[-1]).contiguous()


@dispatch_backward.register_fake
def _dispatch_backward_fake(d_buffer, rows, impl="auto"):
    return d_buffer.new_empty((_tokens(rows), d_buffer.shape[-1]))


def _dispatch_backward(ctx, d_buffer):
    (rows,) = ctx.saved_tensors
    d_x = torch.ops.moec.dispatch_backward(d_buffer, rows, ctx.impl)
    return d_x.view(ctx.x_shape), None, None


dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


@torch.library.custom_op("moec::combine", mutates_args=())
def combine(y: Tensor, weights: Tensor, rows: Tensor, impl: str = "auto") -> Tensor:
    return _implementation("combine", impl, y).combine(y, weights, rows)


@combine.register_fake
def _combine_fake(y, weights, rows, impl="auto"):
    return y.new_empty((*rows.shape[:-1], y.shape[-1]))


def _combine_setup(ctx, inputs, output):
    y, weights, rows, impl = inputs
    ctx.save_for_backward(y, weights, rows)
    ctx.impl = impl


@torch.library.custom_op("moec::combine_backward", mutates_args=())
def combine_backward(
    y: Tensor, weights: Tensor, rows: Tensor, d_out: Tensor, impl: str = "auto"
) -> tuple[Tensor, Tensor]:
    implementation = _implementation("combine", impl, d_out).combine_backward
    d_y, d_weights = implementation(y, weights, rows, d_out)
    return d_y.contiguous(), d_weights.contiguous()


@combine_backward.register_fake
def _combine_backward_fake(y, weights, rows, d_out, impl="auto"):
    return d_out.new_empty((y.shape[0], d_out.shape[-1])), weights.new_empty(weights.shape)


def _combine_backward(ctx, d_out):
    y, weights, rows = ctx.saved_tensors
    d_y, d_weights = torch.ops.moec.combine_backward(y, weights, rows, d_out, ctx.impl)
    return d_y, d_weights, None, None


combine.register_autograd(_combine_backward, setup_context=_combine_setup)
