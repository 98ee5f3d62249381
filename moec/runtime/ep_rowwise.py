"""The ``rowwise`` EP transport: rows pushed into peers' symmetric memory, both directions.

Every rank of an EP group owns one symmetric-memory buffer per (rows, D, dtype), registered
once with ``torch.distributed._symmetric_memory.rendezvous``; a device table of the peers'
buffer pointers lets one Triton kernel write any peer's rows over NVLink. Addresses are
``dest * rows + row`` (-1: nowhere), computed on the device (:func:`moec.ops.ep.
rowwise_route_map`), so nothing is copied to the host. One primitive serves every direction::

    send(x[T, D], slots[T*K], Cr, pg, top_k=K)     -> buffer[Cr, D]   # dispatch
    send(route_ids[T*K, 1], slots, Cr, pg, fill=-1) -> origins[Cr]    # layout: who sent row r
    send(y[Cr, D], origins, T*K, pg, fill=0)         -> picked[T*K, D] # combine: rows go home

Dispatch reads route ``i``'s row straight from the token row ``x[i // K]`` (scaled by the route
weight in combine's backward): the ``[T*K, D]`` copy of the tokens is never written. Combine
pushes each expert-output row back to the route that sent it (``origins``), zeros where no row
came back (dropped routes). One kernel for both directions; pushing instead of pulling did not by
itself speed the combine up on two H200s (159 GB/s pulling, 151 pushing, dispatch 351): its time
was the route sum and copies around the transfer (``benchmarks/RESULTS.md``, multi-GPU).

Ordering uses the handle's device-side barrier: fill, barrier, push, barrier, copy out (the first
barrier keeps a fast peer from writing into a buffer still being copied out). Inside one node
this uses peer pointers; an EP group spanning nodes needs the NVSHMEM backend of symmetric
memory (not wired here).
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
    rows: int,
    pg: dist.ProcessGroup,
    top_k: int = 1,
    weights: Tensor | None = None,
    fill: float | None = None,
) -> Tensor:
    """Push route ``i``'s row ``x[i // top_k]`` (times ``weights[i]`` if given) to
    ``address[i] = dest * rows + row``; return this rank's ``[rows, D]`` buffer. Rows no route
    wrote hold ``fill`` (unspecified when None)."""
    check_available(x)
    buffer, handle, peers = _workspace_for(rows, x, pg)
    x = x.contiguous()
    if fill is None:
        fill = ep_ops._POISON  # tests: rows no route writes hold garbage
    if fill is not None:
        buffer.fill_(fill)
    handle.barrier(channel=0)  # every peer done with its last copy out of its buffer
    routes = address.shape[0]
    if routes:
        acc = torch.promote_types(x.dtype, torch.float32)  # as the other paths weight rows
        scales = x if weights is None else weights.reshape(-1).to(acc).contiguous()
        _push_rows_kernel[_grid(routes, x.shape[1])](
            x, scales, address, peers, routes, rows, x.shape[1],
            TOP_K=top_k, HAS_WEIGHTS=weights is not None, ROUTES=ROUTES, COLS=COLS,
        )  # fmt: skip
    handle.barrier(channel=0)  # every peer's rows have landed here
    return buffer.clone()
