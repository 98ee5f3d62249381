"""``moec::expert_mlp_combined``: the gathered expert MLP and its combine as one op.

expert_mlp_combined(x[*, D], rows[*, K], weights[*, K], w_up[N, D, U], w_down[N, H, D],
                    offsets[N] int32, activation) -> (out[*, D], h[R, U])   R = T*K

equals ``moec::combine(moec::expert_mlp_gathered(x, rows, w_up, w_down, offsets, None, None,
activation)[0], weights, rows)`` (no biases), with ``h`` the gathered op's. Being one op lets
its backward weigh the rows where the down projection's dgrad reads them: the internal op ::

    expert_mlp_combined_backward(x, rows, weights, w_up, w_down, offsets, h, d_out, activation)
        -> (d_rows[R, D], d_weights[*, K] in weights' dtype, d_w_up, d_w_down, d_h[R, U])

reads d_out's token rows, scales by the route weight and reduces the weight's gradient
``<y[rows[t, k]], d_out[t]>`` in that GEMM's epilogue on the CuTe DSL
(:func:`moec.kernels.experts.expert_mlp_combined_backward`), so the expert rows' output y is
not kept for backward and their gradient d_y never exists. Where it cannot (the reference, other
backends) y is recomputed from h. Dropped routes (-1) get a zero weight gradient; ``d_x`` is
``moec::dispatch_backward(d_rows, rows)``. Weight gradients come back in the weights' layouts,
as ``moec::expert_mlp``'s. The pass :mod:`moec.passes.combine_experts` emits the op.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moec.ops.experts import (
    expert_mlp_backward_reference,
    expert_mlp_grads_laid_out,
    expert_mlp_reference,
    h_saved_only,
)
from moec.ops.gathered_experts import check_gathered_args, gather_rows
from moec.ops.grouped import cuda_kernel
from moec.ops.movement import combine_backward_reference, combine_reference

OP = "moec::expert_mlp_combined"


def check_combined_args(
    x: Tensor,
    rows: Tensor,
    weights: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    activation: str,
) -> None:
    """Raise ValueError unless the arguments fit the op (see module), naming the argument."""
    check_gathered_args(x, rows, w_up, w_down, offsets, activation)
    if weights.shape != rows.shape or not weights.is_floating_point():
        raise ValueError(
            f"{OP}: weights {tuple(weights.shape)} {weights.dtype} must be floating point, one "
            f"per route: rows' shape {tuple(rows.shape)}"
        )


def expert_mlp_combined_reference(
    x: Tensor,
    rows: Tensor,
    weights: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    activation: str,
) -> tuple[Tensor, Tensor]:
    """The oracle implementation (forward): gather, the expert MLP's oracle, combine."""
    buffer = gather_rows(x, rows)
    y, h = expert_mlp_reference(buffer, w_up, w_down, offsets, None, None, activation)
    return combine_reference(y, weights, rows), h


@torch.library.custom_op("moec::expert_mlp_combined", mutates_args=())
def expert_mlp_combined(
    x: Tensor,
    rows: Tensor,
    weights: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    activation: str,
) -> tuple[Tensor, Tensor]:
    check_combined_args(x, rows, weights, w_up, w_down, offsets, activation)
    out, h = expert_mlp_combined_reference(x, rows, weights, w_up, w_down, offsets, activation)
    return out.contiguous(), h.contiguous()


@expert_mlp_combined.register_fake
def _expert_mlp_combined_fake(x, rows, weights, w_up, w_down, offsets, activation):
    check_combined_args(x, rows, weights, w_up, w_down, offsets, activation)
    return x.new_empty(x.shape), x.new_empty((math.prod(rows.shape), w_up.shape[-1]))


def _setup(ctx, inputs, output):
    x, rows, weights, w_up, w_down, offsets, activation = inputs
    ctx.save_for_backward(x, rows, weights, w_up, w_down, offsets, output[1])  # not y
    h_saved_only(ctx, output[1])
    ctx.activation = activation


def expert_mlp_combined_backward_reference(
    x: Tensor,
    rows: Tensor,
    weights: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_out: Tensor,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The oracle backward: y recomputed on the gathered buffer, then the combine's and the
    expert MLP's oracles, (d_rows, d_weights, d_w_up, d_w_down, d_h)."""
    buffer = gather_rows(x, rows)
    y, _ = expert_mlp_reference(buffer, w_up, w_down, offsets, None, None, activation)
    d_y, d_weights = combine_backward_reference(y, weights, rows, d_out)
    d_rows, d_w_up, d_w_down, d_h = expert_mlp_backward_reference(
        buffer, w_up, w_down, offsets, h, d_y, activation
    )
    return d_rows, d_weights, d_w_up, d_w_down, d_h


@torch.library.custom_op("moec::expert_mlp_combined_backward", mutates_args=())
def expert_mlp_combined_backward(
    x: Tensor,
    rows: Tensor,
    weights: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_out: Tensor,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    check_combined_args(x, rows, weights, w_up, w_down, offsets, activation)
    args = (x, rows, weights, w_up, w_down, offsets, h, d_out.to(x.dtype), activation)
    kernel = cuda_kernel("expert_mlp_combined_backward", x)
    implementation = expert_mlp_combined_backward_reference if kernel is None else kernel
    d_rows, d_weights, d_w_up, d_w_down, d_h = implementation(*args)
    d_rows, d_w_up, d_w_down, d_h = expert_mlp_grads_laid_out(
        (d_rows, d_w_up, d_w_down, d_h), w_up, w_down
    )
    return d_rows, d_weights.to(weights.dtype).contiguous(), d_w_up, d_w_down, d_h


@expert_mlp_combined_backward.register_fake
def _expert_mlp_combined_backward_fake(
    x, rows, weights, w_up, w_down, offsets, h, d_out, activation
):
    check_combined_args(x, rows, weights, w_up, w_down, offsets, activation)
    d_rows = x.new_empty((h.shape[0], x.shape[-1]))
    return (
        d_rows,
        weights.new_empty(weights.shape),
        torch.empty_like(w_up),
        torch.empty_like(w_down),
        x.new_empty(h.shape),
    )


def _backward(ctx, d_out, d_h_unused):
    if d_out is None:  # out was not used (h takes no gradient): no gradient flows
        return (None,) * 7
    x, rows, weights, w_up, w_down, offsets, h = ctx.saved_tensors
    d_rows, d_weights, d_w_up, d_w_down, _ = torch.ops.moec.expert_mlp_combined_backward(
        x, rows, weights, w_up, w_down, offsets, h, d_out, ctx.activation
    )
    d_x = torch.ops.moec.dispatch_backward(d_rows, rows).view(x.shape)
    return d_x, None, d_weights, d_w_up, d_w_down, None, None


expert_mlp_combined.register_autograd(_backward, setup_context=_setup)
