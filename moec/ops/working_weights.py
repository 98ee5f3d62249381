"""``working_copy(copy, masters)``: read parameters through their persistent low-precision copy.

working_copy(copy[n1 + n2 + ..., *], [P1[n1, *], P2[n2, *], ...]) -> copy (an alias, no copy)
    forward  the values of ``copy``; the runtime keeps ``copy == cat(masters).to(copy.dtype)``
             (:class:`moec.runtime.working_weights.WorkingWeights`)
    backward the incoming gradient's rows for each master (one master: the gradient itself),
             in the gradient's dtype; none for ``copy``

It stands where a graph would cast its float32 parameters to bf16 every step (``aten._to_copy``,
and the ``cat`` of two casts that ``fuse_glu`` makes): the forward does not read 4 and write 2
bytes per parameter for that cast, and the gradient is not cast back to float32 (the engine
accumulates it in each master's ``grad_dtype``, which the runtime sets). A plain function over an
``autograd.Function``, not a ``torch.library`` op: its output aliases an input, which custom
ops may not do.
"""

from __future__ import annotations

import torch
from torch import Tensor


class _WorkingCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, copy: Tensor, *masters: Tensor) -> Tensor:
        ctx.rows = [m.shape[0] for m in masters]
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        pieces = (grad,) if len(ctx.rows) == 1 else grad.split(ctx.rows)
        return None, *pieces


def joined_copy(
    masters: list[Tensor], dtype: torch.dtype, device: torch.device | None = None
) -> Tensor:
    """The working copy of ``masters`` in ``dtype``: one master keeps its strides (a k-major
    expert weight stays k-major, so its copy and gradient are too), several are
    row-concatenated (contiguous)."""
    joined = masters[0] if len(masters) == 1 else torch.cat(masters)
    return joined.to(device=device, dtype=dtype, copy=True)


def working_copy(copy: Tensor, masters: list[Tensor]) -> Tensor:
    rows = sum(m.shape[0] for m in masters)
    trailing = {tuple(m.shape[1:]) for m in masters}
    if trailing != {tuple(copy.shape[1:])} or rows != copy.shape[0]:
        shapes = [tuple(m.shape) for m in masters]
        raise ValueError(
            f"working_copy: copy of shape {tuple(copy.shape)} is not the row concatenation of "
            f"parameters shaped {shapes}"
        )
    return _WorkingCopy.apply(copy, *masters)
