"""The LM head and its loss, forward and backward, at several chunk sizes beside torch.compile.

``moec::linear_cross_entropy`` computes the head's logits ``chunk_elements`` at a time (its
argument, ``Target.loss_chunk_elements`` in a compiled program; ``chunk_rows`` rows per chunk),
on one of two pipelines:

  chunks  moec's own: each chunk's logits become their gradient in place (the row kernel) and
          are multiplied straight into d_h and d_weight (float32, accumulated in the GEMM's
          epilogue)
  fused   quack-kernels' scaled-exp GEMMs (``moec.kernels.cute_loss``; sm90, needs quack): the
          logits GEMM's epilogue writes the softmax's exponentials, the gradient GEMMs scale
          them as they load them (what the op runs where it takes the head)

Small chunks keep the logits' memory down; each chunk costs a d_weight accumulation and, for
few rows, a partly filled last wave of the d_h GEMM. This times the op (loss, then the gradients
of h and of the fp32 weight, under bf16 autocast as in ``benchmarks/e2e.py``) on each pipeline
for each chunk size given, and the same head and loss written plainly under ``torch.compile``
(the whole logits, a float32 cross-entropy), the e2e baseline's LM head. Every row is checked
against the first. Printed: ms per step, the GEMMs' rate (3 GEMMs of 2 x rows x dim x vocab),
the peak memory above the inputs, and each row's time over the chunks pipeline at the default
chunk size.

    python benchmarks/lm_head.py [--rows 24576] [--dim 1536] [--vocab 100352]
                                 [--chunks 28 29 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from triton.testing import do_bench

from moec.kernels import cute_loss
from moec.kernels.target import LOSS_CHUNK_ELEMENTS, Target
from moec.ops import loss as loss_op

Step = Callable[[], tuple[Tensor, Tensor, Tensor]]


def moec_step(h: Tensor, weight: Tensor, targets: Tensor, impl: str, chunk: int) -> Step:
    """The op on implementation ``impl`` (``triton``: the chunks; ``cute``: quack's pipeline),
    ``chunk`` logits at a time."""

    def step() -> tuple[Tensor, Tensor, Tensor]:
        with torch.autocast("cuda", torch.bfloat16):
            op = torch.ops.moec.linear_cross_entropy
            loss = op(h, weight, None, targets, -100, "mean", True, chunk, impl)[0]
        return loss, *torch.autograd.grad(loss, (h, weight))

    return step


def compiled_step(h: Tensor, weight: Tensor, targets: Tensor) -> Step:
    @torch.compile
    def loss_of(h: Tensor, weight: Tensor) -> Tensor:
        with torch.autocast("cuda", torch.bfloat16):
            logits = F.linear(h, weight)
        return F.cross_entropy(logits.float(), targets)

    def step() -> tuple[Tensor, Tensor, Tensor]:
        loss = loss_of(h, weight)
        return loss, *torch.autograd.grad(loss, (h, weight))

    return step


def measure(step: Step, want: tuple[Tensor, ...] | None) -> tuple[float, float, tuple[Tensor, ...]]:
    """(ms, peak GiB above what was allocated before, the step's outputs)."""
    got = step()
    if want is not None:
        torch.testing.assert_close(got[0], want[0], atol=2e-3, rtol=1e-3)
        for g, w in zip(got[1:], want[1:], strict=True):
            error = ((g.float() - w.float()).norm() / w.float().norm()).item()
            assert error < 1e-2, f"a gradient differs from the first row's by {error:.2e}"
    del got
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return do_bench(step, warmup=5, rep=1000), peak, got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=24576)
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=100352)
    parser.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[28, 29, 30],
        help="log2 of the logits per chunk (the op's chunk_elements) to time",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    h = torch.randn(args.rows, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(args.vocab, args.dim, device="cuda") / args.dim**0.5
    weight.requires_grad_()
    targets = torch.randint(0, args.vocab, (args.rows,), device="cuda")
    flops = 3 * 2 * args.rows * args.dim * args.vocab
    default = LOSS_CHUNK_ELEMENTS
    print(f"device: {torch.cuda.get_device_name()}  rows {args.rows}  dim {args.dim}  "
          f"vocab {args.vocab}  default chunk 2^{default.bit_length() - 1}")  # fmt: skip
    results: dict[str, dict[str, float]] = {}
    want = None
    for log2 in args.chunks:
        rows = loss_op.chunk_rows(args.rows, args.vocab, 1 << log2)
        pipelines = [("chunks", "triton")]
        head = (h.to(torch.bfloat16), weight.to(torch.bfloat16), rows)
        if Target.detect("cuda").quack and cute_loss.takes(*head):
            pipelines.append(("fused", "cute"))
        for pipeline, impl in pipelines:
            ms, peak, got = measure(moec_step(h, weight, targets, impl, 1 << log2), want)
            want = got if want is None else want
            name = f"moec {pipeline}, chunks of 2^{log2} logits ({rows} rows)"
            results[name] = {"ms": ms, "peak_gib": peak, "log2": log2, "pipeline": pipeline}
    ms, peak, _ = measure(compiled_step(h, weight, targets), want)
    results["torch.compile, whole logits"] = {"ms": ms, "peak_gib": peak}
    default_ms = next(
        (
            r["ms"]
            for r in results.values()
            if r.get("log2") == default.bit_length() - 1 and r["pipeline"] == "chunks"
        ),
        None,
    )
    for name, r in results.items():
        ratio = f"  {r['ms'] / default_ms:.3f}x the default chunks'" if default_ms else ""
        print(f"{name:<50} {r['ms']:7.2f} ms  {flops / r['ms'] / 1e9:6.1f} TFLOP/s  "
              f"peak +{r['peak_gib']:5.2f} GiB{ratio}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": args.rows, "dim": args.dim, "vocab": args.vocab, **results}, f)


if __name__ == "__main__":
    main()
