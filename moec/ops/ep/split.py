"""Split expert-parallel exchanges (pass ``overlap``): each exchange as an issue op and a wait
op, so that the wait sits right before the consumer and other work is queued between them::

    tail = (*exchange, asynchronous, copy_programs)  # the fused ops' exchange, then Split's
    pending = ep_dispatch_issue(x, None, *tail)
    buffer = ep_dispatch_wait(pending, *tail)                                 # [R, D]
    pending, row_w = ep_combine_issue(y, weights, *tail)
    out, picked = ep_combine_wait(pending, weights, *tail)

Both combine ops take the route weights; each path applies them in one: ``rowwise`` at the issue (on
the experts' side, as its fused combine does; ``row_w`` are the weights as that side holds them,
``[R]``, which the issue's backward reads, and ``picked`` is empty, ``[0, D]``), the a2a paths at
the wait (home; ``row_w`` is empty, ``[0]``). The issue does the sender's local work (route rows
into the send buffer; ``rowwise``: the partial sums toward home) and starts the exchange without
making the current stream wait for it: ``a2a_capacity`` an asynchronous ``all_to_all_single``
(NCCL's stream), ``rowwise`` the push kernels on the transport's communication stream (its route
weights cross first, on the current stream). ``pending`` (``[P, D]``, :func:`pending_rows`: ``P =
R`` for ``a2a_capacity``, ``ep*T`` for ``rowwise``, whose token and partial workspaces move a row
per (token, rank) as its fused exchanges do) is what arrived at this rank, valid only once its wait
op ran: the wait makes the current stream wait for that exchange alone (found by ``pending``'s
storage, see :func:`pending_exchanges`), then does the receiver's local work (``rowwise``: the
gather into the expert buffer, or the sum of the partials). The a2a issue leaves its exchange
running only with ``asynchronous`` (:class:`Split`, the split ops' last arguments, bound by pass
``bind`` from the target: on CUDA; tests turn it on for gloo); without it the issue completes before
it returns, so every op's output is complete data (what opcheck and Inductor's reference runs read).
``sync_1d`` cannot be split (its split sizes reach the host; it synchronizes anyway): the issue ops
refuse it. Costs against the fused ops: none on ``a2a_capacity`` (the receiver's placement moves
into the wait); ``rowwise`` copies each result once more (the transport's stream copies it out of
symmetric memory into ``pending``, which the wait then reads).

The four ops are each other's backward, so the backward is split the same way and autograd
keeps the wait late: the wait's backward issues the reverse exchange (``dispatch_wait`` ->
``combine_issue`` unweighted, ``combine_wait`` -> ``dispatch_issue``, weighted with
``d_weights`` on the a2a paths), the issue's backward waits for it (``dispatch_issue`` ->
``combine_wait`` unweighted, ``combine_issue`` -> ``dispatch_wait``, or on ``rowwise`` with
weights the internal ``ep_combine_issue_backward``, which also computes ``d_weights`` on the
experts' side and sends it home). The gradient passed between a pair is therefore the reverse
exchange's in-flight result, not the gradient of ``pending`` itself (the same shape, ``[P,
D]``, in both directions): only the pair's composition is a vector-Jacobian product.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from moec.ops.ep.exchange import (
    NO_GRADS,
    Exchange,
    Push,
    accumulation_dtype,
    exchange_op,
    picked_weight_grad,
    place_rows,
    route_rows,
    rowwise_transport,
    sum_routes,
    take_rows,
)
from moec.ops.ep.index import token_route_table
from moec.ops.ep.per_rank import (
    expand_tokens,
    partial_sums,
    ranks_reached,
    sum_partials,
    token_push,
    weighted_rows,
    weights_home,
    weights_to_experts,
)
from moec.ops.movement import block_output

SPLIT = ", bool asynchronous=False, int? copy_programs=None"
"""The split ops' last arguments, after the exchange's (:class:`Split`)."""


class Split(NamedTuple):
    """The split ops' last arguments, bound by pass ``bind`` from the target
    (``Target.ep_asynchronous``, ``Target.ep_copy_programs``): ``asynchronous``, whether an a2a
    issue leaves its exchange running until its wait (the ``rowwise`` transport's issue always
    does); ``copy_programs``, programs per column tile of the ``rowwise`` transport's copy
    kernel on its stream (None: one per route tile; a cap holds fewer SMs while it runs beside
    the expert GEMMs, ``benchmarks/ep.py --overlap`` measures both)."""

    asynchronous: bool = False
    copy_programs: int | None = None


SPLIT_NO_GRADS = (*NO_GRADS, *(None,) * len(Split._fields))

_PENDING: dict[int, tuple[Tensor, Callable[[], None], tuple]] = {}
"""In-flight exchanges by the storage of their result: (result, wait, tensors kept alive)."""


def pending_exchanges() -> int:
    """Exchanges issued and not yet waited for (0 between steps of a correct program)."""
    return len(_PENDING)


def _register(out: Tensor, wait: Callable[[], None], keep: tuple = ()) -> None:
    """Hold ``wait`` for the wait op that reads ``out`` (``out`` and ``keep`` stay alive, so the
    storage key cannot be reused meanwhile)."""
    _PENDING[out.untyped_storage().data_ptr()] = (out, wait, keep)


def _wait_for(pending: Tensor) -> None:
    """Make the current stream wait for the exchange that fills ``pending``; nothing when none
    is in flight (completed on issue, already waited, or a copy)."""
    entry = _PENDING.pop(pending.untyped_storage().data_ptr(), None)
    if entry is not None:
        entry[1]()


def pending_rows(slots: Tensor, recv_rows: Tensor, ep_size: int, path: str):
    """``P``: rows of an issued exchange's result, the same in both directions (so each wait's
    backward can hand its issue's backward the reverse exchange's result): ``rowwise``'s token
    and partial workspaces, ``ep*T``; the a2a paths' buffer, ``R``."""
    if path == "rowwise":
        return ep_size * (slots.numel() // slots.shape[-1])
    return recv_rows.shape[0]


def _split_exchange(exchange: tuple | list) -> tuple[Exchange, Split]:
    """A split op's trailing arguments: the exchange and :class:`Split`; ``sync_1d`` refused."""
    ex = Exchange.of(tuple(exchange))
    if ex.path == "sync_1d":
        raise ValueError(
            "ep_path='sync_1d' copies its split sizes to the host (it synchronizes), so its "
            "exchanges cannot be issued ahead of their wait; use moec::ep_dispatch/ep_combine, "
            "or ep_path 'a2a_capacity' / 'rowwise'"
        )
    return ex, Split(*exchange[len(Exchange._fields) :])


def _pending_like(like: Tensor, ex: Exchange) -> Tensor:
    rows = pending_rows(ex.slots, ex.recv_rows, ex.ep_size, ex.path)
    return like.new_empty((rows, like.shape[-1]))


def _issue_a2a(send: Tensor, pg: dist.ProcessGroup, asynchronous: bool) -> Tensor:
    """Equal-split all-to-all of ``send``, left running when ``asynchronous``."""
    out = send.new_empty(send.shape)
    if not asynchronous:
        dist.all_to_all_single(out, send, group=pg)
        return out
    work = dist.all_to_all_single(out, send, group=pg, async_op=True)
    _register(out, work.wait, (send,))  # NCCL: work.wait() makes the current stream wait
    return out


def _issue_rowwise(push: Push, pg: dist.ProcessGroup, split: Split) -> Tensor:
    """``push`` (with ``written``: its rows marked False come out zero, so every pending result
    is defined data) issued on the transport's stream, into a ``[P, D]`` result."""
    out, wait = rowwise_transport().issue(push, pg, push.rows, split.copy_programs)
    _register(out, wait)
    return out


@exchange_op("ep_dispatch_issue", "Tensor x, Tensor? weights", "Tensor", SPLIT)
def ep_dispatch_issue(x: Tensor, weights: Tensor | None, *exchange: Any) -> Tensor:
    ex, split = _split_exchange(exchange)
    flat, pg = x.reshape(-1, x.shape[-1]), ex.process_group()
    if ex.path != "rowwise":
        routes = route_rows(flat, ex.top_k, weights)
        send = place_rows(routes, ex.routes, ex.num_rows, ex.poison)
        return _issue_a2a(send, pg, split.asynchronous)
    if weights is not None:
        raise ValueError(
            "ep_dispatch_issue on the rowwise path sends each token's row once per rank, "
            "unweighted (combine's weights apply on the experts' side, in ep_combine_issue "
            "and its backward); pass weights=None"
        )
    arriving = (token_route_table(ex.recv_rows, ex.tokens, ex.top_k, ex.ep_size) >= 0).any(1)
    return _issue_rowwise(token_push(flat, ex, dist.get_rank(pg), arriving), pg, split)


@ep_dispatch_issue.register_fake
def _ep_dispatch_issue_fake(x, weights, *exchange):
    return _pending_like(x, _split_exchange(exchange)[0])


@exchange_op("ep_dispatch_wait", "Tensor pending", "Tensor", SPLIT)
def ep_dispatch_wait(pending: Tensor, *exchange: Any) -> Tensor:
    ex, _ = _split_exchange(exchange)
    _wait_for(pending)
    if ex.path == "rowwise":
        return expand_tokens(pending, ex)
    return place_rows(pending, ex.recv_rows, ex.num_rows, ex.poison).contiguous()


@ep_dispatch_wait.register_fake
def _ep_dispatch_wait_fake(pending, *exchange):
    ex, _ = _split_exchange(exchange)
    return pending.new_empty((ex.num_rows, pending.shape[-1]))


@exchange_op("ep_combine_issue", "Tensor y, Tensor? weights", "(Tensor, Tensor)", SPLIT)
def ep_combine_issue(y: Tensor, weights: Tensor | None, *exchange: Any) -> tuple[Tensor, Tensor]:
    """``(pending, row_weights)``: ``row_weights`` are the route weights as the experts' side
    holds them (``[R]``) when ``rowwise`` weights here, else empty (``[0]``)."""
    ex, split = _split_exchange(exchange)
    pg, acc = ex.process_group(), accumulation_dtype(y)
    unweighted = y.new_empty((0,), dtype=acc)
    if ex.path != "rowwise":  # the weights apply home, at the wait
        return _issue_a2a(take_rows(y, ex.recv_rows), pg, split.asynchronous), unweighted
    row_weights = None if weights is None else weights_to_experts(weights, ex, acc)
    written = ranks_reached(ex).t().reshape(-1)  # [ep*T]: the partials coming home
    push = partial_sums(y, ex, dist.get_rank(pg), row_weights, written)
    return _issue_rowwise(push, pg, split), unweighted if row_weights is None else row_weights


@ep_combine_issue.register_fake
def _ep_combine_issue_fake(y, weights, *exchange):
    ex, _ = _split_exchange(exchange)
    weighted = ex.path == "rowwise" and weights is not None
    row_weights = ex.num_rows if weighted else 0
    return _pending_like(y, ex), y.new_empty((row_weights,), dtype=accumulation_dtype(y))


@exchange_op("ep_combine_wait", "Tensor pending, Tensor? weights", "(Tensor, Tensor)", SPLIT)
def ep_combine_wait(
    pending: Tensor, weights: Tensor | None, *exchange: Any
) -> tuple[Tensor, Tensor]:
    ex, _ = _split_exchange(exchange)
    _wait_for(pending)
    dim = pending.shape[-1]
    if ex.path == "rowwise":  # the partials of the ranks each token reached, weighted there
        out, picked = sum_partials(pending, ex), pending.new_empty((0, dim))
    else:
        picked = take_rows(pending, ex.routes)
        out = sum_routes(picked, ex.top_k, weights)
    return block_output(out, (*ex.slots.shape[:-1], dim)), picked


@ep_combine_wait.register_fake
def _ep_combine_wait_fake(pending, weights, *exchange):
    ex, _ = _split_exchange(exchange)
    dim = pending.shape[-1]
    picked = 0 if ex.path == "rowwise" else ex.slots.numel()
    return pending.new_empty((*ex.slots.shape[:-1], dim)), pending.new_empty((picked, dim))


@exchange_op(
    "ep_combine_issue_backward",
    "Tensor d_pending, Tensor weights, Tensor row_weights, Tensor y",
    "(Tensor, Tensor)",
    SPLIT,
)
def ep_combine_issue_backward(
    d_pending: Tensor, weights: Tensor, row_weights: Tensor, y: Tensor, *exchange: Any
) -> tuple[Tensor, Tensor]:
    """``rowwise`` ``ep_combine_issue`` with weights, backward: waits for ``d_pending`` (the
    output gradient sent toward the experts by ``ep_combine_wait``'s backward), then on the
    experts' side ``d_y`` and the weights' gradient from ``row_weights`` (what the issue's
    weights became there, its second output) and ``y``; the gradient comes home, a float per
    route. ``weights`` give its shape and dtype."""
    ex, _ = _split_exchange(exchange)
    if ex.path != "rowwise":
        raise ValueError(
            f"ep_combine_issue_backward serves ep_path='rowwise' only (got {ex.path!r}); the "
            "a2a paths' combine issue backward is ep_dispatch_wait"
        )
    _wait_for(d_pending)
    d_y, d_w = weighted_rows(d_pending, ex, y, row_weights)
    d_weights = weights_home(d_w, ex)
    return d_y.contiguous(), d_weights.to(weights.dtype).view(weights.shape).contiguous()


@ep_combine_issue_backward.register_fake
def _ep_combine_issue_backward_fake(d_pending, weights, row_weights, y, *exchange):
    _split_exchange(exchange)
    return y.new_empty(y.shape), weights.new_empty(weights.shape)


# Autograd: the four ops are each other's backward (module docstring).


def _save(ctx, exchange: list, *tensors: Tensor | None) -> None:
    """Save ``tensors`` and a split op's trailing arguments (:func:`_restore`)."""
    ex, ctx.split = _split_exchange(exchange)
    ex.save(ctx, *tensors)


def _restore(ctx) -> tuple[tuple[Tensor | None, ...], tuple]:
    """The tensors :func:`_save` saved, and the trailing arguments of the split ops."""
    tensors, ex = Exchange.restore(ctx)
    return tensors, (*ex, *ctx.split)


def _dispatch_issue_setup(ctx, inputs, output) -> None:
    x, _, *exchange = inputs
    _save(ctx, exchange)
    ctx.x_shape = x.shape


def _dispatch_issue_backward(ctx, d_pending):
    _, tail = _restore(ctx)
    d_x, _ = torch.ops.moec.ep_combine_wait(d_pending, None, *tail)
    return d_x.view(ctx.x_shape), None, *SPLIT_NO_GRADS


def _dispatch_wait_setup(ctx, inputs, output) -> None:
    _save(ctx, inputs[1:])


def _dispatch_wait_backward(ctx, d_buffer):
    _, tail = _restore(ctx)
    d_pending, _ = torch.ops.moec.ep_combine_issue(d_buffer, None, *tail)
    return d_pending, *SPLIT_NO_GRADS


def _combine_issue_setup(ctx, inputs, output) -> None:
    """rowwise with weights: also y, the weights and the experts' side's weights (its backward
    computes the weights' gradient there)."""
    y, weights, *exchange = inputs
    weighted = Exchange.of(exchange).path == "rowwise" and weights is not None
    _save(ctx, exchange, *((y, weights, output[1]) if weighted else (None, None, None)))


def _combine_issue_backward(ctx, d_pending, d_row_weights_unused):
    (y, weights, row_weights), tail = _restore(ctx)
    if weights is None:
        d_y = torch.ops.moec.ep_dispatch_wait(d_pending, *tail)
        return d_y, None, *SPLIT_NO_GRADS
    d_y, d_weights = torch.ops.moec.ep_combine_issue_backward(
        d_pending, weights, row_weights, y, *tail
    )
    return d_y, d_weights, *SPLIT_NO_GRADS


def _combine_wait_setup(ctx, inputs, output) -> None:
    """The a2a paths weight at the wait (rowwise at the issue: nothing weighted here)."""
    _, weights, *exchange = inputs
    weights = None if Exchange.of(exchange).path == "rowwise" else weights
    _save(ctx, exchange, weights, output[1])


def _combine_wait_backward(ctx, d_out, d_picked_unused):
    (weights, picked), tail = _restore(ctx)
    d_pending = torch.ops.moec.ep_dispatch_issue(d_out, weights, *tail)
    d_weights = None
    if weights is not None and ctx.needs_input_grad[1]:
        d_weights = picked_weight_grad(picked, d_out, tail[0].shape[-1])
        d_weights = d_weights.view(weights.shape).to(weights.dtype)
    return d_pending, d_weights, *SPLIT_NO_GRADS


ep_dispatch_issue.register_autograd(_dispatch_issue_backward, setup_context=_dispatch_issue_setup)
ep_dispatch_wait.register_autograd(_dispatch_wait_backward, setup_context=_dispatch_wait_setup)
ep_combine_issue.register_autograd(_combine_issue_backward, setup_context=_combine_issue_setup)
ep_combine_wait.register_autograd(_combine_wait_backward, setup_context=_combine_wait_setup)
