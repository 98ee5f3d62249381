"""Triton kernels behind the ``moec::`` ops, chosen per device (sm90 / sm100+), with fallbacks.

:func:`register` installs CUDA implementations over the op schemas (``torch.library``) and the
backward hooks of :mod:`moec.ops.grouped`; it is idempotent, and a no-op without Triton. Every
implementation falls back to the op's reference for what the kernels do not take (float64,
non-CUDA devices); the reference stays the oracle the tests compare against.

Families: :mod:`~moec.kernels.router` (route), :mod:`~moec.kernels.movement` (dispatch,
combine), :mod:`~moec.kernels.grouped_gemm` (grouped GEMMs with activation epilogues),
:mod:`~moec.kernels.activation`, :mod:`~moec.kernels.experts` (expert_mlp forward/backward),
:mod:`~moec.kernels.cross_entropy` (the in-place loss rows of ``linear_cross_entropy``),
:mod:`~moec.kernels.rope` (rotary embedding).
"""

from __future__ import annotations

from moec.kernels.arch import HAVE_TRITON

_REGISTERED = False


def register() -> bool:
    """Register the CUDA kernels (once); returns whether they are active (Triton importable)."""
    global _REGISTERED
    if not HAVE_TRITON:
        return False
    if _REGISTERED:
        return True
    import torch

    import moec.ops  # noqa: F401  (defines the op schemas)
    from moec.kernels import activation, cross_entropy, cuda_ops, rope
    from moec.ops import grouped

    torch.library.register_kernel("moec::route", "cuda")(cuda_ops.route)
    torch.library.register_kernel("moec::dispatch", "cuda")(cuda_ops.dispatch)
    torch.library.register_kernel("moec::combine", "cuda")(cuda_ops.combine)
    torch.library.register_kernel("moec::expert_mlp", "cuda")(cuda_ops.expert_mlp)
    grouped.register_cuda_kernels(cuda_ops.BACKWARD_HOOKS)
    grouped.register_cuda_kernels(
        {
            "cross_entropy_rows": cross_entropy.cross_entropy_rows,
            "rope": rope.rope,
            "act_forward": activation.act_forward,
            "act_backward": activation.act_backward,
        }
    )
    _REGISTERED = True
    return True


__all__ = ["HAVE_TRITON", "register"]
