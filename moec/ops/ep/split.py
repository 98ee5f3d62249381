"""Split expert-parallel exchanges (pass ``overlap``): each exchange as an issue op and a wait
op, so that the wait sits right before the consumer and other work is queued between them::

    pending = ep_dispatch_issue(x, None, slots, recv_rows, sent, counts, group, n, path)
    buffer = ep_dispatch_wait(pending, slots, recv_rows, sent, counts, group, n, path)  # [R, D]
    pending, row_w = ep_combine_issue(y, weights, slots, recv_rows, sent, counts, group, n, path)
    out, picked = ep_combine_wait(pending, weights, slots, recv_rows, sent, counts, group, n, path)

Both combine ops take the route weights; each path applies them in one: ``rowwise`` at the issue
(on the experts' side, as its fused combine does; ``row_w`` are the weights as that side holds
them, ``[R]``, which the issue's backward reads, and ``picked`` is empty, ``[0, D]``), the a2a
paths at the wait (home; ``row_w`` is empty, ``[0]``). The issue does the sender's local work
(route rows into the send buffer; ``rowwise``: the partial sums toward home) and starts the
exchange without making the current stream wait for it: ``a2a_capacity`` an asynchronous
``all_to_all_single`` (NCCL's stream), ``rowwise`` the push kernels on the transport's
communication stream (its route weights cross first, on the current stream). ``pending``
(``[P, D]``, :func:`pending_rows`: ``P = R`` for ``a2a_capacity``, ``ep*T`` for ``rowwise``,
whose token and partial workspaces move a row per (token, rank) as its fused exchanges do) is
what arrived at this rank, valid only once its wait op ran: the wait makes the current stream
wait for that exchange alone (found by ``pending``'s storage, see :func:`pending_exchanges`),
then does the receiver's local work (``rowwise``: the gather into the expert buffer, or the sum
of the partials). On CPU the issue completes before it returns unless ``HOOKS.asynchronous``
says otherwise, so every op's output there is complete data (what opcheck and Inductor's
reference runs read). ``sync_1d`` cannot be split (its split sizes reach the host; it
synchronizes anyway): the issue ops refuse it. Costs against the fused ops: none on
``a2a_capacity`` (the receiver's placement moves into the wait); ``rowwise`` copies each result
once more (the transport's stream copies it out of symmetric memory into ``pending``, which the
wait then reads).

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

import torch
import torch.distributed as dist
from torch import Tensor

from moec.ops.ep.exchange import (
    HOOKS,
    accumulation_dtype,
    check_path,
    picked_weight_grad,
    place_rows,
    resolve_group,
    route_rows,
    rowwise_transport,
    sum_routes,
    take_rows,
)
from moec.ops.ep.index import (
    token_rank_addresses,
    token_ranks_reached,
    token_route_table,
    token_workspace_rows,
)
from moec.ops.ep.per_rank import (
    expand_tokens,
    partial_sums,
    sum_partials,
    weighted_rows,
    weights_home,
    weights_to_experts,
)
from moec.ops.movement import block_output

_PENDING: dict[int, tuple[Tensor, Callable[[], None], tuple]] = {}
"""In-flight exchanges by the storage of their result: (result, wait, tensors kept alive)."""


def pending_exchanges() -> int:
    """Exchanges issued and not yet waited for (0 between steps of a correct program)."""
    return len(_PENDING)


def _async(t: Tensor) -> bool:
    return t.is_cuda if HOOKS.asynchronous is None else HOOKS.asynchronous


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


def _check_split_path(path: str) -> None:
    check_path(path)
    if path == "sync_1d":
        raise ValueError(
            "ep_path='sync_1d' copies its split sizes to the host (it synchronizes), so its "
            "exchanges cannot be issued ahead of their wait; use moec::ep_dispatch/ep_combine, "
            "or ep_path 'a2a_capacity' / 'rowwise'"
        )


def _issue_a2a(send: Tensor, pg: dist.ProcessGroup) -> Tensor:
    """Equal-split all-to-all of ``send``, left running where :func:`_async` says so."""
    out = send.new_empty(send.shape)
    if not _async(send):
        dist.all_to_all_single(out, send, group=pg)
        return out
    work = dist.all_to_all_single(out, send, group=pg, async_op=True)
    _register(out, work.wait, (send,))  # NCCL: work.wait() makes the current stream wait
    return out


def _issue_rowwise(x, address, written, pg, top_k=1) -> Tensor:
    """``x``'s rows to ``address`` in the peers' ``[P, D]`` workspaces, issued; rows
    ``written`` marks False (no row arrives there) come out zero, so every pending result is
    defined data."""
    rows = written.shape[0]
    transport = rowwise_transport()
    out, wait = transport.issue(x, address, rows, rows, pg, top_k, fill=0, written=written)
    _register(out, wait)
    return out


def _dispatch_issue(x, weights, slots, recv_rows, group, ep_size, path) -> Tensor:
    _check_split_path(path)
    pg = resolve_group(group, ep_size)
    top_k, flat = slots.shape[-1], x.reshape(-1, x.shape[-1])
    num_rows, address = recv_rows.shape[0], slots.reshape(-1)
    if path == "rowwise":
        if weights is not None:
            raise ValueError(
                "ep_dispatch_issue on the rowwise path sends each token's row once per rank, "
                "unweighted (combine's weights apply on the experts' side, in ep_combine_issue "
                "and its backward); pass weights=None"
            )
        tokens = flat.shape[0]
        to = token_rank_addresses(address, num_rows, top_k, ep_size, dist.get_rank(pg))
        arriving = (token_route_table(recv_rows, tokens, top_k, ep_size) >= 0).any(1)
        return _issue_rowwise(flat, to, arriving, pg, ep_size)
    return _issue_a2a(place_rows(route_rows(flat, top_k, weights), address, num_rows), pg)


def _combine_issue(y, weights, slots, recv_rows, group, ep_size, path) -> tuple[Tensor, Tensor]:
    """``(pending, row_weights)``: ``row_weights`` are the route weights as the experts' side
    holds them (``[R]``) when ``rowwise`` weights here, else empty (``[0]``)."""
    _check_split_path(path)
    pg = resolve_group(group, ep_size)
    acc = accumulation_dtype(y)
    unweighted = y.new_empty((0,), dtype=acc)
    if path != "rowwise":  # the weights apply home, at the wait
        return _issue_a2a(take_rows(y, recv_rows), pg), unweighted
    flat, top_k, me = slots.reshape(-1), slots.shape[-1], dist.get_rank(pg)
    row_weights = None
    if weights is not None:
        row_weights = weights_to_experts(weights, flat, recv_rows.shape[0], pg, acc)
    partial, address = partial_sums(y, flat, recv_rows, top_k, ep_size, me, row_weights)
    reached = token_ranks_reached(flat, recv_rows.shape[0], top_k, ep_size)  # [T, ep]
    pending = _issue_rowwise(partial, address, reached.t().reshape(-1), pg)
    return pending, unweighted if row_weights is None else row_weights


def _dispatch_wait(pending, slots, recv_rows, path) -> Tensor:
    _check_split_path(path)
    _wait_for(pending)
    num_rows = recv_rows.shape[0]
    if path == "rowwise":
        tokens = slots.numel() // slots.shape[-1]
        return expand_tokens(pending, token_workspace_rows(recv_rows, tokens, slots.shape[-1]))
    return place_rows(pending, recv_rows, num_rows).contiguous()


def _combine_wait(pending, weights, slots, recv_rows, ep_size, path) -> tuple[Tensor, Tensor]:
    _check_split_path(path)
    _wait_for(pending)
    top_k, dim = slots.shape[-1], pending.shape[-1]
    if path == "rowwise":  # the partials of the ranks each token reached, weighted there
        out = sum_partials(pending, slots.reshape(-1), recv_rows, top_k, ep_size)
        picked = pending.new_empty((0, dim))
    else:
        picked = take_rows(pending, slots.reshape(-1))
        out = sum_routes(picked, top_k, weights)
    return block_output(out, (*slots.shape[:-1], dim)), picked


@torch.library.custom_op("moec::ep_dispatch_issue", mutates_args=())
def ep_dispatch_issue(
    x: Tensor,
    weights: Tensor | None,
    slots: Tensor,
    recv_rows: Tensor,
    sent: Tensor,
    counts: Tensor,
    group: str,
    ep_size: int,
    path: str,
) -> Tensor:
    return _dispatch_issue(x, weights, slots, recv_rows, group, ep_size, path)


@ep_dispatch_issue.register_fake
def _ep_dispatch_issue_fake(x, weights, slots, recv_rows, sent, counts, group, ep_size, path):
    _check_split_path(path)
    return x.new_empty((pending_rows(slots, recv_rows, ep_size, path), x.shape[-1]))


@torch.library.custom_op("moec::ep_dispatch_wait", mutates_args=())
def ep_dispatch_wait(
    pending: Tensor,
    slots: Tensor,
    recv_rows: Tensor,
    sent: Tensor,
    counts: Tensor,
    group: str,
    ep_size: int,
    path: str,
) -> Tensor:
    return _dispatch_wait(pending, slots, recv_rows, path)


@ep_dispatch_wait.register_fake
def _ep_dispatch_wait_fake(pending, slots, recv_rows, sent, counts, group, ep_size, path):
    _check_split_path(path)
    return pending.new_empty((recv_rows.shape[0], pending.shape[-1]))


@torch.library.custom_op("moec::ep_combine_issue", mutates_args=())
def ep_combine_issue(
    y: Tensor,
    weights: Tensor | None,
    slots: Tensor,
    recv_rows: Tensor,
    sent: Tensor,
    counts: Tensor,
    group: str,
    ep_size: int,
    path: str,
) -> tuple[Tensor, Tensor]:
    return _combine_issue(y, weights, slots, recv_rows, group, ep_size, path)


@ep_combine_issue.register_fake
def _ep_combine_issue_fake(y, weights, slots, recv_rows, sent, counts, group, ep_size, path):
    _check_split_path(path)
    pending = y.new_empty((pending_rows(slots, recv_rows, ep_size, path), y.shape[-1]))
    weighted = path == "rowwise" and weights is not None
    row_weights = recv_rows.shape[0] if weighted else 0
    return pending, y.new_empty((row_weights,), dtype=accumulation_dtype(y))


@torch.library.custom_op("moec::ep_combine_wait", mutates_args=())
def ep_combine_wait(
    pending: Tensor,
    weights: Tensor | None,
    slots: Tensor,
    recv_rows: Tensor,
    sent: Tensor,
    counts: Tensor,
    group: str,
    ep_size: int,
    path: str,
) -> tuple[Tensor, Tensor]:
    return _combine_wait(pending, weights, slots, recv_rows, ep_size, path)


@ep_combine_wait.register_fake
def _ep_combine_wait_fake(pending, weights, slots, recv_rows, sent, counts, group, ep_size, path):
    _check_split_path(path)
    dim = pending.shape[-1]
    picked = 0 if path == "rowwise" else slots.numel()
    return pending.new_empty((*slots.shape[:-1], dim)), pending.new_empty((picked, dim))


@torch.library.custom_op("moec::ep_combine_issue_backward", mutates_args=())
def ep_combine_issue_backward(
    d_pending: Tensor,
    weights: Tensor,
    row_weights: Tensor,
    y: Tensor,
    slots: Tensor,
    recv_rows: Tensor,
    sent: Tensor,
    counts: Tensor,
    group: str,
    ep_size: int,
    path: str,
) -> tuple[Tensor, Tensor]:
    """``rowwise`` ``ep_combine_issue`` with weights, backward: waits for ``d_pending`` (the
    output gradient sent toward the experts by ``ep_combine_wait``'s backward), then on the
    experts' side ``d_y`` and the weights' gradient from ``row_weights`` (what the issue's
    weights became there, its second output) and ``y``; the gradient comes home, a float per
    route. ``weights`` give its shape and dtype."""
    _check_split_path(path)
    if path != "rowwise":
        raise ValueError(
            f"ep_combine_issue_backward serves ep_path='rowwise' only (got {path!r}); the a2a "
            "paths' combine issue backward is ep_dispatch_wait"
        )
    _wait_for(d_pending)
    pg, flat, top_k = resolve_group(group, ep_size), slots.reshape(-1), slots.shape[-1]
    source_row = token_workspace_rows(recv_rows, flat.numel() // top_k, top_k)
    d_y, d_w = weighted_rows(d_pending, source_row, y, row_weights)
    d_weights = weights_home(d_w, flat, recv_rows, pg)
    return d_y.contiguous(), d_weights.to(weights.dtype).view(weights.shape).contiguous()


@ep_combine_issue_backward.register_fake
def _ep_combine_issue_backward_fake(
    d_pending, weights, row_weights, y, slots, recv_rows, sent, counts, group, ep_size, path
):
    _check_split_path(path)
    return y.new_empty(y.shape), weights.new_empty(weights.shape)


# Autograd: the four ops are each other's backward (module docstring).


def _split_setup(ctx, inputs, output) -> None:
    """Saves (slots, recv_rows, sent, counts) and (group, ep_size, path) of any of the four."""
    tensors = [a for a in inputs if isinstance(a, Tensor)]
    ctx.save_for_backward(*tensors[-4:])
    ctx.args = tuple(inputs[-3:])
    ctx.first_shape = inputs[0].shape


def _dispatch_issue_backward(ctx, d_pending):
    comm = (*ctx.saved_tensors, *ctx.args)
    d_x, _ = torch.ops.moec.ep_combine_wait(d_pending, None, *comm)
    return d_x.view(ctx.first_shape), *([None] * 8)


def _dispatch_wait_backward(ctx, d_buffer):
    comm = (*ctx.saved_tensors, *ctx.args)
    d_pending, _ = torch.ops.moec.ep_combine_issue(d_buffer, None, *comm)
    return d_pending, *([None] * 7)


def _combine_issue_setup(ctx, inputs, output) -> None:
    """rowwise with weights: also y, the weights and the experts' side's weights (its backward
    computes the weights' gradient there)."""
    y, weights, slots, recv_rows, sent, counts, group, ep_size, path = inputs
    weighted = path == "rowwise" and weights is not None
    kept = (y, weights, output[1]) if weighted else (None, None, None)
    ctx.save_for_backward(*kept, slots, recv_rows, sent, counts)
    ctx.args = (group, ep_size, path)


def _combine_issue_backward(ctx, d_pending, d_row_weights_unused):
    y, weights, row_weights, *comm = ctx.saved_tensors
    if weights is None:
        d_y = torch.ops.moec.ep_dispatch_wait(d_pending, *comm, *ctx.args)
        return d_y, *([None] * 8)
    d_y, d_weights = torch.ops.moec.ep_combine_issue_backward(
        d_pending, weights, row_weights, y, *comm, *ctx.args
    )
    return d_y, d_weights, *([None] * 7)


def _combine_wait_setup(ctx, inputs, output) -> None:
    """The a2a paths weight at the wait (rowwise at the issue: nothing weighted here)."""
    pending, weights, slots, recv_rows, sent, counts, group, ep_size, path = inputs
    weights = None if path == "rowwise" else weights
    ctx.save_for_backward(weights, output[1], slots, recv_rows, sent, counts)
    ctx.args = (group, ep_size, path)


def _combine_wait_backward(ctx, d_out, d_picked_unused):
    weights, picked, *comm = ctx.saved_tensors
    d_pending = torch.ops.moec.ep_dispatch_issue(d_out, weights, *comm, *ctx.args)
    d_weights = None
    if weights is not None and ctx.needs_input_grad[1]:
        d_weights = picked_weight_grad(picked, d_out, comm[0].shape[-1])
        d_weights = d_weights.view(weights.shape).to(weights.dtype)
    return d_pending, d_weights, *([None] * 7)


ep_dispatch_issue.register_autograd(_dispatch_issue_backward, setup_context=_split_setup)
ep_dispatch_wait.register_autograd(_dispatch_wait_backward, setup_context=_split_setup)
ep_combine_issue.register_autograd(_combine_issue_backward, setup_context=_combine_issue_setup)
ep_combine_wait.register_autograd(_combine_wait_backward, setup_context=_combine_wait_setup)
