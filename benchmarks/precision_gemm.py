"""Table 48 of the report: low-precision grouped GEMM speed relative to bf16 ``torch._grouped_mm``.

One up projection 1536 -> 3072 over 16 balanced expert groups at M = 128 / 4096 / 32768 rows,
"prequantized" (operands already FP8) and "including Q" (the activation quantization charged),
in eager submission (25 ms warm-up, 100 ms timed window) and CUDA-graph replay (32 captured
copies, 3 warm-up and 5 timed replays). Variants:

- ``fp8_rowwise``: Triton row quantizer + ``torch._scaled_grouped_mm`` (sm90 only), with
  exact and with fast accumulation (``fast_accum``: what the ops run for forward GEMMs), and
  the quantizer alone (``quantize_only``, its share of "including Q");
- ``mxfp8``: the Triton ``tl.dot_scaled`` kernels of :mod:`moec.kernels.mxfp8` (native
  block-scaled MMA on sm100+, emulated on sm90); "including Q" as a separate quantize kernel
  (``q+gemm``) and fused in the GEMM (``fused``).

Every value printed is ``t(bf16) / t(variant)`` at the same M and mode (> 1: faster than bf16).
A config that fails is reported with its error and the run goes on.

    python benchmarks/precision_gemm.py --out results/precision_gemm.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import traceback
from collections.abc import Callable

import torch


def eager_time(fn: Callable[[], object], warmup_ms: float, window_ms: float) -> float:
    """Seconds per call: calls submitted back to back for a warm-up then a timed window."""
    end = time.perf_counter() + warmup_ms / 1e3
    while time.perf_counter() < end:
        fn()
    torch.cuda.synchronize()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < window_ms / 1e3:
        fn()
        calls += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def graph_time(fn: Callable[[], object], copies: int, warmup: int, timed: int) -> float:
    """Seconds per call from replaying a graph of ``copies`` captured calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(copies):
            fn()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(timed):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1e3 / (timed * copies)


def variants(m: int, k: int, n: int, groups: int) -> dict[str, Callable[[], object]]:
    """name -> a zero-argument call; names are ``<recipe>/<prequantized|with_q...>``."""
    from moec.kernels import fp8_rowwise, mxfp8

    device = torch.device("cuda")
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(groups, k, n, device=device, dtype=torch.bfloat16) / k**0.5
    offsets = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * (m // groups)
    calls: dict[str, Callable[[], object]] = {
        "bf16": lambda: torch._grouped_mm(x, w, offs=offsets),
    }
    xq, wq = mxfp8.mx_quantize(x), mxfp8.mx_quantize_weight(w)
    bf16 = torch.bfloat16
    calls["mxfp8/prequantized"] = lambda: mxfp8.mx_gmm(xq, wq, offsets, bf16)
    calls["mxfp8/with_q(q+gemm)"] = lambda: mxfp8.mx_gmm(mxfp8.mx_quantize(x), wq, offsets, bf16)
    calls["mxfp8/with_q(fused)"] = lambda: mxfp8.mx_gmm(x, wq, offsets, bf16)
    if fp8_rowwise.scaled_grouped_mm_available(device):
        xr, wr = fp8_rowwise.rowwise_quantize(x), fp8_rowwise.quantize_weight(w)
        calls["fp8_rowwise/prequantized"] = lambda: fp8_rowwise.rowwise_gmm(xr, wr, offsets)
        calls["fp8_rowwise/with_q"] = lambda: fp8_rowwise.rowwise_gmm(
            fp8_rowwise.rowwise_quantize(x), wr, offsets
        )
        # what the ops run for forward GEMMs (dgrad keeps exact accumulation)
        calls["fp8_rowwise/prequantized,fast_accum"] = lambda: fp8_rowwise.rowwise_gmm(
            xr, wr, offsets, fast_accum=True
        )
        calls["fp8_rowwise/with_q,fast_accum"] = lambda: fp8_rowwise.rowwise_gmm(
            fp8_rowwise.rowwise_quantize(x), wr, offsets, fast_accum=True
        )
        calls["fp8_rowwise/quantize_only"] = lambda: fp8_rowwise.rowwise_quantize(x)
    return calls


def check(calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Relative error of every GEMM variant against bf16 (a wrong kernel must not look fast)."""
    ref = calls["bf16"]().float()
    outputs = {name: fn() for name, fn in calls.items() if name != "bf16"}
    return {
        name: float((out.float() - ref).norm() / ref.norm())
        for name, out in outputs.items()
        if isinstance(out, torch.Tensor)  # not the quantizer alone
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--m", type=int, nargs="+", default=[128, 4096, 32768])
    parser.add_argument("--k", type=int, default=1536)
    parser.add_argument("--n", type=int, default=3072)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--no-graph", action="store_true", help="skip CUDA-graph replay")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("precision_gemm needs a CUDA device")
    import triton

    results = {
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "shape": {"k": args.k, "n": args.n, "groups": args.groups},
        "rows": [],
    }
    for m in args.m:
        row: dict[str, object] = {"m": m, "seconds": {}, "errors": {}, "failures": {}}
        try:
            calls = variants(m, args.k, args.n, args.groups)
            row["rel_error_vs_bf16"] = check(calls)
        except Exception as exc:  # noqa: BLE001 - report and go on
            row["failures"]["setup"] = f"{type(exc).__name__}: {exc}"
            results["rows"].append(row)
            continue
        for name, fn in calls.items():
            for mode in ("eager", "graph"):
                if mode == "graph" and args.no_graph:
                    continue
                try:
                    t = eager_time(fn, 25, 100) if mode == "eager" else graph_time(fn, 32, 3, 5)
                    row["seconds"][f"{name}@{mode}"] = t
                except Exception as exc:  # noqa: BLE001
                    row["failures"][f"{name}@{mode}"] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
        results["rows"].append(row)
        print_row(row)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print_table(results)


def _speedup(row: dict, name: str, mode: str) -> str:
    seconds = row["seconds"]
    base, t = seconds.get(f"bf16@{mode}"), seconds.get(f"{name}@{mode}")
    return f"{base / t:.2f}x" if base and t else "-"


def print_row(row: dict) -> None:
    for key, value in sorted(row["seconds"].items()):
        print(f"  M={row['m']:>6} {key:<34} {value * 1e6:10.1f} us")
    for key, value in row["failures"].items():
        print(f"  M={row['m']:>6} {key:<34} FAILED {value}")


def print_table(results: dict) -> None:
    names = sorted({k.split("@")[0] for r in results["rows"] for k in r["seconds"]} - {"bf16"})
    print(
        f"\nSpeed vs bf16 torch._grouped_mm on {results['device']} "
        f"({results['shape']['k']} -> {results['shape']['n']}, {results['shape']['groups']} "
        "groups); eager | graph"
    )
    print(f"{'variant':<28}" + "".join(f"{'M=' + str(r['m']):>20}" for r in results["rows"]))
    for name in names:
        cells = [
            f"{_speedup(r, name, 'eager')} | {_speedup(r, name, 'graph')}" for r in results["rows"]
        ]
        print(f"{name:<28}" + "".join(f"{c:>20}" for c in cells))
    for r in results["rows"]:
        errors = ", ".join(f"{k} {v:.4f}" for k, v in r.get("rel_error_vs_bf16", {}).items())
        print(f"M={r['m']}: relative error vs bf16: {errors}")


if __name__ == "__main__":
    main()
