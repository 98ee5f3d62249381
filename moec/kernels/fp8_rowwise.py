"""FP8 rowwise for Hopper speed: a Triton row quantizer and the FP8 grouped GEMM.

``rowwise_quantize(x)``: x (R, K) -> (codes e4m3 (R, K), scales fp32 (R,)) with ``scale =
amax(row) / 448`` (1 for an all-zero row), the layout of
:func:`moec.ops.quantized.rowwise_quantize_reference`; a row up to 65536 wide (a dense FFN's
gated gradient) is read once and kept in registers, a wider one twice, in chunks.
``rowwise_gmm`` runs ``torch._scaled_grouped_mm`` (row scales for the activations, per output
channel for the weights; ``rowwise_mm`` the same for one matrix through ``torch._scaled_mm``)
where torch ships it for this device: sm90 only here, checked from the capability, so no call
ever reaches a kernel built for another architecture. ``quantize_weight`` quantizes a (G, K, N)
weight per output channel in place, whatever its strides, into the column-major codes those
GEMMs take; where G x N gives few programs (a dense weight read along its long side) K is split
over programs, the column maxima joined by an atomic max.
``fast_accum=True`` lets Hopper's FP8 MMA accumulate without the periodic promotion to fp32
(and torch then picks a 256 x 128 tile for large groups): faster, a little less exact; the ops
use it for the forward GEMMs only, as torchao's float8 training does, and keep dgrad exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moec.kernels.activation import KernelActivation, act_value


@triton.jit
def _scale(amax):
    """Scale of a slice of max |value| ``amax``: amax / 448 (e4m3's largest), 1 for all zeros."""
    return tl.where(amax > 0, amax / 448.0, 1.0)


@triton.jit
def _row_values(x_ptr, offs, mask, K, stride_xk, ACT: tl.constexpr, GATED: tl.constexpr):
    """The float32 values quantized at ``offs``: x, or act(x) / act(gate) * up; 0 where masked."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT >= 0:
        if GATED:
            up = tl.load(x_ptr + offs + K * stride_xk, mask=mask, other=0.0).to(tl.float32)
            x = act_value(x, ACT) * up
        else:
            x = act_value(x, ACT)
    return tl.where(mask, x, 0.0)


@triton.jit
def rowwise_quantize_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,  # pointers
    R,
    K,  # sizes: K is the width quantized (for a gated activation, half of x's)
    stride_xr,
    stride_xk,
    stride_qr,  # strides
    ACT: tl.constexpr,  # -1: x itself; else the code of an activation applied first
    GATED: tl.constexpr,  # with ACT: x = [gate | up], the row quantized is act(gate) * up
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_PASS: tl.constexpr,  # BLOCK_K >= K: a row is read once and kept in registers
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = (rows < R)[:, None]
    x_rows = rows[:, None].to(tl.int64) * stride_xr
    q_rows = rows[:, None].to(tl.int64) * stride_qr
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_K)[None, :]
        x = _row_values(
            x_ptr, x_rows + cols * stride_xk, row_ok & (cols < K), K, stride_xk, ACT, GATED
        )
        amax = tl.max(tl.abs(x), axis=1)
    else:  # wide rows: amax over the row in chunks, then quantize it again from L2
        amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)[None, :]
            x = _row_values(
                x_ptr, x_rows + cols * stride_xk, row_ok & (cols < K), K, stride_xk, ACT, GATED
            )
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    scale = _scale(amax)
    if ONE_PASS:
        y = tl.clamp(x / scale[:, None], -448.0, 448.0)
        tl.store(codes_ptr + q_rows + cols, y.to(tl.float8e4nv), mask=row_ok & (cols < K))
    else:
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)[None, :]
            mask = row_ok & (cols < K)
            x = _row_values(x_ptr, x_rows + cols * stride_xk, mask, K, stride_xk, ACT, GATED)
            y = tl.clamp(x / scale[:, None], -448.0, 448.0)
            tl.store(codes_ptr + q_rows + cols, y.to(tl.float8e4nv), mask=mask)
    tl.store(scales_ptr + rows, scale, mask=rows < R)


ROW_ONE_PASS_MAX = 65536
"""Widest row quantized in one pass (held in registers by up to 16 warps, 128 values per
thread); wider rows loop over chunks, reading the row twice."""
ROW_CHUNK = 4096


def rowwise_quantize(
    x: torch.Tensor, act: KernelActivation | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and row scales of x (R, K), or of ``act(x)`` (R, K or K / 2 if gated) computed in
    float32 on the way (the activation's output is never stored in x's dtype)."""
    rows, k = x.shape
    if act is not None and act.gated:
        k //= 2
    codes = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0 or k == 0:
        return codes, scales
    one_pass = triton.next_power_of_2(k) <= ROW_ONE_PASS_MAX
    block_k = triton.next_power_of_2(k) if one_pass else ROW_CHUNK
    block_r = max(1, min(16, 8192 // block_k)) if one_pass else 1
    rowwise_quantize_kernel[(triton.cdiv(rows, block_r),)](
        x, codes, scales,
        rows, k, x.stride(0), x.stride(1), codes.stride(0),
        ACT=-1 if act is None else act.code, GATED=act is not None and act.gated,
        BLOCK_R=block_r, BLOCK_K=block_k, ONE_PASS=one_pass,
        num_warps=min(16, max(4, block_r * block_k // 2048)) if one_pass else 8,
    )  # fmt: skip
    return codes, scales


def scaled_grouped_mm_available(device: torch.device) -> bool:
    """torch's FP8 rowwise grouped GEMM on this device (sm90 only: never probed elsewhere)."""
    return (
        device.type == "cuda"
        and hasattr(torch, "_scaled_grouped_mm")
        and torch.cuda.get_device_capability(device)[0] == 9
    )


@triton.jit
def _weight_tile(w_base, ks, cols, K, N, stride_wk):
    """Rows ``ks`` x columns ``cols`` of one group's (K, N) weight in float32, and their mask."""
    mask = (ks < K)[:, None] & (cols < N)[None, :]
    return tl.load(w_base + ks[:, None] * stride_wk, mask=mask, other=0.0).to(tl.float32), mask


@triton.jit
def _store_column_codes(codes_ptr, g, N, K, cols, ks, w, scale, mask):
    """A (K, N) tile quantized by its columns' scales, stored transposed: codes (G, N, K)."""
    q = tl.clamp(w / scale[None, :], -448.0, 448.0).to(tl.float8e4nv)
    offs = g * N * K + cols[:, None].to(tl.int64) * K + ks[None, :]
    tl.store(codes_ptr + offs, tl.trans(q), mask=tl.trans(mask))


@triton.jit
def columnwise_quantize_kernel(
    w_ptr,
    codes_ptr,
    scales_ptr,  # pointers
    K,
    N,  # sizes of one group: w[g] is (K, N), quantized per column over K
    stride_wg,
    stride_wk,
    stride_wn,  # w's strides, any layout
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    g = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + g * stride_wg + cols[None, :] * stride_wn
    amax = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # pass 1: each column's amax
        w, _ = _weight_tile(w_base, k0 + tl.arange(0, BLOCK_K), cols, K, N, stride_wk)
        amax = tl.maximum(amax, tl.max(tl.abs(w), axis=0))
    scale = _scale(amax)
    for k0 in range(0, K, BLOCK_K):  # pass 2 (tiles still in L2): codes, stored (N, K)
        ks = k0 + tl.arange(0, BLOCK_K)
        w, mask = _weight_tile(w_base, ks, cols, K, N, stride_wk)
        _store_column_codes(codes_ptr, g, N, K, cols, ks, w, scale, mask)
    tl.store(scales_ptr + g * N + cols, scale, mask=cols < N)


@triton.jit
def column_amax_kernel(
    w_ptr,
    amax_ptr,  # (G, N) float32, zero on entry: each program folds in the max of its K range
    K,
    N,
    stride_wg,
    stride_wk,
    stride_wn,
    SPLIT_K: tl.constexpr,  # rows of K per program (a multiple of BLOCK_K)
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    g = tl.program_id(2).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * SPLIT_K
    w_base = w_ptr + g * stride_wg + cols[None, :] * stride_wn
    amax = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_start, k_start + SPLIT_K, BLOCK_K):
        w, _ = _weight_tile(w_base, k0 + tl.arange(0, BLOCK_K), cols, K, N, stride_wk)
        amax = tl.maximum(amax, tl.max(tl.abs(w), axis=0))
    tl.atomic_max(amax_ptr + g * N + cols, amax, mask=cols < N)  # amax >= 0: order-free


@triton.jit
def column_codes_kernel(
    w_ptr,
    amax_ptr,
    codes_ptr,
    scales_ptr,  # pointers: amax from column_amax_kernel; codes (G, N, K)
    K,
    N,
    stride_wg,
    stride_wk,
    stride_wn,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    g = tl.program_id(2).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    scale = _scale(tl.load(amax_ptr + g * N + cols, mask=cols < N, other=0.0))
    w_base = w_ptr + g * stride_wg + cols[None, :] * stride_wn
    w, mask = _weight_tile(w_base, ks, cols, K, N, stride_wk)
    _store_column_codes(codes_ptr, g, N, K, cols, ks, w, scale, mask)
    if tl.program_id(1) == 0:
        tl.store(scales_ptr + g * N + cols, scale, mask=cols < N)


WEIGHT_TILE = 64
WEIGHT_PROGRAMS = 512
"""Programs the weight quantizer aims for: below it (few groups and output channels, a long K,
as in a dense linear's weight) the columns' K is split over programs."""


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (G, K, N), any strides -> codes (G, K, N) column-major in (K, N), scales (G, N) per
    output channel; read in place (a transposed weight needs no copy first)."""
    groups, k, n = w.shape
    codes = torch.empty(groups, n, k, dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty(groups, n, dtype=torch.float32, device=w.device)
    if codes.numel() == 0:
        return codes.transpose(1, 2), scales
    tile = WEIGHT_TILE
    column_programs = groups * triton.cdiv(n, tile)
    k_tiles = triton.cdiv(k, tile)
    splits = min(k_tiles, triton.cdiv(WEIGHT_PROGRAMS, column_programs))
    strides = (w.stride(0), w.stride(1), w.stride(2))
    if splits <= 1:  # enough columns: one program per column block, two passes over its K
        columnwise_quantize_kernel[(triton.cdiv(n, tile), groups)](
            w, codes, scales, k, n, *strides, BLOCK_K=tile, BLOCK_N=tile
        )
        return codes.transpose(1, 2), scales
    split_k = triton.cdiv(k_tiles, splits) * tile
    amax = torch.zeros(groups, n, dtype=torch.float32, device=w.device)
    column_amax_kernel[(triton.cdiv(n, tile), triton.cdiv(k, split_k), groups)](
        w, amax, k, n, *strides, SPLIT_K=split_k, BLOCK_K=tile, BLOCK_N=tile
    )
    column_codes_kernel[(triton.cdiv(n, tile), k_tiles, groups)](
        w, amax, codes, scales, k, n, *strides, BLOCK_K=tile, BLOCK_N=tile
    )
    return codes.transpose(1, 2), scales


def rowwise_gmm(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``out[r] = (a[r] * sa[r]) @ (b[e(r)] * sb[e(r)])`` from :func:`rowwise_quantize` /
    :func:`quantize_weight` outputs."""
    (a_codes, a_scales), (b_codes, b_scales) = a, b
    return torch._scaled_grouped_mm(
        a_codes,
        b_codes,
        a_scales,
        b_scales,
        offs=offsets,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


def rowwise_mm(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``(a * sa) @ (b * sb)`` for one matrix: a from :func:`rowwise_quantize` (R, K), b codes
    (K, N) column-major with scales (1, N) (:func:`quantize_weight` of b[None], group 0)."""
    (a_codes, a_scales), (b_codes, b_scales) = a, b
    return torch._scaled_mm(
        a_codes,
        b_codes,
        a_scales[:, None],
        b_scales.reshape(1, -1),
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )
