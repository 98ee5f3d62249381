"""The ``rowwise`` path's exchanges, a row per (token, rank) in every direction.

Toward the experts (dispatch, combine's backward) a token's row lands once in row ``source*T +
t`` of each reached rank's ``[ep*T, D]`` token workspace (DeepEP's layout:
:func:`~moec.ops.ep.index.token_rank_addresses`), which :func:`expand_tokens` gathers into the
expert buffer. Home (combine, dispatch's backward) each rank sums the rows of a token it holds
(:func:`partial_sums`, combine's weighted) into row ``rank*T + t`` of the home's ``[ep*T, D]``
partial workspace, which :func:`sum_partials` adds up. Combine's route weights cross to the
experts' side (:func:`weights_to_experts`) and their gradient comes home
(:func:`weights_home`), a float per route. The fused ops and the split ones (issue/wait) share
these pieces; the transport (:func:`~moec.ops.ep.exchange.rowwise_transport`) moves the rows.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from moec.ops.ep.exchange import HOOKS, accumulation_dtype, rowwise_transport
from moec.ops.ep.index import (
    token_rank_addresses,
    token_ranks_reached,
    token_route_table,
    token_workspace_rows,
)


def partial_sums(buffer, slots, recv_rows, top_k: int, ep_size: int, me: int, row_weights=None):
    """The experts' side of a home-bound exchange: ``[ep*T, D]`` rows, row ``s*T + t`` the sum
    of source s's token t's rows here (:func:`token_route_table`) times ``row_weights[r]``
    (``[R]``) or 1, by the combine kernel (deterministic; rounded to the buffer's dtype once),
    and their addresses: row ``me*T + t`` of source s's partial workspace, -1 where t has no
    route here."""
    tokens = slots.numel() // top_k
    table = token_route_table(recv_rows, tokens, top_k, ep_size)
    if row_weights is None:
        weights = torch.ones(table.shape, dtype=accumulation_dtype(buffer), device=buffer.device)
    else:
        weights = torch.where(table >= 0, row_weights[table.clamp(min=0)], 0)
    partial = torch.ops.moec.combine(buffer, weights, table)
    row = torch.arange(ep_size * tokens, device=table.device)
    source, token = row // tokens, row % tokens
    home = source * (ep_size * tokens) + me * tokens + token
    return partial, torch.where((table >= 0).any(1), home, -1)


def sum_partials(workspace: Tensor, slots, recv_rows, top_k: int, ep_size: int) -> Tensor:
    """Home's ``[T, D]``: each token's partials from the ranks it reached (row ``d*T + t`` of
    ``workspace``; the other rows are not read)."""
    reached = token_ranks_reached(slots, recv_rows.shape[0], top_k, ep_size)  # [T, ep]
    tokens = reached.shape[0]
    ranks = torch.arange(ep_size, device=slots.device)
    token = torch.arange(tokens, device=slots.device)[:, None]
    gathered = torch.where(reached, ranks * tokens + token, -1)
    ones = torch.ones(gathered.shape, dtype=accumulation_dtype(workspace), device=workspace.device)
    return torch.ops.moec.combine(workspace, ones, gathered)


def sum_home_once_per_rank(buffer, slots, recv_rows, top_k, pg, ep_size, row_weights=None):
    """``rowwise``, home-bound: :func:`partial_sums` pushed home, :func:`sum_partials` read
    straight from the workspace. Dispatch's backward (unweighted) and combine's forward."""
    me = dist.get_rank(pg)
    partial, address = partial_sums(buffer, slots, recv_rows, top_k, ep_size, me, row_weights)
    add_up = functools.partial(
        sum_partials, slots=slots, recv_rows=recv_rows, top_k=top_k, ep_size=ep_size
    )
    return rowwise_transport().send(partial, address, partial.shape[0], pg, consume=add_up)


def expand_tokens(workspace: Tensor, source_row: Tensor) -> Tensor:
    """The expert side's rows of a token workspace: buffer row ``r`` reads row
    ``source_row[r]`` (:func:`token_workspace_rows`); rows no route fills are unspecified
    (poisoned in the tests)."""
    rows = workspace.index_select(0, source_row.clamp(min=0))
    if HOOKS.poison is not None:
        rows = torch.where((source_row >= 0)[:, None], rows, HOOKS.poison)
    return rows


def send_once_per_rank(x, top_k, slots, recv_rows, pg, ep_size, consume=expand_tokens):
    """``rowwise`` toward the experts (DeepEP's layout): each token's row crosses to a rank
    once, however many of its routes go there, into that rank's ``[ep*T, D]`` token workspace
    (:func:`token_rank_addresses`); the receiver returns ``consume(workspace, source_row)``,
    by default :func:`expand_tokens`: one gather into its expert buffer, which is also the copy out
    of the workspace."""
    tokens, num_rows = x.shape[0], recv_rows.shape[0]
    address = token_rank_addresses(slots, num_rows, top_k, ep_size, dist.get_rank(pg))
    source_row = token_workspace_rows(recv_rows, tokens, top_k)
    return rowwise_transport().send(
        x, address, ep_size * tokens, pg, ep_size, consume=lambda w: consume(w, source_row)
    )


def weights_to_experts(weights: Tensor, slots, num_rows, pg, dtype: torch.dtype) -> Tensor:
    """The route weights as the experts' side holds them: ``[R]`` in ``dtype``, 0 where no
    route arrived (a float per route crosses)."""
    route_weights = weights.reshape(-1, 1).to(dtype)
    return rowwise_transport().send(route_weights, slots, num_rows, pg, fill=0).view(-1)


def weighted_rows(workspace: Tensor, source_row: Tensor, y: Tensor, row_weights: Tensor):
    """Combine's backward on the experts' side, from the output gradient's token workspace:
    its rows expanded (:func:`expand_tokens`), then ``(d_y, d_w)`` = ``(row_weights * rows`` rounded
    once to their dtype``, <rows, y>`` per row accumulated in ``row_weights``' dtype, 0 where no
    route arrived)."""
    rows = expand_tokens(workspace, source_row)
    acc = row_weights.dtype
    d_w = (rows.to(acc) * y.to(acc)).sum(-1, keepdim=True)
    d_w = torch.where((source_row >= 0)[:, None], d_w, 0)  # y's unfilled rows: garbage
    return rows.mul_(row_weights[:, None]), d_w


def weights_home(d_w: Tensor, slots, recv_rows, pg) -> Tensor:
    """Each route's weight gradient ``[T*K]`` home from the experts' ``d_w[R, 1]``; 0 for
    dropped routes."""
    home = slots >= 0
    return (
        rowwise_transport().send(d_w, recv_rows, slots.numel(), pg, fill=0, written=home).view(-1)
    )


def combine_once_per_rank(y, weights, slots, recv_rows, top_k, pg, ep_size):
    """``rowwise`` combine: the route weights cross to the experts' side, which sums each
    token's weighted rows before they travel home. Returns ``out[T, D]`` and the weights as
    that side holds them (``[R]``), which its backward reads."""
    row_weights = weights_to_experts(weights, slots, recv_rows.shape[0], pg, accumulation_dtype(y))
    out = sum_home_once_per_rank(y, slots, recv_rows, top_k, pg, ep_size, row_weights)
    return out, row_weights


def combine_backward_once_per_rank(d_out, y, row_weights, slots, recv_rows, top_k, pg, ep_size):
    """``rowwise`` combine backward: ``d_out`` crosses to each rank its token reached once;
    that side computes ``d_y`` and the weights' gradient (:func:`weighted_rows`), whose
    floats go home. Returns ``(d_y[R, D], d_weights[T*K])``."""

    weighted = functools.partial(weighted_rows, y=y, row_weights=row_weights)
    d_y, d_w = send_once_per_rank(d_out, top_k, slots, recv_rows, pg, ep_size, weighted)
    return d_y, weights_home(d_w, slots, recv_rows, pg)
