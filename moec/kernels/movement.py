"""Row-movement kernels for ``moec::dispatch`` and ``moec::combine`` (and their backwards).

dispatch(x[T, D], rows[T, K]) -> buf[R, D]:  buf[rows[t, k]] = x[t] for accepted routes; other
    rows of buf are left unwritten (garbage, as the op's contract allows).
combine(y[R, D], weights[T, K]?, rows[T, K]) -> out[T, D]:  sum over accepted k of
    weights[t, k] * y[rows[t, k]] in float32; without weights it is dispatch's backward.
combine_backward(y, weights, rows, d_out) -> d_y[R, D], d_weights[T, K]:  one pass that writes
    d_y[rows[t, k]] = weights[t, k] * d_out[t] and d_weights[t, k] = <y[rows[t, k]], d_out[t]>.

These are pure bandwidth: a program owns a (BLOCK_T tokens x BLOCK_D columns) tile and unrolls
the K routes, so each route is one contiguous, vectorised row load (or store) per token, the K
loads are in flight together, and the sum over K stays in the thread's registers (no cross-warp
reduction). Rows of dropped routes (-1) are masked out of every load, so NaN/garbage in
unreferenced rows of y never leaks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_T = 4  # tokens per program; with BLOCK_D = 512 a tile is 2048 elements (4 warps)


@triton.jit
def _dispatch_kernel(
    # pointers
    x_ptr,  # (T, D)
    rows_ptr,  # (T, TOP_K) int64
    buf_ptr,  # (R, D)
    # sizes and strides
    T,
    D,
    stride_x,
    stride_b,
    # meta-parameters
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    ts = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_d = (d < D)[None, :]
    tile = tl.load(x_ptr + ts[:, None] * stride_x + d[None, :], mask=(ts < T)[:, None] & in_d)
    for k in tl.static_range(TOP_K):
        rows = tl.load(rows_ptr + ts * TOP_K + k, mask=ts < T, other=-1)
        dest = buf_ptr + rows[:, None] * stride_b + d[None, :]
        tl.store(dest, tile, mask=(rows >= 0)[:, None] & in_d)


@triton.jit
def _combine_kernel(
    # pointers
    y_ptr,  # (R, D)
    weights_ptr,  # (T, TOP_K), read when HAS_WEIGHTS
    rows_ptr,  # (T, TOP_K) int64
    out_ptr,  # (T, D)
    # sizes and strides
    T,
    D,
    stride_y,
    stride_o,
    # meta-parameters
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
):
    ts = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_d = (d < D)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        rows = tl.load(rows_ptr + ts * TOP_K + k, mask=ts < T, other=-1)
        valid = rows >= 0
        tile = tl.load(
            y_ptr + rows[:, None] * stride_y + d[None, :], mask=valid[:, None] & in_d, other=0.0
        ).to(tl.float32)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + ts * TOP_K + k, mask=valid, other=0.0).to(tl.float32)
            acc += tile * w[:, None]
        else:
            acc += tile
    out = out_ptr + ts[:, None] * stride_o + d[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(ts < T)[:, None] & in_d)


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
    T,
    D,
    stride_y,
    stride_do,
    stride_dy,
    # meta-parameters
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    ts = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = ts < T
    ks = tl.arange(0, K_P2)
    dots = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        in_d = (d < D)[None, :]
        g = tl.load(
            d_out_ptr + ts[:, None] * stride_do + d[None, :], mask=in_t[:, None] & in_d, other=0.0
        ).to(tl.float32)
        for k in tl.static_range(TOP_K):
            rows = tl.load(rows_ptr + ts * TOP_K + k, mask=in_t, other=-1)
            mask = (rows >= 0)[:, None] & in_d
            w = tl.load(weights_ptr + ts * TOP_K + k, mask=rows >= 0, other=0.0).to(tl.float32)
            tile = tl.load(y_ptr + rows[:, None] * stride_y + d[None, :], mask=mask, other=0.0)
            partial = tl.sum(tile.to(tl.float32) * g, axis=1)
            dots += tl.where(ks[None, :] == k, partial[:, None], 0.0)
            d_y = (w[:, None] * g).to(d_y_ptr.dtype.element_ty)
            tl.store(d_y_ptr + rows[:, None] * stride_dy + d[None, :], d_y, mask=mask)
    dest = d_weights_ptr + ts[:, None] * TOP_K + ks[None, :]
    tl.store(
        dest, dots.to(d_weights_ptr.dtype.element_ty), mask=in_t[:, None] & (ks < TOP_K)[None, :]
    )


def _block_d(dim: int) -> int:
    return max(16, min(triton.next_power_of_2(dim), 512))


def _flat(t: Tensor) -> Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _tiles(tokens: int, dim: int) -> tuple[int, int, int]:
    """(grid over tokens, grid over columns, BLOCK_D)."""
    block_d = _block_d(dim)
    return triton.cdiv(tokens, BLOCK_T), triton.cdiv(dim, block_d), block_d


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
    grid_t, grid_d, block_d = _tiles(tokens, dim)
    _dispatch_kernel[(grid_t, grid_d)](
        flat_x, flat_rows, buf, tokens, dim, flat_x.stride(0), buf.stride(0),
        TOP_K=top_k, BLOCK_T=BLOCK_T, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return buf


def combine(y: Tensor, weights: Tensor | None, rows: Tensor) -> Tensor:
    """``moec::combine`` (``weights=None``: unweighted gather-sum, dispatch's backward)."""
    flat_rows = rows.reshape(-1, rows.shape[-1]).contiguous()
    tokens, top_k = flat_rows.shape
    y = y if y.stride(-1) == 1 else y.contiguous()
    dim = y.shape[-1]
    out = y.new_empty(*rows.shape[:-1], dim)  # written through a flat view, returned whole
    if tokens == 0 or dim == 0:
        return out
    flat_out = out.view(tokens, dim)
    flat_w = flat_rows if weights is None else weights.reshape(tokens, top_k).contiguous()
    grid_t, grid_d, block_d = _tiles(tokens, dim)
    _combine_kernel[(grid_t, grid_d)](
        y, flat_w, flat_rows, flat_out, tokens, dim, y.stride(0), flat_out.stride(0),
        TOP_K=top_k, BLOCK_T=BLOCK_T, BLOCK_D=block_d, HAS_WEIGHTS=weights is not None,
        num_warps=4,
    )  # fmt: skip
    return out


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
    grid_t, _, block_d = _tiles(tokens, dim)
    _combine_backward_kernel[(grid_t,)](
        y, weights.reshape(tokens, top_k).contiguous(), flat_rows, flat_d, d_y, d_weights,
        tokens, dim, y.stride(0), flat_d.stride(0), d_y.stride(0),
        TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), BLOCK_T=BLOCK_T,
        BLOCK_D=min(block_d, 256), num_warps=4,
    )  # fmt: skip
    return d_y, d_weights
