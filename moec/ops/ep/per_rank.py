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
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from moec.ops.ep.exchange import Exchange, Push, accumulation_dtype, rowwise_transport
from moec.ops.ep.index import (
    token_rank_addresses,
    token_ranks_reached,
    token_route_table,
    token_workspace_rows,
)


def partial_sums(
    buffer: Tensor,
    ex: Exchange,
    me: int,
    row_weights: Tensor | None = None,
    written: Tensor | None = None,
) -> Push:
    """The experts' side of a home-bound exchange: the push of ``[ep*T, D]`` rows, row ``s*T +
    t`` the sum of source s's token t's rows here (:func:`token_route_table`) times
    ``row_weights[r]`` (``[R]``) or 1, by the combine kernel (deterministic; rounded to the
    buffer's dtype once), to row ``me*T + t`` of source s's partial workspace (nowhere where t
    has no route here); ``written``: which rows of this rank's workspace arrive."""
    tokens, ep_size = ex.tokens, ex.ep_size
    table = token_route_table(ex.recv_rows, tokens, ex.top_k, ep_size)
    if row_weights is None:
        weights = torch.ones(table.shape, dtype=accumulation_dtype(buffer), device=buffer.device)
    else:
        weights = torch.where(table >= 0, row_weights[table.clamp(min=0)], 0)
    partial = torch.ops.moec.combine(buffer, weights, table)
    row = torch.arange(ep_size * tokens, device=table.device)
    source, token = row // tokens, row % tokens
    home = source * (ep_size * tokens) + me * tokens + token
    address = torch.where((table >= 0).any(1), home, -1)
    return Push(partial, address, partial.shape[0], written=written, poison=ex.poison)


def ranks_reached(ex: Exchange) -> Tensor:
    """``[T, ep]``: whether token t has an accepted route on rank d."""
    return token_ranks_reached(ex.routes, ex.num_rows, ex.top_k, ex.ep_size)


def sum_partials(workspace: Tensor, ex: Exchange) -> Tensor:
    """Home's ``[T, D]``: each token's partials from the ranks it reached (row ``d*T + t`` of
    ``workspace``; the other rows are not read)."""
    reached = ranks_reached(ex)
    ranks = torch.arange(ex.ep_size, device=reached.device)
    token = torch.arange(ex.tokens, device=reached.device)[:, None]
    gathered = torch.where(reached, ranks * ex.tokens + token, -1)
    ones = torch.ones(gathered.shape, dtype=accumulation_dtype(workspace), device=workspace.device)
    return torch.ops.moec.combine(workspace, ones, gathered)


def sum_home_once_per_rank(buffer: Tensor, ex: Exchange, row_weights: Tensor | None = None):
    """``rowwise``, home-bound: :func:`partial_sums` pushed home, :func:`sum_partials` read
    straight from the workspace. Dispatch's backward (unweighted) and combine's forward."""
    pg = ex.process_group()
    push = partial_sums(buffer, ex, dist.get_rank(pg), row_weights)
    return rowwise_transport().send(push, pg, consume=functools.partial(sum_partials, ex=ex))


def source_rows(ex: Exchange) -> Tensor:
    """Each expert buffer row's row of the token workspace (:func:`token_workspace_rows`)."""
    return token_workspace_rows(ex.recv_rows, ex.tokens, ex.top_k)


def expand_tokens(workspace: Tensor, ex: Exchange) -> Tensor:
    """The expert side's rows of a token workspace: buffer row ``r`` reads row
    ``source_rows(ex)[r]``; rows no route fills are unspecified (``ex.poison`` where set)."""
    source_row = source_rows(ex)
    rows = workspace.index_select(0, source_row.clamp(min=0))
    if ex.poison is not None:
        rows = torch.where((source_row >= 0)[:, None], rows, ex.poison)
    return rows


def token_push(x: Tensor, ex: Exchange, me: int, written: Tensor | None = None) -> Push:
    """Toward the experts (DeepEP's layout): each token's row once to each rank its routes
    reach, into that rank's ``[ep*T, D]`` token workspace (:func:`token_rank_addresses`)."""
    address = token_rank_addresses(ex.routes, ex.num_rows, ex.top_k, ex.ep_size, me)
    rows = ex.ep_size * x.shape[0]
    return Push(x, address, rows, ex.ep_size, written=written, poison=ex.poison)


def send_once_per_rank(x: Tensor, ex: Exchange, consume: Callable | None = None):
    """``rowwise`` toward the experts: :func:`token_push`; the receiver returns
    ``consume(workspace)``, by default :func:`expand_tokens`: one gather into its expert
    buffer, which is also the copy out of the workspace."""
    pg = ex.process_group()
    consume = consume or functools.partial(expand_tokens, ex=ex)
    return rowwise_transport().send(token_push(x, ex, dist.get_rank(pg)), pg, consume=consume)


def weights_to_experts(weights: Tensor, ex: Exchange, dtype: torch.dtype) -> Tensor:
    """The route weights as the experts' side holds them: ``[R]`` in ``dtype``, 0 where no
    route arrived (a float per route crosses)."""
    route_weights = weights.reshape(-1, 1).to(dtype)
    push = Push(route_weights, ex.routes, ex.num_rows, fill=0, poison=ex.poison)
    return rowwise_transport().send(push, ex.process_group()).view(-1)


def weighted_rows(workspace: Tensor, ex: Exchange, y: Tensor, row_weights: Tensor):
    """Combine's backward on the experts' side, from the output gradient's token workspace:
    its rows expanded (:func:`expand_tokens`), then ``(d_y, d_w)`` = ``(row_weights * rows``
    rounded once to their dtype``, <rows, y>`` per row accumulated in ``row_weights``' dtype, 0
    where no route arrived)."""
    rows = expand_tokens(workspace, ex)
    acc = row_weights.dtype
    d_w = (rows.to(acc) * y.to(acc)).sum(-1, keepdim=True)
    d_w = torch.where((source_rows(ex) >= 0)[:, None], d_w, 0)  # y's unfilled rows: garbage
    return rows.mul_(row_weights[:, None]), d_w


def weights_home(d_w: Tensor, ex: Exchange) -> Tensor:
    """Each route's weight gradient ``[T*K]`` home from the experts' ``d_w[R, 1]``; 0 for
    dropped routes."""
    home = ex.routes >= 0
    push = Push(d_w, ex.recv_rows, ex.slots.numel(), fill=0, written=home, poison=ex.poison)
    return rowwise_transport().send(push, ex.process_group()).view(-1)


def combine_once_per_rank(y: Tensor, weights: Tensor, ex: Exchange) -> tuple[Tensor, Tensor]:
    """``rowwise`` combine: the route weights cross to the experts' side, which sums each
    token's weighted rows before they travel home. Returns ``out[T, D]`` and the weights as
    that side holds them (``[R]``), which its backward reads."""
    row_weights = weights_to_experts(weights, ex, accumulation_dtype(y))
    return sum_home_once_per_rank(y, ex, row_weights), row_weights


def combine_backward_once_per_rank(d_out: Tensor, y: Tensor, row_weights: Tensor, ex: Exchange):
    """``rowwise`` combine backward: ``d_out`` crosses to each rank its token reached once;
    that side computes ``d_y`` and the weights' gradient (:func:`weighted_rows`), whose
    floats go home. Returns ``(d_y[R, D], d_weights[T*K])``."""
    weighted = functools.partial(weighted_rows, ex=ex, y=y, row_weights=row_weights)
    d_y, d_w = send_once_per_rank(d_out, ex, weighted)
    return d_y, weights_home(d_w, ex)
