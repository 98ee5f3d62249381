"""Grouped matrix products over an expert-major row buffer, in pure PyTorch, and the buffer's rows.

Rows of expert ``e`` occupy ``[offsets[e-1], offsets[e])`` of a buffer of static length R;
rows past ``offsets[-1]`` are garbage and must never reach a valid result. ``offsets`` stays on
the device: nothing here reads it on the host, so every function is sync-free.

These are the reference GEMMs of the expert ops (moec's kernels are another implementation,
chosen by the op's bound ``impl``): ``torch._grouped_mm`` where it takes the operands sync-free
(:func:`moec.kernels.gemm_backend.grouped_mm_takes`: bf16 on CUDA sm90+, fp32/bf16 on CPU with
16-byte aligned rows), else (or with ``loop``) a masked loop over experts (float64 for
gradcheck, fp32 on CUDA): N times the FLOPs, static shapes, still sync-free.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moec.kernels.gemm_backend import grouped_mm_takes


def row_experts(offsets: Tensor, rows: int) -> Tensor:
    """Expert index of every buffer row, ``num_experts`` for rows past ``offsets[-1]``."""
    positions = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, positions, right=True)


def gmm(x: Tensor, w: Tensor, offsets: Tensor, loop: bool = False) -> Tensor:
    """``out[r] = x[r] @ w[e(r)]``: x (R, K), w (N, K, M) -> (R, M); garbage rows stay garbage."""
    if not loop and grouped_mm_takes("down", x, w):
        return torch._grouped_mm(x.contiguous(), w, offs=offsets)
    experts = row_experts(offsets, x.shape[0])
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for e in range(w.shape[0]):
        out = torch.where((experts == e)[:, None], x @ w[e], out)
    return out


def gmm_wgrad(x: Tensor, dy: Tensor, offsets: Tensor, loop: bool = False) -> Tensor:
    """``dw[e] = x_e^T @ dy_e`` over the rows of expert e: x (R, K), dy (R, M) -> (N, K, M)."""
    num_experts = offsets.shape[0]
    if not loop and grouped_mm_takes("wgrad", x, dy):
        # contiguous x: a gradient can arrive expanded (stride 0), which _grouped_mm refuses
        return torch._grouped_mm(x.contiguous().t(), dy.contiguous(), offs=offsets)
    experts = row_experts(offsets, x.shape[0])
    grads = []
    for e in range(num_experts):
        mine = (experts == e)[:, None]
        grads.append(torch.where(mine, x, 0).t() @ torch.where(mine, dy, 0))
    return torch.stack(grads)


def add_row_bias(h: Tensor, bias: Tensor, experts: Tensor) -> Tensor:
    """``h[r] + bias[e(r)]``; garbage rows get an arbitrary expert's bias."""
    return h + bias.to(h.dtype)[experts.clamp(max=bias.shape[0] - 1)]


def row_bias_grad(dh: Tensor, experts: Tensor, num_experts: int) -> Tensor:
    """Sum of ``dh`` rows per expert; garbage rows land in a dropped extra slot."""
    acc = torch.promote_types(dh.dtype, torch.float32)
    sums = dh.new_zeros(num_experts + 1, dh.shape[-1], dtype=acc)
    return sums.index_add_(0, experts.long(), dh.to(acc))[:num_experts]


def _flat(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def by_row(values: Tensor, rows: Tensor) -> Tensor:
    """``out[R]``: each route's value at its buffer row (``out[rows[t, k]] = values[t, k]``;
    rows no accepted route points at: 0). One scatter into a fixed-size tensor, dropped routes
    (-1) sent to a dump slot that is cut off: no host sync."""
    flat = _flat(rows)
    num_rows = flat.numel()
    target = torch.where(flat >= 0, flat, num_rows).reshape(-1).long()
    out = values.new_zeros(num_rows + 1)
    return out.index_copy_(0, target, values.reshape(-1))[:num_rows]


def row_sources(rows: Tensor) -> Tensor:
    """``sources[R]`` int32: the token of every buffer row (``sources[rows[t, k]] = t``; rows no
    accepted route points at: 0)."""
    flat = _flat(rows)
    tokens, top_k = flat.shape
    token = torch.arange(tokens, device=rows.device, dtype=torch.int32)
    return by_row(token[:, None].expand(tokens, top_k), rows)


def gather_rows(x: Tensor, rows: Tensor) -> Tensor:
    """The dispatched buffer ``[R, D]`` as a gather of x's rows (rows no route points at hold
    token 0's row)."""
    return _flat(x).index_select(0, row_sources(rows))
