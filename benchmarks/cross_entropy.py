"""The LM-head loss's cross-entropy kernel: launch configurations beside a compiled baseline.

``moec::linear_cross_entropy`` computes the logits a chunk of rows at a time and runs
``cross_entropy_rows`` over each chunk: the loss per row and, in place, the logits' gradient.
This times that kernel on one chunk of the e2e model (``benchmarks/e2e.py``: vocab 100352, bf16;
2560 rows, the chunk ``moec.ops.loss.chunk_rows`` takes) under each :class:`Launch` of the sweep,
and the same loss and gradient from ``F.cross_entropy`` under ``torch.compile``. Every row is
checked against ``cross_entropy_rows_reference`` first. Printed: ms, the bandwidth of the
minimum traffic (the logits read once and the gradient written once) and the default launch's
time over each row's (> 1: faster than the default).

    python benchmarks/cross_entropy.py [--rows 2560] [--vocab 100352] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from triton.testing import do_bench

from moec.kernels.cross_entropy import LAUNCH, Launch, cross_entropy_rows
from moec.ops.loss import cross_entropy_rows_reference

SWEEP = [
    Launch(programs_per_sm=p, block_v=b, num_warps=w)
    for p in (0, 1, 2, 4)
    for b in (4096, 8192, 16384)
    for w in (8, 16)
]


def check(launch: Launch, logits: Tensor, targets: Tensor) -> None:
    grad, want_grad = logits.clone(), logits.float()
    loss = cross_entropy_rows(grad, targets, -100, launch)
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
    results = []
    work = logits.clone()  # overwritten by every call: the timing does not depend on values
    for launch in SWEEP:
        check(launch, logits, targets)
        ms = do_bench(lambda launch=launch: cross_entropy_rows(work, targets, -100, launch))
        results.append({**dataclasses.asdict(launch), "ms": ms})
    step = compiled_step()
    loss, grad = step(logits, targets)
    want_grad = logits.float()
    torch.testing.assert_close(loss, cross_entropy_rows_reference(want_grad, targets, -100),
                               atol=1e-3, rtol=1e-4)  # fmt: skip
    compiled_ms = do_bench(lambda: step(logits, targets))
    default = next(r["ms"] for r in results if Launch(r["programs_per_sm"], r["block_v"],
                                                       r["num_warps"]) == LAUNCH)  # fmt: skip
    rows = [(f"moec {r['programs_per_sm']}/SM {r['block_v']} w{r['num_warps']}", r["ms"])
            for r in results] + [("torch.compile F.cross_entropy", compiled_ms)]  # fmt: skip
    for name, ms in sorted(rows, key=lambda r: r[1]):
        print(f"{name:<32} {ms:7.3f} ms  {traffic / ms / 1e9:6.2f} TB/s  {default / ms:5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"launches": results, "compiled_ms": compiled_ms, "rows": args.rows,
                       "vocab": args.vocab}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
