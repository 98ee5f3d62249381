"""``moec::route`` and ``moec::router_losses``: token -> expert assignment with capacity.

route(logits[*, N], top_k, capacity_factor, gating, normalize, routing, bias[N]?, impl) ->
    expert_ids[*, K] int64   chosen experts per token, best first (ties: lower expert id)
    weights[*, K]    float32 route weights (float64 for float64 logits), differentiable
    rows[*, K]       int64   row of the route in the expert-major buffer, -1 when dropped
    offsets[N]       int32   end of each expert's rows in that buffer (inclusive cumsum)
    counts[N]        int64   offered assignments per expert (before capacity)

Selection: top-k of the logits (the gate scores' order), or with ``bias`` (auxiliary-loss-free
balancing, ``moe.balance: aux_free``) top-k of ``gate_scores + bias``; the route weights are the
unbiased gate scores of the chosen experts either way, and the bias gets no gradient.

Capacity policy (the oracle every kernel matches): an expert accepts at most
``C = ceil(capacity_factor * T * K / N)`` routes (``capacity_factor <= 0``: dropless, C = T); the
routes of an expert are ranked in token-major order ``t * K + k`` and those ranked >= C are
dropped. Accepted routes of expert e fill rows ``offsets[e-1] + rank``; the buffer has T*K rows.

Everything is static-shaped and stays on the device: a stable sort ranks routes, scatter_add
counts them; no nonzero, bincount, boolean indexing or host reads. ``impl``
(:mod:`moec.ops.binding`) names one of :data:`IMPLEMENTATIONS`: ``reference`` (here) or
``triton`` (the router kernels of :mod:`moec.kernels.router`, which rank the routes, and choose
them when learned without a selection bias; a biased choice is made in torch, like the
benchmark policies).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moec.kernels.arch import HAVE_TRITON, float_supported
from moec.ops.binding import resolve

if HAVE_TRITON:
    from moec.kernels import router

IntLike = int | torch.SymInt
"""A size: a Python int, or a symbolic one while tracing with fake tensors."""

GATINGS = ("softmax", "sigmoid")
ROUTINGS = ("learned", "random", "uniform")


def capacity(tokens: IntLike, top_k: int, num_experts: int, capacity_factor: float) -> IntLike:
    """``C``: routes one expert accepts from ``tokens`` tokens (see module); ``capacity_factor
    <= 0`` means dropless (``C = tokens``). ``tokens`` may be symbolic (a fake impl's size)."""
    if capacity_factor <= 0:
        return tokens
    return torch.sym_min(tokens, math.ceil(capacity_factor * tokens * top_k / num_experts))


def score_dtype(logits: Tensor) -> torch.dtype:
    """Routing math runs in float32, or float64 for float64 logits (gradcheck)."""
    return torch.promote_types(logits.dtype, torch.float32)


def gate_scores(logits: Tensor, gating: str) -> Tensor:
    """Per-expert scores: softmax over experts, or elementwise sigmoid."""
    logits = logits.to(score_dtype(logits))
    return logits.softmax(-1) if gating == "softmax" else logits.sigmoid()


def route_weights(logits: Tensor, expert_ids: Tensor, gating: str, normalize: bool) -> Tensor:
    """Differentiable route weights of the chosen experts."""
    picked = gate_scores(logits, gating).gather(-1, expert_ids)
    return picked / picked.sum(-1, keepdim=True) if normalize else picked


def choose_experts(
    logits: Tensor, top_k: int, routing: str, gating: str = "softmax", bias: Tensor | None = None
) -> Tensor:
    """Expert ids (T, K): top-k of the scores (of ``gate_scores + bias`` with a selection
    bias), or the benchmark policies ``random``/``uniform``."""
    tokens, num_experts = logits.shape
    if routing == "learned":
        keys = logits if bias is None else gate_scores(logits, gating) + bias
        # A stable descending sort breaks ties towards the lower expert id, on every device.
        ranked = torch.sort(keys, dim=-1, descending=True, stable=True).indices
        return ranked[:, :top_k].contiguous()  # do not keep the (T, N) sort result alive
    if routing == "random":
        noise = torch.rand(tokens, num_experts, device=logits.device)
        return noise.argsort(-1)[:, :top_k]
    base = torch.arange(tokens, device=logits.device)[:, None] * top_k
    return (base + torch.arange(top_k, device=logits.device)) % num_experts


def assign_rows(expert_ids: Tensor, num_experts: int, cap: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rank routes per expert in token-major order; return rows, offsets, counts (see module)."""
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    order = torch.sort(flat, stable=True).indices
    starts = counts.cumsum(0) - counts
    rank_sorted = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    accepted = counts.clamp(max=cap)
    offsets = accepted.cumsum(0)
    row = offsets[flat] - accepted[flat] + rank
    rows = torch.where(rank < cap, row, -1).view_as(expert_ids)
    return rows, offsets.to(torch.int32), counts


def check_route_args(
    logits: Tensor, top_k: int, gating: str, routing: str, bias: Tensor | None = None
) -> None:
    """Raise ValueError unless top_k, gating, routing and bias are ones ``moec::route`` takes."""
    if not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"moec::route: top_k={top_k} must be in [1, {logits.shape[-1]}]")
    if gating not in GATINGS:
        raise ValueError(f"moec::route: gating={gating!r}; expected one of {GATINGS}")
    if routing not in ROUTINGS:
        raise ValueError(f"moec::route: routing={routing!r}; expected one of {ROUTINGS}")
    if bias is None:
        return
    if bias.shape != (logits.shape[-1],) or not bias.is_floating_point():
        raise ValueError(
            f"moec::route: bias of shape {tuple(bias.shape)} and dtype {bias.dtype}; expected "
            f"a floating-point vector of the {logits.shape[-1]} experts"
        )
    if routing != "learned":
        raise ValueError(f"moec::route: a bias steers learned routing only, not {routing!r}")


def route_reference(
    logits: Tensor,
    top_k: int,
    capacity_factor: float,
    gating: str,
    normalize: bool,
    routing: str,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The oracle implementation of ``moec::route`` (any device)."""
    lead, num_experts = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, num_experts)
    expert_ids = choose_experts(flat, top_k, routing, gating, bias)
    weights = route_weights(flat, expert_ids, gating, normalize)
    cap = capacity(flat.shape[0], top_k, num_experts, capacity_factor)
    rows, offsets, counts = assign_rows(expert_ids, num_experts, cap)
    out_shape = (*lead, top_k)
    return (
        expert_ids.view(out_shape),
        weights.view(out_shape),
        rows.view(out_shape),
        offsets,
        counts,
    )


def _route_triton(
    logits: Tensor,
    top_k: int,
    capacity_factor: float,
    gating: str,
    normalize: bool,
    routing: str,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The router kernels where they take the logits (float data on their device)."""
    if not float_supported(logits):
        return route_reference(logits, top_k, capacity_factor, gating, normalize, routing, bias)
    num_experts = logits.shape[-1]
    flat = logits.reshape(-1, num_experts)
    cap = capacity(flat.shape[0], top_k, num_experts, capacity_factor)
    chosen = None
    if routing != "learned" or bias is not None:
        expert_ids = choose_experts(flat, top_k, routing, gating, bias)
        chosen = expert_ids, route_weights(flat, expert_ids, gating, normalize)
    return router.route(logits, top_k, cap, gating, normalize, chosen)


IMPLEMENTATIONS = {"reference": route_reference, "triton": _route_triton}
"""``moec::route``'s implementations by name."""


@torch.library.custom_op("moec::route", mutates_args=())
def route(
    logits: Tensor,
    top_k: int,
    capacity_factor: float,
    gating: str,
    normalize: bool,
    routing: str,
    bias: Tensor | None = None,
    impl: str = "auto",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    check_route_args(logits, top_k, gating, routing, bias)
    implementation = IMPLEMENTATIONS[resolve("route", impl, logits, IMPLEMENTATIONS)]
    return implementation(logits, top_k, capacity_factor, gating, normalize, routing, bias)


@route.register_fake
def _route_fake(logits, top_k, capacity_factor, gating, normalize, routing, bias=None, impl="auto"):
    check_route_args(logits, top_k, gating, routing, bias)
    shape = (*logits.shape[:-1], top_k)
    n = logits.shape[-1]
    new = logits.new_empty
    return (
        new(shape, dtype=torch.int64),
        new(shape, dtype=score_dtype(logits)),
        new(shape, dtype=torch.int64),
        new((n,), dtype=torch.int32),
        new((n,), dtype=torch.int64),
    )


def _route_setup(ctx, inputs, output):
    logits, _, _, gating, normalize, _, _, _ = inputs
    ctx.save_for_backward(logits, output[0])
    ctx.gating, ctx.normalize = gating, normalize


def _route_backward(ctx, d_ids, d_weights, d_rows, d_offsets, d_counts):
    logits, expert_ids = ctx.saved_tensors
    with torch.enable_grad():
        leaf = logits.detach().requires_grad_(True)
        weights = route_weights(leaf, expert_ids, ctx.gating, ctx.normalize)
        (d_logits,) = torch.autograd.grad(weights, leaf, d_weights)
    return d_logits, None, None, None, None, None, None, None


route.register_autograd(_route_backward, setup_context=_route_setup)


def router_loss_terms(
    logits: Tensor, expert_ids: Tensor, top_k: int, gating: str, per_sequence: bool
) -> tuple[Tensor, Tensor]:
    """``([LBL, z-loss], P)``, differentiable w.r.t. ``logits`` [*, N] (``expert_ids`` [*, K]:
    the route's chosen experts).

    LBL: ``N * sum_e f_e * P_e`` over a group of tokens, with f_e the share of the group's
    offered routes sent to expert e and P_e the mean normalized score of e over its tokens; 1
    when balanced. The group is every token (``per_sequence`` false: the Switch/OLMoE
    instance-level loss), or each sequence, the LBL then averaged over sequences (DeepSeek's
    sequence-wise loss); sequences are dim 0 of ``logits`` when it has more than two dims, else
    the tokens are one sequence. z-loss: mean over tokens of ``logsumexp(logits)^2``. ``P``
    [N]: P_e over every token (the factor of the global-batch loss that stays local)."""
    num_experts = logits.shape[-1]
    groups = logits.shape[0] if per_sequence and logits.dim() > 2 else 1
    flat = logits.reshape(-1, num_experts).to(score_dtype(logits))
    scores = gate_scores(flat, gating)
    scores = scores / scores.sum(-1, keepdim=True)
    ids = expert_ids.reshape(groups, -1)
    counts = torch.zeros(groups, num_experts, dtype=scores.dtype, device=scores.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=scores.dtype))
    share = counts / ids.shape[1]
    group_scores = scores.view(groups, -1, num_experts).mean(1)
    lbl = num_experts * (share * group_scores).sum(-1).mean()
    z = flat.logsumexp(-1).square().mean()
    return torch.stack([lbl, z]), scores.mean(0)


def _check_losses_args(logits: Tensor, expert_ids: Tensor, top_k: int) -> None:
    if expert_ids.shape != (*logits.shape[:-1], top_k) or expert_ids.dtype != torch.int64:
        raise ValueError(
            f"moec::router_losses: expert_ids of shape {tuple(expert_ids.shape)} and dtype "
            f"{expert_ids.dtype}; expected int64 of shape {(*logits.shape[:-1], top_k)} (the "
            "route's expert ids for these logits)"
        )


@torch.library.custom_op("moec::router_losses", mutates_args=())
def router_losses(
    logits: Tensor, expert_ids: Tensor, top_k: int, gating: str, per_sequence: bool
) -> tuple[Tensor, Tensor]:
    _check_losses_args(logits, expert_ids, top_k)
    return router_loss_terms(logits, expert_ids, top_k, gating, per_sequence)


@router_losses.register_fake
def _router_losses_fake(logits, expert_ids, top_k, gating, per_sequence):
    _check_losses_args(logits, expert_ids, top_k)
    dtype = score_dtype(logits)
    return logits.new_empty((2,), dtype=dtype), logits.new_empty((logits.shape[-1],), dtype=dtype)


def _losses_setup(ctx, inputs, output):
    logits, expert_ids, top_k, gating, per_sequence = inputs
    ctx.save_for_backward(logits, expert_ids)
    ctx.top_k, ctx.gating, ctx.per_sequence = top_k, gating, per_sequence


def _losses_backward(ctx, d_terms, d_scores):
    logits, expert_ids = ctx.saved_tensors
    with torch.enable_grad():
        leaf = logits.detach().requires_grad_(True)
        outputs = router_loss_terms(leaf, expert_ids, ctx.top_k, ctx.gating, ctx.per_sequence)
        pairs = [(o, g) for o, g in zip(outputs, (d_terms, d_scores), strict=True) if g is not None]
        (d_logits,) = torch.autograd.grad(
            [o for o, _ in pairs], leaf, [g for _, g in pairs], allow_unused=True
        )
    return d_logits, None, None, None, None


router_losses.register_autograd(_losses_backward, setup_context=_losses_setup)
