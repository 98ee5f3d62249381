"""Expert-parallel exchange primitives shared by the fused and the split ops of
:mod:`moec.ops.ep`: the exchange ops' common arguments (:class:`Exchange`), the EP process group,
buffers placed and read by route index, the a2a paths' ``all_to_all_single`` exchanges, the
``rowwise`` transport's contract and registry, and route-row arithmetic. Nothing here is an op;
every function is traced inside one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from moec.errors import MoecError

PATHS: dict[str, str] = {
    "a2a_capacity": "sync-free all_to_all of capacity-sized buffers",
    "sync_1d": "variable-split all_to_all, sizes copied to the host (syncs)",
    "rowwise": "rows pushed into the peers' symmetric memory, one per (token, rank)",
}
"""The EP ops' implementations, their ``path`` argument (see :mod:`moec.ops.ep`), in a few
words (``moec debug`` prints them)."""


class EPPathError(MoecError, RuntimeError):
    """The chosen EP path cannot run here; the message names the path to use instead."""


def check_path(path: str) -> None:
    if path not in PATHS:
        raise ValueError(f"unknown EP path {path!r}; expected one of {tuple(PATHS)}")


EXCHANGE_SCHEMA = (
    "Tensor slots, Tensor recv_rows, Tensor sent, Tensor counts, str group, int ep_size, "
    "str path, float? poison=None"
)
"""The arguments every exchange op ends with (:class:`Exchange`)."""


_TENSORS = 4
"""The exchange's tensor arguments lead it (``slots``, ``recv_rows``, ``sent``, ``counts``)."""


class Exchange(NamedTuple):
    """The arguments every exchange op (dispatch, combine, their backwards and split halves)
    ends with: ``ep_layout``'s ``slots`` (``[T, K]``), ``recv_rows`` (``[R]``), ``sent``
    (``[n]``) and ``counts`` (``[n, L]``); the EP group's name and size; the ``path``
    (:data:`PATHS`); and ``poison``: where not None, every buffer row no route writes (tails,
    padding, rows of dropped routes) holds this value instead of whatever the buffer held, so
    that a result reading one shows it (tests bind NaN through
    :attr:`moec.kernels.target.Target.ep_poison`; no value is read from such a row)."""

    slots: Tensor
    recv_rows: Tensor
    sent: Tensor
    counts: Tensor
    group: str
    ep_size: int
    path: str
    poison: float | None = None

    @classmethod
    def of(cls, args: tuple) -> Exchange:
        """The exchange from an op's trailing arguments (the schema's defaults filled)."""
        exchange = cls(*args[: len(cls._fields)])
        check_path(exchange.path)
        return exchange

    @property
    def top_k(self) -> int:
        return self.slots.shape[-1]

    @property
    def routes(self) -> Tensor:
        """``slots`` flat, ``[T*K]``: each route's slot (-1: none)."""
        return self.slots.reshape(-1)

    @property
    def tokens(self) -> int:
        return self.slots.numel() // self.top_k

    @property
    def num_rows(self) -> int:
        """``R``: rows of the expert buffer."""
        return self.recv_rows.shape[0]

    def process_group(self) -> dist.ProcessGroup:
        return resolve_group(self.group, self.ep_size)

    def save(self, ctx: Any, *tensors: Tensor | None) -> None:
        """Save ``tensors`` and the exchange for an autograd backward (:meth:`restore`)."""
        ctx.save_for_backward(*tensors, *self[:_TENSORS])
        ctx.exchange = tuple(self[_TENSORS:])

    @classmethod
    def restore(cls, ctx: Any) -> tuple[tuple[Tensor | None, ...], Exchange]:
        """The tensors :meth:`save` saved, and the exchange."""
        saved = ctx.saved_tensors
        return saved[:-_TENSORS], cls(*saved[-_TENSORS:], *ctx.exchange)


NO_GRADS = (None,) * len(Exchange._fields)
"""An exchange op's backward's gradients for the exchange's arguments (none)."""


def exchange_op(name: str, inputs: str, outputs: str, extra: str = ""):
    """``torch.library.custom_op`` decorator of ``moec::<name>``, schema ``(<inputs>,
    <EXCHANGE_SCHEMA><extra>) -> <outputs>``: the function takes the inputs, then the
    exchange's arguments (``*exchange``; :meth:`Exchange.of`), then ``extra``'s."""
    schema = f"({inputs}, {EXCHANGE_SCHEMA}{extra}) -> {outputs}"
    return functools.partial(
        torch.library.custom_op, f"moec::{name}", mutates_args=(), schema=schema
    )


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


def place_rows(values: Tensor, index: Tensor, num_rows, poison: float | None = None) -> Tensor:
    """Buffer of ``num_rows`` with ``values[i]`` at ``index[i]`` (-1: nowhere); the other rows
    hold ``poison`` (None: zeros; either way no result reads them)."""
    shape = (num_rows + 1, values.shape[-1])
    fill = 0 if poison is None else poison
    buffer = values.new_full(shape, fill)
    return buffer.index_copy_(0, torch.where(index >= 0, index, num_rows), values)[:num_rows]


def take_rows(buffer: Tensor, index: Tensor) -> Tensor:
    """``buffer[index]`` with zero rows where ``index`` is -1 (garbage cannot leak)."""
    return torch.where((index >= 0)[:, None], buffer[index.clamp(min=0)], 0)


# --- the a2a paths' exchanges -------------------------------------------------------------------
# ``send_routes(x[T, D], weights, exchange) -> buffer[R, D]`` moves each route's row (its token's
# row, times its weight if given) to its expert's rank; ``fetch_routes(buffer, exchange) ->
# [T*K, D]`` brings each route's row back (zero for routes without a row). ``a2a_capacity`` and
# ``sync_1d`` build dispatch, combine and both backwards from them (``rowwise``:
# :mod:`moec.ops.ep.per_rank`).


def _exchange(buffer: Tensor, pg, out_rows, out_splits=None, in_splits=None) -> Tensor:
    out = buffer.new_empty(out_rows, buffer.shape[1])
    dist.all_to_all_single(out, buffer.contiguous(), out_splits, in_splits, group=pg)
    return out


def _host_splits(ex: Exchange) -> tuple[list[int], list[int]]:
    """``sync_1d`` only: send and receive row counts per rank, copied to the host (the sync)."""
    return ex.sent.tolist(), ex.counts.sum(1).tolist()


def send_routes(x: Tensor, weights: Tensor | None, ex: Exchange) -> Tensor:
    """The a2a paths' (``rowwise`` has :func:`~moec.ops.ep.per_rank.send_once_per_rank`)."""
    pg, values = ex.process_group(), route_rows(x, ex.top_k, weights)  # [T*K, D]
    if ex.path == "a2a_capacity":
        source = place_rows(values, ex.routes, ex.num_rows, ex.poison)  # [N*C, D], e*C + j
        received = _exchange(source, pg, ex.num_rows)  # [(s, l, j), D]
        return place_rows(received, ex.recv_rows, ex.num_rows, ex.poison)
    send, recv = _host_splits(ex)
    source = place_rows(values, ex.routes, ex.slots.numel(), ex.poison)[: sum(send)]
    received = _exchange(source, pg, sum(recv), recv, send)
    return place_rows(received, ex.recv_rows[: sum(recv)], ex.num_rows, ex.poison)


def fetch_routes(buffer: Tensor, ex: Exchange) -> Tensor:
    """The a2a paths': ``[T*K, D]``, zero for routes without a row."""
    pg = ex.process_group()
    if ex.path == "a2a_capacity":
        returned = _exchange(take_rows(buffer, ex.recv_rows), pg, ex.num_rows)
        return take_rows(returned, ex.routes)
    send, recv = _host_splits(ex)
    outgoing = take_rows(buffer, ex.recv_rows[: sum(recv)])
    returned = _exchange(outgoing, pg, sum(send), send, recv)
    return take_rows(returned, ex.routes)  # accepted rows come first: every slot < sum(send)


# --- the rowwise transport ----------------------------------------------------------------------


@dataclass(frozen=True)
class Push:
    """One ``rowwise`` exchange: route ``i``'s row ``x[i // top_k]`` (times ``weights[i]``) goes
    to ``address[i] = dest * rows + row`` (-1: nowhere) of the group's ``[rows, D]`` buffers.
    Rows no route wrote hold ``fill`` (None: unspecified). ``written`` (bool ``[rows]``, where
    the receiver knows which rows arrive: the routes coming home) puts ``fill`` (0 when None)
    in the rows it marks False as the buffer is copied out. ``poison`` (:class:`Exchange`):
    what the workspace holds before the push wherever ``fill`` is not put there first."""

    x: Tensor
    address: Tensor
    rows: int
    top_k: int = 1
    weights: Tensor | None = None
    fill: float | None = None
    written: Tensor | None = None
    poison: float | None = None

    def before(self, masked_later: bool) -> float | None:
        """What the workspace is filled with before the push (None: nothing): ``fill``, unless
        the copy out or a consumer masks the rows no route wrote (``masked_later``) or there is
        none; then ``poison``."""
        return self.poison if masked_later or self.fill is None else self.fill


class RowwiseTransport(Protocol):
    """What the ``rowwise`` path needs of its transport."""

    def check_available(self, t: Tensor) -> None:
        """Raise :class:`EPPathError` (naming ``a2a_capacity``) unless ``t`` can travel."""

    def send(
        self, push: Push, pg: dist.ProcessGroup, consume: Callable[[Tensor], Tensor] | None = None
    ) -> Tensor:
        """Run ``push`` (:class:`Push`); return this rank's ``[rows, D]`` buffer, or with
        ``consume``, ``consume(buffer)``, reading the transport's workspace before the next
        exchange (rows no route wrote hold garbage)."""

    def issue(
        self, push: Push, pg: dist.ProcessGroup, out_rows: int, programs: int | None = None
    ) -> tuple[Tensor, Callable[[], None]]:
        """:meth:`send` started on the transport's own stream: returns this rank's ``[out_rows,
        D]`` result (rows ``[0, rows)`` as :meth:`send` fills them, the rest unspecified), valid
        once the returned ``wait()`` made the current stream wait for it. ``programs``: its copy
        kernel's programs per column tile (None: one per route tile)."""


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
