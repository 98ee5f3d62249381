"""Grouped GEMMs over an expert-major row buffer, with activation epilogues; sync-free.

Rows ``[offsets[e-1], offsets[e])`` of the buffer belong to expert e; rows past ``offsets[-1]``
are garbage (never read into a valid result, never written). ``offsets`` stays on the device.

gmm(x[R, K], w[N, K, M], offsets, bias[N, M]?) -> out[R, M]          out[r] = x[r] @ w[e(r)] + b
gmm_act(x[R, D], w_up[N, D, U], offsets, bias?, act) -> h[R, U], a[R, H]
    h = x @ w_up[e] + b, a = act(h) (gated: act(h[:, :H]) * h[:, H:]) fused in the epilogue; a
    gated tile keeps two accumulators (gate columns n and up columns n + H) so a is formed in
    registers.
gmm_act_backward(d_y[R, D], w_down[N, H, D], offsets, h, act) -> d_h[R, U], a[R, H]
    d_a = d_y @ w_down[e]^T with the activation's backward (and the recomputed a) in the epilogue.
gmm_wgrad(x[R, K], dy[R, M], offsets) -> dw[N, K, M]                 dw[e] = x_e^T @ dy_e

Tiling: the forward kernels run a static grid of ``(cdiv(R, BLOCK_M) + N) * cdiv(M, BLOCK_N)``
programs; each derives (expert, row tile) from the device offsets (a cumsum of per-expert tile
counts) and surplus programs exit. The wgrad kernel runs one program per (expert, K tile, M
tile) and loops over that expert's rows. Pointer loads are software-pipelined by Triton (wgmma
on sm90, tcgen05 on sm100+); the configs per arch are in :func:`configs`.

Which implementation runs a piece is :func:`moec.kernels.gemm_backend.backend`'s choice: these
pointer kernels, the persistent TMA kernel of :mod:`moec.kernels.grouped_tma` (same epilogues),
or ``torch._grouped_mm`` (CUTLASS) with the activation forward/backward run by
:mod:`moec.kernels.activation`.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from moec.kernels import cute_gemm, grouped_tma, tuning
from moec.kernels.activation import KernelActivation, act_backward, act_forward
from moec.kernels.arch import arch
from moec.kernels.gemm_backend import GemmPolicy, KernelBackend, backend, detected_policy
from moec.kernels.gemm_tiles import (
    EPILOGUE_ACT,
    EPILOGUE_ACT_BACKWARD,
    EPILOGUE_PLAIN,
    epilogue,
    expert_table,
    expert_tile,
)


@triton.jit
def _gmm_kernel(
    # pointers
    x_ptr,  # (R, K)
    w_ptr,  # (N, K, W) any strides; W = 2 * N_OUT for a gated EPILOGUE_ACT, else N_OUT
    bias_ptr,  # (N, W), read when HAS_BIAS
    h_ptr,  # (R, U): written by EPILOGUE_ACT, read by EPILOGUE_ACT_BACKWARD
    out_ptr,  # (R, N_OUT): the product, or a = act(h)
    d_h_ptr,  # (R, U): written by EPILOGUE_ACT_BACKWARD
    offsets_ptr,  # (N,) int32
    # sizes
    R,  # buffer rows: only an autotune key (a few rows per expert want other tiles)
    K,
    N_OUT,
    # strides
    stride_xr,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wn,
    stride_be,
    stride_hr,
    stride_or,
    # meta-parameters
    NUM_EXPERTS: tl.constexpr,
    E_P2: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: unmasked loads
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    starts, ends, tiles, cum = expert_table(offsets_ptr, NUM_EXPERTS, E_P2, BLOCK_M)
    expert, row0, end = expert_tile(starts, ends, tiles, cum, pid_m, E_P2, BLOCK_M)
    if expert >= NUM_EXPERTS:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    rows_in = tl.minimum(rows, end - 1).to(tl.int64)  # tail rows re-read the last one
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_in = cols % N_OUT
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_in[:, None] * stride_xr + ks[None, :] * stride_xk
    w_ptrs = (
        w_ptr
        + expert.to(tl.int64) * stride_we
        + ks[:, None] * stride_wk
        + cols_in[None, :] * stride_wn
    )
    two = GATED and EPILOGUE == 1
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_ok = ks < K - k0
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if two:
            if EVEN_K:
                b_up = tl.load(w_ptrs + N_OUT * stride_wn)
            else:
                b_up = tl.load(w_ptrs + N_OUT * stride_wn, mask=k_ok[:, None], other=0.0)
            if IEEE:
                acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, b_up, acc_up)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    mask = (rows < end)[:, None] & (cols < N_OUT)[None, :]
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        bias_ptrs = bias_ptr + expert.to(tl.int64) * stride_be + cols_in
        acc += tl.load(bias_ptrs).to(dtype).to(tl.float32)[None, :]
        if two:
            acc_up += tl.load(bias_ptrs + N_OUT).to(dtype).to(tl.float32)[None, :]
    epilogue(
        acc, acc_up, rows, cols, mask, h_ptr, out_ptr, d_h_ptr, stride_hr, stride_or, N_OUT,
        EPILOGUE, ACT, GATED,
    )  # fmt: skip


@triton.jit
def _gmm_wgrad_kernel(
    # pointers
    x_ptr,  # (R, K)
    dy_ptr,  # (R, M)
    dw_ptr,  # (N, K, M) contiguous, any float dtype
    offsets_ptr,  # (N,) int32
    # sizes
    R,  # buffer rows: only an autotune key
    K,
    M,
    # strides
    stride_xr,
    stride_dyr,
    # meta-parameters
    IEEE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles_m = tl.cdiv(M, BLOCK_N)
    expert = pid // (tiles_k * tiles_m)
    rest = pid % (tiles_k * tiles_m)
    kk = (rest // tiles_m) * BLOCK_K + tl.arange(0, BLOCK_K)
    mm = (rest % tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0)
    end = tl.load(offsets_ptr + expert)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    rs = tl.arange(0, BLOCK_R)
    for r0 in range(start, end, BLOCK_R):
        r = (r0 + rs).to(tl.int64)
        r_ok = r < end
        a = tl.load(
            x_ptr + r[None, :] * stride_xr + (kk % K)[:, None], mask=r_ok[None, :], other=0.0
        )
        b = tl.load(
            dy_ptr + r[:, None] * stride_dyr + (mm % M)[None, :], mask=r_ok[:, None], other=0.0
        )
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    dw_ptrs = dw_ptr + expert.to(tl.int64) * K * M + kk[:, None] * M + mm[None, :]
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=(kk < K)[:, None] & (mm < M)[None, :])


def _config(bm: int, bn: int, bk: int, stages: int, warps: int, **kw: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **kw}, num_stages=stages, num_warps=warps
    )


def configs(kind: str, family: str) -> list[triton.Config]:
    """Autotune candidates: kind "gmm" (one accumulator), "gmm2" (gated, two), "wgrad"."""
    if family == "interpreter":
        if kind == "wgrad":
            return [triton.Config({"BLOCK_K": 32, "BLOCK_N": 32, "BLOCK_R": 32})]
        return [_config(32, 32, 32, 1, 4)]
    big = family == "sm100"
    # the last candidates of each kind have few rows per tile, for the weight-bandwidth-bound
    # buffers of a few rows per expert these kernels run on (below
    # the 1024-row rule of gemm_backend.GEMM_BACKENDS)
    if kind == "gmm":
        return [
            _config(128, 256 if big else 128, 64, 4, 8),
            _config(128, 256, 64, 3, 8),
            _config(128, 256, 64, 4, 8),
            _config(64, 128, 64, 4, 4),
            _config(16, 64, 256, 4, 4),
            _config(32, 128, 128, 4, 4),
        ]
    if kind == "gmm2":
        return [
            _config(128, 128, 64, 3, 8),
            _config(64, 128, 64, 4, 4),
            _config(16, 64, 128, 4, 4),
        ]
    return [
        triton.Config({"BLOCK_K": 128, "BLOCK_N": 128, "BLOCK_R": 64}, num_stages=4, num_warps=8),
        triton.Config({"BLOCK_K": 128, "BLOCK_N": 256, "BLOCK_R": 64}, num_stages=3, num_warps=8),
        triton.Config({"BLOCK_K": 64, "BLOCK_N": 128, "BLOCK_R": 16}, num_stages=2, num_warps=4),
    ]


@functools.cache
def _tuned(kind: str, family: str) -> tuning.TableFirst:
    """The autotuned kernel, the shipped tile table consulted first (:mod:`.tuning`);
    ``MOEC_AUTOTUNE=0`` keeps only the first config (tests, CI)."""
    kernel = _gmm_wgrad_kernel if kind == "wgrad" else _gmm_kernel
    key = ["R", "K", "M"] if kind == "wgrad" else ["R", "K", "N_OUT", "EPILOGUE", "NUM_EXPERTS"]
    candidates = configs(kind, family)
    if os.environ.get("MOEC_AUTOTUNE", "1") == "0":
        candidates = candidates[:1]
    if kind != "wgrad":
        kernel = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})(kernel)
    tuned = triton.autotune(configs=candidates, key=key, cache_results=True)(kernel)
    return tuning.TableFirst(f"grouped_gemm.{kind}", tuned)


def _check_operands(x: Tensor, w: Tensor, offsets: Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or w.shape[1] != x.shape[1] or offsets.shape != w.shape[:1]:
        raise ValueError(
            f"gmm: x {tuple(x.shape)}, w {tuple(w.shape)}, offsets {tuple(offsets.shape)}: "
            "expected x (R, K), w (N, K, M), offsets (N,)"
        )
    if offsets.dtype != torch.int32:
        raise ValueError(f"gmm: offsets must be int32, got {offsets.dtype}")


def _launch_gmm(
    chosen: KernelBackend,
    x: Tensor,
    w: Tensor,
    offsets: Tensor,
    bias: Tensor | None,
    out: Tensor,
    h: Tensor | None,
    d_h: Tensor | None,
    epilogue: int,
    act: KernelActivation | None,
) -> None:
    """Run the pointer kernels, or the TMA kernel when ``chosen`` says so (no bias there);
    ``act`` is read by the activation epilogues only."""
    _check_operands(x, w, offsets)
    rows, depth = x.shape
    n_out = out.shape[1]
    if rows == 0 or n_out == 0:
        return
    if chosen == "tma":
        grouped_tma.launch_gmm(x, w, offsets, out, h, d_h, epilogue, act)
        return
    num_experts = w.shape[0]
    code, gated = act if act is not None else (0, False)
    kind = "gmm2" if gated and epilogue == EPILOGUE_ACT else "gmm"
    kernel = _tuned(kind, arch(x.device))
    aux = h if h is not None else out

    def grid(meta: dict) -> tuple[int]:
        return (
            (triton.cdiv(rows, meta["BLOCK_M"]) + num_experts)
            * triton.cdiv(n_out, meta["BLOCK_N"]),
        )

    kernel[grid](
        x, w, bias if bias is not None else w, aux, out, d_h if d_h is not None else aux, offsets,
        rows, depth, n_out,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        bias.stride(0) if bias is not None else 0, aux.stride(0), out.stride(0),
        NUM_EXPERTS=num_experts, E_P2=triton.next_power_of_2(num_experts),
        EPILOGUE=epilogue, ACT=code, GATED=gated, HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
    )  # fmt: skip


def _library_gmm(
    chosen: KernelBackend, x: Tensor, w: Tensor, offsets: Tensor, sources: Tensor | None = None
) -> Tensor | None:
    """``x @ w[e]`` per expert, no epilogue, on the library ``chosen`` names: the CuTe DSL
    (reading rows ``x[sources]`` where given: only ``"cute"`` is given ``sources``, the callers
    gather the rows for the others) or ``torch._grouped_mm``; None where ``chosen`` is one of
    moec's own Triton kernels (``"tma"``, ``"pointer"``), whose launch the caller sets up."""
    if chosen == "cute":
        return cute_gemm.gmm(x, w, offsets, sources)
    if chosen == "grouped_mm":
        return torch._grouped_mm(x.contiguous(), w, offs=offsets)
    return None


def gmm(
    x: Tensor,
    w: Tensor,
    offsets: Tensor,
    bias: Tensor | None = None,
    piece: str = "down",
    policy: GemmPolicy | None = None,
) -> Tensor:
    """``out[r] = x[r] @ w[e(r)] (+ bias[e(r)])``; ``w`` may be a transposed view. ``policy``
    (every function here): which backend runs (None: :func:`detected_policy`)."""
    chosen = backend(piece, x, w, policy or detected_policy()) if bias is None else "pointer"
    library = _library_gmm(chosen, x, w, offsets)
    if library is not None:
        return library
    out = x.new_empty(x.shape[0], w.shape[-1])
    _launch_gmm(chosen, x, w, offsets, bias, out, None, None, EPILOGUE_PLAIN, None)
    return out


def up_backend(
    x: Tensor, w_up: Tensor, has_bias: bool, act: KernelActivation, policy: GemmPolicy | None
) -> str:
    """The backend of the up projection (:func:`gmm_act`) for these operands; the pointer
    kernels are the only ones with a bias epilogue. Where the policy picks ``"cute"`` for a
    gated activation quack computes and ``w_up`` is :func:`cute_gemm.k_major`, ``"cute_glu"``
    runs: its epilogues then cost no weight copies (see :mod:`moec.kernels.cute_gemm`)."""
    if has_bias:
        return "pointer"
    glu_epilogue = act.gated and cute_gemm.computes(act)
    chosen = backend("up", x, w_up, policy or detected_policy(), glu_epilogue)
    if chosen == "cute" and glu_epilogue and cute_gemm.k_major(w_up):
        return "cute_glu"
    return chosen


def h_interleaved(
    x: Tensor,
    w_up: Tensor,
    has_bias: bool,
    act: KernelActivation,
    policy: GemmPolicy | None = None,
) -> bool:
    """Whether :func:`gmm_act` leaves a gated ``h`` with interleaved ``[gate, up]`` column pairs
    (``"cute_glu"``; see :mod:`moec.kernels.cute_gemm`); the backward asks with the forward's
    operands to read ``h`` right."""
    return act.gated and up_backend(x, w_up, has_bias, act, policy) == "cute_glu"


def buffer_like(x: Tensor, sources: Tensor) -> Tensor:
    """A stand-in for the buffer ``x[sources]`` [R, D] the policy decides on (it reads shape,
    dtype and device only): a stride-0 view, nothing allocated."""
    return x[:1].expand(sources.shape[0], x.shape[1])


def reads_token_rows(
    x: Tensor,
    sources: Tensor,
    w_up: Tensor,
    has_bias: bool,
    act: KernelActivation,
    policy: GemmPolicy | None = None,
) -> bool:
    """Whether :func:`gmm_act` given ``sources`` reads the token rows x through them (the CuTe
    DSL's ``A_idx``) rather than gathering the buffer first."""
    chosen = up_backend(buffer_like(x, sources), w_up, has_bias, act, policy)
    return chosen in ("cute", "cute_glu")


def gmm_act(
    x: Tensor,
    w_up: Tensor,
    offsets: Tensor,
    bias: Tensor | None,
    act: KernelActivation,
    sources: Tensor | None = None,
    policy: GemmPolicy | None = None,
) -> tuple[Tensor, Tensor]:
    """(h, a): the up projection with the activation fused into its epilogue (``h`` interleaved
    where :func:`h_interleaved`), or run after it on the activation kernel. ``sources``: x is
    token rows and buffer row r is ``x[sources[r]]``, read through the CuTe DSL's ``A_idx``
    where it runs (:func:`reads_token_rows`), else gathered first."""
    width = w_up.shape[-1]
    rows = x if sources is None else buffer_like(x, sources)
    chosen = up_backend(rows, w_up, bias is not None, act, policy)
    if sources is not None and chosen not in ("cute", "cute_glu"):
        x, sources = x.index_select(0, sources), None
    if chosen == "cute_glu" or _cute_epilogue_runs(chosen, act):
        return cute_gemm.gmm_act(x, w_up, offsets, act, sources)
    h = _library_gmm(chosen, x, w_up, offsets, sources)
    if h is not None:  # the activation on its own kernel
        return h, act_forward(h, act)
    h = x.new_empty(x.shape[0], width)
    a = x.new_empty(x.shape[0], width // 2 if act.gated else width)
    _launch_gmm(chosen, x, w_up, offsets, bias, a, h, None, EPILOGUE_ACT, act)
    return h, a


def dact_in_cute_epilogue(
    d_y: Tensor,
    w_down: Tensor,
    act: KernelActivation,
    interleaved: bool,
    policy: GemmPolicy | None = None,
) -> bool:
    """Whether :func:`gmm_act_backward` runs the activation's backward in a CuTe DSL epilogue
    (:func:`cute_gemm.gmm_act_backward`): always for an interleaved h, else where the policy
    picks ``"cute"`` for the dgrad and quack computes the (ungated) activation."""
    if interleaved:
        return True
    chosen = backend("dgrad_act", d_y, w_down.transpose(-1, -2), policy or detected_policy())
    return _cute_epilogue_runs(chosen, act)


def _cute_epilogue_runs(chosen: KernelBackend, act: KernelActivation) -> bool:
    """Whether a ``"cute"`` GEMM runs ``act`` (or its backward) in its epilogue: quack computes
    the activation and it is ungated (gated ones take ``"cute_glu"``'s interleaved layout)."""
    return chosen == "cute" and not act.gated and cute_gemm.computes(act)


def gmm_act_backward(
    d_y: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    act: KernelActivation,
    interleaved: bool = False,
    policy: GemmPolicy | None = None,
) -> tuple[Tensor, Tensor]:
    """(d_h, a): ``d_a = d_y @ w_down[e]^T`` then the activation backward (in the GEMM's
    epilogue, or on the activation kernel); an ``interleaved`` h (see :func:`h_interleaved`)
    gives an interleaved d_h."""
    if dact_in_cute_epilogue(d_y, w_down, act, interleaved, policy):
        return cute_gemm.gmm_act_backward(d_y, w_down, offsets, h, act)
    w_t = w_down.transpose(-1, -2)
    chosen = backend("dgrad_act", d_y, w_t, policy or detected_policy())
    d_a = _library_gmm(chosen, d_y, w_t, offsets)
    if d_a is not None:  # the activation's backward on its own kernel
        return act_backward(h, d_a, act)
    h = h.contiguous()
    a = d_y.new_empty(d_y.shape[0], w_t.shape[-1])
    d_h = torch.empty_like(h)
    _launch_gmm(chosen, d_y, w_t, offsets, None, a, h, d_h, EPILOGUE_ACT_BACKWARD, act)
    return d_h, a


def gmm_wgrad(
    x: Tensor,
    dy: Tensor,
    offsets: Tensor,
    out_dtype: torch.dtype | None = None,
    policy: GemmPolicy | None = None,
) -> Tensor:
    """``dw[e] = x_e^T @ dy_e`` -> (N, K, M) in ``out_dtype`` (default x's); empty experts get 0."""
    out_dtype = out_dtype or x.dtype
    chosen = backend("wgrad", x, dy, policy or detected_policy())
    if chosen == "grouped_mm":
        return torch._grouped_mm(x.t(), dy.contiguous(), offs=offsets).to(out_dtype)
    if chosen == "cute":
        return cute_gemm.gmm_wgrad(x.contiguous(), dy.contiguous(), offsets, out_dtype)
    x, dy = x.contiguous(), dy.contiguous()
    if x.shape[0] != dy.shape[0]:
        raise ValueError(f"gmm_wgrad: x {tuple(x.shape)} and dy {tuple(dy.shape)} differ in rows")
    num_experts, depth, width = offsets.shape[0], x.shape[1], dy.shape[1]
    dw = torch.empty(num_experts, depth, width, dtype=out_dtype, device=x.device)
    if dw.numel() == 0:
        return dw
    kernel = _tuned("wgrad", arch(x.device))

    def grid(meta: dict) -> tuple[int]:
        return (
            num_experts * triton.cdiv(depth, meta["BLOCK_K"]) * triton.cdiv(width, meta["BLOCK_N"]),
        )

    kernel[grid](
        x, dy, dw, offsets, x.shape[0], depth, width, x.stride(0), dy.stride(0),
        IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return dw
