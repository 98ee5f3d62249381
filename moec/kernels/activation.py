"""Expert activations in Triton: the math shared by the GEMM epilogues, and elementwise kernels.

An activation reaches the kernels as a :class:`KernelActivation`: the ``ACT`` code of its unary
function (:data:`UNARY_CODES`) and whether it is gated::

    act_forward(h[R, U], act) -> a[R, H]        a = f(h), or f(h[:, :H]) * h[:, H:] if gated
    act_backward(h[R, U], d_a[R, H], act) -> d_h[R, U], a[R, H]
        the gradient of that map at h, and a recomputed for the wgrad.
    act_gradient(h[R, U], d_a[R, H], act) -> d_h[R, U]
        the gradient alone (``moec::glu``'s backward: its down projection saved a itself), one
        [R, H] write fewer.

Their tiles are autotuned per width and mode (``MOEC_AUTOTUNE=0`` keeps the first).

Math runs in float32 on values read in the storage dtype (so a fused epilogue that rounds h
first computes exactly what these kernels compute from the stored h).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from moec.kernels import tuning
from moec.kernels.arch import interpreting

UNARY_CODES = {"gelu": 0, "gelu_tanh": 1, "silu": 2, "relu": 3}
"""The unary functions the kernels compute, by name, and their code in the ``ACT`` constexpr
(gelu: erf form; gelu_tanh: tanh approximation; silu: x sigmoid(x); relu)."""


class KernelActivation(NamedTuple):
    """An activation as the kernels take it."""

    code: int
    """``ACT``: the code of the unary function f (a value of :data:`UNARY_CODES`)."""
    gated: bool
    """True: h = [gate | up] of width 2H and a = f(gate) * up; False: a = f(h)."""


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def act_value(x, ACT: tl.constexpr):
    """act(x) for float32 x; ACT: 0 gelu, 1 gelu_tanh, 2 silu, 3 relu."""
    if ACT == 0:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 1:
        y = x * _sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    elif ACT == 2:
        y = x * _sigmoid(x)
    else:
        y = tl.maximum(x, 0.0)
    return y


@triton.jit
def act_derivative(x, ACT: tl.constexpr):
    """d act / dx for float32 x (same codes as :func:`act_value`)."""
    if ACT == 0:
        y = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(
            -0.5 * x * x
        )
    elif ACT == 1:
        t = 2.0 * _sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x)) - 1.0
        y = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (
            1.0 + 0.134145 * x * x
        )
    elif ACT == 2:
        s = _sigmoid(x)
        y = s * (1.0 + x * (1.0 - s))
    else:
        y = (x > 0).to(tl.float32)
    return y


@triton.jit
def _act_kernel(
    # pointers
    h_ptr,  # (R, U) pre-activation
    d_a_ptr,  # (R, H) gradient of the activation output, read when BACKWARD
    a_ptr,  # (R, H) activation output
    d_h_ptr,  # (R, U) written when BACKWARD
    # sizes and strides (h/d_h share a row stride, a/d_a share one)
    R,
    H,
    stride_h,
    stride_a,
    # meta-parameters
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    BACKWARD: tl.constexpr,
    STORE_A: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < R)[:, None] & (cols < H)[None, :]
    h_off = rows[:, None].to(tl.int64) * stride_h + cols[None, :]
    a_off = rows[:, None].to(tl.int64) * stride_a + cols[None, :]
    g = tl.load(h_ptr + h_off, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        u = tl.load(h_ptr + h_off + H, mask=mask, other=0.0).to(tl.float32)
        a = act_value(g, ACT) * u
    else:
        a = act_value(g, ACT)
    if STORE_A:
        tl.store(a_ptr + a_off, a.to(a_ptr.dtype.element_ty), mask=mask)
    if BACKWARD:
        d_a = tl.load(d_a_ptr + a_off, mask=mask, other=0.0).to(tl.float32)
        if GATED:
            tl.store(
                d_h_ptr + h_off,
                (d_a * u * act_derivative(g, ACT)).to(d_h_ptr.dtype.element_ty),
                mask=mask,
            )
            tl.store(
                d_h_ptr + h_off + H,
                (d_a * act_value(g, ACT)).to(d_h_ptr.dtype.element_ty),
                mask=mask,
            )
        else:
            tl.store(
                d_h_ptr + h_off,
                (d_a * act_derivative(g, ACT)).to(d_h_ptr.dtype.element_ty),
                mask=mask,
            )


def _config(rows: int, cols: int, warps: int) -> triton.Config:
    return triton.Config({"BLOCK_R": rows, "BLOCK_H": cols}, num_warps=warps)


TILES = (
    _config(16, 256, 4),
    _config(8, 512, 4),
    _config(4, 1024, 4),
    _config(16, 512, 8),
    _config(32, 256, 8),
    _config(2, 2048, 8),
)
"""Autotune candidates (rows x columns of a, warps); the first is the untuned default."""


@functools.cache
def _tuned() -> tuning.TableFirst:
    """The autotuned kernel, the shipped tile table consulted first (:mod:`.tuning`;
    ``MOEC_AUTOTUNE=0`` and the interpreter keep the first tile: tests, CI). The tile depends
    on the row width and the mode, not on the number of rows."""
    untuned = os.environ.get("MOEC_AUTOTUNE", "1") == "0" or interpreting()
    tiles = list(TILES[:1] if untuned else TILES)
    key = ["H", "ACT", "GATED", "BACKWARD", "STORE_A"]
    tuned = triton.autotune(configs=tiles, key=key, cache_results=True)(_act_kernel)
    return tuning.TableFirst("activation.act", tuned)


def _launch(
    h: Tensor, d_a: Tensor | None, act: KernelActivation, store_a: bool = True
) -> tuple[Tensor | None, Tensor | None]:
    code, gated = act
    h = h.contiguous()
    rows, width = h.shape
    hidden = width // 2 if gated else width
    a = h.new_empty(rows, hidden) if store_a else None
    d_h = None if d_a is None else torch.empty_like(h)
    if d_a is not None and d_a.shape != (rows, hidden):
        raise ValueError(f"act_backward: d_a {tuple(d_a.shape)} != {(rows, hidden)}")
    if rows == 0 or hidden == 0:
        return a, d_h
    d_a = None if d_a is None else d_a.contiguous()
    a_like = a if a is not None else d_a  # a's row stride; an unused pointer where a is not kept
    assert a_like is not None

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(rows, meta["BLOCK_R"]), triton.cdiv(hidden, meta["BLOCK_H"])

    _tuned()[grid](
        h, a_like if d_a is None else d_a, a_like, h if d_h is None else d_h,
        rows, hidden, h.stride(0), a_like.stride(0),
        ACT=code, GATED=gated, BACKWARD=d_a is not None, STORE_A=store_a,
    )  # fmt: skip
    return a, d_h


def act_forward(h: Tensor, act: KernelActivation) -> Tensor:
    """a: the activation of h (R, U) in one kernel."""
    a = _launch(h, None, act)[0]
    assert a is not None
    return a


def act_backward(h: Tensor, d_a: Tensor, act: KernelActivation) -> tuple[Tensor, Tensor]:
    """(d_h, a): the activation's gradient at h for the output gradient d_a, and a, in one
    kernel."""
    a, d_h = _launch(h, d_a, act)
    assert d_h is not None and a is not None
    return d_h, a


def act_gradient(h: Tensor, d_a: Tensor, act: KernelActivation) -> Tensor:
    """d_h: the activation's gradient at h for the output gradient d_a, without writing a."""
    d_h = _launch(h, d_a, act, store_a=False)[1]
    assert d_h is not None
    return d_h
