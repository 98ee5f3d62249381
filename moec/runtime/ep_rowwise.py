"""The ``rowwise`` EP transport: rows written into (and pulled from) peers' symmetric memory.

Every rank of an EP group owns one symmetric-memory buffer of ``Cr x D`` rows per (shape, dtype),
registered once with ``torch.distributed._symmetric_memory.rendezvous``; a device table of the
peers' buffer pointers lets one Triton kernel address any peer's rows over NVLink. Addresses come
from :func:`moec.ops.ep.rowwise_route_map` (``dest * Cr + row``, -1 dropped), computed on the
device, so neither direction copies anything to the host::

    send(x[T, D], address[T*K], Cr, pg, K, weights) -> buffer[Cr, D]  # push each route's row
    fetch(buffer[Cr, D], address[T*K], pg) -> picked[T*K, D]          # pull each route's row back

``send`` reads route ``i``'s row straight from the token row ``x[i // K]`` (scaled by the route
weight in combine's backward): the ``[T*K, D]`` copy of the tokens is never written.

Ordering uses the handle's device-side barrier: ``send`` = barrier, push, barrier, copy out (the
first barrier keeps a fast peer from overwriting a buffer still being copied); ``fetch`` = copy
in, barrier, pull, barrier. Inside one node this uses peer pointers; an EP group spanning nodes
needs the NVSHMEM backend of symmetric memory (not wired here).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl
from torch import Tensor

from moec.ops import ep as ep_ops
from moec.ops.ep import EPPathError

ROUTES, COLS = 4, 512
"""Tile of the copy kernels: 4 routes x 512 columns (16-byte accesses per thread in bf16)."""


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
):
    route = tl.program_id(0) * ROUTES + tl.arange(0, ROUTES)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
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
def _pull_rows_kernel(
    # pointers
    dst_ptr,  # [routes, dim] each route's row, zero when dropped
    address_ptr,  # [routes] int64
    peers_ptr,  # [ep_size] int64
    # sizes
    routes,
    rank_cap,
    dim,
    # meta-parameters
    ROUTES: tl.constexpr,
    COLS: tl.constexpr,
):
    route = tl.program_id(0) * ROUTES + tl.arange(0, ROUTES)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    inside = route < routes
    address = tl.load(address_ptr + route, mask=inside, other=-1)
    valid = address >= 0
    safe = tl.where(valid, address, 0)
    base = tl.load(peers_ptr + safe // rank_cap).to(tl.pointer_type(dst_ptr.dtype.element_ty))
    in_dim = (cols < dim)[None, :]
    source = base[:, None] + (safe % rank_cap)[:, None] * dim + cols[None, :]
    values = tl.load(source, mask=valid[:, None] & in_dim, other=0.0)
    target = dst_ptr + route.to(tl.int64)[:, None] * dim + cols[None, :]
    tl.store(target, values, mask=inside[:, None] & in_dim)


def check_available(t: Tensor) -> None:
    """Raise :class:`EPPathError` unless ``t`` lives where the rowwise transport can run."""
    if not t.is_cuda:
        raise EPPathError(
            f"ep_path='rowwise' writes rows into peers' CUDA symmetric memory; tensors are on "
            f"{t.device}. Use ep_path='a2a_capacity' (sync-free on any backend, incl. gloo)"
        )


@functools.cache
def _workspace(rows: int, dim: int, dtype: torch.dtype, device: torch.device, group: str):
    try:
        buffer = symm_mem.empty((rows, dim), dtype=dtype, device=device)
        handle = symm_mem.rendezvous(buffer, group)
    except Exception as exc:
        raise EPPathError(
            f"symmetric memory is unavailable for EP group {group!r} ({exc}); "
            "use ep_path='a2a_capacity'"
        ) from exc
    peers = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
    return buffer, handle, peers


def _workspace_for(rows: int, like: Tensor, pg: dist.ProcessGroup):
    return _workspace(rows, like.shape[-1], like.dtype, like.device, pg.group_name)


def _grid(routes: int, dim: int) -> tuple[int, int]:
    return triton.cdiv(routes, ROUTES), triton.cdiv(dim, COLS)


def send(
    x: Tensor,
    address: Tensor,
    rank_cap: int,
    pg: dist.ProcessGroup,
    top_k: int = 1,
    weights: Tensor | None = None,
) -> Tensor:
    """Push route ``i``'s row ``x[i // top_k]`` (times ``weights[i]`` if given) to
    ``address[i]``; return this rank's ``[rank_cap, D]`` buffer (rows no route wrote:
    unspecified)."""
    check_available(x)
    buffer, handle, peers = _workspace_for(rank_cap, x, pg)
    x = x.contiguous()
    if ep_ops._POISON is not None:  # tests: rows no route writes hold garbage
        buffer.fill_(ep_ops._POISON)
    handle.barrier(channel=0)
    routes = address.shape[0]
    if routes:
        acc = torch.promote_types(x.dtype, torch.float32)  # as the other paths weight rows
        scales = x if weights is None else weights.reshape(-1).to(acc).contiguous()
        _push_rows_kernel[_grid(routes, x.shape[1])](
            x, scales, address, peers, routes, rank_cap, x.shape[1],
            TOP_K=top_k, HAS_WEIGHTS=weights is not None, ROUTES=ROUTES, COLS=COLS,
        )  # fmt: skip
    handle.barrier(channel=0)
    return buffer.clone()


def fetch(buffer: Tensor, address: Tensor, pg: dist.ProcessGroup) -> Tensor:
    """Pull each route's row from its owner's buffer (zero rows for dropped routes)."""
    check_available(buffer)
    rank_cap = buffer.shape[0]
    shared, handle, peers = _workspace_for(rank_cap, buffer, pg)
    shared.copy_(buffer)
    handle.barrier(channel=0)
    routes = address.shape[0]
    picked = buffer.new_empty(routes, buffer.shape[1])
    if routes:
        _pull_rows_kernel[_grid(routes, buffer.shape[1])](
            picked, address, peers, routes, rank_cap, buffer.shape[1], ROUTES=ROUTES, COLS=COLS
        )
    handle.barrier(channel=0)
    return picked
