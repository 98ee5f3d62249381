"""``moec::expert_mlp`` on the kernels: fused up projection + activation, down projection, and
the backward with the activation's gradient fused into the down projection's dgrad.

forward:  h, a = gmm_act(x, w_up)          (R, U), (R, H)
          y    = gmm(a, w_down)            (R, D)
backward: d_h, a = gmm_act_backward(d_y, w_down, h)      d_a = d_y @ w_down^T, then act'
          d_w_down = a^T d_y,  d_w_up = x^T d_h  (gmm_wgrad, written in the weights' dtype)
          d_x = d_h @ w_up^T
Biases use the reference row reductions of :mod:`moec.ops.grouped` (sync-free index_add).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moec.kernels import grouped_gemm as gg
from moec.kernels.arch import float_supported
from moec.ops.experts import expert_mlp_reference
from moec.ops.grouped import row_bias_grad, row_experts


def expert_mlp(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    b_up: Tensor | None,
    b_down: Tensor | None,
    activation: str,
) -> tuple[Tensor, Tensor]:
    """Forward of ``moec::expert_mlp``: (y, h)."""
    if not float_supported(x, w_up, w_down, offsets) or offsets.dtype != torch.int32:
        return expert_mlp_reference(x, w_up, w_down, offsets, b_up, b_down, activation)
    x = x.contiguous()
    h, a = gg.gmm_act(x, w_up.to(x.dtype), offsets, b_up, activation)
    y = gg.gmm(a, w_down.to(x.dtype), offsets, b_down, piece="down")
    return y, h


def expert_mlp_backward(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_y: Tensor,
    activation: str,
    bias_dtypes: tuple[torch.dtype | None, torch.dtype | None],
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """(d_x, d_w_up, d_w_down, d_b_up, d_b_down) of ``moec::expert_mlp``."""
    d_y = d_y.to(x.dtype).contiguous()
    d_h, a = gg.gmm_act_backward(d_y, w_down.to(x.dtype), offsets, h, activation)
    d_w_down = gg.gmm_wgrad(a, d_y, offsets, out_dtype=w_down.dtype)
    d_w_up = gg.gmm_wgrad(x, d_h, offsets, out_dtype=w_up.dtype)
    d_x = gg.gmm(d_h, w_up.to(x.dtype).transpose(-1, -2), offsets, piece="dgrad")
    up_dtype, down_dtype = bias_dtypes
    d_b_up = d_b_down = None
    if up_dtype is not None or down_dtype is not None:
        experts = row_experts(offsets, x.shape[0])
        num_experts = offsets.shape[0]
        if up_dtype is not None:
            d_b_up = row_bias_grad(d_h, experts, num_experts).to(up_dtype)
        if down_dtype is not None:
            d_b_down = row_bias_grad(d_y, experts, num_experts).to(down_dtype)
    return d_x, d_w_up, d_w_down, d_b_up, d_b_down
