"""Expert-parallel ops: ``moec::ep_layout``, ``moec::ep_dispatch``, ``moec::ep_combine``.

An EP group of ``n`` ranks splits the ``N`` routed experts: rank ``r`` holds experts
``[r*L, (r+1)*L)`` with ``L = N/n``. Every rank routes its own ``T`` local tokens with
``moec::route`` (rows ``[T, K]`` into its local expert-major buffer, ``offsets[N]``); these ops
move the accepted routes to the ranks that own their experts and back::

    slots, recv_rows, local_offsets, counts, dropped = ep_layout(rows, offsets, group, n, cf, path)
    buffer = ep_dispatch(x, slots, recv_rows, counts, group, n, path)          # [R, D]
    y, _ = expert_mlp(buffer, w_up[L], w_down[L], local_offsets, ...)           # local experts
    out, picked = ep_combine(y, weights, slots, recv_rows, counts, group, n, path)  # [*, D]

``counts[n, L]``: accepted routes source ``s`` sends to each local expert (exchanged on the
device). ``buffer`` is expert-major: local expert ``l`` owns rows ``[local_offsets[l-1],
local_offsets[l])`` and inside them the routes of source 0, then source 1, ..., each source's in
its route-rank order; rows past ``local_offsets[-1]`` are garbage (never read for a result).
``picked[T*K, D]`` is each route's expert output before weighting (kept for the backward).
``dropped[1]``: accepted routes this source lost in the exchange (``rowwise`` only, else 0).

Capacity and drops (the reference policy, exactly):

1. ``moec::route`` on the source's own T tokens: expert ``e`` accepts the first
   ``C = min(T, ceil(cf * T * K / N))`` routes in token-major order (dropless: ``C = T``;
   :func:`moec.ops.routing.capacity`, the one home of that rule). This is the
   EP = 1 policy on the same local batch, so ``a2a_capacity`` and ``sync_1d`` (which add no
   drops) compute exactly what EP = 1 computes on each rank's batch, capacity binding or not.
2. ``rowwise`` only: a rank receives at most ``Cr = ceil(cf * T * K)`` rows (dropless:
   ``n * T * min(K, L)``, the worst case). A route's row is its position in the expert-major
   order above; routes whose row is ``>= Cr`` are dropped and counted in ``dropped`` of their
   source. With ``cf >= N / K`` neither step drops anything, so EP = n equals EP = 1.

Paths (``path``):

- ``a2a_capacity`` (sync-free, any backend): a send buffer of ``N * C`` rows, slot ``e*C + j``
  for the j-th accepted route of expert e; one equal-split ``all_to_all_single``; the receiver
  compacts ``(source, expert, j)`` slots into the expert-major buffer (``R = N * C``).
- ``sync_1d`` (the synchronized baseline; it SYNCS): per-rank split sizes are copied to the host
  and a variable-split ``all_to_all_single`` sends exactly the accepted rows (dropless beyond
  step 1). The receive buffer is padded to ``R = N * C`` so the graph keeps static shapes.
- ``rowwise`` (sync-free, CUDA + symmetric memory): counts all-gathered on the device; each
  route's destination rank and row computed on the device (:func:`rowwise_route_map`); a Triton
  kernel writes rows straight into the peers' symmetric-memory buffers (``R = Cr``), the layout
  sends each row's origin along (``recv_rows[r] = source * T*K + route``, -1 for no route), and
  combine pushes every expert-output row back to its origin. The transport is the runtime's
  (it owns the symmetric-memory workspaces): importing ``moec.runtime`` registers it with
  :func:`register_rowwise_transport`. Without CUDA/symmetric memory, or with no transport
  registered, it raises :class:`EPPathError` naming ``a2a_capacity``.

Backward: dispatch's is the reverse exchange plus an unweighted sum (a combine); combine's is a
weighted dispatch plus ``d_weights = <picked, d_out>``. All three every rank of the group must
call in the same order, like any collective. The index math is plain functions tested on CPU.

The exchanges of the backwards are internal ops, so AOTAutograd traces each as one opaque call
and no collective ever runs on fake tensors (``d_weights`` stays plain torch)::

    ep_dispatch_backward(d_buffer[R, D], slots, recv_rows, sent, counts, group, ep_size, path)
        -> d_x[T, D]
    ep_combine_backward(d_out[*, D], weights, slots, recv_rows, sent, counts, group, ep_size,
                        path) -> d_y[R, D]

Every op's outputs are contiguous, as their fake implementations promise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from moec.errors import MoecError
from moec.ops.routing import capacity

PATHS = ("a2a_capacity", "sync_1d", "rowwise")

_POISON: float | None = None
"""Tests set this to fill every buffer slot no route writes (tails, padding) with garbage."""


class EPPathError(MoecError, RuntimeError):
    """The chosen EP path cannot run here; the message names the path to use instead."""


# --- sizes -------------------------------------------------------------------------------------


def rank_capacity(tokens, top_k: int, num_experts: int, ep_size: int, capacity_factor: float):
    """``Cr``: rows one rank receives on the ``rowwise`` path (see module)."""
    if capacity_factor <= 0:
        return ep_size * tokens * min(top_k, num_experts // ep_size)
    return math.ceil(capacity_factor * tokens * top_k)


def buffer_rows(tokens, top_k: int, num_experts: int, ep_size: int, cf: float, path: str):
    """``R``: rows of the expert buffer a rank receives (see module)."""
    if path == "rowwise":
        return rank_capacity(tokens, top_k, num_experts, ep_size, cf)
    return num_experts * capacity(tokens, top_k, num_experts, cf)


# --- index math (pure, device-side, static shapes) ---------------------------------------------


def route_positions(rows: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per route (flat): its expert, its rank j among that expert's accepted routes, accepted."""
    flat = rows.reshape(-1)
    offsets = offsets.to(torch.int64)
    valid = flat >= 0
    expert = torch.searchsorted(offsets, flat.clamp(min=0), right=True)
    expert = torch.where(valid, expert, 0)
    start = offsets[expert] - accepted_counts(offsets)[expert]
    return expert, torch.where(valid, flat - start, 0), valid


def accepted_counts(offsets: Tensor) -> Tensor:
    """Accepted routes per expert from the inclusive offsets, int64."""
    offsets = offsets.to(torch.int64)
    return offsets - torch.cat([offsets.new_zeros(1), offsets[:-1]])


def capacity_slots(rows: Tensor, offsets: Tensor, cap) -> Tensor:
    """``a2a_capacity`` send slot ``e*cap + j`` of every route, -1 when not accepted."""
    expert, j, valid = route_positions(rows, offsets)
    return torch.where(valid, expert * cap + j, -1)


def expert_major_rows(counts: Tensor) -> Tensor:
    """Row in the expert buffer of (source s, local expert l, j=0): ``base[l] + before[s, l]``."""
    per_expert = counts.sum(0)  # [L]
    base = per_expert.cumsum(0) - per_expert
    before = counts.cumsum(0) - counts  # [n, L]
    return base[None, :] + before


def capacity_receive_map(counts: Tensor, cap: int) -> Tensor:
    """``a2a_capacity``: receive slot (s, l, j) -> expert-buffer row, -1 for padding."""
    j = torch.arange(cap, device=counts.device)
    row = expert_major_rows(counts)[:, :, None] + j
    return torch.where(j < counts[:, :, None], row, -1).reshape(-1)


def packed_receive_map(counts: Tensor, cap: int, num_rows: int) -> Tensor:
    """``sync_1d``: position in the packed (source-major) receive buffer -> expert-buffer row."""
    per_source = counts.sum(1)  # [n]
    source_start = per_source.cumsum(0) - per_source
    in_source = counts.cumsum(1) - counts  # [n, L]
    j = torch.arange(cap, device=counts.device)
    position = (source_start[:, None] + in_source)[:, :, None] + j
    row = expert_major_rows(counts)[:, :, None] + j
    valid = j < counts[:, :, None]
    target = torch.where(valid, position, num_rows).reshape(-1)
    out = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=counts.device)
    return out.scatter_(0, target, torch.where(valid, row, -1).reshape(-1))[:num_rows]


def local_offsets(counts: Tensor, limit=None) -> Tensor:
    """Inclusive end of each local expert's rows in the expert buffer (clamped to ``limit``)."""
    ends = counts.sum(0).cumsum(0)
    return (ends if limit is None else ends.clamp(max=limit)).to(torch.int32)


def rowwise_route_map(
    rows: Tensor, offsets: Tensor, all_counts: Tensor, source: int, rank_cap: int
) -> tuple[Tensor, Tensor]:
    """``rowwise``: each route's address ``dest * rank_cap + row`` (-1 dropped) and the number of
    accepted routes this source loses to the rank capacity.

    ``all_counts[n, N]``: accepted routes of every source per global expert. The row of a route
    of source ``s`` to expert ``e`` (owner ``d``, local ``l``) is the expert-major position
    ``sum_{l'<l} sum_s' A[s', dL+l'] + sum_{s'<s} A[s', e] + j``.
    """
    ep_size, num_experts = all_counts.shape
    expert, j, valid = route_positions(rows, offsets)
    per_expert = all_counts.sum(0).view(ep_size, -1)  # [n, L]
    base = (per_expert.cumsum(1) - per_expert).reshape(-1)  # [N]
    before = all_counts[:source].sum(0)  # [N]
    row = base[expert] + before[expert] + j
    keep = valid & (row < rank_cap)
    dest = expert // (num_experts // ep_size)
    address = torch.where(keep, dest * rank_cap + row, -1)
    dropped = (valid & ~keep).sum().reshape(1)
    return address, dropped


# --- process groups ----------------------------------------------------------------------------


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
    if _POISON is None:
        return like.new_zeros(rows, cols)
    return like.new_full((rows, cols), _POISON)


def _place(values: Tensor, index: Tensor, num_rows) -> Tensor:
    """Buffer of ``num_rows`` with ``values[i]`` at ``index[i]`` (-1: nowhere); rest unspecified."""
    buffer = _alloc(num_rows + 1, values.shape[-1], values)
    return buffer.index_copy_(0, torch.where(index >= 0, index, num_rows), values)[:num_rows]


def _take(buffer: Tensor, index: Tensor) -> Tensor:
    """``buffer[index]`` with zero rows where ``index`` is -1 (garbage cannot leak)."""
    return torch.where((index >= 0)[:, None], buffer[index.clamp(min=0)], 0)


# --- layout ------------------------------------------------------------------------------------


def _layout(rows, offsets, group, ep_size, capacity_factor, path):
    pg = resolve_group(group, ep_size)
    num_experts, top_k = offsets.shape[0], rows.shape[-1]
    tokens = rows.numel() // top_k
    accepted = accepted_counts(offsets)
    sent = accepted.view(ep_size, -1).sum(1)
    num_rows = buffer_rows(tokens, top_k, num_experts, ep_size, capacity_factor, path)
    if path == "rowwise":
        transport = _rowwise()
        transport.check_available(rows)
        all_counts = accepted.new_empty(ep_size, num_experts)
        dist.all_gather_into_tensor(all_counts, accepted, group=pg)
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


def _check_path(path: str) -> None:
    if path not in PATHS:
        raise ValueError(f"unknown EP path {path!r}; expected one of {PATHS}")


@torch.library.custom_op("moec::ep_layout", mutates_args=())
def ep_layout(
    rows: Tensor, offsets: Tensor, group: str, ep_size: int, capacity_factor: float, path: str
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_path(path)
    out = _layout(rows, offsets, group, ep_size, capacity_factor, path)
    return tuple(t.contiguous().clone() for t in out)


@ep_layout.register_fake
def _ep_layout_fake(rows, offsets, group, ep_size, capacity_factor, path):
    _check_path(path)
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


# --- transports --------------------------------------------------------------------------------
# ``_send(x[T, D], top_k, weights, slots, recv_rows, sent, counts, ...) -> buffer[R, D]`` moves
# each route's row (its token's row, times its weight if given) to its expert's rank;
# ``_fetch(buffer, ...) -> [T*K, D]`` brings each route's row back (zero for routes without a
# row). Dispatch, combine and both backwards are built from them.


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
        source = _place(values, slots, num_rows)  # [N*C, D], slot e*C + j
        received = _exchange(source, pg, num_rows)  # [(s, l, j), D]
        return _place(received, recv_rows, num_rows)
    send, recv = _host_splits(sent, counts)
    source = _place(values, slots, slots.numel())[: sum(send)]  # expert-major = rank-major
    received = _exchange(source, pg, sum(recv), recv, send)
    return _place(received, recv_rows[: sum(recv)], num_rows)


def _fetch_a2a(buffer, slots, recv_rows, sent, counts, pg, path):
    if path == "a2a_capacity":
        returned = _exchange(_take(buffer, recv_rows), pg, recv_rows.shape[0])
        return _take(returned, slots)
    send, recv = _host_splits(sent, counts)
    outgoing = _take(buffer, recv_rows[: sum(recv)])
    returned = _exchange(outgoing, pg, sum(send), send, recv)
    return _take(returned, slots)  # accepted rows come first: every slot < sum(send)


def _send(x, top_k, weights, slots, recv_rows, sent, counts, group, ep_size, path):
    pg = resolve_group(group, ep_size)
    if path == "rowwise":
        return _rowwise().send(x, slots, recv_rows.shape[0], pg, top_k, weights)
    values = _route_rows(x, top_k, weights)
    return _send_a2a(values, slots, recv_rows, sent, counts, pg, path)


def _fetch(buffer, slots, recv_rows, sent, counts, group, ep_size, path):
    pg = resolve_group(group, ep_size)
    if path == "rowwise":
        return _rowwise().send(buffer, recv_rows, slots.numel(), pg, fill=0)
    return _fetch_a2a(buffer, slots, recv_rows, sent, counts, pg, path)


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
    ) -> Tensor:
        """Push route ``i``'s row ``x[i // top_k]`` (times ``weights[i]``) to ``address[i] =
        dest * rows + row`` (-1: nowhere); return this rank's ``[rows, D]`` buffer, rows no route
        wrote holding ``fill`` (:data:`_POISON` when None and set, else unspecified)."""


_load_rowwise: Callable[[], RowwiseTransport] | None = None
"""The registered loader of the rowwise transport."""


def register_rowwise_transport(load: Callable[[], RowwiseTransport]) -> None:
    """Install the ``rowwise`` transport: ``load()`` returns it when the path first runs, or
    raises ImportError where its dependencies (triton, symmetric memory) are missing. Registering
    again replaces the loader."""
    global _load_rowwise
    _load_rowwise = load


def _rowwise() -> RowwiseTransport:
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


def _acc(t: Tensor) -> torch.dtype:
    """Accumulation dtype: at least float32."""
    return torch.promote_types(t.dtype, torch.float32)


def _route_rows(x: Tensor, top_k: int, weights: Tensor | None = None) -> Tensor:
    """(T, D) -> (T*K, D): each token's row once per route, optionally times its weight."""
    rows = x.reshape(-1, 1, x.shape[-1]).expand(-1, top_k, -1)
    if weights is not None:
        rows = (rows.to(_acc(x)) * weights.reshape(-1, top_k, 1).to(_acc(x))).to(x.dtype)
    return rows.reshape(-1, x.shape[-1])


def _sum_routes(picked: Tensor, top_k: int, weights: Tensor | None = None) -> Tensor:
    """(T*K, D) -> (T, D): sum over k of weights * picked, accumulated in :func:`_acc`. It is
    ``moec::combine`` over the identity rows, so CUDA runs the combine kernel."""
    routes = torch.arange(picked.shape[0], device=picked.device).view(-1, top_k)
    if weights is None:
        weights = torch.ones(routes.shape, dtype=_acc(picked), device=picked.device)
    return torch.ops.moec.combine(picked, weights.reshape(routes.shape), routes)


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
    _check_path(path)
    flat = x.reshape(-1, x.shape[-1])
    comm = (recv_rows, sent, counts, group, ep_size, path)
    return _send(flat, slots.shape[-1], None, slots.reshape(-1), *comm)


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
    _check_path(path)
    comm = (recv_rows, sent, counts, group, ep_size, path)
    picked = _fetch(d_buffer, slots.reshape(-1), *comm)
    return _sum_routes(picked, slots.shape[-1]).reshape(-1, d_buffer.shape[-1]).contiguous()


@ep_dispatch_backward.register_fake
def _ep_dispatch_backward_fake(d_buffer, slots, recv_rows, sent, counts, group, ep_size, path):
    _check_path(path)
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
    _check_path(path)
    picked = _fetch(y, slots.reshape(-1), recv_rows, sent, counts, group, ep_size, path)
    out = _sum_routes(picked, slots.shape[-1], weights)
    return out.view(*slots.shape[:-1], y.shape[-1]), picked


@ep_combine.register_fake
def _ep_combine_fake(y, weights, slots, recv_rows, sent, counts, group, ep_size, path):
    return y.new_empty((*slots.shape[:-1], y.shape[-1])), y.new_empty((slots.numel(), y.shape[-1]))


def _combine_setup(ctx, inputs, output):
    y, weights, slots, recv_rows, sent, counts, group, ep_size, path = inputs
    ctx.save_for_backward(weights, slots, recv_rows, sent, counts, output[1])
    ctx.args = (group, ep_size, path)


@torch.library.custom_op("moec::ep_combine_backward", mutates_args=())
def ep_combine_backward(
    d_out: Tensor,
    weights: Tensor,
    slots: Tensor,
    recv_rows: Tensor,
    sent: Tensor,
    counts: Tensor,
    group: str,
    ep_size: int,
    path: str,
) -> Tensor:
    _check_path(path)
    flat_d_out = d_out.reshape(-1, d_out.shape[-1])
    comm = (recv_rows, sent, counts, group, ep_size, path)
    return _send(flat_d_out, slots.shape[-1], weights, slots.reshape(-1), *comm).contiguous()


@ep_combine_backward.register_fake
def _ep_combine_backward_fake(d_out, weights, slots, recv_rows, sent, counts, group, ep_size, path):
    _check_path(path)
    return d_out.new_empty((recv_rows.shape[0], d_out.shape[-1]))


def _combine_backward(ctx, d_out, d_picked_unused):
    weights, slots, recv_rows, sent, counts, picked = ctx.saved_tensors
    top_k = slots.shape[-1]
    d_y = torch.ops.moec.ep_combine_backward(
        d_out, weights, slots, recv_rows, sent, counts, *ctx.args
    )
    acc = _acc(picked)
    routes = d_out.reshape(-1, 1, d_out.shape[-1]).to(acc)
    d_weights = (picked.view(-1, top_k, picked.shape[-1]).to(acc) * routes).sum(-1)
    return d_y, d_weights.view(weights.shape).to(weights.dtype), *([None] * 7)


ep_combine.register_autograd(_combine_backward, setup_context=_combine_setup)
