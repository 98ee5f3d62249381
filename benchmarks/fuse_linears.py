"""Linears that read one input, run apart or joined into one GEMM (the attention's q, k, v).

The e2e model's attention projections (``benchmarks/e2e.py``: 3 x 8192 tokens, d = 1536, q, k
and v each 1536 x 1536), forward + backward (d_x and the weight gradients), bf16 weights as
moec's working copies are, ms from ``do_bench``:

  apart    ``linear(x, w)`` for each weight: three GEMMs forward, three d_x GEMMs whose
           products are summed, three weight-gradient GEMMs
  joined   ``linear(x, cat(ws))`` split into its parts: one GEMM each way, plus the
           concatenation of the weights (a copy of each weight every step)

Both eager and under ``torch.compile``; every row is checked against ``apart`` (eager) first.
The last column is ``apart``'s time over each row's (> 1: faster).

    python benchmarks/fuse_linears.py [--tokens 24576] [--dim 1536] [--outs 1536 1536 1536]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from triton.testing import do_bench

Step = Callable[[Tensor, list[Tensor], list[Tensor]], tuple[Tensor, ...]]


def apart(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    return [F.linear(x, w) for w in weights]


def joined(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    return list(F.linear(x, torch.cat(weights)).split([w.shape[0] for w in weights], -1))


def step_of(forward: Callable[[Tensor, list[Tensor]], list[Tensor]]) -> Step:
    def step(x: Tensor, weights: list[Tensor], d_outs: list[Tensor]) -> tuple[Tensor, ...]:
        outs = forward(x, weights)
        return torch.autograd.grad(outs, [x, *weights], d_outs)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3 * 8192)
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--outs", type=int, nargs="+", default=[1536, 1536, 1536])
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(args.tokens, args.dim, **bf, requires_grad=True)
    weights = [(torch.randn(n, args.dim, **bf) / args.dim**0.5).requires_grad_() for n in args.outs]
    d_outs = [torch.randn(args.tokens, n, **bf) for n in args.outs]
    flops = 3 * 2 * args.tokens * args.dim * sum(args.outs)
    steps = {
        "apart": step_of(apart),
        "joined": step_of(joined),
        "apart, compiled": torch.compile(step_of(apart)),
        "joined, compiled": torch.compile(step_of(joined)),
    }
    want = steps["apart"](x, weights, d_outs)
    results = {}
    for name, step in steps.items():
        got = step(x, weights, d_outs)
        for g, w in zip(got, want, strict=True):
            error = ((g.float() - w.float()).norm() / w.float().norm()).item()
            assert error < 1e-2, f"{name}: a gradient differs from apart's by {error:.2e}"
        results[name] = do_bench(lambda step=step: step(x, weights, d_outs), rep=500)
    print(f"device: {torch.cuda.get_device_name()}  tokens {args.tokens}  d {args.dim}  "
          f"outs {args.outs}")  # fmt: skip
    for name, ms in results.items():
        print(f"{name:<18} {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  "
              f"apart/this {results['apart'] / ms:.3f}x")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "dim": args.dim, "outs": args.outs, **results}, f)


if __name__ == "__main__":
    main()
