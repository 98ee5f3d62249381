"""Expert GEMMs on the CuTe DSL (cutlass-python) through quack-kernels: the ``"cute"`` backend.

The same pieces as :mod:`moec.kernels.grouped_gemm`, over an expert-major buffer whose rows
``[offsets[e-1], offsets[e])`` belong to expert e (``offsets`` int32 on the device, turned into
quack's ``cu_seqlens = [0, offsets...]`` without a host read)::

    gmm(x[R, K], w[N, K, M], offsets) -> out[R, M]                      varlen-M
    gmm_act(x[R, D], w_up[N, D, U], offsets, act) -> h[R, U], a[R, H]   activation in the epilogue
    gmm_act_backward(d_y[R, D], w_down[N, H, D], offsets, h, act) -> d_h[R, U], a[R, H]
        d_a = d_y @ w_down[e]^T with the activation's backward in the epilogue (quack gemm_dact)
    gmm_act_backward_combined(d_out[T, D], w_down, offsets, h, act, sources, row_weights)
        -> d_h, row_weights * a, d_row_weights[R]: the same for rows a combine weighs, reading
        d_out's token rows, with the route weight and its gradient in the epilogue
    gmm_wgrad(x[R, K], dy[R, M], offsets, out_dtype) -> dw[N, K, M]      varlen-K

Gathered: ``gmm``, ``gmm_act`` and ``gmm_wgrad`` given ``sources[R]`` (int32 on the device)
read buffer row ``r`` as token row ``x[sources[r]]`` of x [T, D] (quack's ``A_idx``: varlen-M
indexing A's rows; varlen-K indexing the columns of the m-major ``A = x^T``, which quack's
varlen-K requires), so the dispatched buffer is never written.

Rows past ``offsets[-1]`` are neither read into a valid result nor written (garbage stays
garbage); empty experts get zero weight gradients.

Gated layout (the ``"cute_glu"`` backend): quack's gated epilogues pair column ``2j`` (gate) with
``2j + 1`` (up), while moec stores ``w_up`` as ``[gate | up]`` with the contraction dim outermost,
a layout quack's ``concat_layout`` cannot relabel. :func:`interleave` reorders ``w_up``'s columns
in the same copy that casts it to the compute dtype, so a gated ``h`` and ``d_h`` from
:func:`gmm_act` / :func:`gmm_act_backward` are interleaved; :func:`deinterleave` turns a gradient
of the interleaved weight back, again in its dtype cast. Only the expert MLP's backward reads
``h``, and it knows the layout from :func:`moec.kernels.grouped_gemm.h_interleaved`. The plain
``"cute"`` backend runs a gated activation on moec's activation kernel instead and keeps
``[gate | up]``.

A :func:`k_major` ``w_up`` (the contraction dim unit-stride: stacked ``nn.Linear`` weights,
``(N, U, D)`` in memory, as SonicMoE keeps them) needs none of those copies: its ``[gate | up]``
dim is the strided one, which quack's ``concat_layout`` reads as pairs, in the up projection
(``B``), the up projection's dgrad (``B`` of ``w_up^T``, pairs along the contraction) and its
wgrad (``out``, written k-major like the weight).

quack compiles each kernel on first use (and autotunes it unless ``MOEC_AUTOTUNE=0``; the first
steps of a run then take minutes); after that a call launches without reading the device. quack
is optional (``pip install moec[cutlass]``): without it
:class:`moec.kernels.target.Target` has ``quack`` off and the policy never picks this backend,
whose module imports quack only when a kernel runs.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from moec.kernels.activation import UNARY_CODES, KernelActivation


@functools.cache
def _quack():
    """quack's GEMM interface, imported on first use (it loads the CuTe DSL's compiler), with
    the shipped autotuning records in moec's quack cache (``tuning.seed_quack_cache``)."""
    from quack import gemm_interface

    from moec.kernels.tuning import seed_quack_cache

    seed_quack_cache()
    return gemm_interface


_QUACK_NAMES: dict[KernelActivation, str] = {
    KernelActivation(UNARY_CODES["silu"], False): "silu",
    KernelActivation(UNARY_CODES["silu"], True): "swiglu",
    KernelActivation(UNARY_CODES["relu"], False): "relu",
    KernelActivation(UNARY_CODES["relu"], True): "reglu",
    KernelActivation(UNARY_CODES["gelu_tanh"], False): "gelu_tanh_approx",
    KernelActivation(UNARY_CODES["gelu_tanh"], True): "geglu",
}
"""moec's kernel activations that quack's epilogues compute, by quack's name (its ``geglu`` is
the tanh form; the erf GELU has no quack epilogue, so ``gelu``/``geglu`` run elsewhere)."""


def _tuned() -> bool:
    return os.environ.get("MOEC_AUTOTUNE", "1") != "0"


def computes(act: KernelActivation) -> bool:
    """Whether quack's epilogues compute ``act`` (the operands' side is
    :func:`moec.kernels.gemm_backend.cute_ready`)."""
    return act in _QUACK_NAMES


def cu_seqlens(offsets: Tensor) -> Tensor:
    """quack's cumulative row offsets ``[0, offsets...]`` (int32, on the device)."""
    return torch.cat([offsets.new_zeros(1), offsets])


def interleave(w_up: Tensor, dtype: torch.dtype) -> Tensor:
    """``[gate | up]`` columns of ``w_up`` (N, D, 2H) -> ``[g0, u0, g1, u1, ...]`` in ``dtype``,
    one copy."""
    n, d, width = w_up.shape
    out = torch.empty(n, d, width // 2, 2, dtype=dtype, device=w_up.device)
    out.copy_(w_up.unflatten(-1, (2, width // 2)).transpose(-1, -2))
    return out.view(n, d, width)


def deinterleave(w: Tensor, dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`interleave`: interleaved columns -> ``[gate | up]`` in ``dtype``."""
    n, d, width = w.shape
    out = torch.empty(n, d, 2, width // 2, dtype=dtype, device=w.device)
    out.copy_(w.unflatten(-1, (width // 2, 2)).transpose(-1, -2))
    return out.view(n, d, width)


def k_major(w: Tensor) -> bool:
    """Whether ``w`` (N, K, M) is dense with its contraction dim K unit-stride ((N, M, K) in
    memory)."""
    return w.dim() == 3 and w.stride(-2) == 1 and w.stride(-1) == w.shape[-2]


def _rows(x: Tensor, sources: Tensor | None) -> int:
    return x.shape[0] if sources is None else sources.shape[0]


def gmm(
    x: Tensor,
    w: Tensor,
    offsets: Tensor,
    sources: Tensor | None = None,
    paired_k: bool = False,
) -> Tensor:
    """``out[r] = x[r] @ w[e(r)]`` (gathered: ``x[sources[r]]``); ``w`` may be a transposed
    view. ``paired_k``: x's columns are interleaved gate/up pairs and ``w``'s contraction dim
    (strided) is ``[gate | up]``: the dgrad of a gated up projection of a :func:`k_major`
    ``w_up``, given ``w_up^T``."""
    out = x.new_empty(_rows(x, sources), w.shape[-1])
    if out.shape[0] == 0:
        return out
    _quack().gemm(
        x.contiguous() if sources is not None else x,
        w.to(x.dtype),
        out=out,
        cu_seqlens_m=cu_seqlens(offsets),
        A_idx=sources,
        tuned=_tuned(),
        **({"concat_layout": ("B",)} if paired_k else {}),
    )
    return out


def gmm_act(
    x: Tensor,
    w_up: Tensor,
    offsets: Tensor,
    act: KernelActivation,
    sources: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(h, a): the up projection with the activation in the epilogue (gathered: on rows
    ``x[sources[r]]``); ``w_up`` ``[gate | up]``, ``h`` interleaved when ``act`` is gated (see
    module: a :func:`k_major` ``w_up`` is read as it is, any other interleaved in a copy)."""
    paired = act.gated and k_major(w_up)
    w = interleave(w_up, x.dtype) if act.gated and not paired else w_up.to(x.dtype)
    return _quack().gemm_act(
        x.contiguous() if sources is not None else x,
        w,
        activation=_QUACK_NAMES[act],
        cu_seqlens_m=cu_seqlens(offsets),
        A_idx=sources,
        store_preact=True,
        tuned=_tuned(),
        concat_layout=("B",) if paired else None,
    )


def gmm_act_backward(
    d_y: Tensor, w_down: Tensor, offsets: Tensor, h: Tensor, act: KernelActivation
) -> tuple[Tensor, Tensor]:
    """(d_h, a): ``d_a = d_y @ w_down[e]^T`` then the activation's backward at ``h`` (interleaved
    when gated, as :func:`gmm_act` wrote it), with ``a`` recomputed for the wgrad."""
    d_h, a = _dact(d_y, w_down, offsets, h, act)
    return d_h, a


def gmm_act_backward_combined(
    d_out: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    act: KernelActivation,
    sources: Tensor,
    row_weights: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """(d_h, a_w, d_row_weights): :func:`gmm_act_backward` of rows the combine weighs
    (``out[t] = sum of row_weights[r] * y[r]`` over t's rows), without their ``d_y``: buffer row
    r reads the output gradient's token row ``d_out[sources[r]]`` (``A_idx``), the epilogue
    scales ``d_a`` by ``row_weights[r]`` (float32) before the activation's backward and writes
    ``a_w = row_weights[r] * a`` (what the down wgrad pairs with the unscaled token rows), and
    reduces ``d_row_weights[r] = <a[r], d_out[sources[r]] @ w_down^T> = <y[r], d_out[t]>``
    (float32): the route weight's gradient."""
    return _dact(
        d_out, w_down, offsets, h, act, A_idx=sources, colvec_scale=row_weights, colvec_reduce=True
    )


def _dact(
    d_y: Tensor, w_down: Tensor, offsets: Tensor, h: Tensor, act: KernelActivation, **epilogue
) -> tuple[Tensor, ...]:
    return _quack().gemm_dact(
        d_y,
        w_down.to(d_y.dtype).transpose(-1, -2),
        h,
        activation=_QUACK_NAMES[act],
        cu_seqlens_m=cu_seqlens(offsets),
        tuned=_tuned(),
        **epilogue,
    )


def gmm_wgrad(
    x: Tensor,
    dy: Tensor,
    offsets: Tensor,
    out_dtype: torch.dtype,
    sources: Tensor | None = None,
    paired_out: bool = False,
) -> Tensor:
    """``dw[e] = x_e^T @ dy_e`` (N, K, M) in ``out_dtype`` (gathered: x_e's rows are
    ``x[sources[r]]`` for e's rows r), accumulated in float32 and written once; empty experts
    get 0. quack's varlen-K takes A m-major: ``x.t()`` of a contiguous x. ``paired_out``: dy's
    columns are interleaved gate/up pairs, and dw is written :func:`k_major` in ``[gate | up]``
    order (the wgrad of a gated up projection of a k-major ``w_up``)."""
    num_experts, depth, width = offsets.shape[0], x.shape[1], dy.shape[1]
    shape = (num_experts, width, depth) if paired_out else (num_experts, depth, width)
    dw = torch.empty(shape, dtype=out_dtype, device=x.device)
    if paired_out:
        dw = dw.transpose(-1, -2)
    if dw.numel() == 0:
        return dw
    _quack().gemm(
        x.contiguous().t(),
        dy.contiguous(),
        out=dw,
        cu_seqlens_k=cu_seqlens(offsets),
        A_idx=sources,
        tuned=_tuned(),
        **({"concat_layout": ("out",)} if paired_out else {}),
    )
    return dw
