"""The ``rowwise`` EP transport: rows written into (and pulled from) peers' symmetric memory.

Every rank of an EP group owns one symmetric-memory buffer of ``Cr x D`` rows per (shape, dtype),
registered once with ``torch.distributed._symmetric_memory.rendezvous``; a device table of the
peers' buffer pointers lets one Triton kernel address any peer's rows over NVLink. Addresses come
from :func:`moec.ops.ep.rowwise_route_map` (``dest * Cr + row``, -1 dropped), computed on the
device, so neither direction copies anything to the host::

    send(values[T*K, D], address[T*K], Cr, pg) -> buffer[Cr, D]   # push each route's row
    fetch(buffer[Cr, D], address[T*K], pg) -> picked[T*K, D]       # pull each route's row back

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

from moec.ops.ep import EPPathError

BLOCK_D = 256


@triton.jit
def _push_rows_kernel(
    # pointers
    src_ptr,  # [routes, dim] rows to send, one per route
    address_ptr,  # [routes] int64: dest * rank_cap + row, -1 dropped
    peers_ptr,  # [ep_size] int64: base pointer of every peer's buffer
    # sizes
    rank_cap,
    dim,
    # meta-parameters
    BLOCK: tl.constexpr,
):
    route = tl.program_id(0)
    address = tl.load(address_ptr + route)
    if address >= 0:
        dest = address // rank_cap
        row = address % rank_cap
        base = tl.load(peers_ptr + dest).to(tl.pointer_type(src_ptr.dtype.element_ty))
        for start in range(0, dim, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < dim
            values = tl.load(src_ptr + route * dim + cols, mask=mask)
            tl.store(base + row * dim + cols, values, mask=mask)


@triton.jit
def _pull_rows_kernel(
    # pointers
    dst_ptr,  # [routes, dim] each route's row, zero when dropped
    address_ptr,  # [routes] int64
    peers_ptr,  # [ep_size] int64
    # sizes
    rank_cap,
    dim,
    # meta-parameters
    BLOCK: tl.constexpr,
):
    route = tl.program_id(0)
    address = tl.load(address_ptr + route)
    valid = address >= 0
    safe = tl.where(valid, address, 0)
    base = tl.load(peers_ptr + safe // rank_cap).to(tl.pointer_type(dst_ptr.dtype.element_ty))
    row = safe % rank_cap
    for start in range(0, dim, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < dim
        values = tl.load(base + row * dim + cols, mask=mask & valid, other=0.0)
        tl.store(dst_ptr + route * dim + cols, values, mask=mask)


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


def send(values: Tensor, address: Tensor, rank_cap: int, pg: dist.ProcessGroup) -> Tensor:
    """Push ``values[i]`` to ``address[i]``; return this rank's ``[rank_cap, D]`` buffer."""
    check_available(values)
    buffer, handle, peers = _workspace_for(rank_cap, values, pg)
    values = values.contiguous()
    handle.barrier(channel=0)
    if values.shape[0]:
        _push_rows_kernel[(values.shape[0],)](
            values, address, peers, rank_cap, values.shape[1], BLOCK=BLOCK_D
        )
    handle.barrier(channel=0)
    return buffer.clone()


def fetch(buffer: Tensor, address: Tensor, pg: dist.ProcessGroup) -> Tensor:
    """Pull each route's row from its owner's buffer (zero rows for dropped routes)."""
    check_available(buffer)
    rank_cap = buffer.shape[0]
    shared, handle, peers = _workspace_for(rank_cap, buffer, pg)
    shared.copy_(buffer)
    handle.barrier(channel=0)
    picked = buffer.new_empty(address.shape[0], buffer.shape[1])
    if address.shape[0]:
        _pull_rows_kernel[(address.shape[0],)](
            picked, address, peers, rank_cap, buffer.shape[1], BLOCK=BLOCK_D
        )
    handle.barrier(channel=0)
    return picked
