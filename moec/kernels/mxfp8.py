"""MXFP8 (OCP MX v1.0, e4m3 elements, E8M0 scales) quantize and grouped GEMM kernels in Triton.

Quantization, for one block of 32 values V along the contraction dim (spec section 6.3)::

    shared_exp = floor(log2(max |V|)) - 8        # emax of e4m3 is 8
    code       = clamp(shared_exp, -127, 127) + 127   (uint8; 0xFF = NaN when max |V| is inf/NaN)
    P_i        = e4m3(V_i / 2^shared_exp)        # round to nearest even, saturate to +-448

A NaN-scale block stores 0x7F in every element. Everything is done on the fp32 bit pattern with
integer arithmetic, so the result is the same on sm90, sm100 and the interpreter whatever the
float flush-to-zero mode: :func:`moec.ops.quantized.mx_quantize_reference` is the oracle.

Kernels (every operand tile is ``[rows, contraction]``, quantized along axis 1):

- :func:`mx_quantize`: x (R, K) -> codes (R, K) float8_e4m3fn, scales (R, K // 32) uint8;
  columnwise quantization is ``mx_quantize(x.t())`` (strided loads, no copy).
- :func:`mx_gmm`: ``out[r] = a[r] @ b[e(r)]`` for a (M, K) and b (G, K, N) grouped by
  ``offsets`` (like ``torch._grouped_mm`` 2D x 3D): forward and dgrad. Either operand may be
  high precision (quantized in registers, fused) or prequantized (:class:`MXTensor`).
- :func:`mx_gmm_wgrad`: ``out[g] = a_g^T @ b_g`` over the rows of group g (2D x 2D -> 3D),
  both operands quantized in registers with 32-row blocks that start at the group's first row.

The products use ``tl.dot_scaled``: native block-scaled MMA (``tcgen05.mma ... block_scale``)
on sm100/sm103, emulated through bf16 on sm90. No path here calls a torch MXFP8 kernel, so
nothing SM100-only can run on sm90.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

BLOCK = 32
"""Elements per MX block (OCP MX v1.0)."""
E4M3_MAX = 448.0
NAN_SCALE = 255


@dataclasses.dataclass
class MXTensor:
    """A prequantized operand: ``codes`` (rows, K) e4m3 and ``scales`` (rows, K // 32) E8M0,
    blocks along the last dim (for a 3D weight: one such matrix per group)."""

    codes: torch.Tensor
    scales: torch.Tensor


# --- device helpers ---------------------------------------------------------------------------


@triton.jit
def _e4m3_code(a):
    """|a| (fp32, finite, >= 0) -> e4m3 code (int32), round to nearest even, saturating."""
    a = tl.minimum(a, 448.0)
    bits = a.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    # Normal e4m3 (a >= 2^-6): drop 20 mantissa bits with round-half-even; carries bump exp.
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    # Subnormal e4m3 (a < 2^-6): integer multiples of 2^-9, round-half-even.
    sig = tl.where(exp > 0, (bits & 0x7FFFFF) | 0x800000, bits & 0x7FFFFF)
    shift = tl.minimum(tl.maximum(141 - exp, 1), 31)  # only exp <= 120 (shift >= 21) is kept
    half = ((shift * 0 + 1) << (shift - 1)) - 1
    sub = (sig + half + ((sig >> shift) & 1)) >> shift
    return tl.where(exp >= 121, normal, sub)


@triton.jit
def _mx_quantize_tile(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """x [ROWS, COLS] -> (codes uint8 [ROWS, COLS], scales uint8 [ROWS, COLS // 32])."""
    if x.dtype == tl.bfloat16:  # exact widening by hand: keeps bf16 denormals everywhere
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) << 16
    else:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    exp = (bits >> 23) & 0xFF
    block_exp = tl.max(tl.reshape(exp, (ROWS, COLS // 32, 32)), axis=2)
    scale = tl.where(block_exp == 255, 255, tl.maximum(block_exp - 8, 0))
    wide = tl.reshape(tl.broadcast_to(scale[:, :, None], (ROWS, COLS // 32, 32)), (ROWS, COLS))
    shift = 127 - wide  # V / 2^shared_exp = V * 2^shift, shift in [-119, 127] for finite blocks
    # |V| * 2^shift without ever feeding an fp32 denormal to a float op (FTZ-proof).
    factor = ((tl.maximum(shift, -126) + 127) << 23).to(tl.float32, bitcast=True)
    den_exp = shift - 22  # a denormal V is mantissa * 2^-149
    den_factor = tl.where(den_exp >= 1, (tl.maximum(den_exp, 1) << 23), 0).to(
        tl.float32, bitcast=True
    )
    mant = bits & 0x7FFFFF
    normal_abs = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    y = tl.where(exp == 0, mant.to(tl.float32) * den_factor, normal_abs * factor)
    code = _e4m3_code(y) | sign
    code = tl.where(wide == 255, 0x7F, code)
    return code.to(tl.uint8), scale.to(tl.uint8)


@triton.jit
def _load_operand(
    ptr,
    scale_ptr,
    rows,
    row_mask,
    c0,
    c_end,
    stride_r,
    stride_c,
    stride_sr,
    stride_sc,
    QUANT: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """Operand tile [ROWS, COLS] at contraction offset ``c0`` as (e4m3 codes, E8M0 scales
    [ROWS, COLS // 32]), contraction indices >= ``c_end`` masked.

    QUANT: ``ptr`` holds high precision values, quantized here (blocks start at ``c0``); else
    codes and scales are loaded (``c0`` a multiple of 32). Masked entries become zero codes with
    scale 2^0, whatever memory holds there (garbage rows cannot leak a NaN scale).
    """
    cols = c0 + tl.arange(0, COLS)
    mask = row_mask[:, None] & (cols < c_end)[None, :]
    offs = rows[:, None] * stride_r + cols[None, :] * stride_c
    if QUANT:
        codes, scales = _mx_quantize_tile(tl.load(ptr + offs, mask=mask, other=0.0), ROWS, COLS)
    else:
        codes = tl.load(ptr + offs, mask=mask, other=0)
        blocks = c0 // 32 + tl.arange(0, COLS // 32)
        smask = row_mask[:, None] & (blocks * 32 < c_end)[None, :]
        soffs = rows[:, None] * stride_sr + blocks[None, :] * stride_sc
        scales = tl.load(scale_ptr + soffs, mask=smask, other=127)
    return codes.to(tl.float8e4nv, bitcast=True), scales.to(tl.uint8, bitcast=True)


# --- kernels ----------------------------------------------------------------------------------


@triton.jit
def mx_quantize_kernel(
    # pointers
    x_ptr,
    codes_ptr,
    scales_ptr,
    # sizes
    R,
    K,
    # strides
    stride_xr,
    stride_xk,
    stride_qr,
    stride_sr,
    # meta-parameters
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """x (R, K) any strides -> codes (R, K) and scales (R, K // 32), both row-major."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < R)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xk, mask=mask, other=0.0)
    codes, scales = _mx_quantize_tile(x, BLOCK_R, BLOCK_K)
    tl.store(codes_ptr + rows[:, None] * stride_qr + cols[None, :], codes, mask=mask)
    sblocks = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    smask = (rows < R)[:, None] & (sblocks * 32 < K)[None, :]
    tl.store(scales_ptr + rows[:, None] * stride_sr + sblocks[None, :], scales, mask=smask)


@triton.jit
def mx_gmm_kernel(
    # pointers: a (M, K) [+ scales], b viewed as bt (G, N, K) [+ scales (G, N, K // 32)], out
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    out_ptr,
    offsets_ptr,
    # sizes
    M,
    N,
    K,
    # strides
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_bg,
    stride_bn,
    stride_bk,
    stride_bsg,
    stride_bsn,
    stride_bsk,
    stride_om,
    stride_on,
    # meta-parameters
    G: tl.constexpr,
    G_POW2: tl.constexpr,
    A_QUANT: tl.constexpr,
    B_QUANT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[r] = a[r] @ b[e(r)] for the rows r < offsets[-1]; other rows get zeros.

    A row tile that spans several groups runs once per group with the other rows masked.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    groups = tl.arange(0, G_POW2)
    ends = tl.load(offsets_ptr + groups, mask=groups < G, other=2147483647)
    total = tl.load(offsets_ptr + G - 1)
    first = tl.program_id(0) * BLOCK_M
    last = tl.minimum(first + BLOCK_M, total) - 1
    g_lo = tl.sum((ends <= first).to(tl.int32))
    g_hi = tl.sum((ends <= last).to(tl.int32))
    num = tl.where(last >= first, g_hi - g_lo + 1, 0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, num):
        g = g_lo + i
        start = tl.where(g > 0, tl.load(offsets_ptr + g - 1, mask=g > 0, other=0), 0)
        end = tl.load(offsets_ptr + g)
        row_mask = (rows >= start) & (rows < end)
        for k0 in range(0, K, BLOCK_K):
            a, a_s = _load_operand(
                a_ptr,
                a_scale_ptr,
                rows,
                row_mask,
                k0,
                K,
                stride_am,
                stride_ak,
                stride_asm,
                stride_ask,
                A_QUANT,
                BLOCK_M,
                BLOCK_K,
            )
            bt, b_s = _load_operand(
                b_ptr + g * stride_bg,
                b_scale_ptr + g * stride_bsg,
                cols,
                cols < N,
                k0,
                K,
                stride_bn,
                stride_bk,
                stride_bsn,
                stride_bsk,
                B_QUANT,
                BLOCK_N,
                BLOCK_K,
            )
            acc = tl.dot_scaled(a, a_s, "e4m3", tl.trans(bt), b_s, "e4m3", acc)
    out_mask = (rows < M)[:, None] & (cols < N)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on, out, mask=out_mask)


@triton.jit
def mx_gmm_wgrad_kernel(
    # pointers: a (R, K), b (R, N), out (G, K, N), offsets (G,)
    a_ptr,
    b_ptr,
    out_ptr,
    offsets_ptr,
    # sizes
    K,
    N,
    # strides
    stride_ar,
    stride_ak,
    stride_br,
    stride_bn,
    stride_og,
    stride_ok,
    stride_on,
    # meta-parameters
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out[g] = a_g^T @ b_g over rows [offsets[g-1], offsets[g]); MX blocks of 32 rows from the
    group's first row (rows past the group are zeros, so no block straddles two groups)."""
    g = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.where(g > 0, tl.load(offsets_ptr + g - 1, mask=g > 0, other=0), 0)
    end = tl.load(offsets_ptr + g)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        at, a_s = _load_operand(
            a_ptr, a_ptr, ks, ks < K, r0, end, stride_ak, stride_ar, 0, 0, True, BLOCK_K, BLOCK_R
        )
        bt, b_s = _load_operand(
            b_ptr, b_ptr, ns, ns < N, r0, end, stride_bn, stride_br, 0, 0, True, BLOCK_N, BLOCK_R
        )
        acc = tl.dot_scaled(at, a_s, "e4m3", tl.trans(bt), b_s, "e4m3", acc)
    mask = (ks < K)[:, None] & (ns < N)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + g * stride_og + ks[:, None] * stride_ok + ns[None, :] * stride_on, out, mask=mask
    )


# --- launchers --------------------------------------------------------------------------------


def _configs(device: torch.device) -> dict[str, int]:
    """Tile sizes per device: small tiles keep the interpreter and sm90 emulation cheap."""
    if device.type != "cuda":
        return {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64}
    if torch.cuda.get_device_capability(device)[0] >= 10:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def mx_quantize(x: torch.Tensor) -> MXTensor:
    """Quantize x (R, K) along its last dim; K must be a multiple of 32. Any strides."""
    rows, k = x.shape
    if k % BLOCK:
        raise ValueError(f"mx_quantize: last dim {k} is not a multiple of {BLOCK}")
    codes = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, k // BLOCK, dtype=torch.uint8, device=x.device)
    block_r, block_k = 32, 128 if k % 128 == 0 else 32
    grid = (triton.cdiv(rows, block_r), triton.cdiv(k, block_k))
    mx_quantize_kernel[grid](
        x,
        codes.view(torch.uint8),
        scales,
        rows,
        k,
        x.stride(0),
        x.stride(1),
        codes.stride(0),
        scales.stride(0),
        BLOCK_R=block_r,
        BLOCK_K=block_k,
    )
    return MXTensor(codes, scales)


def mx_quantize_weight(w: torch.Tensor) -> MXTensor:
    """w (G, K, N) -> codes (G, N, K), scales (G, N, K // 32): blocks along K, the layout
    :func:`mx_gmm` reads for its ``b`` operand."""
    groups, k, n = w.shape
    flat = mx_quantize(w.transpose(1, 2).reshape(groups * n, k))
    return MXTensor(flat.codes.view(groups, n, k), flat.scales.view(groups, n, k // BLOCK))


def _operand_args(t: torch.Tensor | MXTensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    if isinstance(t, MXTensor):
        return t.codes.view(torch.uint8), t.scales, False
    return t, t, True


def mx_gmm(
    a: torch.Tensor | MXTensor,
    b: torch.Tensor | MXTensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``out[r] = a[r] @ b[e(r)]``: a (M, K), b (G, K, N) high precision (or an MXTensor from
    :func:`mx_quantize` / :func:`mx_quantize_weight`, then K a multiple of 32) -> (M, N)."""
    a_data, a_scales, a_quant = _operand_args(a)
    b_data, b_scales, b_quant = _operand_args(b)
    m, k = a_data.shape
    if b_quant:
        groups, _, n = b_data.shape
        b_data = b_data.transpose(1, 2)  # (G, N, K) view
    else:
        groups, n, _ = b_data.shape
    prequantized = not (a_quant and b_quant)
    if (prequantized and k % BLOCK) or b_data.shape[2] != k or offsets.shape != (groups,):
        raise ValueError(
            f"mx_gmm: a {tuple(a_data.shape)} and b {tuple(b_data.shape)} (as G, N, "
            f"K) with {groups} offsets do not fit (prequantized K: a multiple of 32)"
        )
    out = torch.empty(m, n, dtype=out_dtype, device=a_data.device)
    cfg = _configs(a_data.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    a_ss = (0, 0) if a_quant else a_scales.stride()
    b_ss = (0, 0, 0) if b_quant else b_scales.stride()
    mx_gmm_kernel[grid](
        a_data,
        a_scales,
        b_data,
        b_scales,
        out,
        offsets,
        m,
        n,
        k,
        a_data.stride(0),
        a_data.stride(1),
        *a_ss,
        *b_data.stride(),
        *b_ss,
        out.stride(0),
        out.stride(1),
        G=groups,
        G_POW2=triton.next_power_of_2(groups),
        A_QUANT=a_quant,
        B_QUANT=b_quant,
        **cfg,
    )
    return out


def mx_gmm_wgrad(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``out[g] = a_g^T @ b_g``: a (R, K), b (R, N) high precision -> (G, K, N)."""
    k, n, groups = a.shape[1], b.shape[1], offsets.shape[0]
    out = torch.empty(groups, k, n, dtype=out_dtype, device=a.device)
    cfg = _configs(a.device)
    meta = {"BLOCK_K": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_R": cfg["BLOCK_K"]}
    meta.update({key: v for key, v in cfg.items() if key in ("num_warps", "num_stages")})
    grid = (groups, triton.cdiv(k, meta["BLOCK_K"]), triton.cdiv(n, meta["BLOCK_N"]))
    mx_gmm_wgrad_kernel[grid](
        a,
        b,
        out,
        offsets,
        k,
        n,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        *out.stride(),
        **meta,
    )
    return out


KERNELS = {
    "mx_quantize_kernel": mx_quantize_kernel,
    "mx_gmm_kernel": mx_gmm_kernel,
    "mx_gmm_wgrad_kernel": mx_gmm_wgrad_kernel,
}
"""Every MXFP8 kernel, by name (the sm100/sm103 build test compiles each)."""
