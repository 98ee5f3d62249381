"""``moec::expert_mlp_gathered``: the expert MLP reading token rows, without a dispatched buffer.

expert_mlp_gathered(x[*, D], rows[*, K], w_up[N, D, U], w_down[N, H, D], offsets[N] int32,
                    b_up[N, U]?, b_down[N, D]?, activation) -> (y[R, D], h[R, U])   R = T*K

equals ``moec::expert_mlp(moec::dispatch(x, rows), w_up, ...)`` on every row below
``offsets[-1]`` (rows past it are garbage, as the expert MLP's): buffer row ``r`` is token
``sources[r]`` (:func:`row_sources`), so an implementation may read ``x[sources[r]]`` where the
buffer op reads ``buffer[r]`` and the ``R x D`` buffer never exists. The backward saves x, not
the buffer, and runs the internal op::

    expert_mlp_gathered_backward(x[T, D], rows[T, K], w_up, w_down, offsets, h, d_y, activation,
                                 up_bias) -> (d_rows[R, D], d_w_up, d_w_down, d_h[R, U])

(``moec::expert_mlp_backward`` on the gathered rows; on CUDA the kernels of
:mod:`moec.kernels.experts`), then ``d_x = moec::dispatch_backward(d_rows, rows)``: the
unweighted sum over each token's accepted routes, deterministic. Weight gradients come back in
the weights' dtypes, bias gradients as ``moec::expert_mlp``'s. The pass
:mod:`moec.passes.gather_up` emits the op; ``h`` is the implementation's layout, as the expert
MLP's (read only by this op's backward).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moec.ops.activations import check_activation, is_gated
from moec.ops.experts import (
    bias_grads,
    expert_mlp_backward_reference,
    expert_mlp_grads_laid_out,
    expert_mlp_grads_like,
    expert_mlp_reference,
    h_saved_only,
)
from moec.ops.grouped import cuda_kernel

OP = "moec::expert_mlp_gathered"


def check_gathered_args(
    x: Tensor, rows: Tensor, w_up: Tensor, w_down: Tensor, offsets: Tensor, activation: str
) -> None:
    """Raise ValueError unless the arguments fit the op (see module), naming the argument."""
    check_activation(activation)
    if x.dim() < 1 or rows.dim() < 1 or x.shape[:-1] != rows.shape[:-1]:
        raise ValueError(
            f"{OP}: x {tuple(x.shape)} and rows {tuple(rows.shape)} must share their leading "
            "dims (x [*, D], rows [*, K])"
        )
    if rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{OP}: rows must be int32 or int64 buffer rows, got {rows.dtype}")
    if w_up.dim() != 3 or w_down.dim() != 3 or offsets.dim() != 1:
        raise ValueError(
            f"{OP}: w_up {tuple(w_up.shape)}, w_down {tuple(w_down.shape)}, offsets "
            f"{tuple(offsets.shape)}: expected w_up [N, D, U], w_down [N, H, D], offsets [N]"
        )
    n, d, u = w_up.shape
    hidden = u // 2 if is_gated(activation) else u
    if x.shape[-1] != d:
        raise ValueError(f"{OP}: x {tuple(x.shape)} has not w_up's D = {d} columns")
    if w_down.shape != (n, hidden, d):
        raise ValueError(
            f"{OP}: w_down {tuple(w_down.shape)} does not fit w_up {tuple(w_up.shape)} for "
            f"{activation!r}: expected ({n}, {hidden}, {d})"
        )
    if offsets.shape != (n,):
        raise ValueError(f"{OP}: offsets {tuple(offsets.shape)}: expected one per expert, ({n},)")


def _flat(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def row_sources(rows: Tensor) -> Tensor:
    """``sources[R]`` int32: the token of every buffer row (``sources[rows[t, k]] = t``; rows no
    accepted route points at: 0)."""
    flat = _flat(rows)
    tokens, top_k = flat.shape
    token = torch.arange(tokens, device=rows.device, dtype=torch.int32)
    return by_row(token[:, None].expand(tokens, top_k), rows)


def by_row(values: Tensor, rows: Tensor) -> Tensor:
    """``out[R]``: each route's value at its buffer row (``out[rows[t, k]] = values[t, k]``;
    rows no accepted route points at: 0). One scatter into a fixed-size tensor, dropped routes
    (-1) sent to a dump slot that is cut off: no host sync."""
    flat = _flat(rows)
    num_rows = flat.numel()
    target = torch.where(flat >= 0, flat, num_rows).reshape(-1).long()
    out = values.new_zeros(num_rows + 1)
    return out.index_copy_(0, target, values.reshape(-1))[:num_rows]


def gather_rows(x: Tensor, rows: Tensor) -> Tensor:
    """The dispatched buffer ``[R, D]`` as a gather of x's rows (rows no route points at hold
    token 0's row)."""
    return _flat(x).index_select(0, row_sources(rows))


def expert_mlp_gathered_reference(
    x: Tensor,
    rows: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    b_up: Tensor | None,
    b_down: Tensor | None,
    activation: str,
) -> tuple[Tensor, Tensor]:
    """The oracle implementation (forward): gather the buffer, then the expert MLP's oracle."""
    buffer = gather_rows(x, rows)
    return expert_mlp_reference(buffer, w_up, w_down, offsets, b_up, b_down, activation)


@torch.library.custom_op("moec::expert_mlp_gathered", mutates_args=())
def expert_mlp_gathered(
    x: Tensor,
    rows: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    b_up: Tensor | None,
    b_down: Tensor | None,
    activation: str,
) -> tuple[Tensor, Tensor]:
    check_gathered_args(x, rows, w_up, w_down, offsets, activation)
    y, h = expert_mlp_gathered_reference(x, rows, w_up, w_down, offsets, b_up, b_down, activation)
    return y.contiguous(), h.contiguous()


def _routed_rows(rows: Tensor):
    """R = T*K (a SymInt while tracing with dynamic shapes)."""
    return math.prod(rows.shape)


@expert_mlp_gathered.register_fake
def _expert_mlp_gathered_fake(x, rows, w_up, w_down, offsets, b_up, b_down, activation):
    check_gathered_args(x, rows, w_up, w_down, offsets, activation)
    num_rows = _routed_rows(rows)
    return x.new_empty((num_rows, x.shape[-1])), x.new_empty((num_rows, w_up.shape[-1]))


def _setup(ctx, inputs, output):
    x, rows, w_up, w_down, offsets, b_up, b_down, activation = inputs
    ctx.save_for_backward(x, rows, w_up, w_down, offsets, output[1])  # x, never the buffer
    h_saved_only(ctx, output[1])
    ctx.activation = activation
    ctx.x_shape = x.shape
    ctx.bias_dtypes = (
        None if b_up is None else b_up.dtype,
        None if b_down is None else b_down.dtype,
    )


def expert_mlp_gathered_backward_reference(
    x: Tensor,
    rows: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_y: Tensor,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The oracle backward without biases: the expert MLP's on the gathered buffer,
    (d_rows[R, D], d_w_up, d_w_down, d_h)."""
    buffer = gather_rows(x, rows)
    return expert_mlp_backward_reference(buffer, w_up, w_down, offsets, h, d_y, activation)


@torch.library.custom_op("moec::expert_mlp_gathered_backward", mutates_args=())
def expert_mlp_gathered_backward(
    x: Tensor,
    rows: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_y: Tensor,
    activation: str,
    up_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_gathered_args(x, rows, w_up, w_down, offsets, activation)
    x = _flat(x)
    args = (x, rows, w_up, w_down, offsets, h, d_y.to(x.dtype), activation)
    kernel = cuda_kernel("expert_mlp_gathered_backward", x)
    if kernel is None:
        grads = expert_mlp_gathered_backward_reference(*args)
    else:  # the kernels' h layout depends on whether the up projection had a bias
        grads = kernel(*args, up_bias=up_bias)
    return expert_mlp_grads_laid_out(grads, w_up, w_down)


@expert_mlp_gathered_backward.register_fake
def _expert_mlp_gathered_backward_fake(x, rows, w_up, w_down, offsets, h, d_y, activation, up_bias):
    check_gathered_args(x, rows, w_up, w_down, offsets, activation)
    return expert_mlp_grads_like(x.new_empty((h.shape[0], x.shape[-1])), w_up, w_down, h)


def _backward(ctx, d_y, d_h_unused):
    if d_y is None:  # y was not used (h takes no gradient): no gradient flows
        return (None,) * 8
    x, rows, w_up, w_down, offsets, h = ctx.saved_tensors
    d_y = d_y.to(x.dtype)
    up_bias = ctx.bias_dtypes[0] is not None
    d_rows, d_w_up, d_w_down, d_h = torch.ops.moec.expert_mlp_gathered_backward(
        x, rows, w_up, w_down, offsets, h, d_y, ctx.activation, up_bias
    )
    d_x = torch.ops.moec.dispatch_backward(d_rows, rows).view(ctx.x_shape)
    d_b_up, d_b_down = bias_grads(d_h, d_y, offsets, ctx.bias_dtypes)
    return d_x, None, d_w_up, d_w_down, None, d_b_up, d_b_down, None


expert_mlp_gathered.register_autograd(_backward, setup_context=_setup)
