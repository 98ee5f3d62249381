"""``moec::linear_cross_entropy``: an LM head and its cross-entropy loss as one op, in row chunks.

linear_cross_entropy(h[N, D], weight[V, D], bias[V]?, targets[N], ignore_index, reduction,
                     with_grads=True, chunk_elements=2**30, impl="auto")
    -> (loss[], d_h[N, D], d_weight[V, D], d_bias[V] or [0])   (loss and d_weight/d_bias in
       float32, or float64 for float64 inputs)

``loss`` equals ``cross_entropy(linear(h, weight, bias).float(), targets, ignore_index=...,
reduction=...)`` for ``reduction`` ``"mean"`` (over targets != ignore_index) or ``"sum"``.

The [N, V] logits never exist whole (at a 100k vocabulary they are the largest tensors of a training
step): rows go through in chunks of at most ``chunk_elements`` logits (:func:`chunk_rows`; pass
``bind`` sets it from ``Target.loss_chunk_elements``), each chunk's logits are turned in place into
the gradient of the summed loss (softmax - onehot, zero on ignored rows) and multiplied straight
into ``d_h`` and ``d_weight``. So the op computes the head's gradients during the forward, in one
pass over the logits instead of log-softmax, its backward and the casts between them; the backward
only scales them by ``d_loss`` (and 1 / count for "mean"). ``with_grads=False`` computes the loss
alone (the same chunks, no gradient GEMMs; the three gradients come back empty and the op has no
backward): ``CompiledModel`` runs its graph so under ``torch.no_grad()``.

``impl`` (:mod:`moec.ops.binding`) names one of :data:`IMPLEMENTATIONS`: ``reference`` (the
row loss in torch), ``triton`` (the row kernel of :mod:`moec.kernels.cross_entropy` where it
takes the logits) or ``cute``: where quack-kernels' scaled-exp GEMMs take the head
(:func:`moec.kernels.cute_loss.takes`: bf16 on sm90, no bias, a vocabulary and chunks of
multiples of 128, no chunk as long as the model is wide), the same chunks run on them instead
(else as ``triton``): the logits GEMM's epilogue writes the softmax's exponentials and the
gradient GEMMs scale them as they load them, so the logits' gradient is never written (faster
and smaller at the e2e shape: ``benchmarks/RESULTS.md``, session 26).

Logits are computed in h's dtype (the op casts the weight to it; under autocast it casts its
inputs to the autocast dtype, as ``linear`` does); softmax statistics and the loss in float32.
A target outside [0, V) that is not ``ignore_index`` raises on CPU and gives a NaN loss on CUDA
(the kernel cannot raise without a host sync).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from moec.kernels.arch import HAVE_TRITON, float_supported
from moec.kernels.target import LOSS_CHUNK_ELEMENTS
from moec.ops.binding import resolve

if HAVE_TRITON:
    from moec.kernels import cross_entropy, cute_loss

REDUCTIONS = ("mean", "sum")


def chunk_rows(rows: int, vocab: int, elements: int = LOSS_CHUNK_ELEMENTS) -> int:
    """Rows per chunk: at most ``elements`` logits (but at least 128 rows), as few chunks as
    that allows, of equal size rounded up to a multiple of 128 rows (no short last chunk whose
    GEMMs fill a fraction of the GPU)."""
    if rows <= 128:
        return max(rows, 1)
    most = max(128, elements // max(vocab, 1) // 128 * 128)
    per_chunk = -(-rows // -(-rows // most))
    return min(most, -(-per_chunk // 128) * 128)


def cross_entropy_rows_reference(logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
    """Per-row loss (float32 or wider, 0 on ignored rows); ``logits`` is overwritten with the
    gradient of the summed loss, ``softmax(logits) - onehot(target)`` (0 on ignored rows)."""
    x = logits.to(_accumulation_dtype(logits))
    lse = torch.logsumexp(x, dim=-1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)[:, None]
    loss = torch.where(valid, lse - x.gather(1, safe).squeeze(1), 0.0)
    grad = torch.exp(x - lse[:, None]).scatter_add_(1, safe, -torch.ones_like(x[:, :1]))
    logits.copy_(grad * valid[:, None])
    return loss


def _accumulation_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _triton_rows(logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
    """The row kernel where it takes the logits, else the reference."""
    if not float_supported(logits):
        return cross_entropy_rows_reference(logits, targets, ignore_index)
    return cross_entropy.cross_entropy_rows(logits, targets, ignore_index)


def _cute_head(h: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, step: int):
    """(per-row loss, d_h, d_weight) on quack's pipeline where it takes the head, else None."""
    if not cute_loss.takes(h, weight, step):
        return None
    return cute_loss.linear_cross_entropy(h, weight, targets, ignore_index, step)


class Loss(NamedTuple):
    """An implementation: the row loss of a chunk's logits (see
    :func:`cross_entropy_rows_reference`), and the whole head with its gradients where it takes
    them (None: the chunks)."""

    rows: Callable[[Tensor, Tensor, int], Tensor]
    head: Callable[..., tuple[Tensor, Tensor, Tensor] | None] | None = None


IMPLEMENTATIONS: dict[str, Loss] = {
    "reference": Loss(cross_entropy_rows_reference),
    "triton": Loss(_triton_rows),
    "cute": Loss(_triton_rows, _cute_head),
}
"""``moec::linear_cross_entropy``'s implementations by name (see the module)."""


def _mm_into(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """out (the accumulation dtype) = a @ b, or += a @ b: on CUDA in the GEMM's epilogue (the
    product is never materialised, nor rounded to bf16), elsewhere through a temporary."""
    if a.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif a.is_cuda:  # bf16/fp16 operands, fp32 out
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif accumulate:
        out += torch.mm(a, b).to(out.dtype)
    else:
        out.copy_(torch.mm(a, b))


def _check(h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, reduction: str):
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"moec::linear_cross_entropy: reduction {reduction!r} is not one of {REDUCTIONS}"
        )
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(
            f"moec::linear_cross_entropy: h {tuple(h.shape)} and weight {tuple(weight.shape)} "
            "must be (N, D) and (V, D)"
        )
    if targets.shape != h.shape[:1] or targets.dtype.is_floating_point:
        raise ValueError(
            f"moec::linear_cross_entropy: targets {tuple(targets.shape)} {targets.dtype} must be "
            f"integer class indices of shape ({h.shape[0]},)"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(
            f"moec::linear_cross_entropy: bias {tuple(bias.shape)} must be ({weight.shape[0]},)"
        )


def linear_cross_entropy_reference(
    h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, ignore_index: int,
    reduction: str,
) -> Tensor:  # fmt: skip
    """The oracle: the unfused head and loss (the loss only; autograd gives the gradients)."""
    logits = F.linear(h, weight.to(h.dtype), None if bias is None else bias.to(h.dtype))
    logits = logits.to(_accumulation_dtype(logits))
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)


@torch.library.custom_op("moec::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, ignore_index: int,
    reduction: str, with_grads: bool = True, chunk_elements: int = LOSS_CHUNK_ELEMENTS,
    impl: str = "auto",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    _check(h, weight, bias, targets, reduction)
    weight = weight.to(h.dtype)
    bias = None if bias is None else bias.to(h.dtype)
    step = chunk_rows(h.shape[0], weight.shape[0], chunk_elements)
    loss_impl = IMPLEMENTATIONS[resolve("linear_cross_entropy", impl, h, IMPLEMENTATIONS)]
    fused = None
    if with_grads and bias is None and loss_impl.head is not None:
        fused = loss_impl.head(h, weight, targets, ignore_index, step)
    if fused is not None:
        rows_loss, d_h, d_weight = fused
        loss, d_bias = rows_loss.sum(), d_weight.new_empty((0,))
    else:
        loss, d_h, d_weight, d_bias = _chunks(
            h, weight, bias, targets, ignore_index, with_grads, step, loss_impl.rows
        )
    if reduction == "mean":
        loss = loss / (targets != ignore_index).sum()
    return loss, d_h, d_weight, d_bias


def _chunks(
    h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, ignore_index: int,
    with_grads: bool, step: int, row_loss: Callable[[Tensor, Tensor, int], Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The summed loss and its gradients, ``step`` rows at a time: each chunk's logits, turned
    in place into their gradient by ``row_loss``, multiplied into d_h and d_weight."""
    rows, acc = h.shape[0], _accumulation_dtype(h)
    loss = torch.zeros((), dtype=acc, device=h.device)
    d_h, d_weight, d_bias = _grad_buffers(h, weight, bias, with_grads)
    if rows == 0:
        d_weight.zero_()
    d_bias.zero_()
    for start in range(0, rows, step):
        h_chunk = h[start : start + step]
        grad = F.linear(h_chunk, weight, bias)  # the logits, then (in place) their gradient
        loss += row_loss(grad, targets[start : start + step], ignore_index).sum()
        if not with_grads:
            continue
        torch.mm(grad, weight, out=d_h[start : start + step])
        _mm_into(d_weight, grad.t(), h_chunk, accumulate=start > 0)
        if bias is not None:
            d_bias += grad.sum(0, dtype=acc)
    return loss, d_h, d_weight, d_bias


def _grad_buffers(h: Tensor, weight: Tensor, bias: Tensor | None, with_grads: bool):
    """Uninitialised (d_h, d_weight, d_bias), empty without ``with_grads`` (or without bias)."""
    acc = _accumulation_dtype(h)
    if not with_grads:
        return h.new_empty((0,)), h.new_empty((0,), dtype=acc), h.new_empty((0,), dtype=acc)
    vocab = 0 if bias is None else weight.shape[0]
    d_weight = h.new_empty(weight.shape, dtype=acc)
    return h.new_empty(h.shape), d_weight, h.new_empty((vocab,), dtype=acc)


@linear_cross_entropy.register_fake
def _fake(
    h, weight, bias, targets, ignore_index, reduction, with_grads=True,
    chunk_elements=LOSS_CHUNK_ELEMENTS, impl="auto",
):  # fmt: skip
    _check(h, weight, bias, targets, reduction)
    loss = h.new_empty((), dtype=_accumulation_dtype(h))
    return loss, *_grad_buffers(h, weight, bias, with_grads)


def _setup(ctx, inputs, output):
    h, weight, bias, targets, ignore_index, reduction, with_grads, *_ = inputs
    _, d_h, d_weight, d_bias = output
    ctx.save_for_backward(d_h, d_weight, d_bias, targets)
    ctx.mark_non_differentiable(d_h, d_weight, d_bias)
    ctx.set_materialize_grads(False)  # no zero-filled buffers for the outputs never used
    ctx.dtypes = (h.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.ignore_index, ctx.mean, ctx.with_grads = ignore_index, reduction == "mean", with_grads


def _backward(ctx, d_loss, *unused):
    if d_loss is None:  # the loss was not used: no gradient flows
        return (None,) * 9
    if not ctx.with_grads:
        raise RuntimeError(
            "moec::linear_cross_entropy ran with with_grads=False (a forward-only program, e.g. "
            "a CompiledModel called under torch.no_grad()); it has no gradients to give"
        )
    d_h, d_weight, d_bias, targets = ctx.saved_tensors
    scale = d_loss.to(d_weight.dtype)
    if ctx.mean:
        scale = scale / (targets != ctx.ignore_index).sum()
    h_dtype, weight_dtype, bias_dtype = ctx.dtypes
    return (
        (d_h * scale).to(h_dtype),
        (d_weight * scale).to(weight_dtype),
        None if bias_dtype is None else (d_bias * scale).to(bias_dtype),
        *(None,) * 6,
    )


linear_cross_entropy.register_autograd(_backward, setup_context=_setup)
for _device in ("cpu", "cuda"):
    torch.library.register_autocast("moec::linear_cross_entropy", _device, torch.bfloat16)
