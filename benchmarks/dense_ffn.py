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
  fp8         ``linear+glu`` with both projections ``moec.quantized_linear(..., "fp8_rowwise")``
              (what the ``precision`` pass emits: rowwise-scaled FP8 forward and d_x GEMMs,
              bf16 weight gradients)
  torchao     anchor for ``fp8``: the plain FFN as three ``nn.Linear`` converted by torchao's
              ``convert_to_float8_training`` (recipe ``rowwise_with_gw_hp``: the same split of
              FP8 and bf16 GEMMs) under ``torch.compile``; skipped where torchao is not installed
  torchao_all the same with torchao's recipe ``rowwise``: the weight gradients in FP8 too
              (each operand quantized along the tokens), what FP8 weight gradients would buy

Every row is checked against the float32 result of ``linear+glu`` before it is timed (relative
error 2e-2, FP8 rows 1e-1); the last column is ``linear+glu`` over each row (> 1: faster than
today's dense path).

    python benchmarks/dense_ffn.py [--tokens 24576] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from triton.testing import do_bench

import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.kernels import grouped_gemm as gg
from moec.kernels.activation import UNARY_CODES, KernelActivation

D = 1536
WIDTHS = {"dense block": 24576, "shared expert": 1536}

TORCHAO_RECIPES = {"torchao": "rowwise_with_gw_hp", "torchao_all": "rowwise"}
FP8_ROWS = ("fp8", *TORCHAO_RECIPES)
OUTPUTS = ("y", "d_x", "d_w_cat", "d_w_down")
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


def fp8_linears(x: Tensor, w_cat: Tensor, w_down: Tensor, dy: Tensor) -> tuple[Tensor, ...]:
    linear = torch.ops.moec.quantized_linear
    a = torch.ops.moec.glu(linear(x, w_cat, None, "fp8_rowwise"), "swiglu")
    y = linear(a, w_down, None, "fp8_rowwise")
    return y, *torch.autograd.grad(y, (x, w_cat, w_down), dy)


class GatedFFN(nn.Module):
    def __init__(self, w_cat: Tensor, w_down: Tensor) -> None:
        super().__init__()
        width = w_down.shape[1]
        self.gate, self.up, self.down = (
            nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
            for w in (w_cat[:width], w_cat[width:], w_down)
        )
        with torch.no_grad():
            for linear, w in zip((self.gate, self.up, self.down), (*w_cat.split(width), w_down)):
                linear.weight.copy_(w)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def torchao_step(w_cat: Tensor, w_down: Tensor, recipe: str) -> Step | None:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    ffn = GatedFFN(w_cat.detach(), w_down.detach())
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(ffn, config=config)
    compiled = torch.compile(ffn)
    weights = (ffn.gate.weight, ffn.up.weight, ffn.down.weight)

    def step(x: Tensor, w_cat: Tensor, w_down: Tensor, dy: Tensor) -> tuple[Tensor, ...]:
        y = compiled(x)
        d_x, d_gate, d_up, d_down = torch.autograd.grad(y, (x, *weights), dy)
        return y, d_x, torch.cat([d_gate, d_up]), d_down

    return step


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
        "fp8": fp8_linears,
    }
    for name, recipe in TORCHAO_RECIPES.items():
        anchor = torchao_step(w_cat, w_down, recipe)
        if anchor is not None:
            steps[name] = anchor
    for name, step in steps.items():
        got = step(*leaves, dy)
        errs = [_rel(g, w) for g, w in zip(got, want, strict=True)]
        err = max(errs)
        if err > (1e-1 if name in FP8_ROWS else 2e-2):
            named = ", ".join(f"{o} {e:.1e}" for o, e in zip(OUTPUTS, errs, strict=True))
            raise AssertionError(f"{name} at width {width}: relative error vs float32: {named}")
        ms = do_bench(lambda step=step: step(*leaves, dy))
        row[name] = {"ms": ms, "tflops": flops / ms / 1e9, "max_rel_err": err, "rel_errs": errs}
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
        for name in ("linear+glu", "compiled", "one_expert", *FP8_ROWS):
            if name not in row:
                continue
            r = row[name]
            print(
                f"  {name:<11} {r['ms']:8.3f} ms {r['tflops']:6.0f} TFLOP/s  "
                f"err {' '.join(f'{e:.1e}' for e in r['rel_errs'])}  "
                f"linear+glu/this {r['speedup']:.3f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
