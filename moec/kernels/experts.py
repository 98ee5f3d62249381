"""The expert MLP on the kernels: fused up projection + activation, down projection, and the
backward with the activation's gradient fused into the down projection's dgrad.

forward:  h, a = gmm_act(x, w_up)          (R, U), (R, H)
          y    = gmm(a, w_down)            (R, D)
backward: d_h, a = gmm_act_backward(d_y, w_down, h)      d_a = d_y @ w_down^T, then act'
          d_w_down = a^T d_y,  d_w_up = x^T d_h  (gmm_wgrad, written in the weights' dtype)
          d_x = d_h @ w_up^T

Inputs the kernels take: float32/16/bf16 x, int32 offsets, an activation with a kernel code.
The backward returns d_h, from which the caller reduces the bias gradients.
"""

from __future__ import annotations

from torch import Tensor

from moec.kernels import cute_gemm
from moec.kernels import grouped_gemm as gg
from moec.kernels.activation import KernelActivation


def expert_mlp(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    b_up: Tensor | None,
    b_down: Tensor | None,
    act: KernelActivation,
) -> tuple[Tensor, Tensor]:
    """(y, h): the expert MLP's output and pre-activation; weights cast to x's dtype."""
    x = x.contiguous()
    h, a = gg.gmm_act(x, w_up.to(x.dtype), offsets, b_up, act)
    y = gg.gmm(a, w_down.to(x.dtype), offsets, b_down, piece="down")
    return y, h


def expert_mlp_backward(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_y: Tensor,
    act: KernelActivation,
    up_bias: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d_x, d_w_up, d_w_down, d_h) for the output gradient d_y; weight gradients in the
    weights' dtype. ``up_bias``: the forward had an up-projection bias (it decides, with the
    operands, how the forward laid out a gated h: :func:`grouped_gemm.h_interleaved`); d_h is
    returned in ``[gate | up]`` order unless h was interleaved, which never has a bias."""
    d_y = d_y.to(x.dtype).contiguous()
    w_up_x = w_up.to(x.dtype)  # what the forward's GEMM read
    interleaved = gg.h_interleaved(x, w_up_x, up_bias, act)
    d_h, a = gg.gmm_act_backward(d_y, w_down.to(x.dtype), offsets, h, act, interleaved)
    d_w_down = gg.gmm_wgrad(a, d_y, offsets, out_dtype=w_down.dtype)
    if interleaved:
        d_w_up = cute_gemm.deinterleave(gg.gmm_wgrad(x, d_h, offsets), w_up.dtype)
        w_up_x = cute_gemm.interleave(w_up_x, x.dtype)
    else:
        d_w_up = gg.gmm_wgrad(x, d_h, offsets, out_dtype=w_up.dtype)
    d_x = gg.gmm(d_h, w_up_x.transpose(-1, -2), offsets, piece="dgrad")
    return d_x, d_w_up, d_w_down, d_h
