"""The ``rowwise`` EP transport: rows pushed into peers' symmetric memory, both directions.

Every rank of an EP group owns one symmetric-memory buffer per (rows, D, dtype), registered
once with ``torch.distributed._symmetric_memory.rendezvous``; a device table of the peers'
buffer pointers lets one Triton kernel (:mod:`moec.kernels.ep_push`) write any peer's rows over
NVLink. Addresses are ``dest * rows + row`` (-1: nowhere), computed on the device
(:mod:`moec.ops.ep.index`), so nothing is copied to the host. One primitive serves every
direction::

    send(x[T, D], to[T*ep], ep*T, pg, top_k=ep, consume=expand) -> buffer[Cr, D]  # dispatch
    send(route_ids[T*K, 1], slots, Cr, pg, fill=-1) -> origins[Cr]    # layout: who sent row r
    send(weights[T*K, 1], slots, Cr, pg, fill=0) -> weights[Cr]       # combine: to the experts
    send(partial[ep*T, D], home[ep*T], ep*T, pg, consume=sum) -> out[T, D]  # combine: home
    send(d_w[Cr, 1], origins, T*K, pg, fill=0, written=home) -> d_weights[T*K]  # its backward

Toward the experts (dispatch, combine's backward) each token's row crosses once per rank that
gets any of its routes (``to``: one address per token and rank,
:func:`~moec.ops.ep.index.token_rank_addresses`), read straight from ``x``; the receiver's
``expand`` gathers its buffer rows from that ``[ep*T, D]`` workspace. Home (combine,
dispatch's backward) each rank first sums a token's rows it holds (combine's weighted) and
returns one partial per token and rank, which the home's ``sum`` adds up. The ``[T*K, D]``
copies of the tokens and of the expert outputs are never written. One kernel for every
direction.

Ordering uses the handle's device-side barrier: fill, barrier, push, barrier, copy out (the first
barrier keeps a fast peer from writing into a buffer still being copied out). Inside one node
this uses peer pointers; an EP group spanning nodes needs the NVSHMEM backend of symmetric
memory (not wired here).

Split exchanges (:func:`issue`, pass ``overlap``): the same fill, barrier, push, barrier and copy
out run on a communication stream of their own (one per device), after an event of the current
stream (the inputs are ready), into a result allocated on the current stream; the returned
``wait()`` makes the current stream wait for an event recorded after the copy. Inputs and the
result are marked used on the communication stream (``record_stream``), so the caching
allocator reuses none of them before the copy has run. Split exchanges use workspaces of their
own, so an in-flight exchange never shares one with an exchange on the compute stream; on the
communication stream they run in issue order, which every rank shares, so one workspace per
shape serves any number in flight.

The op layer reaches this transport through :func:`moec.ops.ep.register_rowwise_transport`;
importing :mod:`moec.runtime` registers it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch import Tensor

from moec.kernels.ep_push import push_rows
from moec.ops import ep as ep_ops
from moec.ops.ep import EPPathError


def check_available(t: Tensor) -> None:
    """Raise :class:`EPPathError` unless ``t`` lives where the rowwise transport can run."""
    if not t.is_cuda:
        raise EPPathError(
            f"ep_path='rowwise' writes rows into peers' CUDA symmetric memory; tensors are on "
            f"{t.device}. Use ep_path='a2a_capacity' (sync-free on any backend, incl. gloo)"
        )


@functools.cache
def _workspace(
    rows: int, dim: int, dtype: torch.dtype, device: torch.device, group: str, lane: str = "sync"
):
    """The symmetric buffer, its handle and the peers' pointers of one (shape, group, lane)."""
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


def _workspace_for(rows: int, like: Tensor, pg: dist.ProcessGroup, lane: str = "sync"):
    return _workspace(rows, like.shape[-1], like.dtype, like.device, pg.group_name, lane)


SPLIT_PROGRAMS: int | None = None
"""Programs per column tile of a split exchange's copy kernel (None: one per route tile). A
capped grid holds fewer SMs while the copy runs beside the expert GEMMs; ``benchmarks/ep.py
--overlap`` measures both."""


@functools.cache
def _comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream split exchanges run on (one per device)."""
    return torch.cuda.Stream(device)


def send(
    x: Tensor,
    address: Tensor,
    rows: int,
    pg: dist.ProcessGroup,
    top_k: int = 1,
    weights: Tensor | None = None,
    fill: float | None = None,
    written: Tensor | None = None,
    consume: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Push route ``i``'s row ``x[i // top_k]`` (times ``weights[i]`` if given) to
    ``address[i] = dest * rows + row``; return this rank's ``[rows, D]`` buffer. Rows no route
    wrote hold ``fill`` (unspecified when None). ``written`` (bool ``[rows]``, where the caller
    knows which rows arrive: the routes coming home) puts ``fill`` in the others as the buffer
    is copied out, in the same pass (no fill before the push). ``consume``: return
    ``consume(workspace)`` instead of a copy; it must read the workspace on the current stream
    and keep no view of it (the next exchange of the shape overwrites it), and mask the rows no
    route wrote itself."""
    check_available(x)
    buffer, handle, peers = _workspace_for(rows, x, pg)
    before = _fill_before(fill, written is not None or consume is not None)
    if before is not None:
        buffer.fill_(before)
    handle.barrier(channel=0)  # every peer done with its last copy out of its buffer
    push_rows(x, address, peers, rows, top_k, weights)  # weighted as the other paths weight rows
    handle.barrier(channel=0)  # every peer's rows have landed here
    if consume is not None:
        return consume(buffer)
    return _copy_out(buffer, written, fill, buffer.new_empty(buffer.shape))


def _fill_before(fill: float | None, masked_later: bool) -> float | None:
    """What the workspace holds before the push: ``fill``, unless the copy out (or the
    consumer) masks the rows no route wrote; then, and where ``fill`` is None, the tests'
    poison (``moec.ops.ep.HOOKS.poison``: None, no fill, outside them)."""
    return ep_ops.HOOKS.poison if masked_later or fill is None else fill


def _copy_out(buffer: Tensor, written: Tensor | None, fill: float | None, out: Tensor) -> Tensor:
    """``out`` = the workspace, with ``fill`` (0 when None) in the rows ``written`` marks
    False, in one pass."""
    if written is None:
        return out.copy_(buffer)
    other = buffer.new_full((), 0.0 if fill is None else fill)  # where(out=) takes no scalar
    return torch.where(written[:, None], buffer, other, out=out)


def issue(
    x: Tensor,
    address: Tensor,
    rows: int,
    out_rows: int,
    pg: dist.ProcessGroup,
    top_k: int = 1,
    weights: Tensor | None = None,
    fill: float | None = None,
    written: Tensor | None = None,
) -> tuple[Tensor, Callable[[], None]]:
    """:func:`send` on the communication stream (module docstring): this rank's ``[out_rows,
    D]`` result (rows ``[0, rows)`` as :func:`send` fills them) and the ``wait()`` after which
    the current stream may read it."""
    check_available(x)
    buffer, handle, peers = _workspace_for(rows, x, pg, lane="split")
    before = _fill_before(fill, written is not None)
    compute, comm = torch.cuda.current_stream(x.device), _comm_stream(x.device)
    out = x.new_empty(out_rows, x.shape[-1])  # on the compute stream, which reads it
    comm.wait_stream(compute)  # x, address and weights are written
    with torch.cuda.stream(comm):
        if before is not None:
            buffer.fill_(before)
        handle.barrier(channel=0)
        push_rows(x, address, peers, rows, top_k, weights, SPLIT_PROGRAMS)
        handle.barrier(channel=0)
        _copy_out(buffer, written, fill, out[:rows])
        done = torch.cuda.Event()
        done.record(comm)
    for t in (x, address, weights, written, out):
        if t is not None:
            t.record_stream(comm)
    return out, lambda: torch.cuda.current_stream(out.device).wait_event(done)
