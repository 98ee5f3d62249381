"""The fused expert-parallel ops: ``moec::ep_layout``, ``moec::ep_dispatch``,
``moec::ep_combine``, and the internal ops their backwards run, ``moec::ep_dispatch_backward`` and
``moec::ep_combine_backward`` (contract, capacity and paths: :mod:`moec.ops.ep`).

Each op is one opaque call that runs its exchange to completion: the a2a paths through
:func:`~moec.ops.ep.exchange.send_routes` / :func:`~moec.ops.ep.exchange.fetch_routes`,
``rowwise`` through :mod:`moec.ops.ep.per_rank`. Their backwards are ops too, so AOTAutograd
traces each as one call and no collective ever runs on fake tensors.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import Tensor

from moec.ops.ep.exchange import (
    accumulation_dtype,
    check_path,
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
        recv = transport.send(route_ids[:, None], slots, num_rows, pg, fill=-1).view(-1)
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


@torch.library.custom_op("moec::ep_dispatch", mutates_args=())
def ep_dispatch(
    x: Tensor,
    slots: Tensor,
    recv_rows: Tensor,
    sent: Tensor,
    counts: Tensor,
    group: str,
    ep_size: int,
    path: str,
) -> Tensor:
    check_path(path)
    flat, top_k = x.reshape(-1, x.shape[-1]), slots.shape[-1]
    if path == "rowwise":
        pg = resolve_group(group, ep_size)
        return send_once_per_rank(flat, top_k, slots.reshape(-1), recv_rows, pg, ep_size)
    comm = (recv_rows, sent, counts, group, ep_size, path)
    return send_routes(flat, top_k, None, slots.reshape(-1), *comm)


@ep_dispatch.register_fake
def _ep_dispatch_fake(x, slots, recv_rows, sent, counts, group, ep_size, path):
    return x.new_empty((recv_rows.shape[0], x.shape[-1]))


def _dispatch_setup(ctx, inputs, output):
    x, slots, recv_rows, sent, counts, group, ep_size, path = inputs
    ctx.save_for_backward(slots, recv_rows, sent, counts)
    ctx.args, ctx.x_shape = (group, ep_size, path), x.shape


@torch.library.custom_op("moec::ep_dispatch_backward", mutates_args=())
def ep_dispatch_backward(
    d_buffer: Tensor,
    slots: Tensor,
    recv_rows: Tensor,
    sent: Tensor,
    counts: Tensor,
    group: str,
    ep_size: int,
    path: str,
) -> Tensor:
    check_path(path)
    comm = (recv_rows, sent, counts, group, ep_size, path)
    flat, top_k = slots.reshape(-1), slots.shape[-1]
    if path == "rowwise":
        pg = resolve_group(group, ep_size)
        d_x = sum_home_once_per_rank(d_buffer, flat, recv_rows, top_k, pg, ep_size)
    else:
        sum_accepted = functools.partial(sum_routes, top_k=top_k, valid=flat >= 0)
        d_x = fetch_routes(d_buffer, flat, *comm, consume=sum_accepted)
    return d_x.reshape(-1, d_buffer.shape[-1]).contiguous()


@ep_dispatch_backward.register_fake
def _ep_dispatch_backward_fake(d_buffer, slots, recv_rows, sent, counts, group, ep_size, path):
    check_path(path)
    return d_buffer.new_empty((math.prod(slots.shape[:-1]), d_buffer.shape[-1]))


def _dispatch_backward(ctx, d_buffer):
    slots, recv_rows, sent, counts = ctx.saved_tensors
    d_x = torch.ops.moec.ep_dispatch_backward(d_buffer, slots, recv_rows, sent, counts, *ctx.args)
    return d_x.view(ctx.x_shape), None, None, None, None, None, None, None


ep_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


# --- ep_combine --------------------------------------------------------------------------------


@torch.library.custom_op("moec::ep_combine", mutates_args=())
def ep_combine(
    y: Tensor,
    weights: Tensor,
    slots: Tensor,
    recv_rows: Tensor,
    sent: Tensor,
    counts: Tensor,
    group: str,
    ep_size: int,
    path: str,
) -> tuple[Tensor, Tensor]:
    check_path(path)
    flat, top_k = slots.reshape(-1), slots.shape[-1]
    if path == "rowwise":
        pg = resolve_group(group, ep_size)
        out, saved = combine_once_per_rank(y, weights, flat, recv_rows, top_k, pg, ep_size)
    else:
        saved = fetch_routes(y, flat, recv_rows, sent, counts, group, ep_size, path)  # picked
        out = sum_routes(saved, top_k, weights)
    return block_output(out, (*slots.shape[:-1], y.shape[-1])), saved


@ep_combine.register_fake
def _ep_combine_fake(y, weights, slots, recv_rows, sent, counts, group, ep_size, path):
    check_path(path)
    out = y.new_empty((*slots.shape[:-1], y.shape[-1]))
    if path == "rowwise":
        return out, y.new_empty((recv_rows.shape[0],), dtype=accumulation_dtype(y))
    return out, y.new_empty((slots.numel(), y.shape[-1]))


def _combine_setup(ctx, inputs, output):
    y, weights, slots, recv_rows, sent, counts, group, ep_size, path = inputs
    experts_side = y if path == "rowwise" else None  # only rowwise's backward reads y
    ctx.save_for_backward(weights, output[1], experts_side, slots, recv_rows, sent, counts)
    ctx.args = (group, ep_size, path)


@torch.library.custom_op("moec::ep_combine_backward", mutates_args=())
def ep_combine_backward(
    d_out: Tensor,
    weights: Tensor,
    saved: Tensor,
    y: Tensor | None,
    slots: Tensor,
    recv_rows: Tensor,
    sent: Tensor,
    counts: Tensor,
    group: str,
    ep_size: int,
    path: str,
) -> tuple[Tensor, Tensor]:
    check_path(path)
    flat_d_out, top_k = d_out.reshape(-1, d_out.shape[-1]), slots.shape[-1]
    if path == "rowwise":
        if y is None:
            raise ValueError("ep_combine_backward on the rowwise path needs the expert output y")
        pg = resolve_group(group, ep_size)
        comm = (slots.reshape(-1), recv_rows, top_k, pg, ep_size)
        d_y, d_weights = combine_backward_once_per_rank(flat_d_out, y, saved, *comm)
    else:
        comm = (recv_rows, sent, counts, group, ep_size, path)
        d_y = send_routes(flat_d_out, top_k, weights, slots.reshape(-1), *comm)
        d_weights = picked_weight_grad(saved, flat_d_out, top_k)
    return d_y.contiguous(), d_weights.to(weights.dtype).view(weights.shape).contiguous()


@ep_combine_backward.register_fake
def _ep_combine_backward_fake(
    d_out, weights, saved, y, slots, recv_rows, sent, counts, group, ep_size, path
):
    check_path(path)
    return d_out.new_empty((recv_rows.shape[0], d_out.shape[-1])), weights.new_empty(weights.shape)


def _combine_backward(ctx, d_out, d_saved_unused):
    weights, saved, y, *comm = ctx.saved_tensors
    d_y, d_weights = torch.ops.moec.ep_combine_backward(d_out, weights, saved, y, *comm, *ctx.args)
    return d_y, d_weights, *([None] * 7)


ep_combine.register_autograd(_combine_backward, setup_context=_combine_setup)
