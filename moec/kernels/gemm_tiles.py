"""What the grouped GEMM kernels (pointer-based and TMA) share: row tiles and the epilogue.

:func:`expert_table` turns the device offsets into per-expert row-tile counts, from which
:func:`expert_tile` maps a row-tile index to (expert, first row, end row). :func:`epilogue`
writes a tile from registers; the EPILOGUE_* codes: PLAIN stores the product; ACT stores h and
a = act(h) (gated: act of the gate half times the up half, the halves ``N_OUT`` columns apart);
ACT_BACKWARD treats the product as d_a, reads h, and stores d_h and the recomputed a.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moec.kernels.activation import act_derivative, act_value

EPILOGUE_PLAIN, EPILOGUE_ACT, EPILOGUE_ACT_BACKWARD = 0, 1, 2


@triton.jit
def expert_table(offsets_ptr, NUM_EXPERTS: tl.constexpr, E_P2: tl.constexpr, BLOCK: tl.constexpr):
    """Per expert (padded to E_P2): first row, end row, row tiles of BLOCK and their cumsum."""
    e = tl.arange(0, E_P2)
    ends = tl.load(offsets_ptr + e, mask=e < NUM_EXPERTS, other=0)
    starts = tl.load(offsets_ptr + e - 1, mask=(e > 0) & (e < NUM_EXPERTS), other=0)
    tiles = tl.where(e < NUM_EXPERTS, tl.cdiv(ends - starts, BLOCK), 0)
    return starts, ends, tiles, tl.cumsum(tiles, axis=0)


@triton.jit
def expert_tile(starts, ends, tiles, cum, pid_m, E_P2: tl.constexpr, BLOCK: tl.constexpr):
    """(expert, first row, end row) of row tile ``pid_m``; expert >= NUM_EXPERTS past the last."""
    expert = tl.sum((cum <= pid_m).to(tl.int32), axis=0)
    sel = tl.arange(0, E_P2) == expert
    first = tl.sum(tl.where(sel, cum - tiles, 0), axis=0)
    start = tl.sum(tl.where(sel, starts, 0), axis=0)
    end = tl.sum(tl.where(sel, ends, 0), axis=0)
    return expert, start + (pid_m - first) * BLOCK, end


@triton.jit
def epilogue(
    acc,
    acc_up,
    rows,
    cols,
    mask,
    h_ptr,
    out_ptr,
    d_h_ptr,
    stride_hr,
    stride_or,
    N_OUT,
    EPILOGUE: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
):
    """Write a (rows, cols) tile of the products from registers: EPILOGUE_PLAIN stores ``acc``;
    EPILOGUE_ACT stores h (``acc``, and ``acc_up`` at column + N_OUT when gated) and a = act(h);
    EPILOGUE_ACT_BACKWARD reads h, stores d_h from d_a = ``acc`` and the recomputed a."""
    row_off = rows[:, None].to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    out_ptrs = out_ptr + row_off * stride_or + cols[None, :]
    if EPILOGUE == 0:
        tl.store(out_ptrs, acc.to(dtype), mask=mask)
    elif EPILOGUE == 1:
        h = acc.to(dtype)  # the stored pre-activation; a is computed from it
        h_ptrs = h_ptr + row_off * stride_hr + cols[None, :]
        tl.store(h_ptrs, h, mask=mask)
        a = act_value(h.to(tl.float32), ACT)
        if GATED:
            up = acc_up.to(dtype)
            tl.store(h_ptrs + N_OUT, up, mask=mask)
            a = a * up.to(tl.float32)
        tl.store(out_ptrs, a.to(dtype), mask=mask)
    else:
        h_ptrs = h_ptr + row_off * stride_hr + cols[None, :]
        d_h_ptrs = d_h_ptr + row_off * stride_hr + cols[None, :]
        g = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
        d_a = acc.to(dtype).to(tl.float32)
        if GATED:
            up = tl.load(h_ptrs + N_OUT, mask=mask, other=0.0).to(tl.float32)
            act = act_value(g, ACT)
            tl.store(d_h_ptrs, (d_a * up * act_derivative(g, ACT)).to(dtype), mask=mask)
            tl.store(d_h_ptrs + N_OUT, (d_a * act).to(dtype), mask=mask)
            a = act * up
        else:
            tl.store(d_h_ptrs, (d_a * act_derivative(g, ACT)).to(dtype), mask=mask)
            a = act_value(g, ACT)
        tl.store(out_ptrs, a.to(dtype), mask=mask)
