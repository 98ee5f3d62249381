"""The LM head's cross-entropy on quack-kernels' scaled-exp GEMMs (CuTe DSL, sm90).

    linear_cross_entropy(h[N, D], weight[V, D], targets[N], ignore_index, rows_per_chunk)
        -> loss[N] float32 (0 on ignored rows), d_h[N, D] in h's dtype, d_weight[V, D] float32

``d_h`` and ``d_weight`` are the gradients of the summed loss. Rows go through in chunks of
``rows_per_chunk``, as in moec's own loop (:mod:`moec.ops.loss`), but each chunk is three GEMMs
and a small glue kernel instead of a GEMM, a row kernel and two GEMMs: the logits GEMM's
epilogue stores ``E = exp(logits - k)`` (bf16, with a power-of-two offset ``k`` per row and
column tile) and emits the per-tile sums of ``E`` and the target's logit; the glue turns those
into the loss and per-row scales; the d_h and d_weight GEMMs scale ``E`` as they load it, so the
logits' gradient is never written and the logits are read once, by the GEMMs that need them.
d_weight accumulates across chunks in float32 through TMA reduce-add stores (no read of the
accumulator). A target outside [0, V) that is not ``ignore_index`` gives its row a NaN loss
and no gradient, as moec's row kernel does (without a host sync; quack's kernels would index
past the logits, so such rows reach them as ignored ones).

:func:`takes` says which heads the pipeline computes; whether it runs is the bound
implementation of ``moec::linear_cross_entropy`` (:mod:`moec.ops.loss`; a
:class:`moec.kernels.target.Target` without quack never binds it). quack is optional
(``moec[cutlass]``) and imported on first use; each GEMM compiles once per shape and then
launches without reading the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moec.kernels.arch import arch

ROW_TILE = 128
"""The pipeline's row tile: chunks are a multiple of it (quack pads a shorter last chunk)."""
VOCAB_TILE = 128
"""The d_weight GEMM's row tile over the vocabulary: the vocabulary is a multiple of it."""


def chunk_sizes(rows: int, rows_per_chunk: int) -> set[int]:
    """The row counts of the pipeline's chunks: ``rows_per_chunk``, and the last chunk's rows
    padded to a multiple of :data:`ROW_TILE` (as quack pads them)."""
    chunks = -(-rows // rows_per_chunk)
    last = rows - (chunks - 1) * rows_per_chunk
    padded_last = -(-last // ROW_TILE) * ROW_TILE
    return {rows_per_chunk, padded_last} if chunks > 1 else {padded_last}


def shapes_fit(rows: int, dim: int, vocab: int, rows_per_chunk: int) -> bool:
    """Whether the pipeline's tiles divide the problem: chunks and the vocabulary multiples of
    128, rows of h and weight 16-byte aligned in bf16 (TMA); and no chunk of ``dim`` rows (quack
    tells the d_h GEMM's per-row scale from a per-column one by its length)."""
    return (
        rows > 0
        and rows_per_chunk % ROW_TILE == 0
        and vocab % VOCAB_TILE == 0
        and dim % 8 == 0
        and dim not in chunk_sizes(rows, rows_per_chunk)
    )


def takes(h: Tensor, weight: Tensor, rows_per_chunk: int) -> bool:
    """Whether :func:`linear_cross_entropy` computes this head: bf16 h and weight on an sm90 GPU
    (the pipeline's operand-transform mainloop is Hopper's), unit-stride rows, and
    :func:`shapes_fit` (quack's presence is the caller's: the bound implementation)."""
    return (
        h.is_cuda
        and h.dtype == weight.dtype == torch.bfloat16
        and h.stride(-1) == 1
        and weight.is_contiguous()
        and arch(h.device) == "sm90"
        and shapes_fit(h.shape[0], h.shape[1], weight.shape[0], rows_per_chunk)
    )


def linear_cross_entropy(
    h: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, rows_per_chunk: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(per-row loss, d_h, d_weight) of the summed loss (see the module docstring); the
    operands must be ones :func:`takes`."""
    from quack.linear_cross_entropy import scaled_exp_linear_cross_entropy_fwd

    from moec.kernels.tuning import seed_quack_cache

    seed_quack_cache()  # its weight gradient is quack's autotuned GEMM
    rows, vocab = h.shape[0], weight.shape[0]
    if h.stride(0) != h.shape[1]:
        h = h.contiguous()
    outside = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    loss, d_h, d_weight = scaled_exp_linear_cross_entropy_fwd(
        h, weight, torch.where(outside, ignore_index, targets), rows_per_chunk, ignore_index
    )
    loss = loss[:rows].masked_fill(outside, float("nan"))  # quack pads a short last chunk
    return loss, d_h[:rows], d_weight
