"""Grouped GEMM: moec's Triton kernels vs ``torch._grouped_mm`` (the report's Table 48 shape).

x (M, 1536) bf16 split into 16 balanced groups, w (16, 1536, 3072):
  gmm        out = x @ w[e]                       moec vs torch._grouped_mm
  gmm+swiglu h = x @ w[e], a = silu(h_g) * h_u    moec vs _grouped_mm + moec act kernel
  wgrad      dw[e] = x_e^T @ dy_e                 moec vs torch._grouped_mm
"triton" forces moec's Triton kernels; "moec" is the default policy, which sends a piece to
``torch._grouped_mm`` where that measured faster (so there it equals the baseline). Each Triton
result is checked against ``torch._grouped_mm`` before timing.

    python benchmarks/grouped_gemm.py [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator

import torch
from triton.testing import do_bench

from moec.kernels import activation, grouped_gemm

GROUPS, K, N = 16, 1536, 3072


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def _check(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    err = _rel(a, b)
    if err > 1e-2:
        raise AssertionError(f"{name}: relative error {err:.3g} vs torch._grouped_mm")


def run(m: int) -> list[dict]:
    torch.manual_seed(m)
    dev = "cuda"
    x = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(GROUPS, K, N, device=dev, dtype=torch.bfloat16) / K**0.5
    dy = torch.randn(m, N, device=dev, dtype=torch.bfloat16)
    offs = torch.arange(1, GROUPS + 1, device=dev, dtype=torch.int32) * (m // GROUPS)

    def base_act() -> tuple[torch.Tensor, torch.Tensor]:
        h = torch._grouped_mm(x, w, offs=offs)
        return h, activation.act_forward(h, "swiglu")

    cases = {
        "gmm": (
            lambda: grouped_gemm.gmm(x, w, offs),
            lambda: torch._grouped_mm(x, w, offs=offs),
            2 * m * K * N,
        ),
        "gmm+swiglu": (
            lambda: grouped_gemm.gmm_act(x, w, offs, None, "swiglu")[1],
            lambda: base_act()[1],
            2 * m * K * N,
        ),
        "wgrad": (
            lambda: grouped_gemm.gmm_wgrad(x, dy, offs),
            lambda: torch._grouped_mm(x.t(), dy, offs=offs),
            2 * m * K * N,
        ),
    }
    out = []
    for name, (moec_fn, base_fn, flops) in cases.items():
        with triton_only():
            _check(f"{name} M={m}", moec_fn(), base_fn())
            t_triton = do_bench(moec_fn)
        t_moec = do_bench(moec_fn)
        t_base = do_bench(base_fn)
        out.append(
            {
                "op": name,
                "M": m,
                "triton_ms": t_triton,
                "moec_ms": t_moec,
                "grouped_mm_ms": t_base,
                "moec_tflops": flops / t_moec / 1e9,
                "grouped_mm_tflops": flops / t_base / 1e9,
                "triton_speedup": t_base / t_triton,
                "speedup": t_base / t_moec,
            }
        )
    return out


@contextlib.contextmanager
def triton_only() -> Iterator[None]:
    """Force the Triton kernels (moec's default policy picks _grouped_mm where it is faster)."""
    saved = dict(grouped_gemm.GROUPED_MM_PIECES), grouped_gemm.GROUPED_MM_MIN_ROWS
    grouped_gemm.GROUPED_MM_PIECES.update(sm90=frozenset(), sm100=frozenset())
    grouped_gemm.GROUPED_MM_MIN_ROWS = 0
    try:
        yield
    finally:
        grouped_gemm.GROUPED_MM_PIECES.update(saved[0])
        grouped_gemm.GROUPED_MM_MIN_ROWS = saved[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[128, 4096, 32768])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    rows = [r for m in args.m for r in run(m)]
    print(f"{'op':<12}{'M':>7}{'triton ms':>11}{'moec ms':>10}{'_grouped_mm ms':>16}"
          f"{'moec TF/s':>11}{'gmm TF/s':>10}{'triton':>8}{'moec':>8}")  # fmt: skip
    for r in rows:
        times = f"{r['triton_ms']:>11.4f}{r['moec_ms']:>10.4f}{r['grouped_mm_ms']:>16.4f}"
        rates = f"{r['moec_tflops']:>11.1f}{r['grouped_mm_tflops']:>10.1f}"
        ratios = f"{r['triton_speedup']:>7.2f}x{r['speedup']:>7.2f}x"
        print(f"{r['op']:<12}{r['M']:>7}{times}{rates}{ratios}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
