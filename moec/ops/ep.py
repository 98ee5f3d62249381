"""Expert-parallel ops: ``moec::ep_layout``, ``moec::ep_dispatch``, ``moec::ep_combine``.

An EP group of ``n`` ranks splits the ``N`` routed experts: rank ``r`` holds experts
``[r*L, (r+1)*L)`` with ``L = N/n``. Every rank routes its own ``T`` local tokens with
``moec::route`` (rows ``[T, K]`` into its local expert-major buffer, ``offsets[N]``); these ops
move the accepted routes to the ranks that own their experts and back::

    slots, recv_rows, local_offsets, counts, dropped = ep_layout(rows, offsets, group, n, cf, path)
    buffer = ep_dispatch(x, slots, recv_rows, counts, group, n, path)          # [R, D]
    y, _ = expert_mlp(buffer, w_up[L], w_down[L], local_offsets, ...)           # local experts
    out, saved = ep_combine(y, weights, slots, recv_rows, counts, group, n, path)  # [*, D]

``counts[n, L]``: accepted routes source ``s`` sends to each local expert (exchanged on the
device). ``buffer`` is expert-major: local expert ``l`` owns rows ``[local_offsets[l-1],
local_offsets[l])`` and inside them the routes of source 0, then source 1, ..., each source's in
its route-rank order; rows past ``local_offsets[-1]`` are garbage (never read for a result).
``saved`` is what the backward reads: on the a2a paths ``picked[T*K, D]``, each route's expert
output before weighting, home; on ``rowwise`` the route weights as the experts' side holds them
(``[R]``, in the accumulation dtype), the backward reading ``y`` there too.
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
  kernel writes rows straight into the peers' symmetric-memory buffers, the layout sends each
  row's origin along (``recv_rows[r] = source * T*K + route``, -1 for no route), and combine
  pushes every expert-output row back to its origin. Toward the experts (dispatch, combine's
  backward) a token's row crosses to a rank once, however many of its routes go there (DeepEP's
  layout: :func:`token_rank_addresses`, up to K times fewer bytes at top-K), and the
  receiver expands it into the ``R = Cr`` rows of its buffer with one gather. Toward home
  (combine, dispatch's backward) each rank sums a token's rows first (combine's weighted: the
  route weights cross to the experts first, a float each) and sends one partial home per rank
  (:func:`token_route_table`); the home sums the partials. Combine's backward computes the
  weights' gradient ``<d_out, y>`` on the experts' side and sends it home, a float per route.
  A partial is rounded to the rows' dtype once before it travels. The transport is
  the runtime's (it owns the symmetric-memory workspaces): importing ``moec.runtime`` registers
  it with :func:`register_rowwise_transport`. Without CUDA/symmetric memory, or with no
  transport registered, it raises :class:`EPPathError` naming ``a2a_capacity``.

Backward: dispatch's is the reverse exchange plus an unweighted sum (a combine); combine's is a
weighted dispatch plus ``d_weights = <picked, d_out>`` (rowwise: ``<y, d_out>`` on the experts'
side). All three every rank of the group must call in the same order, like any collective. The
index math is plain functions tested on CPU.

The exchanges of the backwards are internal ops, so AOTAutograd traces each as one opaque call
and no collective ever runs on fake tensors::

    ep_dispatch_backward(d_buffer[R, D], slots, recv_rows, sent, counts, group, ep_size, path)
        -> d_x[T, D]
    ep_combine_backward(d_out[*, D], weights, saved, y | None, slots, recv_rows, sent, counts,
                        group, ep_size, path) -> (d_y[R, D], d_weights)

Every op's outputs are contiguous, as their fake implementations promise.

Split exchanges (pass ``overlap``): each exchange as an issue op and a wait op, so that the wait
sits right before the consumer and other work is queued between them::

    pending = ep_dispatch_issue(x, None, slots, recv_rows, sent, counts, group, n, path)
    buffer = ep_dispatch_wait(pending, slots, recv_rows, sent, counts, group, n, path)  # [R, D]
    pending = ep_combine_issue(y, weights, slots, recv_rows, sent, counts, group, n, path)
    out, picked = ep_combine_wait(pending, weights, slots, recv_rows, sent, counts, group, n, path)

Both combine ops take the route weights; each path applies them in one: ``rowwise`` at the issue
(on the experts' side, as its fused combine does: ``picked`` is then empty, ``[0, D]``), the
a2a paths at the wait (home). The issue does the sender's local work (route rows into the send
buffer; ``rowwise``: the partial sums toward home) and starts the exchange without making the
current stream wait for it: ``a2a_capacity`` an asynchronous ``all_to_all_single`` (NCCL's
stream), ``rowwise`` the push kernels on the transport's communication stream (its route
weights cross first, on the current stream). ``pending`` (``[P, D]``, :func:`pending_rows`:
``P = R`` for ``a2a_capacity``, ``ep*T`` for ``rowwise``, whose token and partial workspaces
move a row per (token, rank) as its fused exchanges do) is what arrived at this rank, valid only
once its wait op ran: the wait makes the current stream wait for that exchange alone (found by
``pending``'s storage, see :func:`pending_exchanges`), then does the receiver's local work
(``rowwise``: the gather into the expert buffer, or the sum of the partials). On CPU the issue
completes before it returns unless :data:`_ASYNC` says otherwise, so every op's output there is
complete data (what opcheck and Inductor's reference runs read). ``sync_1d`` cannot be split
(its split sizes reach the host; it synchronizes anyway): the issue ops refuse it. Costs against
the fused ops: none on ``a2a_capacity`` (the receiver's placement moves into the wait);
``rowwise`` copies each result once more (the transport's stream copies it out of symmetric
memory into ``pending``, which the wait then reads), and its backward sends the route weights
a second time (4 bytes per route).

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

import functools
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
_ASYNC: bool | None = None
"""Whether issue ops leave their exchange running: None = on CUDA only (CPU outputs stay complete
data); tests set True to run gloo's exchanges asynchronously too."""


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
# row). The a2a paths build dispatch, combine and both backwards from them; ``rowwise`` from
# ``_send_once_per_rank`` (toward the experts) and ``_sum_home_once_per_rank`` (home).


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
    """The a2a paths' (``rowwise`` has :func:`_send_once_per_rank`)."""
    pg = resolve_group(group, ep_size)
    values = _route_rows(x, top_k, weights)
    return _send_a2a(values, slots, recv_rows, sent, counts, pg, path)


def token_ranks_reached(slots: Tensor, num_rows, top_k: int, ep_size: int) -> Tensor:
    """``[T, ep]`` bool: whether token t has an accepted route on rank d (``slots``: route
    addresses ``dest * num_rows + row``, -1 dropped)."""
    routes = slots.reshape(-1, top_k)
    dest = torch.where(routes >= 0, routes // num_rows, -1)  # [T, K]
    ranks = torch.arange(ep_size, device=slots.device)
    return (dest[:, :, None] == ranks).any(1)


def token_rank_addresses(slots: Tensor, num_rows, top_k: int, ep_size: int, source: int):
    """``rowwise``, sending each token once per destination rank: address ``[T * ep]`` of
    (token t, rank d) = ``d * (ep*T) + source*T + t`` (row ``source*T + t`` of d's token
    workspace ``[ep*T, D]``) where t has an accepted route on d (:func:`token_ranks_reached`),
    else -1."""
    reached = token_ranks_reached(slots, num_rows, top_k, ep_size)
    tokens = reached.shape[0]
    ranks = torch.arange(ep_size, device=slots.device)
    token = torch.arange(tokens, device=slots.device)[:, None]
    address = ranks * (ep_size * tokens) + source * tokens + token
    return torch.where(reached, address, -1).reshape(-1)


def token_workspace_rows(recv_rows: Tensor, tokens, top_k: int) -> Tensor:
    """Row of the token workspace holding each buffer row's token (``recv_rows[r] = source *
    T*K + route``, route ``t*K + k``): ``source * T + t``; -1 where no route arrives."""
    routes = tokens * top_k
    row = (recv_rows // routes) * tokens + (recv_rows % routes) // top_k
    return torch.where(recv_rows >= 0, row, -1)


def token_route_table(recv_rows: Tensor, tokens, top_k: int, ep_size: int) -> Tensor:
    """``[ep*T, K]``: for each (source s, token t), row ``s*T + t``, the buffer rows holding its
    routes that arrived here (column k for route ``t*K + k``), -1 elsewhere; one scatter."""
    size = ep_size * tokens * top_k  # recv_rows = s*T*K + t*K + k = (s*T + t)*K + k
    table = torch.full((size + 1,), -1, dtype=torch.int64, device=recv_rows.device)
    rows = torch.arange(recv_rows.shape[0], device=recv_rows.device)
    table.index_copy_(0, torch.where(recv_rows >= 0, recv_rows, size), rows)
    return table[:size].view(ep_size * tokens, top_k)


# ``rowwise`` moves a token's rows once per (token, rank): toward the experts a token's row lands
# in row ``source*T + t`` of each reached rank's ``[ep*T, D]`` token workspace, which
# :func:`_expand` gathers into the expert buffer; home, each rank sums a token's rows it holds
# (:func:`_partials`) into row ``rank*T + t`` of the home's ``[ep*T, D]`` partial workspace,
# which :func:`_sum_partials` adds up. Combine's route weights cross to the experts' side
# (:func:`_weights_to_experts`) and their gradient comes home (:func:`_weights_home`), a float
# per route. The fused ops and the split ones (issue/wait) share these pieces.


def _partials(buffer, slots, recv_rows, top_k: int, ep_size: int, me: int, row_weights=None):
    """The experts' side of a home-bound exchange: ``[ep*T, D]`` rows, row ``s*T + t`` the sum
    of source s's token t's rows here (:func:`token_route_table`) times ``row_weights[r]``
    (``[R]``) or 1, by the combine kernel (deterministic; rounded to the buffer's dtype once),
    and their addresses: row ``me*T + t`` of source s's partial workspace, -1 where t has no
    route here."""
    tokens = slots.numel() // top_k
    table = token_route_table(recv_rows, tokens, top_k, ep_size)
    if row_weights is None:
        weights = torch.ones(table.shape, dtype=_acc(buffer), device=buffer.device)
    else:
        weights = torch.where(table >= 0, row_weights[table.clamp(min=0)], 0)
    partial = torch.ops.moec.combine(buffer, weights, table)
    row = torch.arange(ep_size * tokens, device=table.device)
    source, token = row // tokens, row % tokens
    home = source * (ep_size * tokens) + me * tokens + token
    return partial, torch.where((table >= 0).any(1), home, -1)


def _sum_partials(workspace: Tensor, slots, recv_rows, top_k: int, ep_size: int) -> Tensor:
    """Home's ``[T, D]``: each token's partials from the ranks it reached (row ``d*T + t`` of
    ``workspace``; the other rows are not read)."""
    reached = token_ranks_reached(slots, recv_rows.shape[0], top_k, ep_size)  # [T, ep]
    tokens = reached.shape[0]
    ranks = torch.arange(ep_size, device=slots.device)
    token = torch.arange(tokens, device=slots.device)[:, None]
    gathered = torch.where(reached, ranks * tokens + token, -1)
    ones = torch.ones(gathered.shape, dtype=_acc(workspace), device=workspace.device)
    return torch.ops.moec.combine(workspace, ones, gathered)


def _sum_home_once_per_rank(buffer, slots, recv_rows, top_k, pg, ep_size, row_weights=None):
    """``rowwise``, home-bound: :func:`_partials` pushed home, :func:`_sum_partials` read
    straight from the workspace. Dispatch's backward (unweighted) and combine's forward."""
    me = dist.get_rank(pg)
    partial, address = _partials(buffer, slots, recv_rows, top_k, ep_size, me, row_weights)

    def sum_partials(workspace: Tensor) -> Tensor:
        return _sum_partials(workspace, slots, recv_rows, top_k, ep_size)

    rows = partial.shape[0]
    return _rowwise().send(partial, address, rows, pg, consume=sum_partials)


def _expand(workspace: Tensor, source_row: Tensor) -> Tensor:
    """The expert side's rows of a token workspace: buffer row ``r`` reads row
    ``source_row[r]`` (:func:`token_workspace_rows`); rows no route fills are unspecified
    (poisoned in the tests)."""
    rows = workspace.index_select(0, source_row.clamp(min=0))
    if _POISON is not None:
        rows = torch.where((source_row >= 0)[:, None], rows, _POISON)
    return rows


def _send_once_per_rank(x, top_k, slots, recv_rows, pg, ep_size, consume=_expand):
    """``rowwise`` toward the experts (DeepEP's layout): each token's row crosses to a rank
    once, however many of its routes go there, into that rank's ``[ep*T, D]`` token workspace
    (:func:`token_rank_addresses`); the receiver returns ``consume(workspace, source_row)``,
    by default :func:`_expand`: one gather into its expert buffer, which is also the copy out
    of the workspace."""
    tokens, num_rows = x.shape[0], recv_rows.shape[0]
    address = token_rank_addresses(slots, num_rows, top_k, ep_size, dist.get_rank(pg))
    source_row = token_workspace_rows(recv_rows, tokens, top_k)
    return _rowwise().send(
        x, address, ep_size * tokens, pg, ep_size, consume=lambda w: consume(w, source_row)
    )


def _weights_to_experts(weights: Tensor, slots, num_rows, pg, dtype: torch.dtype) -> Tensor:
    """The route weights as the experts' side holds them: ``[R]`` in ``dtype``, 0 where no
    route arrived (a float per route crosses)."""
    route_weights = weights.reshape(-1, 1).to(dtype)
    return _rowwise().send(route_weights, slots, num_rows, pg, fill=0).view(-1)


def _weighted_rows(workspace: Tensor, source_row: Tensor, y: Tensor, row_weights: Tensor):
    """Combine's backward on the experts' side, from the output gradient's token workspace:
    its rows expanded (:func:`_expand`), then ``(d_y, d_w)`` = ``(row_weights * rows`` rounded
    once to their dtype``, <rows, y>`` per row accumulated in ``row_weights``' dtype, 0 where no
    route arrived)."""
    rows = _expand(workspace, source_row)
    acc = row_weights.dtype
    d_w = (rows.to(acc) * y.to(acc)).sum(-1, keepdim=True)
    d_w = torch.where((source_row >= 0)[:, None], d_w, 0)  # y's unfilled rows: garbage
    return rows.mul_(row_weights[:, None]), d_w


def _weights_home(d_w: Tensor, slots, recv_rows, pg) -> Tensor:
    """Each route's weight gradient ``[T*K]`` home from the experts' ``d_w[R, 1]``; 0 for
    dropped routes."""
    home = slots >= 0
    return _rowwise().send(d_w, recv_rows, slots.numel(), pg, fill=0, written=home).view(-1)


def _combine_once_per_rank(y, weights, slots, recv_rows, top_k, pg, ep_size):
    """``rowwise`` combine: the route weights cross to the experts' side, which sums each
    token's weighted rows before they travel home. Returns ``out[T, D]`` and the weights as
    that side holds them (``[R]``), which its backward reads."""
    row_weights = _weights_to_experts(weights, slots, recv_rows.shape[0], pg, _acc(y))
    out = _sum_home_once_per_rank(y, slots, recv_rows, top_k, pg, ep_size, row_weights)
    return out, row_weights


def _combine_backward_once_per_rank(d_out, y, row_weights, slots, recv_rows, top_k, pg, ep_size):
    """``rowwise`` combine backward: ``d_out`` crosses to each rank its token reached once;
    that side computes ``d_y`` and the weights' gradient (:func:`_weighted_rows`), whose
    floats go home. Returns ``(d_y[R, D], d_weights[T*K])``."""

    weighted = functools.partial(_weighted_rows, y=y, row_weights=row_weights)
    d_y, d_w = _send_once_per_rank(d_out, top_k, slots, recv_rows, pg, ep_size, weighted)
    return d_y, _weights_home(d_w, slots, recv_rows, pg)


def _fetch(buffer, slots, recv_rows, sent, counts, group, ep_size, path, consume=None):
    """The a2a paths': ``[T*K, D]``, zero for routes without a row, or ``consume`` of it."""
    pg = resolve_group(group, ep_size)
    picked = _fetch_a2a(buffer, slots, recv_rows, sent, counts, pg, path)
    return picked if consume is None else consume(picked)


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
        wrote holding ``fill`` (:data:`_POISON` when None and set, else unspecified). With
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


def _picked_weight_grad(picked: Tensor, d_out: Tensor, top_k: int) -> Tensor:
    """The a2a paths' route weights' gradient, home: ``<picked[t*K + k], d_out[t]>``
    ``[T, K]``, accumulated in :func:`_acc`."""
    acc = _acc(picked)
    routes = d_out.reshape(-1, 1, d_out.shape[-1]).to(acc)
    return (picked.view(-1, top_k, picked.shape[-1]).to(acc) * routes).sum(-1)


def _sum_routes(
    picked: Tensor, top_k: int, weights: Tensor | None = None, valid: Tensor | None = None
) -> Tensor:
    """(T*K, D) -> (T, D): sum over k of weights * picked, accumulated in :func:`_acc`, rows
    ``valid`` marks False left out (not read). It is ``moec::combine`` over the identity rows,
    so CUDA runs the combine kernel."""
    routes = torch.arange(picked.shape[0], device=picked.device)
    if valid is not None:
        routes = torch.where(valid.reshape(-1), routes, -1)
    routes = routes.view(-1, top_k)
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
    flat, top_k = x.reshape(-1, x.shape[-1]), slots.shape[-1]
    if path == "rowwise":
        pg = resolve_group(group, ep_size)
        return _send_once_per_rank(flat, top_k, slots.reshape(-1), recv_rows, pg, ep_size)
    comm = (recv_rows, sent, counts, group, ep_size, path)
    return _send(flat, top_k, None, slots.reshape(-1), *comm)


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
    flat, top_k = slots.reshape(-1), slots.shape[-1]
    if path == "rowwise":
        pg = resolve_group(group, ep_size)
        d_x = _sum_home_once_per_rank(d_buffer, flat, recv_rows, top_k, pg, ep_size)
    else:
        sum_routes = functools.partial(_sum_routes, top_k=top_k, valid=flat >= 0)
        d_x = _fetch(d_buffer, flat, *comm, consume=sum_routes)
    return d_x.reshape(-1, d_buffer.shape[-1]).contiguous()


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
    flat, top_k = slots.reshape(-1), slots.shape[-1]
    if path == "rowwise":
        pg = resolve_group(group, ep_size)
        out, saved = _combine_once_per_rank(y, weights, flat, recv_rows, top_k, pg, ep_size)
    else:
        saved = _fetch(y, flat, recv_rows, sent, counts, group, ep_size, path)  # picked
        out = _sum_routes(saved, top_k, weights)
    return out.view(*slots.shape[:-1], y.shape[-1]), saved


@ep_combine.register_fake
def _ep_combine_fake(y, weights, slots, recv_rows, sent, counts, group, ep_size, path):
    _check_path(path)
    out = y.new_empty((*slots.shape[:-1], y.shape[-1]))
    if path == "rowwise":
        return out, y.new_empty((recv_rows.shape[0],), dtype=_acc(y))
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
    _check_path(path)
    flat_d_out, top_k = d_out.reshape(-1, d_out.shape[-1]), slots.shape[-1]
    if path == "rowwise":
        if y is None:
            raise ValueError("ep_combine_backward on the rowwise path needs the expert output y")
        pg = resolve_group(group, ep_size)
        comm = (slots.reshape(-1), recv_rows, top_k, pg, ep_size)
        d_y, d_weights = _combine_backward_once_per_rank(flat_d_out, y, saved, *comm)
    else:
        comm = (recv_rows, sent, counts, group, ep_size, path)
        d_y = _send(flat_d_out, top_k, weights, slots.reshape(-1), *comm)
        d_weights = _picked_weight_grad(saved, flat_d_out, top_k)
    return d_y.contiguous(), d_weights.to(weights.dtype).view(weights.shape).contiguous()


@ep_combine_backward.register_fake
def _ep_combine_backward_fake(
    d_out, weights, saved, y, slots, recv_rows, sent, counts, group, ep_size, path
):
    _check_path(path)
    return d_out.new_empty((recv_rows.shape[0], d_out.shape[-1])), weights.new_empty(weights.shape)


def _combine_backward(ctx, d_out, d_saved_unused):
    weights, saved, y, *comm = ctx.saved_tensors
    d_y, d_weights = torch.ops.moec.ep_combine_backward(d_out, weights, saved, y, *comm, *ctx.args)
    return d_y, d_weights, *([None] * 7)


ep_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


# --- split exchanges: issue, then wait before the consumer (module docstring) ------------------

_PENDING: dict[int, tuple[Tensor, Callable[[], None], tuple]] = {}
"""In-flight exchanges by the storage of their result: (result, wait, tensors kept alive)."""


def pending_exchanges() -> int:
    """Exchanges issued and not yet waited for (0 between steps of a correct program)."""
    return len(_PENDING)


def _async(t: Tensor) -> bool:
    return t.is_cuda if _ASYNC is None else _ASYNC


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
    _check_path(path)
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
    out, wait = _rowwise().issue(x, address, rows, rows, pg, top_k, fill=0, written=written)
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
    return _issue_a2a(_place(_route_rows(flat, top_k, weights), address, num_rows), pg)


def _combine_issue(y, weights, slots, recv_rows, group, ep_size, path) -> Tensor:
    _check_split_path(path)
    pg = resolve_group(group, ep_size)
    if path == "rowwise":
        flat, top_k, me = slots.reshape(-1), slots.shape[-1], dist.get_rank(pg)
        row_weights = None
        if weights is not None:
            row_weights = _weights_to_experts(weights, flat, recv_rows.shape[0], pg, _acc(y))
        partial, address = _partials(y, flat, recv_rows, top_k, ep_size, me, row_weights)
        reached = token_ranks_reached(flat, recv_rows.shape[0], top_k, ep_size)  # [T, ep]
        return _issue_rowwise(partial, address, reached.t().reshape(-1), pg)
    return _issue_a2a(_take(y, recv_rows), pg)  # the weights apply home, at the wait


def _dispatch_wait(pending, slots, recv_rows, path) -> Tensor:
    _check_split_path(path)
    _wait_for(pending)
    num_rows = recv_rows.shape[0]
    if path == "rowwise":
        tokens = slots.numel() // slots.shape[-1]
        return _expand(pending, token_workspace_rows(recv_rows, tokens, slots.shape[-1]))
    return _place(pending, recv_rows, num_rows).contiguous()


def _combine_wait(pending, weights, slots, recv_rows, ep_size, path) -> tuple[Tensor, Tensor]:
    _check_split_path(path)
    _wait_for(pending)
    top_k, dim = slots.shape[-1], pending.shape[-1]
    if path == "rowwise":  # the partials of the ranks each token reached, weighted there
        out = _sum_partials(pending, slots.reshape(-1), recv_rows, top_k, ep_size)
        picked = pending.new_empty((0, dim))
    else:
        picked = _take(pending, slots.reshape(-1))
        out = _sum_routes(picked, top_k, weights)
    return out.view(*slots.shape[:-1], dim), picked


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
) -> Tensor:
    return _combine_issue(y, weights, slots, recv_rows, group, ep_size, path)


@ep_combine_issue.register_fake
def _ep_combine_issue_fake(y, weights, slots, recv_rows, sent, counts, group, ep_size, path):
    _check_split_path(path)
    return y.new_empty((pending_rows(slots, recv_rows, ep_size, path), y.shape[-1]))


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
    experts' side ``d_y`` and the weights' gradient, which comes home (the weights cross
    again, a float per route each way)."""
    _check_split_path(path)
    if path != "rowwise":
        raise ValueError(
            f"ep_combine_issue_backward serves ep_path='rowwise' only (got {path!r}); the a2a "
            "paths' combine issue backward is ep_dispatch_wait"
        )
    _wait_for(d_pending)
    pg, flat, top_k = resolve_group(group, ep_size), slots.reshape(-1), slots.shape[-1]
    row_weights = _weights_to_experts(weights, flat, recv_rows.shape[0], pg, _acc(y))
    source_row = token_workspace_rows(recv_rows, flat.numel() // top_k, top_k)
    d_y, d_w = _weighted_rows(d_pending, source_row, y, row_weights)
    d_weights = _weights_home(d_w, flat, recv_rows, pg)
    return d_y.contiguous(), d_weights.to(weights.dtype).view(weights.shape).contiguous()


@ep_combine_issue_backward.register_fake
def _ep_combine_issue_backward_fake(
    d_pending, weights, y, slots, recv_rows, sent, counts, group, ep_size, path
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
    return torch.ops.moec.ep_combine_issue(d_buffer, None, *comm), *([None] * 7)


def _combine_issue_setup(ctx, inputs, output) -> None:
    """rowwise with weights: also y and the weights (its backward computes their gradient)."""
    y, weights, slots, recv_rows, sent, counts, group, ep_size, path = inputs
    weighted = path == "rowwise" and weights is not None
    kept = (y, weights) if weighted else (None, None)
    ctx.save_for_backward(*kept, slots, recv_rows, sent, counts)
    ctx.args = (group, ep_size, path)


def _combine_issue_backward(ctx, d_pending):
    y, weights, *comm = ctx.saved_tensors
    if weights is None:
        d_y = torch.ops.moec.ep_dispatch_wait(d_pending, *comm, *ctx.args)
        return d_y, *([None] * 8)
    d_y, d_weights = torch.ops.moec.ep_combine_issue_backward(
        d_pending, weights, y, *comm, *ctx.args
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
        d_weights = _picked_weight_grad(picked, d_out, comm[0].shape[-1])
        d_weights = d_weights.view(weights.shape).to(weights.dtype)
    return d_pending, d_weights, *([None] * 7)


ep_dispatch_issue.register_autograd(_dispatch_issue_backward, setup_context=_split_setup)
ep_dispatch_wait.register_autograd(_dispatch_wait_backward, setup_context=_split_setup)
ep_combine_issue.register_autograd(_combine_issue_backward, setup_context=_combine_issue_setup)
ep_combine_wait.register_autograd(_combine_wait_backward, setup_context=_combine_wait_setup)
