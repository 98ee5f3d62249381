"""The expert MLP on the kernels: fused up projection + activation, down projection, and the
backward with the activation's gradient fused into the down projection's dgrad.

forward:  h, a = gmm_act(x, w_up)          (R, U), (R, H)
          y    = gmm(a, w_down)            (R, D)
backward: d_h, a = gmm_act_backward(d_y, w_down, h)      d_a = d_y @ w_down^T, then act'
          d_w_down = a^T d_y,  d_w_up = x^T d_h  (gmm_wgrad, written in the weights' dtype)
          d_x = d_h @ w_up^T

Inputs the kernels take: float32/16/bf16 x, int32 offsets, an activation with a kernel code.
The backward returns d_h, from which the caller reduces the bias gradients.

Every function takes the MLP's :class:`ExpertOperands`. Gathered (:func:`expert_mlp` given
``sources``, the forward of the combined MLP): x is the
token rows [T, D] and buffer row r is ``x[sources[r]]``. Where the policy runs the up projection on
the CuTe DSL (``"cute"``/``"cute_glu"`` for a buffer of R = len(sources) rows), its GEMM and its
wgrad read the token rows through quack's ``A_idx`` and the buffer is never written; on any
other backend the buffer is gathered (one ``index_select``) and the plain functions run.

Combined (:func:`expert_mlp_combined_backward`): the gathered expert MLP whose output rows a
combine weighs and sums per token. On the CuTe DSL its backward reads the output gradient's
token rows in the down dgrad (``A_idx``), applies the route weight there and reduces the
weight's gradient in the same epilogue, so neither the rows' output gradient d_y nor the
forward's y exist.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from moec.kernels import cute_gemm
from moec.kernels import grouped_gemm as gg
from moec.kernels.activation import KernelActivation
from moec.kernels.gemm_backend import GemmPolicy, backend


class ExpertOperands(NamedTuple):
    """What every expert MLP of the kernels (here and :mod:`moec.kernels.fp8_experts`) takes:
    the rows ``x`` [R, D] (or the token rows a gathered call reads), the weights ``w_up``
    [N, D, U] and ``w_down`` [N, H, D] (any float dtype, read in x's) and the int32 ``offsets``
    [N] that end each expert's rows."""

    x: Tensor
    w_up: Tensor
    w_down: Tensor
    offsets: Tensor


def expert_mlp(
    operands: ExpertOperands,
    b_up: Tensor | None,
    b_down: Tensor | None,
    act: KernelActivation,
    policy: GemmPolicy,
    sources: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(y, h): the expert MLP's output and pre-activation; weights cast to x's dtype; every
    function here runs its GEMMs on the backends ``policy`` picks.
    ``sources``: x is token rows, buffer row r is ``x[sources[r]]`` (see module)."""
    x, w_up, w_down, offsets = operands
    x = x.contiguous()
    h, a = gg.gmm_act(x, w_up.to(x.dtype), offsets, b_up, act, sources, policy)
    y = gg.gmm(a, w_down.to(x.dtype), offsets, b_down, "down", policy)
    return y, h


def expert_mlp_backward(
    operands: ExpertOperands,
    h: Tensor,
    d_y: Tensor,
    act: KernelActivation,
    policy: GemmPolicy,
    up_bias: bool = False,
    sources: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d_x, d_w_up, d_w_down, d_h) for the output gradient d_y; weight gradients in the
    weights' dtype. ``up_bias``: the forward had an up-projection bias (it decides, with the
    operands, how the forward laid out a gated h: :func:`grouped_gemm.h_interleaved`); d_h is
    returned in ``[gate | up]`` order unless h was interleaved, which never has a bias.
    ``sources``: x is the token rows of a gathered forward (buffer row r = ``x[sources[r]]``,
    see the module) whose up projection read them through ``A_idx``; d_x is then per buffer row."""
    x, w_up, w_down, offsets = operands
    d_y = d_y.to(x.dtype).contiguous()
    w_up_x = w_up.to(x.dtype)  # what the forward's GEMM read
    rows = x if sources is None else gg.buffer_like(x, sources)
    interleaved = gg.h_interleaved(rows, w_up_x, up_bias, act, policy)
    d_h, a = gg.gmm_act_backward(d_y, w_down.to(x.dtype), offsets, h, act, interleaved, policy)
    d_w_down = _wgrad_like(a, d_y, offsets, w_down, policy)
    d_x, d_w_up = _up_backward(x, sources, w_up, offsets, d_h, interleaved, policy)
    return d_x, d_w_up, d_w_down, d_h


def _up_backward(
    x: Tensor,
    sources: Tensor | None,
    w_up: Tensor,
    offsets: Tensor,
    d_h: Tensor,
    interleaved: bool,
    policy: GemmPolicy,
) -> tuple[Tensor, Tensor]:
    """(d_x per buffer row, d_w_up) of the up projection, given d_h in the layout the forward's
    h had (``interleaved``: see :func:`grouped_gemm.h_interleaved`)."""
    w_up_x = w_up.to(x.dtype)
    if interleaved and cute_gemm.k_major(w_up_x):  # pairs read in place (see cute_gemm)
        d_w_up = _up_wgrad(x, sources, d_h, offsets, w_up, policy, paired=True)
        return cute_gemm.gmm(d_h, w_up_x.transpose(-1, -2), offsets, paired_k=True), d_w_up
    if interleaved:
        wgrad = _up_wgrad(x, sources, d_h, offsets, w_up_x, policy)
        d_w_up = cute_gemm.deinterleave(wgrad, w_up.dtype)
        w_up_x = cute_gemm.interleave(w_up_x, x.dtype)
    else:
        d_w_up = _up_wgrad(x, sources, d_h, offsets, w_up, policy)
    return gg.gmm(d_h, w_up_x.transpose(-1, -2), offsets, None, "dgrad", policy), d_w_up


def _up_wgrad(
    x: Tensor,
    sources: Tensor | None,
    d_h: Tensor,
    offsets: Tensor,
    like: Tensor,
    policy: GemmPolicy,
    paired: bool = False,
) -> Tensor:
    """The up projection's weight gradient in ``like``'s dtype: of the buffer x (in ``like``'s
    layout, :func:`_wgrad_like`), or of the token rows x through ``sources`` (quack's varlen-K
    with ``A_idx`` where the policy runs the wgrad on the CuTe DSL, else on the gathered buffer).
    ``paired``: d_h is interleaved and the gradient is written k-major in ``[gate | up]`` order,
    on the CuTe DSL whatever the policy (no other kernel reads pairs; quack runs, as it ran the
    up projection)."""
    out_dtype = like.dtype
    if paired:
        return cute_gemm.gmm_wgrad(x, d_h, offsets, out_dtype, sources, paired_out=True)
    if sources is None:
        return _wgrad_like(x, d_h, offsets, like, policy)
    if backend("wgrad", gg.buffer_like(x, sources), d_h, policy) == "cute":
        return cute_gemm.gmm_wgrad(x, d_h, offsets, out_dtype, sources)
    return gg.gmm_wgrad(x.index_select(0, sources), d_h, offsets, out_dtype, policy)


def expert_mlp_combined_backward(
    operands: ExpertOperands,
    sources: Tensor,
    row_weights: Tensor,
    h: Tensor,
    d_out: Tensor,
    act: KernelActivation,
    policy: GemmPolicy,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d_rows [R, D], d_row_weights [R] float32, d_w_up, d_w_down, d_h) of the gathered expert
    MLP (no biases; x token rows [T, D], buffer row r = ``x[sources[r]]``) followed by the
    combine ``out[t] = sum of row_weights[r] * y[r]`` over t's rows, for d_out [T, D].

    Where the down dgrad runs in a CuTe DSL epilogue
    (:func:`grouped_gemm.dact_in_cute_epilogue`), it reads d_out's token rows through
    ``A_idx`` with the route weight as its row scale and reduces the weight's gradient
    (:func:`cute_gemm.gmm_act_backward_combined`): no [R, D] d_y is written, and y need not
    have been kept. Elsewhere d_y is gathered and scaled, and y recomputed from h for the
    weights' gradient. d_rows is per buffer row; the caller sums it over each token's routes."""
    x, w_up, w_down, offsets = operands
    d_out = d_out.to(x.dtype).contiguous()
    w_up_x, w_down_x = w_up.to(x.dtype), w_down.to(x.dtype)
    reads_tokens = gg.reads_token_rows(x, sources, w_up_x, False, act, policy)
    up_sources = sources if reads_tokens else None
    rows = gg.buffer_like(x, sources)
    interleaved = gg.h_interleaved(rows, w_up_x, False, act, policy)
    if gg.dact_in_cute_epilogue(rows, w_down_x, act, interleaved, policy):
        d_h, a_w, d_row_weights = cute_gemm.gmm_act_backward_combined(
            d_out, w_down_x, offsets, h, act, sources, row_weights
        )
        d_w_down = _down_wgrad_of_token_rows(a_w, d_out, sources, offsets, w_down, policy)
    else:
        picked = d_out.index_select(0, sources)
        d_y = (picked * row_weights[:, None]).to(x.dtype)
        d_h, a = gg.gmm_act_backward(d_y, w_down_x, offsets, h, act, interleaved, policy)
        y = gg.gmm(a, w_down_x, offsets, None, "down", policy)
        d_row_weights = (y.float() * picked.float()).sum(-1)
        d_w_down = _wgrad_like(a, d_y, offsets, w_down, policy)
    x_up = x if up_sources is not None else x.index_select(0, sources)
    d_rows, d_w_up = _up_backward(x_up, up_sources, w_up, offsets, d_h, interleaved, policy)
    return d_rows, d_row_weights, d_w_up, d_w_down, d_h


def _down_wgrad_of_token_rows(
    a_w: Tensor, d_out: Tensor, sources: Tensor, offsets: Tensor, like: Tensor, policy: GemmPolicy
) -> Tensor:
    """``sum over e's rows r of a_w[r]^T d_out[sources[r]]`` per expert, in ``like``'s dtype and
    layout: for a k-major ``like`` on the CuTe DSL, ``(d_out[sources]^T a_w)^T`` with the token
    rows read through ``A_idx`` and written in place; else on the gathered rows."""
    on_cute = backend("wgrad", gg.buffer_like(d_out, sources), a_w, policy) == "cute"
    if cute_gemm.k_major(like) and on_cute:
        return cute_gemm.gmm_wgrad(d_out, a_w, offsets, like.dtype, sources).transpose(-1, -2)
    return _wgrad_like(a_w, d_out.index_select(0, sources), offsets, like, policy)


def _wgrad_like(x: Tensor, dy: Tensor, offsets: Tensor, like: Tensor, policy: GemmPolicy) -> Tensor:
    """``x_e^T dy_e`` per expert in ``like``'s dtype, and for a :func:`cute_gemm.k_major`
    ``like`` in its layout: computed as ``(dy_e^T x_e)^T``, which no transposing copy follows."""
    if cute_gemm.k_major(like):
        return gg.gmm_wgrad(dy, x, offsets, like.dtype, policy).transpose(-1, -2)
    return gg.gmm_wgrad(x, dy, offsets, like.dtype, policy)
