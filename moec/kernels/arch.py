"""Where the Triton kernels run: availability, the interpreter, and the sm90 / sm100+ split.

``supported(t)`` is the single gate every CUDA implementation checks before launching a kernel
(CUDA tensor, or any tensor under ``TRITON_INTERPRET=1``; a float dtype the kernels handle);
everything else falls back to the op's reference. ``arch(device)`` picks the config table.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    HAVE_TRITON = False

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Data dtypes the kernels take; float64 (gradcheck) always uses the reference."""

Arch = Literal["sm90", "sm100", "interpreter", "other"]


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def supported(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can run on these tensors (device and data dtype of the first)."""
    if not HAVE_TRITON:
        return False
    first = tensors[0]
    on_device = first.is_cuda or (interpreting() and first.device.type == "cpu")
    return on_device and all(t.device == first.device for t in tensors)


def float_supported(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """:func:`supported` and ``x`` holds a dtype in :data:`KERNEL_DTYPES`."""
    return supported(x, *others) and x.dtype in KERNEL_DTYPES


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def arch(device: torch.device) -> Arch:
    """Config family for ``device``: sm90 (Hopper), sm100 (Blackwell B200/B300 and later)."""
    if device.type != "cuda":
        return "interpreter"
    major, _ = _capability(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    if major >= 10:
        return "sm100"
    return "sm90" if major == 9 else "other"


def native_low_precision(device: torch.device) -> Literal["fp8_rowwise", "mxfp8"] | None:
    """The low-precision GEMM recipe this CUDA device runs on its own kernels: ``fp8_rowwise``
    on sm90 (torch's FP8 rowwise GEMMs), ``mxfp8`` on sm100+ (block-scaled MMA); None
    elsewhere. Any other recipe runs emulated there: right values, not speed."""
    family = arch(device)
    return {"sm90": "fp8_rowwise", "sm100": "mxfp8"}.get(family)  # type: ignore[return-value]


def emulated_precision(gemm: str, device: torch.device) -> str | None:
    """Why ``precision.gemm`` runs emulated on this CUDA device (its GEMMs fake-quantized or on
    a kernel without that MMA), or None where it has its own kernels (or is bf16, or on CPU)."""
    if gemm == "bf16" or device.type != "cuda":
        return None
    native = native_low_precision(device)
    if gemm == native:
        return None
    here = f"this GPU ({arch(device)})"
    instead = f"; {native} is the recipe with kernels here" if native else ""
    return f"{gemm} has no kernels on {here}: it runs emulated (right values, not faster){instead}"
