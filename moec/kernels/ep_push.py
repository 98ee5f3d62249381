"""The copy kernel of the ``rowwise`` EP transport: routes' rows written straight into peers'
buffers.

push_rows(x[T, D], address[T*K], peers[n], rows, top_k, weights?) writes route ``i``'s row
``x[i // top_k]`` (times ``weights[i]`` when given) at row ``address[i] % rows`` of the buffer
of peer ``address[i] // rows``, whose base pointer is ``peers[address[i] // rows]``; routes with
``address[i] = -1`` write nothing. The buffers are ``[rows, D]`` in x's dtype (symmetric memory
on GPUs, so the stores go over NVLink); rows no route addresses keep what they held. With
``programs`` the grid is capped and each program loops over route tiles (the split exchanges'
copies, which run beside the expert GEMMs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

ROUTES, COLS = 4, 512
"""Tile of the copy kernel: 4 routes x 512 columns (16-byte accesses per thread in bf16)."""


@triton.jit
def _push_tile(
    tile, cols, src_ptr, weights_ptr, address_ptr, peers_ptr, routes, rank_cap, dim,
    TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, ROUTES: tl.constexpr,
):  # fmt: skip
    route = tile * ROUTES + tl.arange(0, ROUTES)
    address = tl.load(address_ptr + route, mask=route < routes, other=-1)
    keep = address >= 0
    safe = tl.where(keep, address, 0)
    base = tl.load(peers_ptr + safe // rank_cap).to(tl.pointer_type(src_ptr.dtype.element_ty))
    mask = keep[:, None] & (cols < dim)[None, :]
    token = (route // TOP_K).to(tl.int64)
    values = tl.load(src_ptr + token[:, None] * dim + cols[None, :], mask=mask)
    if HAS_WEIGHTS:
        scale = tl.load(weights_ptr + route, mask=keep, other=0.0)
        values = (values.to(scale.dtype) * scale[:, None]).to(src_ptr.dtype.element_ty)
    tl.store(base[:, None] + (safe % rank_cap)[:, None] * dim + cols[None, :], values, mask=mask)


@triton.jit
def _push_rows_kernel(
    # pointers
    src_ptr,  # [routes / TOP_K, dim] source rows: route i sends row i // TOP_K
    weights_ptr,  # [routes] row scales, float32 or wider (read when HAS_WEIGHTS)
    address_ptr,  # [routes] int64: dest * rank_cap + row, -1 dropped
    peers_ptr,  # [ep_size] int64: base pointer of every peer's buffer
    # sizes
    routes,
    rank_cap,
    dim,
    # meta-parameters
    TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    ROUTES: tl.constexpr,
    COLS: tl.constexpr,
    STRIDED: tl.constexpr,  # fewer programs than route tiles: each loops over its tiles
):
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    if STRIDED:
        for tile in range(tl.program_id(0), tl.cdiv(routes, ROUTES), tl.num_programs(0)):
            _push_tile(
                tile, cols, src_ptr, weights_ptr, address_ptr, peers_ptr, routes, rank_cap, dim,
                TOP_K, HAS_WEIGHTS, ROUTES,
            )  # fmt: skip
    else:
        _push_tile(
            tl.program_id(0), cols, src_ptr, weights_ptr, address_ptr, peers_ptr, routes,
            rank_cap, dim, TOP_K, HAS_WEIGHTS, ROUTES,
        )  # fmt: skip


def push_rows(
    x: Tensor,
    address: Tensor,
    peers: Tensor,
    rows: int,
    top_k: int = 1,
    weights: Tensor | None = None,
    programs: int | None = None,
) -> None:
    """Write every route's row into its peer's buffer (see module); rows are scaled in x's
    dtype promoted to at least float32, then rounded to x's dtype. ``programs``: at most this
    many programs per column tile, each looping over route tiles (a copy that runs beside other
    kernels then holds few SMs); None: one program per tile."""
    routes = address.shape[0]
    if routes == 0:
        return
    if programs is not None and programs < 1:
        raise ValueError(f"push_rows: programs must be >= 1 or None, got {programs}")
    x = x.contiguous()
    acc = torch.promote_types(x.dtype, torch.float32)
    scales = x if weights is None else weights.reshape(-1).to(acc).contiguous()
    tiles = triton.cdiv(routes, ROUTES)
    strided = programs is not None and programs < tiles
    grid = (programs if strided else tiles, triton.cdiv(x.shape[1], COLS))
    _push_rows_kernel[grid](
        x, scales, address, peers, routes, rows, x.shape[1],
        TOP_K=top_k, HAS_WEIGHTS=weights is not None, ROUTES=ROUTES, COLS=COLS, STRIDED=strided,
    )  # fmt: skip
