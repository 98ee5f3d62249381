"""A dense gated FFN run as one k-major expert of ``moec.expert_mlp``, beside moec's dense path.

The e2e model's dense FFNs (``benchmarks/e2e.py``: one microbatch of 3 x 8192 tokens, d = 1536,
SwiGLU width 24576 in the two dense blocks and 1536 in the six shared experts), forward +
backward (d_x and both weight gradients), ms from ``do_bench``:

  linear+glu  what the compiled program runs today (pass ``fuse_glu``): ``h = x @ W_cat^T``
              (cuBLAS, W_cat = [W_gate; W_up], the bf16 working copy), ``moec.glu(h)``,
              ``y = a @ W_down^T``
  compiled    the plain FFN ``(silu(x W_gate^T) * (x W_up^T)) W_down^T`` under ``torch.compile``
  one_expert  ``moec.expert_mlp`` with a single expert whose weights are ``W_cat^T`` and
              ``W_down^T`` (k-major views, no copy): with quack-kernels installed the policy
              runs SwiGLU in the up GEMM's epilogue and its backward in the down dgrad's

Every row is checked against the float32 result of ``linear+glu`` before it is timed; the last
column is ``linear+glu`` over each row (> 1: faster than today's dense path).

    python benchmarks/dense_ffn.py [--tokens 24576] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from triton.testing import do_bench

import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.kernels import grouped_gemm as gg
from moec.kernels.activation import UNARY_CODES, KernelActivation

D = 1536
WIDTHS = {"dense block": 24576, "shared expert": 1536}

SWIGLU = KernelActivation(UNARY_CODES["silu"], True)

Step = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, ...]]


def linear_glu(x: Tensor, w_cat: Tensor, w_down: Tensor, dy: Tensor) -> tuple[Tensor, ...]:
    a = torch.ops.moec.glu(F.linear(x, w_cat), "swiglu")
    y = F.linear(a, w_down)
    return y, *torch.autograd.grad(y, (x, w_cat, w_down), dy)


def plain(x: Tensor, w_cat: Tensor, w_down: Tensor) -> Tensor:
    gate, up = F.linear(x, w_cat).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


def compiled_step() -> Step:
    ffn = torch.compile(plain)

    def step(x: Tensor, w_cat: Tensor, w_down: Tensor, dy: Tensor) -> tuple[Tensor, ...]:
        y = ffn(x, w_cat, w_down)
        return y, *torch.autograd.grad(y, (x, w_cat, w_down), dy)

    return step


def one_expert(x: Tensor, w_cat: Tensor, w_down: Tensor, dy: Tensor) -> tuple[Tensor, ...]:
    offsets = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
    w_up_k, w_down_k = w_cat.t().unsqueeze(0), w_down.t().unsqueeze(0)  # k-major views
    y, _ = torch.ops.moec.expert_mlp(x, w_up_k, w_down_k, offsets, None, None, "swiglu")
    return y, *torch.autograd.grad(y, (x, w_cat, w_down), dy)


def _rel(a: Tensor, b: Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def measure(tokens: int, width: int) -> dict[str, object]:
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, D, **bf, requires_grad=True)
    w_cat = (torch.randn(2 * width, D, **bf) / D**0.5).requires_grad_()
    w_down = (torch.randn(D, width, **bf) / width**0.5).requires_grad_()
    dy = torch.randn(tokens, D, **bf)
    leaves = (x, w_cat, w_down)
    want = linear_glu(*(t.detach().float().requires_grad_() for t in leaves), dy.float())
    flops = 3 * 2 * tokens * D * 3 * width  # fwd + 2x bwd of the up (2H) and down (H) GEMMs
    k_major = w_cat.t().unsqueeze(0)
    row: dict[str, object] = {
        "tokens": tokens,
        "width": width,
        "up_backend": gg.up_backend(x, k_major, False, SWIGLU),
    }
    steps: dict[str, Step] = {
        "linear+glu": linear_glu,
        "compiled": compiled_step(),
        "one_expert": one_expert,
    }
    for name, step in steps.items():
        got = step(*leaves, dy)
        err = max(_rel(g, w) for g, w in zip(got, want, strict=True))
        if err > 2e-2:
            raise AssertionError(f"{name} at width {width}: relative error {err:.2e} vs float32")
        ms = do_bench(lambda step=step: step(*leaves, dy))
        row[name] = {"ms": ms, "tflops": flops / ms / 1e9, "max_rel_err": err}
    base = row["linear+glu"]["ms"]
    for name in steps:
        row[name]["speedup"] = base / row[name]["ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3 * 8192)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for label, width in WIDTHS.items():
        row = measure(args.tokens, width)
        rows.append({"ffn": label, **row})
        print(f"{label}: {args.tokens} tokens, d {D} -> SwiGLU {width}, up backend of one_expert: "
              f"{row['up_backend']}")  # fmt: skip
        for name in ("linear+glu", "compiled", "one_expert"):
            r = row[name]
            print(
                f"  {name:<11} {r['ms']:8.3f} ms {r['tflops']:6.0f} TFLOP/s  "
                f"err {r['max_rel_err']:.1e}  linear+glu/this {r['speedup']:.3f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
