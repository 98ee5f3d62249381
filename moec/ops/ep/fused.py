"""The fused expert-parallel ops: ``moec::ep_layout``, ``moec::ep_dispatch``,
``moec::ep_combine``, and the internal ops their backwards run, ``moec::ep_dispatch_backward`` and
``moec::ep_combine_backward`` (contract, capacity and paths: :mod:`moec.ops.ep`).

Each op is one opaque call that runs its exchange to completion: the a2a paths through
:func:`~moec.ops.ep.exchange.send_routes` / :func:`~moec.ops.ep.exchange.fetch_routes`,
``rowwise`` through :mod:`moec.ops.ep.per_rank`. Their backwards are ops too, so AOTAutograd
traces each as one call and no collective ever runs on fake tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moec.ops.ep.exchange import (
    NO_GRADS,
    Exchange,
    Push,
    accumulation_dtype,
    check_path,
    exchange_op,
    fetch_routes,
    picked_weight_grad,
    resolve_group,
    rowwise_transport,
    send_routes,
    sum_routes,
)
from moec.ops.ep.index import (
    accepted_counts,
    buffer_rows,
    capacity_receive_map,
    capacity_slots,
    local_offsets,
    packed_receive_map,
    rowwise_route_map,
)
from moec.ops.ep.per_rank import (
    combine_backward_once_per_rank,
    combine_once_per_rank,
    send_once_per_rank,
    sum_home_once_per_rank,
)
from moec.ops.movement import block_output
from moec.ops.routing import capacity

# --- layout ------------------------------------------------------------------------------------


def _layout(rows, offsets, group, ep_size, capacity_factor, path):
    pg = resolve_group(group, ep_size)
    num_experts, top_k = offsets.shape[0], rows.shape[-1]
    tokens = rows.numel() // top_k
    accepted = accepted_counts(offsets)
    sent = accepted.view(ep_size, -1).sum(1)
    num_rows = buffer_rows(tokens, top_k, num_experts, ep_size, capacity_factor, path)
    if path == "rowwise":
        transport = rowwise_transport()
        transport.check_available(rows)
        all_counts = accepted.new_empty(ep_size, num_experts)
        dist.all_gather_into_tensor(all_counts.view(-1), accepted, group=pg)  # gloo: flat
        rank = dist.get_rank(pg)
        slots, dropped = rowwise_route_map(rows, offsets, all_counts, rank, num_rows)
        counts = all_counts.view(ep_size, ep_size, -1)[:, rank]
        route_ids = rank * slots.numel() + torch.arange(slots.numel(), device=rows.device)
        recv = transport.send(Push(route_ids[:, None], slots, num_rows, fill=-1), pg).view(-1)
        offs = local_offsets(counts, num_rows)
        return slots.view(rows.shape), recv, offs, counts, sent, dropped
    counts = torch.empty_like(accepted)
    dist.all_to_all_single(counts, accepted, group=pg)
    counts = counts.view(ep_size, -1)  # [n, L]: from each source to my experts
    cap = capacity(tokens, top_k, num_experts, capacity_factor)
    if path == "a2a_capacity":
        slots = capacity_slots(rows, offsets, cap).view(rows.shape)
        recv = capacity_receive_map(counts, cap)
    else:
        slots, recv = rows, packed_receive_map(counts, cap, num_rows)
    return slots, recv, local_offsets(counts), counts, sent, accepted.new_zeros(1)


@torch.library.custom_op("moec::ep_layout", mutates_args=())
def ep_layout(
    rows: Tensor, offsets: Tensor, group: str, ep_size: int, capacity_factor: float, path: str
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    check_path(path)
    out = _layout(rows, offsets, group, ep_size, capacity_factor, path)
    return tuple(t.contiguous().clone() for t in out)


@ep_layout.register_fake
def _ep_layout_fake(rows, offsets, group, ep_size, capacity_factor, path):
    check_path(path)
    num_experts, top_k = offsets.shape[0], rows.shape[-1]
    tokens = rows.numel() // top_k
    num_rows = buffer_rows(tokens, top_k, num_experts, ep_size, capacity_factor, path)
    local = num_experts // ep_size
    new, i64 = rows.new_empty, torch.int64
    return (
        new(rows.shape, dtype=i64),
        new((num_rows,), dtype=i64),
        new((local,), dtype=torch.int32),
        new((ep_size, local), dtype=i64),
        new((ep_size,), dtype=i64),
        new((1,), dtype=i64),
    )


# --- ep_dispatch -------------------------------------------------------------------------------


@exchange_op("ep_dispatch", "Tensor x", "Tensor")
def ep_dispatch(x: Tensor, *exchange: Any) -> Tensor:
    ex = Exchange.of(exchange)
    flat = x.reshape(-1, x.shape[-1])
    if ex.path == "rowwise":
        return send_once_per_rank(flat, ex)
    return send_routes(flat, None, ex)


@ep_dispatch.register_fake
def _ep_dispatch_fake(x, *exchange):
    return x.new_empty((Exchange.of(exchange).num_rows, x.shape[-1]))


def _dispatch_setup(ctx, inputs, output):
    x, *exchange = inputs
    Exchange(*exchange).save(ctx)
    ctx.x_shape = x.shape


@exchange_op("ep_dispatch_backward", "Tensor d_buffer", "Tensor")
def ep_dispatch_backward(d_buffer: Tensor, *exchange: Any) -> Tensor:
    ex = Exchange.of(exchange)
    if ex.path == "rowwise":
        d_x = sum_home_once_per_rank(d_buffer, ex)
    else:
        d_x = sum_routes(fetch_routes(d_buffer, ex), ex.top_k, valid=ex.routes >= 0)
    return d_x.reshape(-1, d_buffer.shape[-1]).contiguous()


@ep_dispatch_backward.register_fake
def _ep_dispatch_backward_fake(d_buffer, *exchange):
    slots = Exchange.of(exchange).slots
    return d_buffer.new_empty((math.prod(slots.shape[:-1]), d_buffer.shape[-1]))


def _dispatch_backward(ctx, d_buffer):
    _, ex = Exchange.restore(ctx)
    d_x = torch.ops.moec.ep_dispatch_backward(d_buffer, *ex)
    return d_x.view(ctx.x_shape), *NO_GRADS


ep_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


# --- ep_combine --------------------------------------------------------------------------------


@exchange_op("ep_combine", "Tensor y, Tensor weights", "(Tensor, Tensor)")
def ep_combine(y: Tensor, weights: Tensor, *exchange: Any) -> tuple[Tensor, Tensor]:
    ex = Exchange.of(exchange)
    if ex.path == "rowwise":
        out, saved = combine_once_per_rank(y, weights, ex)
    else:
        saved = fetch_routes(y, ex)  # picked
        out = sum_routes(saved, ex.top_k, weights)
    return block_output(out, (*ex.slots.shape[:-1], y.shape[-1])), saved


@ep_combine.register_fake
def _ep_combine_fake(y, weights, *exchange):
    ex = Exchange.of(exchange)
    out = y.new_empty((*ex.slots.shape[:-1], y.shape[-1]))
    if ex.path == "rowwise":
        return out, y.new_empty((ex.num_rows,), dtype=accumulation_dtype(y))
    return out, y.new_empty((ex.slots.numel(), y.shape[-1]))


def _combine_setup(ctx, inputs, output):
    y, weights, *exchange = inputs
    ex = Exchange(*exchange)
    experts_side = y if ex.path == "rowwise" else None  # only rowwise's backward reads y
    ex.save(ctx, weights, output[1], experts_side)


@exchange_op(
    "ep_combine_backward",
    "Tensor d_out, Tensor weights, Tensor saved, Tensor? y",
    "(Tensor, Tensor)",
)
def ep_combine_backward(
    d_out: Tensor, weights: Tensor, saved: Tensor, y: Tensor | None, *exchange: Any
) -> tuple[Tensor, Tensor]:
    ex = Exchange.of(exchange)
    flat_d_out = d_out.reshape(-1, d_out.shape[-1])
    if ex.path == "rowwise":
        if y is None:
            raise ValueError("ep_combine_backward on the rowwise path needs the expert output y")
        d_y, d_weights = combine_backward_once_per_rank(flat_d_out, y, saved, ex)
    else:
        d_y = send_routes(flat_d_out, weights, ex)
        d_weights = picked_weight_grad(saved, flat_d_out, ex.top_k)
    return d_y.contiguous(), d_weights.to(weights.dtype).view(weights.shape).contiguous()


@ep_combine_backward.register_fake
def _ep_combine_backward_fake(d_out, weights, saved, y, *exchange):
    ex = Exchange.of(exchange)
    return d_out.new_empty((ex.num_rows, d_out.shape[-1])), weights.new_empty(weights.shape)


def _combine_backward(ctx, d_out, d_saved_unused):
    (weights, saved, y), ex = Exchange.restore(ctx)
    d_y, d_weights = torch.ops.moec.ep_combine_backward(d_out, weights, saved, y, *ex)
    return d_y, d_weights, *NO_GRADS


ep_combine.register_autograd(_combine_backward, setup_context=_combine_setup)
