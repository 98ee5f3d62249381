"""Grouped matrix products over an expert-major row buffer, the building block of expert MLPs.

Rows of expert ``e`` occupy ``[offsets[e-1], offsets[e])`` of a buffer of static length R;
rows past ``offsets[-1]`` are garbage and must never reach a valid result. ``offsets`` stays on
the device: nothing here reads it on the host, so every function is sync-free.

Implementations, chosen per call:

- on CUDA, the kernels :func:`moec.ops.cuda.register_kernels` installs through
  :func:`register_cuda_kernels` for float32/16 and bf16 (Triton, or ``torch._grouped_mm``, per
  :func:`moec.kernels.gemm_backend.backend`);
- otherwise the pure-PyTorch path, where ``backend(..., kernels=False)`` picks
  ``torch._grouped_mm`` if it takes the operands sync-free (bf16 on CUDA sm90+, fp32/bf16 on CPU
  with 16-byte aligned rows), else a masked loop over experts (float64 for gradcheck, fp32 on
  CUDA): N times the FLOPs, static shapes, still sync-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moec.kernels.gemm_backend import Backend, backend

_FORCE_LOOP = False
"""Tests set this to compare the two implementations."""

_CUDA_KERNELS: dict[str, Callable[..., Any]] = {}
"""Kernels for CUDA tensors by name (``gmm``, ``gmm_wgrad``, and the hooks of the other ops:
``dispatch_backward``, ``combine_backward``, ``expert_mlp_backward``, ``cross_entropy_rows``,
``rope``, ``glu_forward``, ``glu_backward``); empty until registered."""

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def register_cuda_kernels(kernels: dict[str, Callable[..., Any]]) -> None:
    """Install CUDA kernels (called by :func:`moec.ops.cuda.register_kernels`)."""
    _CUDA_KERNELS.update(kernels)


def cuda_kernel(name: str, tensor: torch.Tensor) -> Callable[..., Any] | None:
    """The registered kernel ``name`` for a float32/16/bf16 CUDA ``tensor``; None: the reference."""
    if _FORCE_LOOP or not tensor.is_cuda or tensor.dtype not in _KERNEL_DTYPES:
        return None
    return _CUDA_KERNELS.get(name)


def row_experts(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Expert index of every buffer row, ``num_experts`` for rows past ``offsets[-1]``."""
    positions = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, positions, right=True)


def _backend(piece: str, x: torch.Tensor, w: torch.Tensor) -> Backend:
    """The pure-PyTorch path's implementation: ``"loop"`` when tests force it."""
    return "loop" if _FORCE_LOOP else backend(piece, x, w, kernels=False)


def gmm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[r] = x[r] @ w[e(r)]``: x (R, K), w (N, K, M) -> (R, M); garbage rows stay garbage."""
    kernel = cuda_kernel("gmm", x)
    if kernel is not None:
        return kernel(x, w, offsets)
    if _backend("down", x, w) == "grouped_mm":
        return torch._grouped_mm(x.contiguous(), w, offs=offsets)
    experts = row_experts(offsets, x.shape[0])
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for e in range(w.shape[0]):
        out = torch.where((experts == e)[:, None], x @ w[e], out)
    return out


def gmm_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``dw[e] = x_e^T @ dy_e`` over the rows of expert e: x (R, K), dy (R, M) -> (N, K, M)."""
    kernel = cuda_kernel("gmm_wgrad", x)
    if kernel is not None:
        return kernel(x, dy, offsets)
    num_experts = offsets.shape[0]
    if _backend("wgrad", x, dy) == "grouped_mm":
        # contiguous x: a gradient can arrive expanded (stride 0), which _grouped_mm refuses
        return torch._grouped_mm(x.contiguous().t(), dy.contiguous(), offs=offsets)
    experts = row_experts(offsets, x.shape[0])
    grads = []
    for e in range(num_experts):
        mine = (experts == e)[:, None]
        grads.append(torch.where(mine, x, 0).t() @ torch.where(mine, dy, 0))
    return torch.stack(grads)


def add_row_bias(h: torch.Tensor, bias: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """``h[r] + bias[e(r)]``; garbage rows get an arbitrary expert's bias."""
    return h + bias.to(h.dtype)[experts.clamp(max=bias.shape[0] - 1)]


def row_bias_grad(dh: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Sum of ``dh`` rows per expert; garbage rows land in a dropped extra slot."""
    acc = torch.promote_types(dh.dtype, torch.float32)
    sums = dh.new_zeros(num_experts + 1, dh.shape[-1], dtype=acc)
    return sums.index_add_(0, experts.long(), dh.to(acc))[:num_experts]
