"""Causal attention forward and backward at the e2e shape: torch's SDPA backends and FA4.

The e2e model's attention (3 sequences of 8192 tokens, 12 heads of 128, causal, bf16) on each of
``scaled_dot_product_attention``'s CUDA backends (cuDNN: what torch picks on Hopper; flash: FA2;
efficient) and on FlashAttention 4's CuTe DSL kernels (``flash_attn.cute``, package
flash-attn-4; sm90 and sm100), which ``moec::flash_attention`` runs
(``moec.kernels.flash_attention``). Every row's output and gradients are checked against the
cuDNN row first. Printed: ms (``do_bench`` median) of the forward and of forward + backward,
and the rate of the causal attention's FLOPs (forward 2 GEMMs, backward 5, over half the
score matrix).

    python benchmarks/attention.py [--batch 3] [--seq 8192] [--heads 12] [--head-dim 128]
                                   [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from moec.kernels import flash_attention

BACKENDS = {
    "sdpa cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa flash": SDPBackend.FLASH_ATTENTION,
    "sdpa efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def _sdpa(backend: SDPBackend) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return attend


def _fa4(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return torch.ops.moec.flash_attention(q, k, v, True, q.shape[-1] ** -0.5)[0]


def _relative(a: Tensor, b: Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--json")
    args = parser.parse_args()
    import moec.ops  # noqa: F401  (registers torch.ops.moec)

    shape = (args.batch, args.heads, args.seq, args.head_dim)
    # (B, S, H, D) storage seen as (B, H, S, D), as a model's q/k/v reach attention
    q, k, v = (
        torch.randn(args.batch, args.seq, args.heads, args.head_dim, device="cuda")
        .to(torch.bfloat16)
        .transpose(1, 2)
        .requires_grad_()
        for _ in range(3)
    )
    d_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    causal_pairs = args.batch * args.heads * args.seq * (args.seq + 1) / 2
    flops = {"forward": 4 * causal_pairs * args.head_dim}
    flops["forward+backward"] = flops["forward"] * 3.5
    rows = {name: _sdpa(backend) for name, backend in BACKENDS.items()}
    if flash_attention.takes(q, k, v, causal=True):
        rows["fa4 (moec::flash_attention)"] = _fa4
    else:
        print(f"note: FA4 does not run here: {flash_attention.why_not(q, k, v, causal=True)}")
    print(f"device: {torch.cuda.get_device_name()}  q/k/v {shape} bf16, causal")
    want = None
    results: dict[str, dict[str, float]] = {}
    for name, attend in rows.items():
        try:
            out = attend(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), d_out)
        except RuntimeError as error:  # a backend that does not take this shape
            print(f"{name:<30} skipped: {str(error).splitlines()[0]}")
            continue
        got = (out, *grads)
        if want is None:
            want = got
        errors = [_relative(g, w) for g, w in zip(got, want, strict=True)]
        assert max(errors) < 2e-2, f"{name}: out/dq/dk/dv differ from the first row by {errors}"
        forward = do_bench(lambda attend=attend: attend(q, k, v), rep=300, return_mode="median")
        both = do_bench(
            lambda attend=attend: torch.autograd.grad(attend(q, k, v), (q, k, v), d_out),
            rep=300,
            return_mode="median",
        )
        results[name] = {"forward_ms": forward, "forward_backward_ms": both, "error": max(errors)}
        print(
            f"{name:<30} forward {forward:7.3f} ms {flops['forward'] / forward / 1e9:6.0f} TFLOP/s"
            f"   forward+backward {both:7.3f} ms "
            f"{flops['forward+backward'] / both / 1e9:6.0f} TFLOP/s   error {max(errors):.1e}"
        )
    first = next(iter(results.values()))["forward_backward_ms"]
    for name, r in results.items():
        print(f"{name:<30} {first / r['forward_backward_ms']:.3f}x the first row, forward+backward")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": shape, **results}, f)


if __name__ == "__main__":
    main()
