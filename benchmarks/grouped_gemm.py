"""Grouped GEMM: moec's kernels vs ``torch._grouped_mm`` (the report's Table 48 shape).

x (M, 1536) bf16 split into 16 balanced groups, w (16, 1536, 3072):
  gmm        out = x @ w[e]                          vs torch._grouped_mm
  gmm+swiglu h = x @ w[e], a = silu(h_g) * h_u       vs _grouped_mm + moec's activation kernel
  dgrad      d_x = dy @ w[e]^T (transposed view)     vs torch._grouped_mm
  dgrad+act  d_a = dy @ w_down[e]^T, SwiGLU backward vs _grouped_mm + moec's activation backward
  wgrad      dw[e] = x_e^T @ dy_e                    vs torch._grouped_mm
Columns: "pointer" and "tma" force moec's pointer-based and persistent TMA Triton kernels
(graph-timed; the TMA kernel has no wgrad), "cute" and "cute_glu" the CuTe DSL GEMMs of
quack-kernels (when installed: ``pip install moec[cutlass]``), the gated activation on moec's
kernel or in quack's epilogue (there a gated h is interleaved, which the check undoes); "moec"
is the shipped policy
(:mod:`moec.kernels.gemm_backend`, which may pick ``_grouped_mm`` itself), "dense" is one
cuBLAS GEMM of the same total size (M x 1536 x 3072, a single weight): a ceiling for what a
grouped GEMM of 16 weights can reach.
Every forced result is checked against the baseline before timing; speedups are baseline time /
moec time, "eager" timed launch by launch (``do_bench``), "graph" replayed from a CUDA graph
(``do_bench_cudagraph``): the GPU time alone, which is what a run-ahead training step sees when
a kernel's host launch (~25 us for a Triton launch) is longer than its GPU time, as at M = 128.

    python benchmarks/grouped_gemm.py [--m 128 4096 32768 131072] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable

import torch
from triton.testing import do_bench, do_bench_cudagraph

from moec.kernels import activation, cute_gemm, gemm_backend, grouped_gemm
from moec.kernels.gemm_backend import GemmPolicy
from moec.kernels.target import Target
from moec.ops.activations import kernel_activation

GROUPS, K, N = 16, 1536, 3072


@functools.cache
def target() -> Target:
    """This machine's GPU (detected when the benchmark runs: ``--help`` needs no GPU)."""
    return Target.detect("cuda")


def forced() -> tuple[str, ...]:
    """The backends each case also runs forced to."""
    return ("pointer", "tma") + (("cute", "cute_glu") if target().quack else ())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def _first(out: torch.Tensor | tuple) -> torch.Tensor:
    return out[-1] if isinstance(out, tuple) else out


def cases(m: int, policy: GemmPolicy) -> dict[str, tuple[Callable, Callable]]:
    """name -> (moec call on ``policy``, baseline call); each returns the tensor to compare (a
    gated d_h from an interleaved h is compared after :func:`cute_gemm.deinterleave`)."""
    torch.manual_seed(m)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, K, **bf)
    w = torch.randn(GROUPS, K, N, **bf) / K**0.5
    dy = torch.randn(m, N, **bf)
    d_y = torch.randn(m, K, **bf)  # the down projection's output gradient (K wide)
    w_down = torch.randn(GROUPS, N // 2, K, **bf) / K**0.5
    h = torch.randn(m, N, **bf)
    offs = torch.arange(1, GROUPS + 1, device="cuda", dtype=torch.int32) * (m // GROUPS)
    gg = grouped_gemm
    swiglu = kernel_activation("swiglu")
    h_pairs = h.unflatten(-1, (2, N // 2)).transpose(-1, -2).reshape(m, N)  # interleaved h

    def moec_act_backward() -> torch.Tensor:
        if not gg.h_interleaved(x, w, False, swiglu, policy):
            return gg.gmm_act_backward(d_y, w_down, offs, h, swiglu, False, policy)[0]
        d_h = gg.gmm_act_backward(d_y, w_down, offs, h_pairs, swiglu, True, policy)[0]
        return cute_gemm.deinterleave(d_h[None], d_h.dtype)[0]

    def base_act() -> torch.Tensor:
        return activation.act_forward(torch._grouped_mm(x, w, offs=offs), swiglu)

    def base_act_backward() -> torch.Tensor:
        d_a = torch._grouped_mm(d_y, w_down.transpose(-1, -2), offs=offs)
        return activation.act_backward(h, d_a, swiglu)[0]

    return {
        "gmm": (
            lambda: gg.gmm(x, w, offs, None, "down", policy),
            lambda: torch._grouped_mm(x, w, offs=offs),
        ),
        "gmm+swiglu": (lambda: gg.gmm_act(x, w, offs, None, swiglu, None, policy)[1], base_act),
        "dgrad": (
            lambda: gg.gmm(dy, w.transpose(-1, -2), offs, None, "dgrad", policy),
            lambda: torch._grouped_mm(dy, w.transpose(-1, -2), offs=offs),
        ),
        "dgrad+act": (moec_act_backward, base_act_backward),
        "wgrad": (
            lambda: gg.gmm_wgrad(x, dy, offs, None, policy),
            lambda: torch._grouped_mm(x.t(), dy, offs=offs),
        ),
    }


def run(m: int) -> list[dict]:
    flops = 2 * m * K * N
    a = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    dense_ms = do_bench(lambda: a @ b)
    out = []
    for name, (moec_fn, base_fn) in cases(m, target().gemm_policy()).items():
        row = {"op": name, "M": m, "dense_tflops": flops / dense_ms / 1e9}
        want = base_fn()
        for backend in forced():
            if (backend == "tma" and name == "wgrad") or (
                backend == "cute_glu" and name not in ("gmm+swiglu", "dgrad+act")
            ):  # no TMA wgrad; cute_glu differs from cute on the gated pieces alone
                continue
            forced_fn = cases(m, GemmPolicy.parse(backend))[name][0]
            err = _rel(_first(forced_fn()), want)
            if err > 1e-2:
                raise AssertionError(f"{name} M={m} {backend}: relative error {err:.3g}")
            row[f"{backend}_ms"] = do_bench_cudagraph(forced_fn)
        row["moec_ms"] = do_bench(moec_fn)
        row["grouped_mm_ms"] = do_bench(base_fn)
        row["moec_graph_ms"] = do_bench_cudagraph(moec_fn)
        row["grouped_mm_graph_ms"] = do_bench_cudagraph(base_fn)
        row["moec_tflops"] = flops / row["moec_graph_ms"] / 1e9
        row["speedup"] = row["grouped_mm_ms"] / row["moec_ms"]
        row["graph_speedup"] = row["grouped_mm_graph_ms"] / row["moec_graph_ms"]
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[128, 4096, 32768])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(gemm_backend.policy_text(target().arch, target().gemm_policy()))
    rows = [r for m in args.m for r in run(m)]
    forced_head = "".join(f"{b:>9}" for b in forced())
    print(f"{'op':<11}{'M':>7}{forced_head}{'moec':>9}{'_grouped_mm':>12}"
          f"{'graph moec':>11}{'graph gmm':>10}{'TF/s':>6}{'dense':>6}"
          f"{'eager':>8}{'graph':>7}")  # fmt: skip
    for r in rows:
        forced_ms = "".join(f"{r.get(f'{b}_ms', float('nan')) * 1e3:>9.1f}" for b in forced())
        print(f"{r['op']:<11}{r['M']:>7}{forced_ms}{r['moec_ms'] * 1e3:>9.1f}"
              f"{r['grouped_mm_ms'] * 1e3:>12.1f}{r['moec_graph_ms'] * 1e3:>11.1f}"
              f"{r['grouped_mm_graph_ms'] * 1e3:>10.1f}{r['moec_tflops']:>6.0f}"
              f"{r['dense_tflops']:>6.0f}"
              f"{r['speedup']:>7.2f}x{r['graph_speedup']:>6.2f}x")  # fmt: skip
    print("(times in us; TF/s of moec from the graph time; speedups over _grouped_mm)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
