"""The expert MLP with FP8 rowwise GEMMs on Hopper: quantizers fused where the data passes
anyway, the weight gradients in the inputs' precision.

forward:  h = gmm8(q(x), q(w_up))                        fast accumulation
          y = gmm8(q(act(h)), q(w_down))                 act and its quantizer in one kernel
backward: d_a = gmm8(q(d_y), q(w_down^T))                exact accumulation
          d_h, a = act_backward(h, d_a)
          d_w_down = a^T d_y,  d_w_up = x^T d_h          bf16 operands, float32 accumulation
          d_x = gmm8(q(d_h), q(w_up^T))                  exact accumulation

``gmm8`` is :func:`moec.kernels.fp8_rowwise.rowwise_gmm` (``torch._scaled_grouped_mm``, sm90),
``q`` the rowwise quantizer (weights per output channel). The weight gradients stay out of FP8
as in torchao's float8 training: a rowwise scale along the summed token dimension would not be
per-row. Rows past ``offsets[-1]`` are garbage in every output, as in the bf16 expert MLP.

Inputs the kernels take: bf16 x, int32 offsets, weights of any float dtype (read in x's
dtype, as the bf16 expert MLP reads them), an activation with a kernel code, no biases, every
GEMM dimension a multiple of 16 (:func:`takes`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moec.kernels import fp8_rowwise
from moec.kernels import grouped_gemm as gg
from moec.kernels.activation import KernelActivation, act_backward
from moec.kernels.experts import ExpertOperands


def takes(operands: ExpertOperands) -> bool:
    """Whether these operands run here: bf16 x on a device with the FP8 grouped GEMM, int32
    offsets, and 16-aligned D, U and H (each GEMM's K and N)."""
    x, w_up, w_down, offsets = operands
    dims = (x.shape[-1], w_up.shape[-1], w_down.shape[-2])
    return (
        x.dtype == torch.bfloat16
        and offsets.dtype == torch.int32
        and all(d % 16 == 0 for d in dims)
        and fp8_rowwise.scaled_grouped_mm_available(x.device)
    )


def expert_mlp(operands: ExpertOperands, act: KernelActivation) -> tuple[Tensor, Tensor]:
    """(y, h): the output and the pre-activation, both in x's dtype."""
    x, w_up, w_down, offsets = operands
    x = x.contiguous()
    w_up_q = fp8_rowwise.quantize_weight(w_up.to(x.dtype))
    w_down_q = fp8_rowwise.quantize_weight(w_down.to(x.dtype))
    h = fp8_rowwise.rowwise_gmm(
        fp8_rowwise.rowwise_quantize(x), w_up_q, offsets, x.dtype, fast_accum=True
    )
    a_q = fp8_rowwise.rowwise_quantize(h, act)
    y = fp8_rowwise.rowwise_gmm(a_q, w_down_q, offsets, x.dtype, fast_accum=True)
    return y, h


def expert_mlp_backward(
    operands: ExpertOperands, h: Tensor, d_y: Tensor, act: KernelActivation
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d_x, d_w_up, d_w_down, d_h) for the output gradient d_y; weight gradients in the
    weights' dtype, the others in x's."""
    x, w_up, w_down, offsets = operands
    x, d_y = x.contiguous(), d_y.to(x.dtype).contiguous()
    d_a = _dgrad(d_y, w_down.to(x.dtype), offsets)
    d_h, a = act_backward(h, d_a, act)
    d_w_down = gg.gmm_wgrad(a, d_y, offsets, out_dtype=w_down.dtype)
    d_w_up = gg.gmm_wgrad(x, d_h, offsets, out_dtype=w_up.dtype)
    return _dgrad(d_h, w_up.to(x.dtype), offsets), d_w_up, d_w_down, d_h


def _dgrad(d_out: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """``d_out[r] @ w[e(r)]^T`` in FP8 with exact accumulation (gradients keep their small
    terms); w^T's output channels are w's rows, so its quantizer reads w without a copy."""
    w_t = fp8_rowwise.quantize_weight(w.transpose(-1, -2))
    return fp8_rowwise.rowwise_gmm(fp8_rowwise.rowwise_quantize(d_out), w_t, offsets, d_out.dtype)
