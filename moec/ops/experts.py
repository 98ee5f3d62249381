"""``moec::expert_mlp``: every routed expert's MLP in one op, by recipe.

expert_mlp(x, w_up[N, D, U], w_down[N, H, D], offsets[N] int32, b_up[N, U]?, b_down[N, D]?,
           activation, recipe="bf16", rows[*, K]?=None, weights[*, K]?=None, impl="auto")
    -> (y, h[R, U])

Plain (``rows`` None): x [R, D] is the expert-major buffer, rows ``[offsets[e-1], offsets[e])``
of it belong to expert e (see ``moec::route``)::

    h = x @ w_up[e] + b_up[e]            # U = 2H for gated activations ([gate | up]), else H
    y = act(h) @ w_down[e] + b_down[e]   # y [R, D]

Combine inside (``rows`` and ``weights``, no biases): x [*, D] holds the tokens, ``rows`` their
routes' buffer rows and ``weights`` the route weights (``moec::route``); the op equals
``moec::combine(expert_mlp(moec::dispatch(x, rows), ...)[0], weights, rows)``, y [*, D],
R = T*K. The [R, D] buffer need not exist (the CuTe DSL reads the token rows through a row
index), and the backward applies the route weights, and reduces their gradient, where the down
projection's dgrad reads the rows: the experts' output rows are not kept for backward and their
gradient is never written (pass :mod:`moec.passes.combine_experts` emits this form).

``recipe``: ``bf16`` (the GEMMs in x's dtype), ``mxfp8`` or ``fp8_rowwise`` (the GEMMs
quantized as :mod:`moec.ops.quantized` says; the weights stay high-precision masters).
``impl``: which implementation of :data:`IMPLEMENTATIONS` runs, bound by pass ``bind`` for the
program's :class:`~moec.kernels.target.Target`; ``auto`` (a direct call) is
``Target.detect(x.device).expert_impl(recipe)``. Every implementation computes the reference's
values (up to summation order and, for the quantized recipes, the kernels' rounding); one that
does not take some operands (an activation without a kernel code, float64) runs the reference
GEMMs for them.

``h`` is returned so autograd can keep the pre-activation instead of recomputing the first GEMM;
the graph never reads it, and only this op's backward does, so its column order is the
implementation's (the CuTe DSL kernels interleave a gated h's gate and up columns in pairs).
Weights may be float32 masters while x is bf16: they are cast to x's dtype and their gradients
come back in their own dtype and layout (``torch.empty_like``'s strides: a k-major weight gets
a k-major gradient). Rows past ``offsets[-1]`` are garbage in, garbage out, and contribute
nothing to any gradient. The backward's GEMMs are the internal op::

    expert_mlp_backward(x, w_up, w_down, offsets, h, d_y, activation, up_bias, recipe, rows?,
                        weights?, impl)
        -> (d_rows[R, D], d_w_up, d_w_down, d_h[R, U], d_weights (weights' shape, else [0]))

so AOTAutograd traces them as one opaque call; ``d_x`` is ``d_rows`` (plain) or
``moec::dispatch_backward(d_rows, rows)``, and the bias gradients, row sums of d_h and d_y,
stay plain torch in the autograd formula.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor

from moec.kernels.arch import HAVE_TRITON, float_supported
from moec.kernels.gemm_backend import GemmPolicy
from moec.ops.activations import (
    activate,
    activate_backward,
    check_activation,
    is_gated,
    kernel_activation,
)
from moec.ops.binding import detected
from moec.ops.grouped import (
    add_row_bias,
    by_row,
    gather_rows,
    gmm,
    gmm_wgrad,
    row_bias_grad,
    row_experts,
    row_sources,
)
from moec.ops.movement import combine_backward_reference, combine_reference
from moec.ops.quantized import RECIPES, quantized_gmm, quantized_gmm_wgrad

if HAVE_TRITON:
    from moec.kernels import experts as kernel_experts
    from moec.kernels import fp8_experts
    from moec.kernels import grouped_gemm as kernel_gemm
    from moec.kernels import movement as kernel_movement

OP = "moec::expert_mlp"
EXPERT_RECIPES = ("bf16", *RECIPES)


# --- arguments ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExpertCall:
    """One call's operands and settings (see the module for their meaning)."""

    x: Tensor
    w_up: Tensor
    w_down: Tensor
    offsets: Tensor
    b_up: Tensor | None
    b_down: Tensor | None
    activation: str
    recipe: str
    rows: Tensor | None
    weights: Tensor | None

    def buffer(self) -> Tensor:
        """The expert-major row buffer [R, D] (gathered from the tokens when combining)."""
        return self.x if self.rows is None else gather_rows(self.x, self.rows)


def check_expert_mlp_args(call: ExpertCall) -> None:
    """Raise ValueError unless the arguments fit the op (see module), naming the argument."""
    check_activation(call.activation)
    if call.recipe not in EXPERT_RECIPES:
        raise ValueError(f"{OP}: recipe {call.recipe!r}; known: {EXPERT_RECIPES}")
    w_up, w_down, offsets = call.w_up, call.w_down, call.offsets
    if w_up.dim() != 3 or w_down.dim() != 3 or offsets.dim() != 1:
        raise ValueError(
            f"{OP}: w_up {tuple(w_up.shape)}, w_down {tuple(w_down.shape)}, offsets "
            f"{tuple(offsets.shape)}: expected w_up [N, D, U], w_down [N, H, D], offsets [N]"
        )
    n, d, u = w_up.shape
    hidden = u // 2 if is_gated(call.activation) else u
    if call.x.shape[-1] != d or w_down.shape != (n, hidden, d) or offsets.shape != (n,):
        raise ValueError(
            f"{OP}: shapes do not fit: x {tuple(call.x.shape)}, w_up {tuple(w_up.shape)}, "
            f"w_down {tuple(w_down.shape)}, offsets {tuple(offsets.shape)} for "
            f"{call.activation!r} (expected w_down ({n}, {hidden}, {d}) and offsets ({n},))"
        )
    if call.rows is not None or call.weights is not None:
        _check_combine_args(call)


def _check_combine_args(call: ExpertCall) -> None:
    x, rows, weights = call.x, call.rows, call.weights
    if rows is None or weights is None:
        raise ValueError(f"{OP}: rows and weights come together (the combine inside), or neither")
    if call.b_up is not None or call.b_down is not None:
        raise ValueError(f"{OP}: the combine inside (rows, weights) takes no biases b_up, b_down")
    if x.dim() < 1 or rows.dim() < 1 or x.shape[:-1] != rows.shape[:-1]:
        raise ValueError(
            f"{OP}: x {tuple(x.shape)} and rows {tuple(rows.shape)} must share their leading "
            "dims (x [*, D], rows [*, K])"
        )
    if rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{OP}: rows must be int32 or int64 buffer rows, got {rows.dtype}")
    if weights.shape != rows.shape or not weights.is_floating_point():
        raise ValueError(
            f"{OP}: weights {tuple(weights.shape)} {weights.dtype} must be floating point, one "
            f"per route: rows' shape {tuple(rows.shape)}"
        )


def routed_rows(call: ExpertCall):
    """R, the buffer's rows: x's (plain) or T*K (a SymInt while tracing with dynamic shapes)."""
    return call.x.shape[0] if call.rows is None else math.prod(call.rows.shape)


# --- the GEMMs an implementation composes the MLP of -------------------------------------------


@dataclasses.dataclass(frozen=True)
class Gemms:
    """``mm(a, b, offsets, forward)``: ``out[r] = a[r] @ b[e(r)]`` in a's dtype (``forward``: a
    forward GEMM, which a quantized recipe may accumulate fast); ``wgrad(a, b, offsets, like)``:
    ``a_e^T b_e`` per expert in ``like``'s dtype."""

    mm: Callable[[Tensor, Tensor, Tensor, bool], Tensor]
    wgrad: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def reference_gemms(recipe: str, loop: bool = False) -> Gemms:
    """The pure-PyTorch GEMMs (``torch._grouped_mm`` where it takes the operands unless
    ``loop``; a low-precision recipe fake-quantized)."""
    if recipe == "bf16":
        return Gemms(
            lambda a, b, offsets, forward: gmm(a, b, offsets, loop),
            lambda a, b, offsets, like: gmm_wgrad(a, b, offsets, loop).to(like.dtype),
        )
    return _quantized_gemms(recipe, "reference")


def _quantized_gemms(recipe: str, path: str) -> Gemms:
    return Gemms(
        lambda a, b, offsets, forward: quantized_gmm(a, b, offsets, recipe, path, forward),
        lambda a, b, offsets, like: quantized_gmm_wgrad(a, b, offsets, recipe, path).to(like.dtype),
    )


def _kernel_gemms(policy: GemmPolicy, x: Tensor) -> Gemms:
    """moec's grouped-GEMM kernels on ``policy`` where they take x (float data on their
    device), else the reference GEMMs."""
    if not float_supported(x):
        return reference_gemms("bf16")

    def mm(a: Tensor, b: Tensor, offsets: Tensor, forward: bool) -> Tensor:
        piece = "dgrad" if b.stride(-1) != 1 else "down"
        return kernel_gemm.gmm(a, b, offsets, None, piece, policy)

    return Gemms(mm, lambda a, b, offsets, like: kernel_gemm.gmm_wgrad(a, b, offsets, None, policy))


def composed_forward(call: ExpertCall, gemms: Gemms) -> tuple[Tensor, Tensor]:
    """(y, h) of the MLP GEMM by GEMM, the activation and biases in torch."""
    x = call.buffer()
    experts = row_experts(call.offsets, x.shape[0])
    h = gemms.mm(x, call.w_up.to(x.dtype), call.offsets, True)
    if call.b_up is not None:
        h = add_row_bias(h, call.b_up, experts)
    y = gemms.mm(activate(h, call.activation), call.w_down.to(x.dtype), call.offsets, True)
    if call.b_down is not None:
        y = add_row_bias(y, call.b_down, experts)
    if call.rows is not None:
        y = combine_reference(y, call.weights, call.rows)
    return y, h


def composed_backward(
    call: ExpertCall, h: Tensor, d_y: Tensor, gemms: Gemms
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward GEMM by GEMM (no bias gradients; see the module's internal op): a combine
    inside recomputes the rows' output from h for the weights' gradient."""
    x = call.buffer()
    d_weights = x.new_empty(0)
    act = activate(h, call.activation)
    w_up, w_down = call.w_up.to(x.dtype), call.w_down.to(x.dtype)
    if call.rows is not None:
        y = gemms.mm(act, w_down, call.offsets, True)
        d_y, d_weights = combine_backward_reference(y, call.weights, call.rows, d_y)
    d_y = d_y.to(x.dtype)
    d_w_down = gemms.wgrad(act, d_y, call.offsets, call.w_down)
    d_act = gemms.mm(d_y, w_down.transpose(-1, -2), call.offsets, False)
    d_h = activate_backward(h, d_act, call.activation).to(x.dtype)
    d_w_up = gemms.wgrad(x, d_h, call.offsets, call.w_up)
    d_x = gemms.mm(d_h, w_up.transpose(-1, -2), call.offsets, False)
    return d_x, d_w_up, d_w_down, d_h, d_weights


# --- the implementations -----------------------------------------------------------------------

Forward = Callable[[ExpertCall, str], tuple[Tensor, Tensor]]
Backward = Callable[[ExpertCall, Tensor, Tensor, bool, str], tuple[Tensor, ...]]


def _reference_forward(call: ExpertCall, option: str) -> tuple[Tensor, Tensor]:
    return composed_forward(call, reference_gemms(call.recipe, loop=option == "loop"))


def _reference_backward(call, h, d_y, up_bias, option):
    return composed_backward(call, h, d_y, reference_gemms(call.recipe, loop=option == "loop"))


def _kernels_takes(call: ExpertCall):
    """The kernels' activation where they run this bf16-recipe call (float data on their
    device, int32 offsets, an activation with a kernel code), else None."""
    act = kernel_activation(call.activation)
    operands = (call.x, call.w_up, call.w_down, call.offsets)
    if act is None or not float_supported(*operands) or call.offsets.dtype != torch.int32:
        return None
    return act


def _kernels_forward(call: ExpertCall, spec: str) -> tuple[Tensor, Tensor]:
    """``kernels:<policy>``: bf16 on moec's kernels (:mod:`moec.kernels.experts`) with the
    grouped-GEMM policy ``spec`` (:meth:`GemmPolicy.parse`); a low-precision recipe on the
    MXFP8 Triton kernels (emulated MMA off sm100)."""
    policy = GemmPolicy.parse(spec) if spec else GemmPolicy(quack=False)
    if call.recipe != "bf16":
        return composed_forward(call, _quantized_gemms(call.recipe, "kernels"))
    act = _kernels_takes(call)
    if act is None:
        return composed_forward(call, _kernel_gemms(policy, call.x))
    operands, args = _kernel_operands(call), (call.b_up, call.b_down, act, policy)
    if call.rows is None:
        return kernel_experts.expert_mlp(operands, *args)
    y, h = kernel_experts.expert_mlp(operands, *args, row_sources(call.rows))
    return kernel_movement.combine(y, call.weights, call.rows), h


def _kernels_backward(call, h, d_y, up_bias, spec):
    policy = GemmPolicy.parse(spec) if spec else GemmPolicy(quack=False)
    if call.recipe != "bf16":
        return composed_backward(call, h, d_y, _quantized_gemms(call.recipe, "kernels"))
    act = _kernels_takes(call)
    if act is None:
        return composed_backward(call, h, d_y, _kernel_gemms(policy, call.x))
    operands = _kernel_operands(call)
    if call.rows is None:
        grads = kernel_experts.expert_mlp_backward(operands, h, d_y, act, policy, up_bias)
        return (*grads, call.x.new_empty(0))
    rows = call.rows
    d_rows, d_row_weights, d_w_up, d_w_down, d_h = kernel_experts.expert_mlp_combined_backward(
        operands,
        row_sources(rows),
        by_row(call.weights.float(), rows),
        h,
        d_y.reshape(-1, d_y.shape[-1]),
        act,
        policy,
    )
    d_weights = torch.where(rows >= 0, d_row_weights[rows.clamp(min=0).long()], 0.0)
    return d_rows, d_w_up, d_w_down, d_h, d_weights


def _kernel_operands(call: ExpertCall):
    """The call's :class:`moec.kernels.experts.ExpertOperands` (a combined call's x as token
    rows [T, D])."""
    x = call.x if call.rows is None else call.x.reshape(-1, call.x.shape[-1])
    return kernel_experts.ExpertOperands(x, call.w_up, call.w_down, call.offsets)


def _native_takes(call: ExpertCall):
    """The kernels' activation where the fp8_rowwise kernels of :mod:`moec.kernels.fp8_experts`
    run the whole MLP (plain, no biases, operands they take), else None."""
    if call.rows is not None or call.b_up is not None or call.b_down is not None:
        return None
    if not fp8_experts.takes(_kernel_operands(call)):
        return None
    return kernel_activation(call.activation)


def _native_forward(call: ExpertCall, option: str) -> tuple[Tensor, Tensor]:
    """``native``: the recipe on the arch's own kernels (fp8_rowwise: sm90's FP8 grouped GEMM,
    the activation fused into the down projection's quantizer; the GEMMs one by one where the
    fused kernels do not take the operands)."""
    act = _native_takes(call)
    if act is None:
        return composed_forward(call, _quantized_gemms(call.recipe, "native"))
    return fp8_experts.expert_mlp(_kernel_operands(call), act)


def _native_backward(call, h, d_y, up_bias, option):
    act = _native_takes(call)  # h is laid out the same by either forward
    if act is None:
        return composed_backward(call, h, d_y, _quantized_gemms(call.recipe, "native"))
    grads = fp8_experts.expert_mlp_backward(_kernel_operands(call), h, d_y, act)
    return (*grads, call.x.new_empty(0))


IMPLEMENTATIONS: dict[str, tuple[Forward, Backward]] = {
    "reference": (_reference_forward, _reference_backward),
    "loop": (_reference_forward, _reference_backward),
    "kernels": (_kernels_forward, _kernels_backward),
    "native": (_native_forward, _native_backward),
}
"""The implementations by name (an ``impl`` is ``name`` or ``name:option``): ``reference``
(pure PyTorch), ``loop`` (the same with a masked loop for every GEMM, tests' second oracle),
``kernels:<policy>`` (moec's kernels; :meth:`GemmPolicy.spec`), ``native`` (a low-precision
recipe on the arch's own kernels). :meth:`moec.kernels.target.Target.expert_impl` binds one."""


def implementation(call: ExpertCall, impl: str) -> tuple[Forward, Backward, str]:
    """(forward, backward, option) of ``impl`` (``auto``: detected for x's device)."""
    if impl == "auto":
        impl = detected(call.x.device).expert_impl(call.recipe)
    name, _, option = impl.partition(":")
    if name not in IMPLEMENTATIONS or (not HAVE_TRITON and name in ("kernels", "native")):
        raise ValueError(f"{OP}: impl {impl!r}; known: 'auto', {sorted(IMPLEMENTATIONS)}")
    return (*IMPLEMENTATIONS[name], name if name == "loop" else option)


# --- the op ------------------------------------------------------------------------------------


@torch.library.custom_op("moec::expert_mlp", mutates_args=())
def expert_mlp(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    b_up: Tensor | None,
    b_down: Tensor | None,
    activation: str,
    recipe: str = "bf16",
    rows: Tensor | None = None,
    weights: Tensor | None = None,
    impl: str = "auto",
) -> tuple[Tensor, Tensor]:
    call = ExpertCall(x, w_up, w_down, offsets, b_up, b_down, activation, recipe, rows, weights)
    check_expert_mlp_args(call)
    forward, _, option = implementation(call, impl)
    y, h = forward(call, option)
    return y.contiguous(), h.contiguous()


@expert_mlp.register_fake
def _expert_mlp_fake(
    x, w_up, w_down, offsets, b_up, b_down, activation, recipe="bf16", rows=None, weights=None,
    impl="auto",
):  # fmt: skip
    call = ExpertCall(x, w_up, w_down, offsets, b_up, b_down, activation, recipe, rows, weights)
    check_expert_mlp_args(call)
    return x.new_empty(x.shape), x.new_empty((routed_rows(call), w_up.shape[-1]))


def h_saved_only(ctx, h: Tensor) -> None:
    """The op returns its pre-activation h only for its backward to save: h takes no gradient
    (a use of it elsewhere would get none rather than a silently dropped one), and autograd
    hands the backward None for it instead of filling an (R, U) buffer with zeros."""
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)


def _setup(ctx, inputs, output):
    x, w_up, w_down, offsets, b_up, b_down, activation, recipe, rows, weights, impl = inputs
    ctx.save_for_backward(x, w_up, w_down, offsets, output[1], rows, weights)
    h_saved_only(ctx, output[1])
    ctx.settings = activation, recipe, impl
    ctx.bias_dtypes = (
        None if b_up is None else b_up.dtype,
        None if b_down is None else b_down.dtype,
    )


def bias_grads(
    d_h: Tensor,
    d_y: Tensor,
    offsets: Tensor,
    bias_dtypes: tuple[torch.dtype | None, torch.dtype | None],
) -> tuple[Tensor | None, Tensor | None]:
    """(d_b_up, d_b_down): the per-expert row sums of d_h and d_y in the biases' dtypes (None
    for a missing bias)."""
    up_dtype, down_dtype = bias_dtypes
    if up_dtype is None and down_dtype is None:
        return None, None
    experts = row_experts(offsets, d_h.shape[0])
    num_experts = offsets.shape[0]
    d_b_up = None if up_dtype is None else row_bias_grad(d_h, experts, num_experts).to(up_dtype)
    d_b_down = (
        None if down_dtype is None else row_bias_grad(d_y, experts, num_experts).to(down_dtype)
    )
    return d_b_up, d_b_down


@torch.library.custom_op("moec::expert_mlp_backward", mutates_args=())
def expert_mlp_backward(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_y: Tensor,
    activation: str,
    up_bias: bool,
    recipe: str = "bf16",
    rows: Tensor | None = None,
    weights: Tensor | None = None,
    impl: str = "auto",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    call = ExpertCall(x, w_up, w_down, offsets, None, None, activation, recipe, rows, weights)
    check_expert_mlp_args(call)
    _, backward, option = implementation(call, impl)
    # the kernels' h layout depends on whether the up projection had a bias
    d_x, d_w_up, d_w_down, d_h, d_weights = backward(call, h, d_y.to(x.dtype), up_bias, option)
    if weights is not None:
        d_weights = d_weights.to(weights.dtype)
    return (
        d_x.contiguous(),
        in_layout_of(d_w_up, w_up),
        in_layout_of(d_w_down, w_down),
        d_h.contiguous(),
        d_weights.contiguous(),
    )


def in_layout_of(t: Tensor, like: Tensor) -> Tensor:
    """``t`` in ``like``'s dtype with the strides ``torch.empty_like(like)`` has (a copy only
    where they differ)."""
    t = t.to(like.dtype)
    if t.stride() == torch.empty_like(like, device="meta").stride():
        return t
    return torch.empty_like(like).copy_(t)


@expert_mlp_backward.register_fake
def _expert_mlp_backward_fake(
    x, w_up, w_down, offsets, h, d_y, activation, up_bias, recipe="bf16", rows=None,
    weights=None, impl="auto",
):  # fmt: skip
    call = ExpertCall(x, w_up, w_down, offsets, None, None, activation, recipe, rows, weights)
    check_expert_mlp_args(call)
    return (
        x.new_empty((h.shape[0], x.shape[-1])),
        torch.empty_like(w_up),
        torch.empty_like(w_down),
        x.new_empty(h.shape),
        x.new_empty(0) if weights is None else weights.new_empty(weights.shape),
    )


def movement_impl(impl: str) -> str:
    """The ``moec::dispatch`` implementation that goes with the expert MLP's ``impl``."""
    name = impl.partition(":")[0]
    if name in ("kernels", "native"):
        return "triton"
    return "reference" if name in ("reference", "loop") else "auto"


def _backward(ctx, d_y, d_h_unused):
    if d_y is None:  # y was not used (h takes no gradient): no gradient flows
        return (None,) * 11
    x, w_up, w_down, offsets, h, rows, weights = ctx.saved_tensors
    activation, recipe, impl = ctx.settings
    d_y = d_y.to(x.dtype)
    up_bias = ctx.bias_dtypes[0] is not None
    d_rows, d_w_up, d_w_down, d_h, d_weights = torch.ops.moec.expert_mlp_backward(
        x, w_up, w_down, offsets, h, d_y, activation, up_bias, recipe, rows, weights, impl
    )
    if rows is None:
        d_x, d_weights = d_rows, None
    else:
        d_x = torch.ops.moec.dispatch_backward(d_rows, rows, movement_impl(impl)).view(x.shape)
    d_b_up, d_b_down = bias_grads(d_h, d_y, offsets, ctx.bias_dtypes)
    return d_x, d_w_up, d_w_down, None, d_b_up, d_b_down, None, None, None, d_weights, None


expert_mlp.register_autograd(_backward, setup_context=_setup)
