"""``moec::glu`` (the dense FFNs' gated activation) forward and backward, beside torch.compile.

At the e2e model's shapes (24576 tokens; the dense blocks' 2 x 24576 pre-activation, the shared
experts' 2 x 1536), times in one run:

  forward      ``moec::glu``: reads h = [gate | up], writes a
  backward     ``moec::glu_backward``: reads h and d_a, writes d_h (the kernel's gradient alone)
  backward+a   the same kernel writing a too, as the expert MLPs' backward needs it for their
               weight gradient (what ``moec::glu``'s backward ran before it took the gradient
               alone)
  compiled     ``silu(gate) * up`` and its backward under ``torch.compile``: the strongest
               baseline a careful user writes

and each of the activation kernel's autotune tiles (``moec.kernels.activation.TILES``) for the
forward and the backward. Printed: ms (``do_bench`` median), the bandwidth of the minimum
traffic (each input read once, each output written once), and moec's ratio to compiled.
Every timed output is checked against the reference first.

    python benchmarks/glu.py [--rows 24576] [--widths 24576 1536] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from torch import Tensor
from triton.testing import do_bench

from moec.kernels import activation
from moec.ops.activations import activate, activate_backward

SILU = activation.KernelActivation(activation.UNARY_CODES["silu"], gated=True)


def _check(got: Tensor, want: Tensor, what: str) -> None:
    error = ((got.float() - want).norm() / want.norm()).item()
    assert error < 1e-2, f"{what}: relative error {error:.2e} against the reference"


def _time(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def _tile_rows(h: Tensor, d_a: Tensor, backward: bool) -> dict[str, float]:
    """ms of each autotune tile, forward (a) or backward (d_h alone)."""
    rows, hidden = d_a.shape
    out = torch.empty_like(h) if backward else torch.empty_like(d_a)
    times = {}
    for config in activation.TILES:
        block_r, block_h = config.kwargs["BLOCK_R"], config.kwargs["BLOCK_H"]
        grid = (triton.cdiv(rows, block_r), triton.cdiv(hidden, block_h))

        def launch(config=config, grid=grid) -> None:
            activation._act_kernel[grid](
                h, d_a, d_a if backward else out, out, rows, hidden, h.stride(0), d_a.stride(0),
                ACT=SILU.code, GATED=True, BACKWARD=backward, STORE_A=not backward,
                num_warps=config.num_warps, **config.kwargs,
            )  # fmt: skip

        times[f"{block_r}x{block_h}/{config.num_warps}w"] = _time(launch)
    return times


def measure(rows: int, width: int) -> dict[str, object]:
    h = torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16)
    d_a = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    want_a = activate(h.float(), "swiglu")
    want_d_h = activate_backward(h.float(), d_a.float(), "swiglu")

    @torch.compile
    def compiled_forward(h: Tensor) -> Tensor:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    h_leaf = h.detach().requires_grad_()

    def compiled_backward() -> Tensor:
        (d_h,) = torch.autograd.grad(compiled_forward(h_leaf), h_leaf, d_a)
        return d_h

    runs: dict[str, tuple[Callable[[], Tensor], Tensor, float]] = {
        "moec forward": (lambda: torch.ops.moec.glu(h, "swiglu"), want_a, 3.0),
        "moec backward": (lambda: torch.ops.moec.glu_backward(h, d_a, "swiglu"), want_d_h, 5.0),
        "moec backward+a": (lambda: activation.act_backward(h, d_a, SILU)[0], want_d_h, 6.0),
        "compiled forward": (lambda: compiled_forward(h), want_a, 3.0),
        # forward and backward: the compiled backward recomputes nothing it saved
        "compiled forward+backward": (compiled_backward, want_d_h, 8.0),
    }
    result: dict[str, object] = {"rows": rows, "width": width}
    element_bytes = rows * width * h.element_size()
    for name, (fn, want, traffic) in runs.items():
        _check(fn(), want, name)
        ms = _time(fn)
        result[name] = {"ms": ms, "tb_s": traffic * element_bytes / ms / 1e9}
    result["tiles forward"] = _tile_rows(h, d_a, backward=False)
    result["tiles backward"] = _tile_rows(h, d_a, backward=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=24576)
    parser.add_argument("--widths", type=int, nargs="+", default=[24576, 1536])
    parser.add_argument("--json")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  rows {args.rows}")
    results = []
    for width in args.widths:
        r = measure(args.rows, width)
        results.append(r)
        print(f"\nwidth {width} (h {args.rows} x {2 * width})")
        for name, v in r.items():
            if isinstance(v, dict) and "ms" in v:
                print(f"  {name:<28} {v['ms']:8.3f} ms  {v['tb_s']:5.2f} TB/s")
        ms = {name: v["ms"] for name, v in r.items() if isinstance(v, dict) and "ms" in v}
        compiled_backward = ms["compiled forward+backward"] - ms["compiled forward"]
        print(f"  compiled / moec, forward: {ms['compiled forward'] / ms['moec forward']:.3f}x")
        print(
            "  compiled (forward+backward - forward) / moec, backward: "
            f"{compiled_backward / ms['moec backward']:.3f}x"
        )
        print(f"  backward+a / backward: {ms['moec backward+a'] / ms['moec backward']:.3f}x")
        for mode in ("tiles forward", "tiles backward"):
            tiles = "  ".join(f"{k} {t:.3f}" for k, t in r[mode].items())
            print(f"  {mode}: {tiles}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
