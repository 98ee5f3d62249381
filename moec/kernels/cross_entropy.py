"""Cross-entropy over rows of logits, in place, for ``moec::linear_cross_entropy``.

cross_entropy_rows(logits[n, V], targets[n], ignore_index) -> loss[n] float32, and ``logits``
overwritten with ``softmax(logits) - onehot(target)`` (zero rows where target == ignore_index).

One program per row, two passes over it: an online max / sum of exponentials (per lane, merged at
the end), then the gradient written over the logits. A row is read twice and written once in its
own dtype; nothing of size [n, V] in float32 is ever allocated. A target outside [0, V) that is not
ignore_index gives that row a NaN loss (raising would need a host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr,  # (n, V), overwritten with the gradient
    targets_ptr,  # (n,) int64
    loss_ptr,  # (n,) float32 out
    V,
    stride,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    cols = tl.arange(0, BLOCK_V)
    run_max = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, x)
        seen = new_max > float("-inf")  # lanes past V in a short row stay empty
        rescale = tl.where(seen, tl.exp(run_max - new_max), 0.0)
        run_sum = run_sum * rescale + tl.where(seen, tl.exp(x - new_max), 0.0)
        run_max = new_max
    row_max = tl.max(run_max, axis=0)
    lse = row_max + tl.log(tl.sum(run_sum * tl.exp(run_max - row_max), axis=0))
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    in_range = (target >= 0) & (target < V)
    picked = tl.load(base + target, mask=valid & in_range, other=0.0).to(tl.float32)
    loss = tl.where(valid, tl.where(in_range, lse - picked, float("nan")), 0.0)
    tl.store(loss_ptr + row, loss)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        x = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(c == target, 1.0, 0.0)
        grad = tl.where(valid, grad, 0.0)
        tl.store(base + c, grad.to(logits_ptr.dtype.element_ty), mask=c < V)


def block_v(vocab: int) -> int:
    return max(16, min(triton.next_power_of_2(vocab), 4096))


def cross_entropy_rows(logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
    """Per-row loss; ``logits`` (rows contiguous) becomes the gradient of the summed loss."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("cross_entropy_rows: logits rows must be contiguous (they are written)")
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return loss
    block = block_v(vocab)
    _cross_entropy_rows_kernel[(rows,)](
        logits, targets.contiguous(), loss, vocab, logits.stride(0), ignore_index,
        BLOCK_V=block, num_warps=8 if block >= 4096 else 4,
    )  # fmt: skip
    return loss
