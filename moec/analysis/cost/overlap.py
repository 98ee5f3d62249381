"""Exposed expert-parallel communication of one MoE block, with and without two-batch overlap.

A pure model (no device, no graph) of the schedule pass ``overlap`` emits, for plans to choose
``parallel.overlap`` and for the later profile comparison. Inputs: the bytes one rank exchanges
in the block's dispatch and combine together (split evenly between them: both move one row per
accepted route), the link bandwidth (bytes/s, e.g. from a one-time probe), the block's expert
compute time (seconds), and an optional fixed latency per exchange. An exchange of ``b`` bytes
takes ``latency + b / bandwidth``.

- ``none``: dispatch, experts, combine in series; every exchange is exposed:
  ``exposed = t_dispatch + t_combine``.
- ``two_batch``: two streams, each FIFO. The comm stream runs A.dispatch, B.dispatch, A.combine,
  B.combine; the compute stream A.experts, B.experts. A.experts waits for A.dispatch, B.experts
  for B.dispatch and A.experts, A.combine for A.experts and B.dispatch, B.combine for
  B.experts and A.combine; each half moves and computes half of the whole's work.
  ``exposed = makespan - compute``. Each half pays the latency again, so with latency-bound
  exchanges overlap can expose more than it hides.

A half moves ``half_share`` of the whole's bytes per exchange: one half for ``rowwise`` (its rank
capacity halves with the tokens), but for ``a2a_capacity`` each half's buffer keeps the whole's
per-expert capacity ``C`` (pass overlap keeps the routing exact, and any expert's accepted routes
may all come from one half), so a half moves ``min(T/2, C) / C`` of the whole's bytes: up to all
of them, twice the traffic in all (:func:`two_batch_half_share`). Measured on two H200s (issue #22,
``benchmarks/ep.py --overlap``, the report's layer): the split exchanges cut the exposed
exchange time of the two halves from 3.7 to 0.2 ms (a2a_capacity) and from 4.9 to 2.6 ms
(rowwise), but running beside the expert GEMMs slows both (NCCL's and the push kernel's SMs),
and two halves cost more than one whole (two layouts, smaller GEMMs): neither is modelled here.

Backward mirrors the forward (two exchanges per block, in the reversed order, against the
expert GEMMs' backward), so the same function answers for it with the backward's compute time.

``rowwise``'s fused exchanges send a token's row to a rank once, however many of its routes go
there (:func:`moec.ops.ep.index.token_rank_addresses`), and bring one partial sum per token and
rank home (combine, dispatch's backward): all four move :func:`once_per_rank_share` of a row
per route, split (``two_batch``) or not.
"""

from __future__ import annotations

import dataclasses
import functools
import math


@dataclasses.dataclass(frozen=True)
class ExposedComm:
    """Seconds of one block under one schedule."""

    comm: float
    """Time the exchanges take on their own (the sum over exchanges)."""
    compute: float
    """Expert compute time."""
    makespan: float
    """From the first dispatch issued to the last combine done."""

    @property
    def exposed(self) -> float:
        """Communication time on the critical path: ``makespan - compute``."""
        return self.makespan - self.compute

    @property
    def hidden(self) -> float:
        """Communication time spent under compute: ``comm - exposed``."""
        return self.comm - self.exposed


def _exchange(nbytes: float, bandwidth: float, latency: float) -> float:
    return latency + nbytes / bandwidth


def two_batch_half_share(path: str, tokens: int, capacity: int | None = None) -> float:
    """Bytes one two_batch half moves per exchange, as a fraction of the whole's: ``rowwise``
    (or dropless) 0.5; ``a2a_capacity`` ``min(T/2, C) / C`` for ``T`` tokens of a rank and its
    per-expert capacity ``C`` (None: dropless, ``C = T``)."""
    if path not in ("a2a_capacity", "rowwise"):
        raise ValueError(f"path={path!r}: two_batch splits 'a2a_capacity' or 'rowwise' exchanges")
    if tokens < 2:
        raise ValueError(f"tokens must be >= 2 to halve, got {tokens}")
    if path == "rowwise" or capacity is None:
        return 0.5
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 or None (dropless), got {capacity}")
    return min(tokens // 2, capacity) / capacity


def exposed_comm(
    exchanged_bytes: float,
    bandwidth: float,
    compute_s: float,
    overlap: str = "none",
    latency_s: float = 0.0,
    half_share: float = 0.5,
) -> ExposedComm:
    """The block's timing under ``overlap`` (``none`` | ``two_batch``; see the module);
    ``half_share``: the bytes of one half's exchange over the whole's
    (:func:`two_batch_half_share`)."""
    if bandwidth <= 0:
        raise ValueError(f"link bandwidth must be > 0 bytes/s, got {bandwidth}")
    if not 0 < half_share <= 1:
        raise ValueError(f"half_share must be in (0, 1], got {half_share}")
    for name, value in (("exchanged_bytes", exchanged_bytes), ("compute_s", compute_s)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if latency_s < 0:
        raise ValueError(f"latency_s must be >= 0, got {latency_s}")
    if overlap == "none":
        dispatch = combine = _exchange(exchanged_bytes / 2, bandwidth, latency_s)
        return ExposedComm(dispatch + combine, compute_s, dispatch + compute_s + combine)
    if overlap != "two_batch":
        raise ValueError(f"overlap={overlap!r}; expected 'none' or 'two_batch'")
    move = _exchange(exchanged_bytes / 2 * half_share, bandwidth, latency_s)  # a half's exchange
    work = compute_s / 2  # one half's experts
    a_dispatch = move
    b_dispatch = a_dispatch + move
    a_experts = a_dispatch + work
    b_experts = max(b_dispatch, a_experts) + work
    a_combine = max(b_dispatch, a_experts) + move
    b_combine = max(a_combine, b_experts) + move
    return ExposedComm(4 * move, compute_s, b_combine)


def overlap_gain(
    exchanged_bytes: float,
    bandwidth: float,
    compute_s: float,
    latency_s: float = 0.0,
    half_share: float = 0.5,
) -> float:
    """Seconds per block that ``two_batch`` saves over ``none`` (negative: it costs)."""
    args = (exchanged_bytes, bandwidth, compute_s)
    none = exposed_comm(*args, "none", latency_s)
    two = exposed_comm(*args, "two_batch", latency_s, half_share)
    return none.makespan - two.makespan


@functools.cache
def once_per_rank_share(top_k: int, num_experts: int, ep: int) -> float:
    """Rows per route that cross toward the experts when each token's row goes to a rank once:
    the ranks its ``top_k`` routes reach over ``top_k``, for experts drawn uniformly without
    replacement, ``num_experts / ep`` per rank: ``ep * (1 - C(N - L, K) / C(N, K)) / K``."""
    if not 1 <= top_k <= num_experts or ep < 1 or num_experts % ep:
        raise ValueError(
            f"top_k={top_k}, num_experts={num_experts}, ep={ep}: expected 1 <= top_k <= "
            "num_experts and ep dividing num_experts"
        )
    local = num_experts // ep
    missed = math.comb(num_experts - local, top_k) / math.comb(num_experts, top_k)
    return ep * (1 - missed) / top_k
