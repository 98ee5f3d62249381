"""Expert-parallel exchange primitives shared by the fused and the split ops of
:mod:`moec.ops.ep`: the EP process group, buffers placed and read by route index, the a2a paths'
``all_to_all_single`` exchanges, the ``rowwise`` transport's contract and registry, and route-row
arithmetic. Nothing here is an op; every function is traced inside one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from moec.errors import MoecError

PATHS = ("a2a_capacity", "sync_1d", "rowwise")


@dataclass
class Hooks:
    """Switches the tests flip (one shared instance, :data:`HOOKS`)."""

    poison: float | None = None
    """Fill every buffer row no route writes (tails, padding) with this garbage."""
    asynchronous: bool | None = None
    """Whether issue ops leave their exchange running: None = on CUDA only (CPU outputs stay
    complete data); True runs gloo's exchanges asynchronously too."""


HOOKS = Hooks()


class EPPathError(MoecError, RuntimeError):
    """The chosen EP path cannot run here; the message names the path to use instead."""


def check_path(path: str) -> None:
    if path not in PATHS:
        raise ValueError(f"unknown EP path {path!r}; expected one of {PATHS}")


# --- process groups and buffers -----------------------------------------------------------------


def resolve_group(group: str, ep_size: int) -> dist.ProcessGroup:
    """The EP process group by name; checks that it has ``ep_size`` ranks."""
    if not dist.is_initialized():
        raise EPPathError(
            f"EP ops need an initialized process group (group {group!r}); call "
            "moec.runtime.distributed.init_from_env(plan) under torchrun first"
        )
    pg = dist.distributed_c10d._resolve_process_group(group)
    if dist.get_world_size(pg) != ep_size:
        raise EPPathError(f"EP group {group!r} has {dist.get_world_size(pg)} ranks, not {ep_size}")
    return pg


def _alloc(rows, cols: int, like: Tensor) -> Tensor:
    if HOOKS.poison is None:
        return like.new_zeros(rows, cols)
    return like.new_full((rows, cols), HOOKS.poison)


def place_rows(values: Tensor, index: Tensor, num_rows) -> Tensor:
    """Buffer of ``num_rows`` with ``values[i]`` at ``index[i]`` (-1: nowhere); rest unspecified."""
    buffer = _alloc(num_rows + 1, values.shape[-1], values)
    return buffer.index_copy_(0, torch.where(index >= 0, index, num_rows), values)[:num_rows]


def take_rows(buffer: Tensor, index: Tensor) -> Tensor:
    """``buffer[index]`` with zero rows where ``index`` is -1 (garbage cannot leak)."""
    return torch.where((index >= 0)[:, None], buffer[index.clamp(min=0)], 0)


# --- the a2a paths' exchanges -------------------------------------------------------------------
# ``send_routes(x[T, D], top_k, weights, slots, ...) -> buffer[R, D]`` moves each route's row (its
# token's row, times its weight if given) to its expert's rank; ``fetch_routes(buffer, ...) ->
# [T*K, D]`` brings each route's row back (zero for routes without a row). ``a2a_capacity`` and
# ``sync_1d`` build dispatch, combine and both backwards from them (``rowwise``:
# :mod:`moec.ops.ep.per_rank`).


def _exchange(buffer: Tensor, pg, out_rows, out_splits=None, in_splits=None) -> Tensor:
    out = buffer.new_empty(out_rows, buffer.shape[1])
    dist.all_to_all_single(out, buffer.contiguous(), out_splits, in_splits, group=pg)
    return out


def _host_splits(sent: Tensor, counts: Tensor) -> tuple[list[int], list[int]]:
    """``sync_1d`` only: send and receive row counts per rank, copied to the host (the sync)."""
    return sent.tolist(), counts.sum(1).tolist()


def _send_a2a(values, slots, recv_rows, sent, counts, pg, path):
    """``values[T*K, D]``: one row per route."""
    num_rows = recv_rows.shape[0]
    if path == "a2a_capacity":
        source = place_rows(values, slots, num_rows)  # [N*C, D], slot e*C + j
        received = _exchange(source, pg, num_rows)  # [(s, l, j), D]
        return place_rows(received, recv_rows, num_rows)
    send, recv = _host_splits(sent, counts)
    source = place_rows(values, slots, slots.numel())[: sum(send)]  # expert-major = rank-major
    received = _exchange(source, pg, sum(recv), recv, send)
    return place_rows(received, recv_rows[: sum(recv)], num_rows)


def _fetch_a2a(buffer, slots, recv_rows, sent, counts, pg, path):
    if path == "a2a_capacity":
        returned = _exchange(take_rows(buffer, recv_rows), pg, recv_rows.shape[0])
        return take_rows(returned, slots)
    send, recv = _host_splits(sent, counts)
    outgoing = take_rows(buffer, recv_rows[: sum(recv)])
    returned = _exchange(outgoing, pg, sum(send), send, recv)
    return take_rows(returned, slots)  # accepted rows come first: every slot < sum(send)


def send_routes(x, top_k, weights, slots, recv_rows, sent, counts, group, ep_size, path):
    """The a2a paths' (``rowwise`` has :func:`send_once_per_rank`)."""
    pg = resolve_group(group, ep_size)
    values = route_rows(x, top_k, weights)
    return _send_a2a(values, slots, recv_rows, sent, counts, pg, path)


def fetch_routes(buffer, slots, recv_rows, sent, counts, group, ep_size, path, consume=None):
    """The a2a paths': ``[T*K, D]``, zero for routes without a row, or ``consume`` of it."""
    pg = resolve_group(group, ep_size)
    picked = _fetch_a2a(buffer, slots, recv_rows, sent, counts, pg, path)
    return picked if consume is None else consume(picked)


# --- the rowwise transport ----------------------------------------------------------------------


class RowwiseTransport(Protocol):
    """What the ``rowwise`` path needs of its transport."""

    def check_available(self, t: Tensor) -> None:
        """Raise :class:`EPPathError` (naming ``a2a_capacity``) unless ``t`` can travel."""

    def send(
        self,
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
        """Push route ``i``'s row ``x[i // top_k]`` (times ``weights[i]``) to ``address[i] =
        dest * rows + row`` (-1: nowhere); return this rank's ``[rows, D]`` buffer, rows no route
        wrote holding ``fill`` (``HOOKS.poison`` when None and set, else unspecified). With
        ``written`` (which rows arrive) the rows it marks False hold ``fill`` (0 when None);
        with ``consume``, ``consume(buffer)`` is returned instead, reading the transport's
        workspace before the next exchange (rows no route wrote hold garbage)."""

    def issue(
        self,
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
        """:meth:`send` started on the transport's own stream: returns this rank's ``[out_rows,
        D]`` result (rows ``[0, rows)`` as :meth:`send` fills them, the rest unspecified), valid
        once the returned ``wait()`` made the current stream wait for it."""


Loader = Callable[[], RowwiseTransport]
_load_rowwise: Loader | None = None
"""The registered loader of the rowwise transport."""


def register_rowwise_transport(load: Callable[[], RowwiseTransport] | None) -> Loader | None:
    """Install the ``rowwise`` transport: ``load()`` returns it when the path first runs, or
    raises ImportError where its dependencies (triton, symmetric memory) are missing. Registering
    again replaces the loader (None: none); returns the one it replaced."""
    global _load_rowwise
    previous, _load_rowwise = _load_rowwise, load
    return previous


def rowwise_transport() -> RowwiseTransport:
    """The registered transport, or :class:`EPPathError` naming the fallback."""
    if _load_rowwise is None:
        raise EPPathError(
            "ep_path='rowwise' needs the runtime's symmetric-memory transport, registered by "
            "`import moec.runtime`; import it, or use ep_path='a2a_capacity' (sync-free on any "
            "backend)"
        )
    try:
        return _load_rowwise()
    except ImportError as exc:
        raise EPPathError(
            f"ep_path='rowwise' needs triton and torch.distributed._symmetric_memory ({exc}); "
            "use ep_path='a2a_capacity' (sync-free on any backend)"
        ) from exc


# --- route rows ---------------------------------------------------------------------------------


def accumulation_dtype(t: Tensor) -> torch.dtype:
    """Accumulation dtype: at least float32."""
    return torch.promote_types(t.dtype, torch.float32)


def route_rows(x: Tensor, top_k: int, weights: Tensor | None = None) -> Tensor:
    """(T, D) -> (T*K, D): each token's row once per route, optionally times its weight."""
    rows = x.reshape(-1, 1, x.shape[-1]).expand(-1, top_k, -1)
    if weights is not None:
        acc = accumulation_dtype(x)
        rows = (rows.to(acc) * weights.reshape(-1, top_k, 1).to(acc)).to(x.dtype)
    return rows.reshape(-1, x.shape[-1])


def picked_weight_grad(picked: Tensor, d_out: Tensor, top_k: int) -> Tensor:
    """The a2a paths' route weights' gradient, home: ``<picked[t*K + k], d_out[t]>``
    ``[T, K]``, accumulated in :func:`accumulation_dtype`."""
    acc = accumulation_dtype(picked)
    routes = d_out.reshape(-1, 1, d_out.shape[-1]).to(acc)
    return (picked.view(-1, top_k, picked.shape[-1]).to(acc) * routes).sum(-1)


def sum_routes(
    picked: Tensor, top_k: int, weights: Tensor | None = None, valid: Tensor | None = None
) -> Tensor:
    """(T*K, D) -> (T, D): sum over k of weights * picked, accumulated in
    :func:`accumulation_dtype`, rows ``valid`` marks False left out (not read). It is
    ``moec::combine`` over the identity rows, so CUDA runs the combine kernel."""
    routes = torch.arange(picked.shape[0], device=picked.device)
    if valid is not None:
        routes = torch.where(valid.reshape(-1), routes, -1)
    routes = routes.view(-1, top_k)
    if weights is None:
        weights = torch.ones(routes.shape, dtype=accumulation_dtype(picked), device=picked.device)
    return torch.ops.moec.combine(picked, weights.reshape(routes.shape), routes)
