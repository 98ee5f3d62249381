"""The ``rowwise`` EP transport: rows pushed into peers' symmetric memory, both directions.

Every rank of an EP group owns one symmetric-memory buffer per (rows, D, dtype), registered
once with ``torch.distributed._symmetric_memory.rendezvous``; a device table of the peers'
buffer pointers lets one Triton kernel (:mod:`moec.kernels.ep_push`) write any peer's rows over
NVLink. Addresses are ``dest * rows + row`` (-1: nowhere), computed on the device
(:mod:`moec.ops.ep.index`), so nothing is copied to the host. One primitive serves every
direction::

    send(Push(x[T, D], to[T*ep], ep*T, top_k=ep), pg, expand) -> buffer[Cr, D]  # dispatch
    send(Push(route_ids[T*K, 1], slots, Cr, fill=-1), pg) -> origins[Cr]  # layout: row r's sender
    send(Push(weights[T*K, 1], slots, Cr, fill=0), pg) -> weights[Cr]    # combine: to experts
    send(Push(partial[ep*T, D], home[ep*T], ep*T), pg, sum) -> out[T, D]  # combine: home
    send(Push(d_w[Cr, 1], origins, T*K, fill=0, written=home), pg) -> d_weights[T*K]  # backward

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
from moec.ops.ep import EPPathError, Push


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


@functools.cache
def _comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream split exchanges run on (one per device)."""
    return torch.cuda.Stream(device)


def send(
    push: Push, pg: dist.ProcessGroup, consume: Callable[[Tensor], Tensor] | None = None
) -> Tensor:
    """Run ``push`` (:class:`~moec.ops.ep.Push`); return this rank's ``[rows, D]`` buffer.
    ``written`` puts ``fill`` in the rows it marks False as the buffer is copied out, in the
    same pass (no fill before the push). ``consume``: return ``consume(workspace)`` instead of
    a copy; it must read the workspace on the current stream and keep no view of it (the next
    exchange of the shape overwrites it), and mask the rows no route wrote itself."""
    check_available(push.x)
    buffer, handle, peers = _workspace_for(push.rows, push.x, pg)
    before = push.before(push.written is not None or consume is not None)
    if before is not None:
        buffer.fill_(before)
    handle.barrier(channel=0)  # every peer done with its last copy out of its buffer
    _push(push, peers)  # weighted as the other paths weight rows
    handle.barrier(channel=0)  # every peer's rows have landed here
    if consume is not None:
        return consume(buffer)
    return _copy_out(buffer, push, buffer.new_empty(buffer.shape))


def _push(push: Push, peers: Tensor, programs: int | None = None) -> None:
    push_rows(push.x, push.address, peers, push.rows, push.top_k, push.weights, programs)


def _copy_out(buffer: Tensor, push: Push, out: Tensor) -> Tensor:
    """``out`` = the workspace, with ``push.fill`` (0 when None) in the rows ``push.written``
    marks False, in one pass."""
    if push.written is None:
        return out.copy_(buffer)
    fill = 0.0 if push.fill is None else push.fill
    other = buffer.new_full((), fill)  # where(out=) takes no scalar
    return torch.where(push.written[:, None], buffer, other, out=out)


def issue(
    push: Push, pg: dist.ProcessGroup, out_rows: int, programs: int | None = None
) -> tuple[Tensor, Callable[[], None]]:
    """:func:`send` on the communication stream (module docstring): this rank's ``[out_rows,
    D]`` result (rows ``[0, rows)`` as :func:`send` fills them) and the ``wait()`` after which
    the current stream may read it. ``programs``: the copy kernel's programs per column tile
    (None: one per route tile; a capped grid holds fewer SMs while the copy runs beside the
    expert GEMMs, ``moec.ops.ep.split.Split``)."""
    x = push.x
    check_available(x)
    buffer, handle, peers = _workspace_for(push.rows, x, pg, lane="split")
    before = push.before(push.written is not None)
    compute, comm = torch.cuda.current_stream(x.device), _comm_stream(x.device)
    out = x.new_empty(out_rows, x.shape[-1])  # on the compute stream, which reads it
    comm.wait_stream(compute)  # x, address and weights are written
    with torch.cuda.stream(comm):
        if before is not None:
            buffer.fill_(before)
        handle.barrier(channel=0)
        _push(push, peers, programs)
        handle.barrier(channel=0)
        _copy_out(buffer, push, out[: push.rows])
        done = torch.cuda.Event()
        done.record(comm)
    for t in (x, push.address, push.weights, push.written, out):
        if t is not None:
            t.record_stream(comm)
    return out, lambda: torch.cuda.current_stream(out.device).wait_event(done)
