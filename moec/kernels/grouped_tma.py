"""Persistent grouped GEMM on TMA tensor descriptors (sm90+): grouped_gemm.py's forward-style ops.

Same contract as :mod:`moec.kernels.grouped_gemm` (rows ``[offsets[e-1], offsets[e])`` belong to
expert e; rows past ``offsets[-1]`` are never read into a result nor written; ``offsets`` stays
on the device) and the same epilogues (:func:`moec.kernels.gemm_tiles.epilogue`: plain, fused
activation, fused activation backward); what differs is how operands move:

* One program per SM loops over the output tiles (a persistent grid). Tile t maps to (row tile,
  column tile) with GROUP_M row tiles sweeping the columns together, so the weight tiles in
  flight are read from HBM once; the row tile maps to (expert, first row, end row) through the
  per-expert tile table made once per program from the device offsets.
* Operands arrive by TMA: x through one descriptor over the whole buffer (rows of the next
  expert that a tail tile reads are computed and dropped by the epilogue's row mask), the
  weights through one 3-D descriptor ``[experts, K, width]`` (``[experts, width, K]`` for a
  transposed view, its tiles transposed in shared memory), which zero-fills K and width tails.
* The epilogue writes from registers with masked stores: it measured faster than staging TMA
  stores through shared memory (benchmarks/RESULTS.md, persistent TMA grouped GEMM), and the
  fused-activation tiles do not fit in shared memory beside the operand pipeline.

:func:`moec.kernels.gemm_backend.tma_applies` says when the kernel takes the operands (sm90+,
TMA-ready strides) and :func:`moec.kernels.gemm_backend.backend` which pieces use it.
Descriptors made on the device need Triton's global scratch allocator: :func:`_set_allocator`
points it at torch's.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from moec.kernels import tuning
from moec.kernels.activation import KernelActivation
from moec.kernels.arch import arch, interpreting
from moec.kernels.gemm_tiles import EPILOGUE_ACT, epilogue, expert_table, expert_tile


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _gmm_tma_kernel(
    x_ptr,  # (R, K), unit inner stride
    w_ptr,  # (N, K, W) or, W_TRANSPOSED, the (N, W, K) tensor it is a view of
    h_ptr,  # (R, U): written by EPILOGUE_ACT, read by EPILOGUE_ACT_BACKWARD
    out_ptr,  # (R, N_OUT)
    d_h_ptr,  # (R, U): written by EPILOGUE_ACT_BACKWARD
    offsets_ptr,
    R,
    K,
    N_OUT,
    W,
    stride_xr,
    stride_we,
    stride_wr,  # stride of w's second dim (K, or W when transposed)
    stride_hr,
    stride_or,
    NUM_EXPERTS: tl.constexpr,
    E_P2: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    W_TRANSPOSED: tl.constexpr,
    IEEE: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    starts, ends, tiles, cum = expert_table(offsets_ptr, NUM_EXPERTS, E_P2, BLOCK_M)
    total_m = tl.sum(tiles, axis=0)
    tiles_n = tl.cdiv(N_OUT, BLOCK_N)
    x_desc = tl.make_tensor_descriptor(
        x_ptr, shape=[R, K], strides=[stride_xr, 1], block_shape=[BLOCK_M, BLOCK_K]
    )
    if W_TRANSPOSED:
        w_desc = tl.make_tensor_descriptor(
            w_ptr,
            shape=[NUM_EXPERTS, W, K],
            strides=[stride_we, stride_wr, 1],
            block_shape=[1, BLOCK_N, BLOCK_K],
        )
    else:
        w_desc = tl.make_tensor_descriptor(
            w_ptr,
            shape=[NUM_EXPERTS, K, W],
            strides=[stride_we, stride_wr, 1],
            block_shape=[1, BLOCK_K, BLOCK_N],
        )
    two = GATED and EPILOGUE == 1
    per_group = GROUP_M * tiles_n
    for tile in tl.range(tl.program_id(0), total_m * tiles_n, NUM_SMS, flatten=FLATTEN):
        # GROUP_M row tiles sweep the columns together: their weight tiles are read once
        first_m = tile // per_group * GROUP_M
        size_m = tl.minimum(total_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % size_m
        n0 = (tile % per_group) // size_m * BLOCK_N
        expert, row0, end = expert_tile(starts, ends, tiles, cum, pid_m, E_P2, BLOCK_M)

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = x_desc.load([row0, k0])
            if W_TRANSPOSED:
                b = w_desc.load([expert, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
            else:
                b = w_desc.load([expert, k0, n0]).reshape(BLOCK_K, BLOCK_N)
            acc = _dot(a, b, acc, IEEE)
            if two:
                b_up = w_desc.load([expert, k0, n0 + N_OUT]).reshape(BLOCK_K, BLOCK_N)
                acc_up = _dot(a, b_up, acc_up, IEEE)

        rows = row0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        mask = (rows < end)[:, None] & (cols < N_OUT)[None, :]
        epilogue(
            acc, acc_up, rows, cols, mask, h_ptr, out_ptr, d_h_ptr, stride_hr, stride_or, N_OUT,
            EPILOGUE, ACT, GATED,
        )  # fmt: skip


def _config(bm: int, bn: int, group_m: int, stages: int, warps: int, flatten: bool):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": group_m, "FLATTEN": flatten},
        num_stages=stages,
        num_warps=warps,
    )


def configs(kind: str, family: str) -> list[triton.Config]:
    """Autotune candidates: kind "gmm" (one accumulator) or "gmm2" (gated, two)."""
    if family == "interpreter":
        return [
            triton.Config(
                {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "FLATTEN": False}
            )
        ]
    if kind == "gmm":
        # first: the fastest measured on sm90 for the up projection's dgrad, the piece this kernel
        # runs (benchmarks/RESULTS.md, persistent TMA grouped GEMM)
        return [
            _config(128, 256, 16, 3, 8, True),
            _config(128, 256, 8, 3, 8, False),
            _config(128, 128, 8, 4, 8, True),
            _config(64, 256, 8, 4, 4, True),
        ]
    return [_config(128, 128, 8, 3, 8, False), _config(128, 128, 8, 3, 8, True)]


@functools.cache
def _tuned(kind: str, family: str) -> tuning.TableFirst:
    """The autotuned kernel, the shipped tile table consulted first (:mod:`.tuning`);
    ``MOEC_AUTOTUNE=0`` keeps only the first config (tests, CI)."""
    candidates = configs(kind, family)
    if os.environ.get("MOEC_AUTOTUNE", "1") == "0":
        candidates = candidates[:1]
    key = ["R", "K", "N_OUT", "EPILOGUE", "NUM_EXPERTS"]
    tuned = triton.autotune(configs=candidates, key=key, cache_results=True)(_gmm_tma_kernel)
    return tuning.TableFirst(f"grouped_tma.{kind}", tuned)


def _scratch(size: int, alignment: int, stream: int | None) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _set_allocator() -> None:
    """Descriptors made on the device live in a per-launch global scratch that torch's caching
    allocator gives (no host sync). Triton keeps the allocator in a context variable, which a
    new thread (autograd's backward worker) does not inherit: it is set before every launch."""
    if not interpreting():  # the interpreter keeps descriptors on the host
        triton.set_allocator(_scratch)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(t: Tensor) -> int:
    """One program per SM (a few under the interpreter)."""
    if not t.is_cuda:
        return 4
    return _num_sms(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_gmm(
    x: Tensor,
    w: Tensor,
    offsets: Tensor,
    out: Tensor,
    h: Tensor | None,
    d_h: Tensor | None,
    epilogue: int,
    act: KernelActivation | None,
) -> None:
    """Run the kernel: ``out`` (and ``h`` / ``d_h`` as ``epilogue`` says) written in place;
    the caller has checked shapes (none empty) and
    :func:`~moec.kernels.gemm_backend.tma_applies`."""
    _set_allocator()
    rows, depth = x.shape
    num_experts, _, width = w.shape
    code, gated = act if act is not None else (0, False)
    n_out = out.shape[1]
    transposed = w.stride(-1) != 1
    base = w.transpose(-1, -2) if transposed else w
    aux = h if h is not None else out
    sms = _programs(x)
    kind = "gmm2" if gated and epilogue == EPILOGUE_ACT else "gmm"
    _tuned(kind, arch(x.device))[(sms,)](
        x, base, aux, out, d_h if d_h is not None else aux, offsets,
        rows, depth, n_out, width,
        x.stride(0), base.stride(0), base.stride(1), aux.stride(0), out.stride(0),
        NUM_EXPERTS=num_experts, E_P2=triton.next_power_of_2(num_experts),
        EPILOGUE=epilogue, ACT=code, GATED=gated, W_TRANSPOSED=transposed,
        IEEE=x.dtype == torch.float32, NUM_SMS=sms,
    )  # fmt: skip
