"""The FP8 row quantizer on the e2e model's rows, at several one-pass widths.

``moec.kernels.fp8_rowwise.rowwise_quantize`` keeps a row up to ``ROW_ONE_PASS_MAX`` wide in
registers (read once; 4 warps per 8192 values, up to 16); a wider row is read twice, in chunks
(the amax, then the codes, hopefully from L2). The e2e model's FP8 dense FFNs quantize rows of
1536 (x, d_y), 24576 (the activation, or ``swiglu`` of a 49152-wide h in the same kernel) and
49152 (the gated gradient). This times each at every one-pass bound given and prints the
bandwidth of the minimum traffic (input read once, codes and scales written once). Each
variant's codes are checked equal to the default's.

    python benchmarks/row_quantizer.py [--rows 24576] [--one-pass 8192 32768 65536]
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from moec.kernels import fp8_rowwise
from moec.kernels.activation import UNARY_CODES, KernelActivation

SWIGLU = KernelActivation(UNARY_CODES["silu"], True)
CASES = {  # name: (input width, activation)
    "x 1536": (1536, None),
    "a 24576": (24576, None),
    "swiglu(h) 49152 -> 24576": (49152, SWIGLU),
    "d_h 49152": (49152, None),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3 * 8192)
    parser.add_argument("--one-pass", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    default = fp8_rowwise.ROW_ONE_PASS_MAX
    print(f"device: {torch.cuda.get_device_name()}  rows {args.rows}  default one-pass {default}")
    results: dict[str, dict[int, float]] = {}
    for name, (width, act) in CASES.items():
        x = torch.randn(args.rows, width, device="cuda", dtype=torch.bfloat16) * 3
        out_width = width // 2 if act is not None and act.gated else width
        traffic = x.numel() * 2 + args.rows * (out_width + 4)
        fp8_rowwise.ROW_ONE_PASS_MAX = default
        want = fp8_rowwise.rowwise_quantize(x, act)
        results[name] = {}
        for bound in args.one_pass:
            fp8_rowwise.ROW_ONE_PASS_MAX = bound
            got = fp8_rowwise.rowwise_quantize(x, act)
            assert torch.equal(got[1], want[1]), f"{name}: scales differ at one-pass {bound}"
            assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), name
            ms = do_bench(lambda x=x, act=act: fp8_rowwise.rowwise_quantize(x, act), rep=300)
            results[name][bound] = ms
            print(f"{name:<26} one-pass {bound:>6}: {ms:6.3f} ms  {traffic / ms / 1e9:5.2f} TB/s")
    fp8_rowwise.ROW_ONE_PASS_MAX = default
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": args.rows, **results}, f)


if __name__ == "__main__":
    main()
