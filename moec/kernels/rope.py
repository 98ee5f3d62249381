"""Rotary position embedding for ``moec::rope``: one read of x (and the tables), one write.

rope(x[..., D], cos, sin, dtype, backward) -> out[..., D] (contiguous, ``dtype``):
    forward   out_lo = x_lo cos_lo - x_hi sin_lo,  out_hi = x_hi cos_hi + x_lo sin_hi
    backward  (its transpose, x being the incoming gradient)
              out_lo = x_lo cos_lo + x_hi sin_hi,  out_hi = x_hi cos_hi - x_lo sin_lo
where lo / hi are the halves of the last dimension. x has up to 4 dimensions and any strides
(q and k arrive as transposed views of the projections); cos / sin are broadcast by stride-0
expansion, so a (S, D) table is read, never materialised at x's size. Arithmetic in float32;
x float32/16/bf16 (wider inputs are the caller's to handle).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_R = 32
MAX_DIMS = 4
"""Dimensions of x the kernel takes."""


@triton.jit
def _rope_kernel(
    # pointers
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    # sizes: rows = N0 * N1 * N2 of x's leading dimensions, HALF = D / 2
    R,
    N1,
    N2,
    HALF,
    # strides of the three leading dimensions (the last one is 1)
    sx0,
    sx1,
    sx2,
    sc0,
    sc1,
    sc2,
    ss0,
    ss1,
    ss2,
    # meta-parameters
    BACKWARD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HALF_P2: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    i2 = rows % N2
    i1 = (rows // N2) % N1
    i0 = rows // (N1 * N2)
    cols = tl.arange(0, HALF_P2)[None, :]
    mask = (rows < R)[:, None] & (cols < HALF)
    x_at = x_ptr + (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None] + cols
    c_at = cos_ptr + (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None] + cols
    s_at = sin_ptr + (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None] + cols
    x_lo = tl.load(x_at, mask=mask).to(tl.float32)
    x_hi = tl.load(x_at + HALF, mask=mask).to(tl.float32)
    c_lo = tl.load(c_at, mask=mask).to(tl.float32)
    c_hi = tl.load(c_at + HALF, mask=mask).to(tl.float32)
    s_lo = tl.load(s_at, mask=mask).to(tl.float32)
    s_hi = tl.load(s_at + HALF, mask=mask).to(tl.float32)
    if BACKWARD:
        out_lo = x_lo * c_lo + x_hi * s_hi
        out_hi = x_hi * c_hi - x_lo * s_lo
    else:
        out_lo = x_lo * c_lo - x_hi * s_lo
        out_hi = x_hi * c_hi + x_lo * s_hi
    out_at = out_ptr + rows[:, None] * (2 * HALF) + cols
    tl.store(out_at, out_lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_at + HALF, out_hi.to(out_ptr.dtype.element_ty), mask=mask)


def _leading_strides(t: Tensor) -> list[int]:
    return list(t.stride()[:-1])


def rope(x: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype, backward: bool) -> Tensor:
    """The rotation of x (forward, or its transpose, the gradient w.r.t. x, when ``backward``),
    written in ``dtype``."""
    if x.dim() > MAX_DIMS:
        raise ValueError(f"rope kernel: x has {x.dim()} dimensions, at most {MAX_DIMS} supported")
    given, shape = x.shape, (1,) * (MAX_DIMS - x.dim()) + tuple(x.shape)
    x, cos, sin = (t.expand(given).reshape(shape) for t in (x, cos, sin))
    x, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, cos, sin))
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    rows, half = x.numel() // x.shape[-1], x.shape[-1] // 2
    if rows == 0:
        return out.view(given)
    _rope_kernel[(triton.cdiv(rows, BLOCK_R),)](
        x, cos, sin, out, rows, x.shape[1], x.shape[2], half,
        *_leading_strides(x), *_leading_strides(cos), *_leading_strides(sin),
        BACKWARD=backward, BLOCK_R=BLOCK_R, HALF_P2=triton.next_power_of_2(half), num_warps=4,
    )  # fmt: skip
    return out.view(given)
