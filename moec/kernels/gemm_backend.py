"""Which implementation runs a grouped GEMM over an expert buffer: the one home of that choice.

:func:`backend` answers for one expert GEMM ``piece`` and its operands ``x`` (the row buffer)
and ``w`` (the weights, or ``dy`` for ``"wgrad"``):

- ``kernels=True`` (moec's Triton kernels run these operands: the CUDA implementation that
  :mod:`moec.ops.cuda` registers, or the interpreter): bf16 on CUDA with at least
  :data:`GROUPED_MM_MIN_ROWS` buffer rows takes :data:`GEMM_BACKENDS` ``[arch][piece]``
  (``"tma"`` only where :func:`tma_applies` and never for ``"wgrad"``, else ``"pointer"``);
  everything else (float32/16, the interpreter, fewer rows, an arch without a table) runs
  ``"pointer"``, the kernels of :mod:`moec.kernels.grouped_gemm`.
- ``kernels=False`` (the ops' pure-PyTorch path, :mod:`moec.ops.grouped`): ``"grouped_mm"``
  where :func:`grouped_mm_takes` the operands, else ``"loop"`` (a masked loop over experts).

Backends: ``"grouped_mm"`` is ``torch._grouped_mm`` (CUTLASS on CUDA; an activation then runs on
its own kernel), ``"tma"`` the persistent TMA kernel of :mod:`moec.kernels.grouped_tma`,
``"pointer"`` the pointer-based kernels of :mod:`moec.kernels.grouped_gemm` (activation fused in
the epilogue), ``"loop"`` the ops' reference. This module imports no Triton, so the ops' path can
ask it on machines without Triton.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from moec.kernels.arch import arch, interpreting

KernelBackend = Literal["grouped_mm", "tma", "pointer"]
Backend = Literal[KernelBackend, "loop"]

PIECES = ("up", "down", "dgrad", "dgrad_act", "wgrad")
"""The expert GEMMs: "up" (gmm_act), "down" (gmm), "dgrad" (gmm with transposed weights: the
input gradient of the up projection), "dgrad_act" (gmm_act_backward), "wgrad"."""

_SM90_BACKENDS: dict[str, KernelBackend] = {
    "up": "grouped_mm",
    "down": "grouped_mm",
    "dgrad": "tma",
    "dgrad_act": "grouped_mm",
    "wgrad": "grouped_mm",
}
GEMM_BACKENDS: dict[str, dict[str, KernelBackend]] = {
    "sm90": _SM90_BACKENDS,
    "sm100": _SM90_BACKENDS,
}
"""Per arch, the implementation of each piece (:data:`PIECES`) for bf16 CUDA buffers of at least
:data:`GROUPED_MM_MIN_ROWS` rows: the fastest one measured on an H200 at the MoE layer's size
(benchmarks/RESULTS.md, "persistent TMA grouped GEMM, per-piece backends": the TMA kernel on the
up projection's dgrad, ``_grouped_mm`` on the others, whose fused-activation epilogues lose to it
plus the separate activation kernel). sm100 uses the sm90 table until measured on its own."""

GROUPED_MM_MIN_ROWS = 1024
"""Below this many buffer rows (a static shape) every piece runs the pointer kernels: their
small-row tiles suit the weight-read-bound (wgrad: write-bound) GEMMs of a few rows per expert,
where they measured faster than ``torch._grouped_mm`` on the GPU (benchmarks/RESULTS.md, grouped
GEMM table with small-row autotune candidates)."""


@contextlib.contextmanager
def forced_backend(chosen: KernelBackend) -> Iterator[None]:
    """Run every piece at every size on ``chosen`` where moec's kernels run (benchmarks, tests);
    restores the policy on exit. The ops' pure-PyTorch path is unaffected."""
    global GROUPED_MM_MIN_ROWS
    saved, min_rows = dict(GEMM_BACKENDS), GROUPED_MM_MIN_ROWS
    every = dict.fromkeys(PIECES, chosen)
    GEMM_BACKENDS.update(sm90=every, sm100=every)
    GROUPED_MM_MIN_ROWS = 0
    try:
        yield
    finally:
        GEMM_BACKENDS.update(saved)
        GROUPED_MM_MIN_ROWS = min_rows


def _tma_ready(t: Tensor) -> bool:
    """Unit inner stride, other strides and the base 16-byte aligned (what TMA takes)."""
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and all((s * size) % 16 == 0 for s in t.stride()[:-1])
        and t.data_ptr() % 16 == 0
    )


def tma_applies(x: Tensor, w: Tensor) -> bool:
    """Whether the TMA kernel takes these operands: sm90+ (or the interpreter), x TMA-ready,
    w TMA-ready as given or as a transposed view."""
    if x.is_cuda:
        if arch(x.device) not in ("sm90", "sm100"):
            return False
    elif not interpreting():
        return False
    return _tma_ready(x) and (_tma_ready(w) or _tma_ready(w.transpose(-1, -2)))


def grouped_mm_takes(piece: str, x: Tensor, w: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs ``piece`` on these operands, sync-free: bf16 on CUDA
    sm90+; float32/bf16 on the CPU with 16-byte aligned rows (of x, w and, but for ``"wgrad"``,
    w's transpose). Fake float32 is refused: torch's fake ``_grouped_mm`` takes bf16 only."""
    if x.dtype == torch.float32 and is_fake(x):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and arch(x.device) in ("sm90", "sm100")
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    operands = (x, w) if piece == "wgrad" else (x, w, w.transpose(-1, -2))
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in operands)


def backend(piece: str, x: Tensor, w: Tensor, kernels: bool = True) -> Backend:
    """The implementation that runs ``piece`` on these operands (see module)."""
    if not kernels:
        return "grouped_mm" if grouped_mm_takes(piece, x, w) else "loop"
    if not x.is_cuda or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return "pointer"
    if x.shape[0] < GROUPED_MM_MIN_ROWS:
        return "pointer"
    chosen = GEMM_BACKENDS.get(arch(x.device), {}).get(piece, "pointer")
    if chosen == "tma" and (piece == "wgrad" or not tma_applies(x, w)):
        return "pointer"
    return chosen
