"""The LM-head loss's cross-entropy kernel beside a compiled baseline.

``moec::linear_cross_entropy`` computes the logits a chunk of rows at a time and runs
``cross_entropy_rows`` over each chunk: the loss per row and, in place, the logits' gradient.
This times that kernel on one chunk of the e2e model (``benchmarks/e2e.py``: vocab 100352, bf16;
2560 rows, the chunk ``moec.ops.loss.chunk_rows`` takes), and the same loss and gradient from
``F.cross_entropy`` under ``torch.compile``. Both are checked against
``cross_entropy_rows_reference`` first. Printed: ms, the bandwidth of the minimum traffic (the
logits read once and the gradient written once; the kernel reads them twice) and moec's time
over each row's.

    python benchmarks/cross_entropy.py [--rows 2560] [--vocab 100352] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from triton.testing import do_bench

from moec.kernels.cross_entropy import cross_entropy_rows
from moec.ops.loss import cross_entropy_rows_reference


def check(loss: Tensor, grad: Tensor, logits: Tensor, targets: Tensor) -> None:
    want_grad = logits.float()
    want = cross_entropy_rows_reference(want_grad, targets, -100)
    torch.testing.assert_close(loss, want, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(grad.float(), want_grad, atol=2e-3, rtol=1e-2)


def compiled_step() -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
    @torch.compile
    def step(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        x = logits.detach().requires_grad_()
        loss = F.cross_entropy(x.float(), targets, reduction="none")
        (grad,) = torch.autograd.grad(loss.sum(), x)
        return loss, grad

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2560)
    parser.add_argument("--vocab", type=int, default=100352)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, device="cuda") * 3).to(torch.bfloat16)
    targets = torch.randint(0, args.vocab, (args.rows,), device="cuda")
    traffic = 2 * logits.numel() * logits.element_size()
    print(f"device: {torch.cuda.get_device_name()}  rows {args.rows}  vocab {args.vocab}")
    work = logits.clone()
    check(cross_entropy_rows(work, targets, -100), work, logits, targets)
    step = compiled_step()
    check(*step(logits, targets), logits, targets)
    # the kernel overwrites ``work`` at every call: the timing does not depend on the values
    times = {
        "moec cross_entropy_rows": do_bench(lambda: cross_entropy_rows(work, targets, -100)),
        "torch.compile F.cross_entropy": do_bench(lambda: step(logits, targets)),
    }
    moec_ms = times["moec cross_entropy_rows"]
    for name, ms in times.items():
        print(f"{name:<30} {ms:7.3f} ms  {traffic / ms / 1e9:5.2f} TB/s  moec {ms / moec_ms:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ms": times, "rows": args.rows, "vocab": args.vocab}, f, indent=1)


if __name__ == "__main__":
    main()
