"""``moec::expert_mlp``: every routed expert's MLP over the expert-major buffer in one op.

expert_mlp(x[R, D], w_up[N, D, U], w_down[N, H, D], offsets[N] int32,
           b_up[N, U]?, b_down[N, D]?, activation) -> (y[R, D], h[R, U])

Rows ``[offsets[e-1], offsets[e])`` of x belong to expert e (see ``moec::route``)::

    h = x @ w_up[e] + b_up[e]            # U = 2H for gated activations ([gate | up]), else H
    y = act(h) @ w_down[e] + b_down[e]

``h`` is returned so autograd can keep the pre-activation instead of recomputing the first GEMM;
the graph never reads it, and only this op's backward does, so its column order is the
implementation's (the CuTe DSL kernels interleave a gated h's gate and up columns in pairs).
Weights may be float32 masters while x is bf16: they are cast to x's dtype and their gradients
come back in their own dtype. Rows past ``offsets[-1]`` are garbage in,
garbage out, and contribute nothing to any gradient.

The backward's GEMMs are the internal op::

    expert_mlp_backward(x, w_up, w_down, offsets, h, d_y, activation, up_bias)
        -> (d_x[R, D] x's dtype, d_w_up, d_w_down (the weights' shapes and dtypes), d_h[R, U])

so AOTAutograd traces them as one opaque call (on CUDA the kernels of
:mod:`moec.kernels.experts`, never launched on fake tensors); the bias gradients, row sums of
d_h and d_y, stay plain torch in the autograd formula. Weight gradients have their weights'
strides (``torch.empty_like``'s: a k-major weight, the stacked ``nn.Linear`` layout, gets a
k-major gradient, which autograd accumulates without a copy); every other output is contiguous.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moec.ops.activations import activate, activate_backward, check_activation, is_gated
from moec.ops.grouped import add_row_bias, cuda_kernel, gmm, gmm_wgrad, row_bias_grad, row_experts


def check_expert_mlp_args(
    x: Tensor, w_up: Tensor, w_down: Tensor, offsets: Tensor, activation: str
) -> None:
    """Raise ValueError unless the shapes fit the op (see module) and the activation is known."""
    check_activation(activation)
    n, d, u = w_up.shape
    hidden = u // 2 if is_gated(activation) else u
    if x.shape[-1] != d or w_down.shape != (n, hidden, d) or offsets.shape != (n,):
        raise ValueError(
            f"moec::expert_mlp: shapes do not fit: x {tuple(x.shape)}, w_up {tuple(w_up.shape)}, "
            f"w_down {tuple(w_down.shape)}, offsets {tuple(offsets.shape)} for {activation!r} "
            f"(expected w_down ({n}, {hidden}, {d}) and offsets ({n},))"
        )


def _up(x: Tensor, w_up: Tensor, b_up: Tensor | None, offsets: Tensor, experts: Tensor) -> Tensor:
    h = gmm(x, w_up.to(x.dtype), offsets)
    return h if b_up is None else add_row_bias(h, b_up, experts)


def expert_mlp_reference(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    b_up: Tensor | None,
    b_down: Tensor | None,
    activation: str,
) -> tuple[Tensor, Tensor]:
    """The oracle implementation of ``moec::expert_mlp`` (forward)."""
    experts = row_experts(offsets, x.shape[0])
    h = _up(x, w_up, b_up, offsets, experts)
    y = gmm(activate(h, activation), w_down.to(x.dtype), offsets)
    if b_down is not None:
        y = add_row_bias(y, b_down, experts)
    return y, h


@torch.library.custom_op("moec::expert_mlp", mutates_args=())
def expert_mlp(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    b_up: Tensor | None,
    b_down: Tensor | None,
    activation: str,
) -> tuple[Tensor, Tensor]:
    check_expert_mlp_args(x, w_up, w_down, offsets, activation)
    return expert_mlp_reference(x, w_up, w_down, offsets, b_up, b_down, activation)


@expert_mlp.register_fake
def _expert_mlp_fake(x, w_up, w_down, offsets, b_up, b_down, activation):
    check_expert_mlp_args(x, w_up, w_down, offsets, activation)
    return x.new_empty(x.shape), x.new_empty((x.shape[0], w_up.shape[-1]))


def h_saved_only(ctx, h: Tensor) -> None:
    """An expert MLP op returns its pre-activation h only for its backward to save: h takes no
    gradient (a use of it elsewhere would get none rather than a silently dropped one), and
    autograd hands the backward None for it instead of filling an (R, U) buffer with zeros."""
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)


def _setup(ctx, inputs, output):
    x, w_up, w_down, offsets, b_up, b_down, activation = inputs
    ctx.save_for_backward(x, w_up, w_down, offsets, output[1])
    h_saved_only(ctx, output[1])
    ctx.activation = activation
    ctx.bias_dtypes = (
        None if b_up is None else b_up.dtype,
        None if b_down is None else b_down.dtype,
    )


def expert_mlp_backward_reference(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_y: Tensor,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The oracle backward of ``moec::expert_mlp`` without biases: (d_x, d_w_up, d_w_down, d_h)
    for ``d_y`` in x's dtype; weight gradients in the weights' dtype."""
    act = activate(h, activation)
    d_w_down = gmm_wgrad(act, d_y, offsets).to(w_down.dtype)
    d_act = gmm(d_y, w_down.to(x.dtype).transpose(-1, -2), offsets)
    d_h = activate_backward(h, d_act, activation)
    d_w_up = gmm_wgrad(x, d_h, offsets).to(w_up.dtype)
    d_x = gmm(d_h, w_up.to(x.dtype).transpose(-1, -2), offsets)
    return d_x, d_w_up, d_w_down, d_h


def bias_grads(
    d_h: Tensor,
    d_y: Tensor,
    offsets: Tensor,
    bias_dtypes: tuple[torch.dtype | None, torch.dtype | None],
) -> tuple[Tensor | None, Tensor | None]:
    """(d_b_up, d_b_down): the per-expert row sums of d_h and d_y in the biases' dtypes (None
    for a missing bias)."""
    up_dtype, down_dtype = bias_dtypes
    if up_dtype is None and down_dtype is None:
        return None, None
    experts = row_experts(offsets, d_h.shape[0])
    num_experts = offsets.shape[0]
    d_b_up = None if up_dtype is None else row_bias_grad(d_h, experts, num_experts).to(up_dtype)
    d_b_down = (
        None if down_dtype is None else row_bias_grad(d_y, experts, num_experts).to(down_dtype)
    )
    return d_b_up, d_b_down


@torch.library.custom_op("moec::expert_mlp_backward", mutates_args=())
def expert_mlp_backward(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_y: Tensor,
    activation: str,
    up_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_expert_mlp_args(x, w_up, w_down, offsets, activation)
    args = (x, w_up, w_down, offsets, h, d_y.to(x.dtype), activation)
    kernel = cuda_kernel("expert_mlp_backward", x)
    if kernel is None:
        grads = expert_mlp_backward_reference(*args)
    else:  # the kernels' h layout depends on whether the up projection had a bias
        grads = kernel(*args, up_bias=up_bias)
    return expert_mlp_grads_laid_out(grads, w_up, w_down)


def in_layout_of(t: Tensor, like: Tensor) -> Tensor:
    """``t`` with the strides ``torch.empty_like(like)`` has (a copy only where they differ)."""
    if t.stride() == torch.empty_like(like, device="meta").stride():
        return t
    return torch.empty_like(like, dtype=t.dtype).copy_(t)


def expert_mlp_grads_laid_out(
    grads: tuple[Tensor, ...], w_up: Tensor, w_down: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d_x, d_w_up, d_w_down, d_h) as the expert MLP backward ops return them: weight
    gradients in their weights' layouts, the rest contiguous (see module)."""
    d_x, d_w_up, d_w_down, d_h = grads
    return (
        d_x.contiguous(),
        in_layout_of(d_w_up, w_up),
        in_layout_of(d_w_down, w_down),
        d_h.contiguous(),
    )


def expert_mlp_grads_like(
    x: Tensor, w_up: Tensor, w_down: Tensor, h: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Empty (d_x, d_w_up, d_w_down, d_h) as an expert MLP's backward returns them: the fake
    result of every expert MLP backward op."""
    return (
        x.new_empty(x.shape),
        torch.empty_like(w_up),
        torch.empty_like(w_down),
        x.new_empty(h.shape),
    )


@expert_mlp_backward.register_fake
def _expert_mlp_backward_fake(x, w_up, w_down, offsets, h, d_y, activation, up_bias):
    check_expert_mlp_args(x, w_up, w_down, offsets, activation)
    return expert_mlp_grads_like(x, w_up, w_down, h)


def _backward(ctx, d_y, d_h_unused):
    if d_y is None:  # y was not used (h takes no gradient): no gradient flows
        return (None,) * 7
    x, w_up, w_down, offsets, h = ctx.saved_tensors
    d_y = d_y.to(x.dtype)
    up_bias = ctx.bias_dtypes[0] is not None
    d_x, d_w_up, d_w_down, d_h = torch.ops.moec.expert_mlp_backward(
        x, w_up, w_down, offsets, h, d_y, ctx.activation, up_bias
    )
    d_b_up, d_b_down = bias_grads(d_h, d_y, offsets, ctx.bias_dtypes)
    return d_x, d_w_up, d_w_down, None, d_b_up, d_b_down, None


expert_mlp.register_autograd(_backward, setup_context=_setup)
