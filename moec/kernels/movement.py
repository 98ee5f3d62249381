"""Row-movement kernels for ``moec::dispatch`` and ``moec::combine`` (and their backwards).

dispatch(x[T, D], rows[T, K]) -> buf[R, D]:  buf[rows[t, k]] = x[t] for accepted routes; other
    rows of buf are left unwritten (garbage, as the op's contract allows).
combine(y[R, D], weights[T, K]?, rows[T, K]) -> out[T, D]:  sum over accepted k of
    weights[t, k] * y[rows[t, k]] in float32; without weights it is dispatch's backward.
combine_backward(y, weights, rows, d_out) -> d_y[R, D], d_weights[T, K]:  one pass that writes
    d_y[rows[t, k]] = weights[t, k] * d_out[t] and d_weights[t, k] = <y[rows[t, k]], d_out[t]>.

One program per token; it holds the token's K rows as a (K_P2, BLOCK_D) tile and walks D. Rows of
dropped routes (-1) are masked out of every load, so NaN/garbage in unreferenced rows of y
never leaks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _dispatch_kernel(
    # pointers
    x_ptr,  # (T, D)
    rows_ptr,  # (T, TOP_K) int64
    buf_ptr,  # (R, D)
    # sizes and strides
    D,
    stride_x,
    stride_b,
    # meta-parameters
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_P2)
    rows = tl.load(rows_ptr + t * TOP_K + ks, mask=ks < TOP_K, other=-1)
    valid = rows >= 0
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        v = tl.load(x_ptr + t * stride_x + d, mask=d < D)
        tile = tl.broadcast_to(v[None, :], (K_P2, BLOCK_D))
        tl.store(
            buf_ptr + rows[:, None] * stride_b + d[None, :],
            tile,
            mask=valid[:, None] & (d < D)[None, :],
        )


@triton.jit
def _combine_kernel(
    # pointers
    y_ptr,  # (R, D)
    weights_ptr,  # (T, TOP_K), read when HAS_WEIGHTS
    rows_ptr,  # (T, TOP_K) int64
    out_ptr,  # (T, D)
    # sizes and strides
    D,
    stride_y,
    stride_o,
    # meta-parameters
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_P2)
    rows = tl.load(rows_ptr + t * TOP_K + ks, mask=ks < TOP_K, other=-1)
    valid = rows >= 0
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + t * TOP_K + ks, mask=valid, other=0.0).to(tl.float32)
    else:
        w = valid.to(tl.float32)
    w = tl.where(valid, w, 0.0)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        tile = tl.load(
            y_ptr + rows[:, None] * stride_y + d[None, :],
            mask=valid[:, None] & (d < D)[None, :],
            other=0.0,
        ).to(tl.float32)
        acc = tl.sum(tile * w[:, None], axis=0)
        tl.store(out_ptr + t * stride_o + d, acc.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _combine_backward_kernel(
    # pointers
    y_ptr,  # (R, D)
    weights_ptr,  # (T, TOP_K)
    rows_ptr,  # (T, TOP_K) int64
    d_out_ptr,  # (T, D)
    d_y_ptr,  # (R, D) out
    d_weights_ptr,  # (T, TOP_K) out
    # sizes and strides
    D,
    stride_y,
    stride_do,
    stride_dy,
    # meta-parameters
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_P2)
    rows = tl.load(rows_ptr + t * TOP_K + ks, mask=ks < TOP_K, other=-1)
    valid = rows >= 0
    w = tl.load(weights_ptr + t * TOP_K + ks, mask=valid, other=0.0).to(tl.float32)
    acc = tl.zeros((K_P2,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        g = tl.load(d_out_ptr + t * stride_do + d, mask=d < D, other=0.0).to(tl.float32)
        mask = valid[:, None] & (d < D)[None, :]
        tile = tl.load(y_ptr + rows[:, None] * stride_y + d[None, :], mask=mask, other=0.0)
        acc += tl.sum(tile.to(tl.float32) * g[None, :], axis=1)
        d_y = (w[:, None] * g[None, :]).to(d_y_ptr.dtype.element_ty)
        tl.store(d_y_ptr + rows[:, None] * stride_dy + d[None, :], d_y, mask=mask)
    tl.store(
        d_weights_ptr + t * TOP_K + ks, acc.to(d_weights_ptr.dtype.element_ty), mask=ks < TOP_K
    )


def _block_d(dim: int, k_p2: int) -> int:
    return max(16, min(triton.next_power_of_2(dim), 4096 // k_p2, 512))


def _flat(t: Tensor) -> Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _num_warps(block_d: int, k_p2: int) -> int:
    return 8 if block_d * k_p2 >= 4096 else 4


def dispatch(x: Tensor, rows: Tensor) -> Tensor:
    """``moec::dispatch``: (T, D) tokens -> (T*K, D) expert-major buffer; unwritten rows garbage."""
    flat_x, flat_rows = _flat(x), rows.reshape(-1, rows.shape[-1]).contiguous()
    tokens, top_k = flat_rows.shape
    if flat_x.shape[0] != tokens:
        raise ValueError(f"dispatch: x has {flat_x.shape[0]} tokens, rows {tokens}")
    dim = flat_x.shape[-1]
    buf = flat_x.new_empty(rows.numel(), dim)
    if tokens == 0 or dim == 0:
        return buf
    k_p2 = triton.next_power_of_2(top_k)
    block_d = _block_d(dim, k_p2)
    _dispatch_kernel[(tokens,)](
        flat_x, flat_rows, buf, dim, flat_x.stride(0), buf.stride(0),
        TOP_K=top_k, K_P2=k_p2, BLOCK_D=block_d, num_warps=_num_warps(block_d, k_p2),
    )  # fmt: skip
    return buf


def combine(y: Tensor, weights: Tensor | None, rows: Tensor) -> Tensor:
    """``moec::combine`` (``weights=None``: unweighted gather-sum, dispatch's backward)."""
    flat_rows = rows.reshape(-1, rows.shape[-1]).contiguous()
    tokens, top_k = flat_rows.shape
    y = y if y.stride(-1) == 1 else y.contiguous()
    dim = y.shape[-1]
    out = y.new_empty(tokens, dim)
    if tokens == 0 or dim == 0:
        return out.view(*rows.shape[:-1], dim)
    flat_w = flat_rows if weights is None else weights.reshape(tokens, top_k).contiguous()
    k_p2 = triton.next_power_of_2(top_k)
    block_d = _block_d(dim, k_p2)
    _combine_kernel[(tokens,)](
        y, flat_w, flat_rows, out, dim, y.stride(0), out.stride(0),
        TOP_K=top_k, K_P2=k_p2, BLOCK_D=block_d, HAS_WEIGHTS=weights is not None,
        num_warps=_num_warps(block_d, k_p2),
    )  # fmt: skip
    return out.view(*rows.shape[:-1], dim)


def combine_backward(
    y: Tensor, weights: Tensor, rows: Tensor, d_out: Tensor
) -> tuple[Tensor, Tensor]:
    """Gradients of ``moec::combine`` w.r.t. y (rows no route reads are garbage) and weights."""
    flat_rows = rows.reshape(-1, rows.shape[-1]).contiguous()
    tokens, top_k = flat_rows.shape
    flat_d = _flat(d_out)
    y = y if y.stride(-1) == 1 else y.contiguous()
    dim = y.shape[-1]
    d_y = flat_d.new_empty(y.shape)
    d_weights = torch.empty(weights.shape, dtype=weights.dtype, device=weights.device)
    if tokens == 0:
        return d_y, d_weights
    k_p2 = triton.next_power_of_2(top_k)
    block_d = _block_d(dim, k_p2)
    _combine_backward_kernel[(tokens,)](
        y, weights.reshape(tokens, top_k).contiguous(), flat_rows, flat_d, d_y, d_weights,
        dim, y.stride(0), flat_d.stride(0), d_y.stride(0),
        TOP_K=top_k, K_P2=k_p2, BLOCK_D=block_d, num_warps=_num_warps(block_d, k_p2),
    )  # fmt: skip
    return d_y, d_weights
