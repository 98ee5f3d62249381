"""The expert MLP on the kernels: fused up projection + activation, down projection, and the
backward with the activation's gradient fused into the down projection's dgrad.

forward:  h, a = gmm_act(x, w_up)          (R, U), (R, H)
          y    = gmm(a, w_down)            (R, D)
backward: d_h, a = gmm_act_backward(d_y, w_down, h)      d_a = d_y @ w_down^T, then act'
          d_w_down = a^T d_y,  d_w_up = x^T d_h  (gmm_wgrad, written in the weights' dtype)
          d_x = d_h @ w_up^T

Inputs the kernels take: float32/16/bf16 x, int32 offsets, an activation with a kernel code.
The backward returns d_h, from which the caller reduces the bias gradients.

Gathered (:func:`expert_mlp` given ``sources``, :func:`expert_mlp_gathered_backward`): x is the
token rows [T, D] and buffer row r is ``x[sources[r]]``. Where the policy runs the up projection on
the CuTe DSL (``"cute"``/``"cute_glu"`` for a buffer of R = len(sources) rows), its GEMM and its
wgrad read the token rows through quack's ``A_idx`` and the buffer is never written; on any
other backend the buffer is gathered (one ``index_select``) and the plain functions run, the
backward gathering it again rather than keeping it.
"""

from __future__ import annotations

from torch import Tensor

from moec.kernels import cute_gemm
from moec.kernels import grouped_gemm as gg
from moec.kernels.activation import KernelActivation
from moec.kernels.gemm_backend import backend


def expert_mlp(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    b_up: Tensor | None,
    b_down: Tensor | None,
    act: KernelActivation,
    sources: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(y, h): the expert MLP's output and pre-activation; weights cast to x's dtype.
    ``sources``: x is token rows, buffer row r is ``x[sources[r]]`` (see module)."""
    x = x.contiguous()
    h, a = gg.gmm_act(x, w_up.to(x.dtype), offsets, b_up, act, sources)
    y = gg.gmm(a, w_down.to(x.dtype), offsets, b_down, piece="down")
    return y, h


def expert_mlp_backward(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_y: Tensor,
    act: KernelActivation,
    up_bias: bool = False,
    sources: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d_x, d_w_up, d_w_down, d_h) for the output gradient d_y; weight gradients in the
    weights' dtype. ``up_bias``: the forward had an up-projection bias (it decides, with the
    operands, how the forward laid out a gated h: :func:`grouped_gemm.h_interleaved`); d_h is
    returned in ``[gate | up]`` order unless h was interleaved, which never has a bias.
    ``sources``: x is the token rows of a gathered forward (buffer row r = ``x[sources[r]]``,
    see the module) whose up projection read them through ``A_idx``; d_x is then per buffer row."""
    d_y = d_y.to(x.dtype).contiguous()
    w_up_x = w_up.to(x.dtype)  # what the forward's GEMM read
    rows = x if sources is None else gg.buffer_like(x, sources)
    interleaved = gg.h_interleaved(rows, w_up_x, up_bias, act)
    d_h, a = gg.gmm_act_backward(d_y, w_down.to(x.dtype), offsets, h, act, interleaved)
    d_w_down = _wgrad_like(a, d_y, offsets, w_down)
    if interleaved and cute_gemm.k_major(w_up_x):  # pairs read in place (see cute_gemm)
        d_w_up = _up_wgrad(x, sources, d_h, offsets, w_up, paired=True)
        d_x = cute_gemm.gmm(d_h, w_up_x.transpose(-1, -2), offsets, paired_k=True)
        return d_x, d_w_up, d_w_down, d_h
    if interleaved:
        d_w_up = cute_gemm.deinterleave(_up_wgrad(x, sources, d_h, offsets, w_up_x), w_up.dtype)
        w_up_x = cute_gemm.interleave(w_up_x, x.dtype)
    else:
        d_w_up = _up_wgrad(x, sources, d_h, offsets, w_up)
    d_x = gg.gmm(d_h, w_up_x.transpose(-1, -2), offsets, piece="dgrad")
    return d_x, d_w_up, d_w_down, d_h


def _up_wgrad(
    x: Tensor,
    sources: Tensor | None,
    d_h: Tensor,
    offsets: Tensor,
    like: Tensor,
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
        return _wgrad_like(x, d_h, offsets, like)
    if backend("wgrad", gg.buffer_like(x, sources), d_h) == "cute":
        return cute_gemm.gmm_wgrad(x, d_h, offsets, out_dtype, sources)
    return gg.gmm_wgrad(x.index_select(0, sources), d_h, offsets, out_dtype=out_dtype)


def _wgrad_like(x: Tensor, dy: Tensor, offsets: Tensor, like: Tensor) -> Tensor:
    """``x_e^T dy_e`` per expert in ``like``'s dtype, and for a :func:`cute_gemm.k_major`
    ``like`` in its layout: computed as ``(dy_e^T x_e)^T``, which no transposing copy follows."""
    if cute_gemm.k_major(like):
        return gg.gmm_wgrad(dy, x, offsets, out_dtype=like.dtype).transpose(-1, -2)
    return gg.gmm_wgrad(x, dy, offsets, out_dtype=like.dtype)


def expert_mlp_gathered_backward(
    x: Tensor,
    sources: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_y: Tensor,
    act: KernelActivation,
    up_bias: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d_rows [R, D], d_w_up, d_w_down, d_h) of :func:`expert_mlp` given ``sources``: as on the
    buffer, which is gathered again unless the forward read the token rows; the caller sums
    d_rows over each token's routes."""
    x = x.contiguous()
    if gg.reads_token_rows(x, sources, w_up.to(x.dtype), up_bias, act):
        return expert_mlp_backward(x, w_up, w_down, offsets, h, d_y, act, up_bias, sources)
    buffer = x.index_select(0, sources)
    return expert_mlp_backward(buffer, w_up, w_down, offsets, h, d_y, act, up_bias)
