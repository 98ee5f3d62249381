"""The CUDA implementations of the ``moec::`` ops on the Triton kernels of :mod:`moec.kernels`.

:func:`register_kernels` installs them over the op schemas (``torch.library``, dispatch key
CUDA) and as the backward hooks of :mod:`moec.ops.grouped`; it is idempotent, and a no-op that
returns False without Triton. Each implementation checks the op's arguments like the op does,
runs the kernel when the kernel takes the inputs, and the op's reference otherwise, so results
match the reference whatever the inputs:

- float32/16/bf16 data on the kernels' device (:func:`moec.kernels.arch.float_supported`);
- for the expert MLP (plain and gathered), int32 offsets;
- for the expert MLP and ``moec::glu``, an activation the kernels compute
  (:func:`kernel_activation`): other activations (user-registered ones, built-ins without a
  kernel code) run the reference on CUDA too;
- for ``moec::flash_attention`` (and its backward), what FlashAttention 4 takes
  (:func:`moec.kernels.flash_attention.takes`: the package installed, sm90 or sm100, bf16/fp16);
- for ``moec::rope``, x of at most :data:`moec.kernels.rope.MAX_DIMS` dimensions;
- for ``moec::quantized_expert_mlp`` (and its backward), the ``fp8_rowwise`` recipe on bf16
  data where torch has the FP8 grouped GEMM (:func:`moec.kernels.fp8_experts.takes`), no
  biases; other recipes and operands run the op's reference (which itself uses the FP8 GEMM or
  the MXFP8 kernels where they apply).

The decisions and the op-level arithmetic (capacity, the experts of the ``random`` / ``uniform``
routing policies, bias gradients) live here and in the ops; the kernels take plain tensors and
numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from moec.kernels.arch import HAVE_TRITON, float_supported
from moec.ops import grouped
from moec.ops.activations import activate, activate_backward, gated_from_unary, is_gated
from moec.ops.attention import flash_attention_backward_reference, flash_attention_reference
from moec.ops.combined_experts import (
    check_combined_args,
    expert_mlp_combined_backward_reference,
)
from moec.ops.experts import (
    check_expert_mlp_args,
    expert_mlp_backward_reference,
    expert_mlp_reference,
)
from moec.ops.gathered_experts import (
    by_row,
    check_gathered_args,
    expert_mlp_gathered_backward_reference,
    expert_mlp_gathered_reference,
    row_sources,
)
from moec.ops.movement import combine_reference, dispatch_reference
from moec.ops.quantized import (
    check_quantized_mlp_args,
    quantized_expert_mlp_backward_reference,
    quantized_expert_mlp_reference,
)
from moec.ops.rope import rotate
from moec.ops.routing import (
    capacity,
    check_route_args,
    choose_experts,
    route_reference,
    route_weights,
)

if HAVE_TRITON:
    from moec.kernels import (
        cross_entropy,
        cute_loss,
        experts,
        fp8_experts,
        grouped_gemm,
        movement,
        router,
    )
    from moec.kernels import flash_attention as fa4
    from moec.kernels import rope as rope_kernel
    from moec.kernels.activation import (
        UNARY_CODES,
        KernelActivation,
        act_forward,
        act_gradient,
    )


def kernel_activation(activation: str) -> KernelActivation | None:
    """The kernels' form of ``activation`` (a name of :mod:`moec.ops.activations`): the code of
    its unary function and whether it is gated; None when no kernel computes it."""
    gated = is_gated(activation)
    for unary, code in UNARY_CODES.items():
        if (gated_from_unary(unary) if gated else unary) == activation:
            return KernelActivation(code, gated)
    return None


# --- forward implementations of the ops --------------------------------------------------------


def route(
    logits: Tensor,
    top_k: int,
    capacity_factor: float,
    gating: str,
    normalize: bool,
    routing: str,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``moec::route``: the router kernels rank the routes (and choose them when learned
    without a selection bias; a biased choice is made in torch, like the benchmark policies)."""
    check_route_args(logits, top_k, gating, routing, bias)
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


def dispatch(x: Tensor, rows: Tensor) -> Tensor:
    """``moec::dispatch``."""
    if float_supported(x, rows):
        return movement.dispatch(x, rows)
    return dispatch_reference(x, rows)


def combine(y: Tensor, weights: Tensor, rows: Tensor) -> Tensor:
    """``moec::combine``."""
    if float_supported(y, weights, rows):
        return movement.combine(y, weights, rows)
    return combine_reference(y, weights, rows)


def _expert_kernel_activation(
    x: Tensor, w_up: Tensor, w_down: Tensor, offsets: Tensor, activation: str
) -> KernelActivation | None:
    """The kernels' activation where they run this expert MLP (float data on their device,
    int32 offsets, an activation with a kernel code), else None: the reference runs."""
    act = kernel_activation(activation)
    if act is None or not float_supported(x, w_up, w_down, offsets) or offsets.dtype != torch.int32:
        return None
    return act


def expert_mlp(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    b_up: Tensor | None,
    b_down: Tensor | None,
    activation: str,
) -> tuple[Tensor, Tensor]:
    """``moec::expert_mlp``: (y, h)."""
    check_expert_mlp_args(x, w_up, w_down, offsets, activation)
    act = _expert_kernel_activation(x, w_up, w_down, offsets, activation)
    if act is None:
        return expert_mlp_reference(x, w_up, w_down, offsets, b_up, b_down, activation)
    return experts.expert_mlp(x, w_up, w_down, offsets, b_up, b_down, act)


def expert_mlp_gathered(
    x: Tensor,
    rows: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    b_up: Tensor | None,
    b_down: Tensor | None,
    activation: str,
) -> tuple[Tensor, Tensor]:
    """``moec::expert_mlp_gathered``: (y, h), the up projection reading token rows where it
    runs on the CuTe DSL (:func:`moec.kernels.experts.expert_mlp` given the rows' sources)."""
    check_gathered_args(x, rows, w_up, w_down, offsets, activation)
    args = (x, rows, w_up, w_down, offsets, b_up, b_down)
    act = _expert_kernel_activation(x, w_up, w_down, offsets, activation)
    if act is None:
        return expert_mlp_gathered_reference(*args, activation)
    flat = x.reshape(-1, x.shape[-1])
    return experts.expert_mlp(flat, *args[2:], act, row_sources(rows))


def expert_mlp_combined(
    x: Tensor,
    rows: Tensor,
    weights: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    activation: str,
) -> tuple[Tensor, Tensor]:
    """``moec::expert_mlp_combined``: (out, h), the gathered expert MLP then the combine kernel."""
    check_combined_args(x, rows, weights, w_up, w_down, offsets, activation)
    y, h = expert_mlp_gathered(x, rows, w_up, w_down, offsets, None, None, activation)
    return combine(y, weights, rows), h


def _fp8_kernel_activation(
    x: Tensor, w_up: Tensor, w_down: Tensor, offsets: Tensor, activation: str, recipe: str
) -> KernelActivation | None:
    """The kernels' activation where the FP8 rowwise kernels run this quantized expert MLP
    (:func:`moec.kernels.fp8_experts.takes`), else None: the reference runs."""
    if recipe != "fp8_rowwise" or not fp8_experts.takes(x, w_up, w_down, offsets):
        return None
    return kernel_activation(activation)


def quantized_expert_mlp(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    b_up: Tensor | None,
    b_down: Tensor | None,
    activation: str,
    recipe: str,
) -> tuple[Tensor, Tensor]:
    """``moec::quantized_expert_mlp``: (y, h); biases run the reference."""
    check_quantized_mlp_args(x, w_up, w_down, offsets, activation, recipe)
    args = (x, w_up, w_down, offsets)
    act = _fp8_kernel_activation(*args, activation, recipe)
    if act is None or b_up is not None or b_down is not None:
        return quantized_expert_mlp_reference(*args, b_up, b_down, activation, recipe)
    return fp8_experts.expert_mlp(*args, act)


def quantized_expert_mlp_backward(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_y: Tensor,
    activation: str,
    recipe: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``moec::quantized_expert_mlp_backward``: (d_x, d_w_up, d_w_down, d_h); h is laid out
    the same by either forward, so the kernels take any h of the operands they take."""
    check_quantized_mlp_args(x, w_up, w_down, offsets, activation, recipe)
    args = (x, w_up, w_down, offsets, h, d_y)
    act = _fp8_kernel_activation(x, w_up, w_down, offsets, activation, recipe)
    if act is None:
        return quantized_expert_mlp_backward_reference(*args, activation, recipe)
    return fp8_experts.expert_mlp_backward(*args, act)


_OPS: dict[str, Callable[..., Any]] = {
    "route": route,
    "dispatch": dispatch,
    "combine": combine,
    "expert_mlp": expert_mlp,
    "expert_mlp_gathered": expert_mlp_gathered,
    "expert_mlp_combined": expert_mlp_combined,
    "quantized_expert_mlp": quantized_expert_mlp,
    "quantized_expert_mlp_backward": quantized_expert_mlp_backward,
}
"""The CUDA implementations by op name (``moec::<name>``)."""


# --- hooks: what the ops' Python bodies and backwards call on CUDA tensors ---------------------


def expert_mlp_backward(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_y: Tensor,
    activation: str,
    up_bias: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d_x, d_w_up, d_w_down, d_h) of ``moec::expert_mlp`` (``up_bias``: the forward had b_up)."""
    act = kernel_activation(activation)
    if act is None:
        return expert_mlp_backward_reference(x, w_up, w_down, offsets, h, d_y, activation)
    return experts.expert_mlp_backward(x, w_up, w_down, offsets, h, d_y, act, up_bias)


def expert_mlp_gathered_backward(
    x: Tensor,
    rows: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_y: Tensor,
    activation: str,
    up_bias: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d_rows, d_w_up, d_w_down, d_h) of ``moec::expert_mlp_gathered`` (x [T, D]); the
    reference where the forward ran it (its h is laid out as the reference's)."""
    act = _expert_kernel_activation(x, w_up, w_down, offsets, activation)
    if act is None:
        return expert_mlp_gathered_backward_reference(
            x, rows, w_up, w_down, offsets, h, d_y, activation
        )
    sources = row_sources(rows)
    return experts.expert_mlp_gathered_backward(
        x, sources, w_up, w_down, offsets, h, d_y, act, up_bias
    )


def expert_mlp_combined_backward(
    x: Tensor,
    rows: Tensor,
    weights: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_out: Tensor,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d_rows, d_weights, d_w_up, d_w_down, d_h) of ``moec::expert_mlp_combined``; the
    reference where the forward ran it."""
    act = _expert_kernel_activation(x, w_up, w_down, offsets, activation)
    if act is None:
        return expert_mlp_combined_backward_reference(
            x, rows, weights, w_up, w_down, offsets, h, d_out, activation
        )
    row_weights = by_row(weights.float(), rows)
    d_rows, d_row_weights, d_w_up, d_w_down, d_h = experts.expert_mlp_combined_backward(
        x.reshape(-1, x.shape[-1]),
        row_sources(rows),
        row_weights,
        w_up,
        w_down,
        offsets,
        h,
        d_out.reshape(-1, d_out.shape[-1]),
        act,
    )
    d_weights = torch.where(rows >= 0, d_row_weights[rows.clamp(min=0).long()], 0.0)
    return d_rows, d_weights, d_w_up, d_w_down, d_h


def glu_forward(h: Tensor, activation: str) -> Tensor:
    """The gated activation of h (R, 2H) -> (R, H)."""
    act = kernel_activation(activation)
    if act is None:
        return activate(h, activation)
    return act_forward(h, act)


def glu_backward(h: Tensor, d_a: Tensor, activation: str) -> Tensor:
    """d_h (R, 2H) of the gated activation at h for the output gradient d_a (R, H)."""
    act = kernel_activation(activation)
    if act is None:
        return activate_backward(h, d_a, activation)
    return act_gradient(h, d_a, act)


def flash_attention(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """``moec::flash_attention`` on FA4 where it takes the inputs, else the reference."""
    if not fa4.takes(q, k, v, is_causal):
        return flash_attention_reference(q, k, v, is_causal, scale)
    return fa4.forward(q, k, v, is_causal, scale)


def flash_attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    d_out: Tensor,
    is_causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``moec::flash_attention``'s backward on FA4 where it takes the inputs."""
    if not fa4.takes(q, k, v, is_causal):
        return flash_attention_backward_reference(q, k, v, out, lse, d_out, is_causal, scale)
    return fa4.backward(q, k, v, out, lse, d_out, is_causal, scale)


def rope(x: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype, backward: bool) -> Tensor:
    """``moec::rope``'s rotation (or its transpose when ``backward``) in ``dtype``."""
    if x.dim() > rope_kernel.MAX_DIMS:
        return rotate(x, cos, sin, backward).to(dtype)
    return rope_kernel.rope(x, cos, sin, dtype, backward)


def _gmm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    return grouped_gemm.gmm(x, w, offsets, piece="dgrad" if w.stride(-1) != 1 else "down")


def _dispatch_backward(d_buffer: Tensor, rows: Tensor) -> Tensor:
    return movement.combine(d_buffer, None, rows)


def _hooks() -> dict[str, Callable[..., Any]]:
    """The hooks by the names the ops look them up with (:func:`moec.ops.grouped.cuda_kernel`)."""
    return {
        "gmm": _gmm,
        "gmm_wgrad": grouped_gemm.gmm_wgrad,
        "dispatch_backward": _dispatch_backward,
        "combine_backward": movement.combine_backward,
        "expert_mlp_backward": expert_mlp_backward,
        "expert_mlp_gathered_backward": expert_mlp_gathered_backward,
        "expert_mlp_combined_backward": expert_mlp_combined_backward,
        "cross_entropy_rows": cross_entropy.cross_entropy_rows,
        "fused_linear_cross_entropy": cute_loss.linear_cross_entropy,
        "rope": rope,
        "glu_forward": glu_forward,
        "glu_backward": glu_backward,
        "flash_attention": flash_attention,
        "flash_attention_backward": flash_attention_backward,
    }


@functools.cache
def register_kernels() -> bool:
    """Register the CUDA implementations (once); returns whether they are active (Triton
    importable)."""
    if not HAVE_TRITON:
        return False
    for name, implementation in _OPS.items():
        torch.library.register_kernel(f"moec::{name}", "cuda")(implementation)
    grouped.register_cuda_kernels(_hooks())
    return True
