"""Row movement at the e2e shape: moec's dispatch / combine kernels vs the torch index ops a
careful user writes (gather of sorted rows, index_copy back + weighted sum), forward and backward.

Tokens 3 x 8192, d 1536, top-8 (every route accepted, rows in expert-major order from a random
router). Prints time and achieved bandwidth (bytes a kernel must read + write) and the ratio.

    python -m benchmarks.movement [--tokens 24576] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from moec.kernels import movement
from moec.ops.routing import route_reference


def bench(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3 * 8192)
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    t, d, k = args.tokens, args.dim, args.top_k
    logits = torch.randn(t, args.experts, device="cuda")
    _, weights, rows, _, _ = route_reference(logits, k, 0.0, "softmax", True, "learned")
    order = torch.argsort(rows.reshape(-1))  # buffer row r holds route order[r] (token r // k)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(t * k, d, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    w16 = weights.to(torch.bfloat16)
    row_bytes = t * k * d * 2  # the (T*K, D) buffer once
    tok_bytes = t * d * 2
    cases = {
        "dispatch": (
            lambda: movement.dispatch(x, rows),
            lambda: x[order // k],
            row_bytes + tok_bytes,
        ),
        "combine": (
            lambda: movement.combine(y, weights, rows),
            lambda: (y[rows.reshape(-1)].view(t, k, d) * w16[..., None]).sum(1),
            row_bytes + tok_bytes,
        ),
        "combine backward": (
            lambda: movement.combine_backward(y, weights, rows, g),
            lambda: (
                (g[:, None, :] * w16[..., None]).reshape(-1, d)[order],
                (y[rows.reshape(-1)].view(t, k, d) * g[:, None, :]).sum(-1),
            ),
            2 * row_bytes + tok_bytes,
        ),
    }
    results = []
    print(f"row movement, {torch.cuda.get_device_name()}, T={t} D={d} K={k}, bf16")
    print(f"{'op':18} {'moec ms':>9} {'GB/s':>7} {'torch ms':>9} {'speedup':>8}")
    for name, (ours, theirs, nbytes) in cases.items():
        a, b = bench(ours), bench(theirs)
        results.append({"op": name, "moec_s": a, "torch_s": b, "moec_gbps": nbytes / a / 1e9})
        print(f"{name:18} {a * 1e3:9.3f} {nbytes / a / 1e9:7.0f} {b * 1e3:9.3f} {b / a:7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
