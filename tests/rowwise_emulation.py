"""A stand-in for the ``rowwise`` EP transport on any process group (gloo included), so the CPU
suite runs the rowwise path's op code (route maps, capacity drops, the masked fetch, the sum
read straight from the workspace, split exchanges) at EP = n.

It keeps :class:`moec.ops.ep.RowwiseTransport`'s contract, as
:mod:`moec.runtime.ep_rowwise` implements it with symmetric memory and a push kernel: route
``i``'s row ``x[i // top_k]`` (times ``weights[i]``) lands in row ``address[i] % rows`` of rank
``address[i] // rows``; rows no route wrote hold ``fill`` or, where the contract leaves them
unspecified, NaN (integers: a large sentinel), the worst garbage a caller could see. Every rank
all-gathers every route's address and row: a test transport, not a fast one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from moec.ops.ep import Push

GARBAGE_INT = 2**40
"""What an unspecified integer row holds."""


def check_available(t: Tensor) -> None:
    """Any device that the process group reaches."""


def send(
    push: Push, pg: dist.ProcessGroup, consume: Callable[[Tensor], Tensor] | None = None
) -> Tensor:
    x, address, rows = push.x, push.address, push.rows
    values = x[torch.arange(address.numel(), device=x.device) // push.top_k]
    if push.weights is not None:
        values = values * push.weights.reshape(-1, 1).to(values.dtype)
    world, me = dist.get_world_size(pg), dist.get_rank(pg)
    addresses = [torch.empty_like(address) for _ in range(world)]
    dist.all_gather(addresses, address.contiguous(), group=pg)
    rows_of = [torch.empty_like(values) for _ in range(world)]
    dist.all_gather(rows_of, values.contiguous(), group=pg)
    before = push.before(push.written is not None or consume is not None)
    if before is None:
        before = float("nan") if x.is_floating_point() else GARBAGE_INT
    buffer = x.new_full((rows, x.shape[-1]), before)
    for sent, row in zip(addresses, rows_of, strict=True):
        mine = (sent >= 0) & (sent // rows == me)
        buffer[sent[mine] % rows] = row[mine]
    if consume is not None:
        return consume(buffer)
    if push.written is not None:
        return torch.where(push.written[:, None], buffer, 0.0 if push.fill is None else push.fill)
    return buffer


def issue(
    push: Push, pg: dist.ProcessGroup, out_rows: int, programs: int | None = None
) -> tuple[Tensor, Callable[[], None]]:
    """:func:`send`, done by the time it returns: the wait has nothing to wait for (no copy
    kernel: ``programs`` changes nothing)."""
    x = push.x
    out = x.new_full((out_rows, x.shape[-1]), float("nan") if x.is_floating_point() else 0)
    out[: push.rows] = send(push, pg)
    return out, lambda: None
