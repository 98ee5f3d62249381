"""Triton kernels behind the ``moec::`` ops, configured per device (sm90 / sm100+).

Kernels take plain tensors and numbers (an activation as a code and a gated flag, a capacity as
a row count) and know nothing of the ops: each op names its implementations in a table beside
it (:mod:`moec.ops.binding`), checks its arguments, and runs a kernel or its reference. Each
kernel family documents the inputs it takes; :data:`~moec.kernels.arch.HAVE_TRITON` says
whether any can run, and :class:`~moec.kernels.target.Target` which backends a machine has.

Families: :mod:`~moec.kernels.router` (route), :mod:`~moec.kernels.movement` (dispatch,
combine), :mod:`~moec.kernels.grouped_gemm` and :mod:`~moec.kernels.grouped_tma` (grouped GEMMs
with activation epilogues), :mod:`~moec.kernels.activation`, :mod:`~moec.kernels.experts` (the
expert MLP forward/backward), :mod:`~moec.kernels.cross_entropy` (the in-place loss rows of
``linear_cross_entropy``), :mod:`~moec.kernels.cute_loss` (the whole of it on quack's fused
GEMMs, sm90), :mod:`~moec.kernels.rope` (rotary embedding),
:mod:`~moec.kernels.ep_push` (the rowwise EP copy), :mod:`~moec.kernels.adamw`,
:mod:`~moec.kernels.mxfp8` and :mod:`~moec.kernels.fp8_rowwise` (quantized GEMMs).
"""

from moec.kernels.arch import HAVE_TRITON

__all__ = ["HAVE_TRITON"]
