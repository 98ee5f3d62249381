"""Expert-parallel index math: buffer sizes and every route's and token's address, as pure
device-side functions on static shapes (no host sync, no collective), tested on CPU.

The layout they describe is :mod:`moec.ops.ep`'s: rank ``r`` of ``n`` owns experts ``[r*L,
(r+1)*L)``; ``counts[n, L]`` are the accepted routes each source sends to each local expert; the
expert buffer (``R`` rows) is expert-major, inside an expert source-major, inside a source in
route order. ``rowwise`` addresses are ``dest * rows + row`` (-1: nowhere), its token
workspaces ``[ep*T, D]`` hold row ``source*T + t`` for token t of source s.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moec.ops.routing import capacity

# --- sizes -------------------------------------------------------------------------------------


def rank_capacity(tokens, top_k: int, num_experts: int, ep_size: int, capacity_factor: float):
    """``Cr``: rows one rank receives on the ``rowwise`` path (see :mod:`moec.ops.ep`)."""
    if capacity_factor <= 0:
        return ep_size * tokens * min(top_k, num_experts // ep_size)
    return math.ceil(capacity_factor * tokens * top_k)


def buffer_rows(tokens, top_k: int, num_experts: int, ep_size: int, cf: float, path: str):
    """``R``: rows of the expert buffer a rank receives (see :mod:`moec.ops.ep`)."""
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


# --- rowwise: a row per (token, rank) -----------------------------------------------------------


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
