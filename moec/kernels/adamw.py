"""One AdamW update of one parameter in a single pass, writing its bf16 working copy too.

adamw_step_(tensors: moec.kernels.adamw_update.AdamWTensors (param fp32, grad fp32|bf16,
                    exp_avg, exp_avg_sq, copy bf16 | None, grad_scale | None, found_inf | None),
            update: moec.kernels.adamw_update.AdamWStep (lr, beta1, beta2, eps, weight_decay, step))
    grad      /= grad_scale                      (the clip factor, a device scalar: no host read)
    param     *= 1 - lr * weight_decay
    exp_avg    = exp_avg + (1 - beta1) * (grad - exp_avg)
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    param     -= lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^step) + eps)
    copy       = bf16(param)

``update.step`` is a host float, or the parameter's step counter as a float32 device tensor
(the count of this update, torch's capturable layout): the kernel then computes the
bias corrections from it. ``update.lr`` may be a float32 device scalar too (with a device step):
the kernel reads it, so a captured CUDA graph follows the schedule's learning rate.
``found_inf`` (a float32 device scalar, nonzero to skip) masks every
load and store: a skipped update leaves the parameter, its moments and its copy as they were.
torch's single-tensor AdamW in the same order (its ``lerp`` for weights below 1/2 is the
exp_avg line), with IEEE division and square root, so results agree to float32 rounding (the
compiler may fuse a multiply-add). Reads 14 bytes per element (bf16 gradients) and writes 14;
torch's fused AdamW over float32 gradients plus the cast of the working copy and of the
gradient from bf16 move 40.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from moec.kernels.adamw_update import AdamWStep, AdamWTensors

BLOCK = 1024


@triton.jit
def _adamw_kernel(
    # pointers
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    copy_ptr,
    grad_scale_ptr,
    step_ptr,
    found_inf_ptr,
    lr_ptr,
    # sizes and hyper-parameters (host floats: bias corrections are computed on the host)
    n,
    decay,
    lr,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    step_size,
    bias_correction2_sqrt,
    eps,
    weight_decay,
    # meta-parameters
    HAS_COPY: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DEVICE_STEP: tl.constexpr,
    DEVICE_LR: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_FOUND_INF:  # a skipped step touches no element
        n = tl.where(tl.load(found_inf_ptr) == 0, n, 0)
    mask = offs < n
    if DEVICE_LR:  # as the host computes them from the float lr, in float32
        lr = tl.load(lr_ptr)
        decay = 1.0 - lr * weight_decay
    if DEVICE_STEP:
        step = tl.load(step_ptr)
        step_size = tl.div_rn(lr, 1.0 - tl.exp2(step * tl.log2(beta1)))
        bias_correction2_sqrt = tl.sqrt_rn(1.0 - tl.exp2(step * tl.log2(beta2)))
    grad = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    if HAS_SCALE:
        grad = tl.div_rn(grad, tl.load(grad_scale_ptr))
    param = tl.load(param_ptr + offs, mask=mask) * decay
    exp_avg = tl.load(exp_avg_ptr + offs, mask=mask)
    exp_avg = exp_avg + one_minus_beta1 * (grad - exp_avg)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offs, mask=mask) * beta2
    exp_avg_sq = exp_avg_sq + one_minus_beta2 * grad * grad
    denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
    param = param - step_size * tl.div_rn(exp_avg, denom)
    tl.store(param_ptr + offs, param, mask=mask)
    tl.store(exp_avg_ptr + offs, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, exp_avg_sq, mask=mask)
    if HAS_COPY:
        rounded = param.to(copy_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(copy_ptr + offs, rounded, mask=mask)


def adamw_step_(tensors: AdamWTensors, update: AdamWStep) -> None:
    """Update ``tensors``' parameter, moments (and copy) in place; all of one shape and one
    dense layout (:func:`kernel_applies`): the kernel walks their storage as flat."""
    param, copy = tensors.param, tensors.copy
    grad_scale, found_inf = tensors.grad_scale, tensors.found_inf
    n = param.numel()
    device_step = isinstance(update.step, Tensor)
    device_lr = isinstance(update.lr, Tensor)
    if device_lr and not device_step:
        raise ValueError("adamw_step_: a device lr needs the step counter on the device too")
    host = update if not device_step else dataclasses.replace(update, step=1.0)
    if device_lr:  # the host-side factors are unused: the kernel derives them from the lr
        host = dataclasses.replace(host, lr=1.0)
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param,
        tensors.grad,
        tensors.exp_avg,
        tensors.exp_avg_sq,
        param if copy is None else copy,
        param if grad_scale is None else grad_scale,
        update.step if device_step else param,
        param if found_inf is None else found_inf,
        update.lr if device_lr else param,
        n,
        host.decay,
        host.lr,
        update.beta1,
        1 - update.beta1,
        update.beta2,
        1 - update.beta2,
        host.step_size,
        host.bias_correction2_sqrt,
        update.eps,
        update.weight_decay,
        HAS_COPY=copy is not None,
        HAS_SCALE=grad_scale is not None,
        DEVICE_STEP=device_step,
        DEVICE_LR=device_lr,
        HAS_FOUND_INF=found_inf is not None,
        BLOCK=BLOCK,
    )


def kernel_applies(param: Tensor, grad: Tensor, *others: Tensor | None) -> bool:
    """Whether :func:`adamw_step_` takes this parameter (else torch's AdamW does): float32 on a
    supported device, and ``grad`` and ``others`` (moments, working copy; None: absent) of its
    shape and strides, all dense (a k-major expert weight, whose moments and gradient follow
    its strides, qualifies)."""
    from moec.kernels import arch

    tensors = [param, grad, *(t for t in others if t is not None)]
    return (
        arch.supported(param, grad)
        and param.dtype == torch.float32
        and grad.dtype in (torch.float32, torch.bfloat16)
        and not grad.is_sparse
        and _dense(param)
        and all(t.shape == param.shape and t.stride() == param.stride() for t in tensors)
    )


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once (some order of its dims is
    contiguous)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
