"""The CUDA implementations :func:`moec.kernels.register` installs: argument checks of the ops,
the kernel when it takes the inputs, the reference otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from moec.kernels import experts, grouped_gemm, movement, router
from moec.kernels.arch import float_supported
from moec.ops.experts import _check as _check_expert_mlp
from moec.ops.movement import combine_reference, dispatch_reference
from moec.ops.routing import _check_route_args, route_reference


def route(
    logits: Tensor, top_k: int, capacity_factor: float, gating: str, normalize: bool, routing: str
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_route_args(logits, top_k, gating, routing)
    if float_supported(logits):
        return router.route(logits, top_k, capacity_factor, gating, normalize, routing)
    return route_reference(logits, top_k, capacity_factor, gating, normalize, routing)


def dispatch(x: Tensor, rows: Tensor) -> Tensor:
    if float_supported(x, rows):
        return movement.dispatch(x, rows)
    return dispatch_reference(x, rows)


def combine(y: Tensor, weights: Tensor, rows: Tensor) -> Tensor:
    if float_supported(y, weights, rows):
        return movement.combine(y, weights, rows)
    return combine_reference(y, weights, rows)


def expert_mlp(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    b_up: Tensor | None,
    b_down: Tensor | None,
    activation: str,
) -> tuple[Tensor, Tensor]:
    _check_expert_mlp(x, w_up, w_down, offsets, activation)
    return experts.expert_mlp(x, w_up, w_down, offsets, b_up, b_down, activation)


def _dispatch_backward(d_buffer: Tensor, rows: Tensor) -> Tensor:
    return movement.combine(d_buffer, None, rows)


def _gmm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    return grouped_gemm.gmm(x, w, offsets, piece="dgrad" if w.stride(-1) != 1 else "down")


BACKWARD_HOOKS: dict[str, Callable[..., Any]] = {
    "gmm": _gmm,
    "gmm_wgrad": grouped_gemm.gmm_wgrad,
    "dispatch_backward": _dispatch_backward,
    "combine_backward": movement.combine_backward,
    "expert_mlp_backward": experts.expert_mlp_backward,
}
"""Kernels the ops' Python backwards (and :mod:`moec.ops.grouped`) call on CUDA tensors."""

__all__ = ["BACKWARD_HOOKS", "combine", "dispatch", "expert_mlp", "route"]
