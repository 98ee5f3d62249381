"""Materialization from scratch: the e2e workload's program given its tensors by ``FreshInit``.

Builds ``benchmarks/e2e.py``'s dense model (the report's Table 47 shape; ``--layers`` fewer
blocks, the first ``dense_first`` dense) on the meta device, compiles it to its MoE program
(capture and passes, not timed), then times :func:`moec.runtime.materialize.materialize` with
``FreshInit`` onto ``--device``, as ``moec train --init-from fresh`` does: the dense tensors
drawn on the CPU module by module by the model's ``_init_weights`` (several modules at once,
each from a generator of its own), the ``random`` experts by their own generators, everything
copied to the device. ``--repeats`` materializations of
one program (each replaces every tensor), wall and CPU seconds each; ``--cprofile`` prints the
last one's top functions. On a CPU device the copies are host copies, not host-to-device ones.

    python benchmarks/materialize.py [--layers 3] [--device cuda|cpu] [--repeats 2]
                                     [--cprofile] [--json FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

from benchmarks import e2e
from moec.compiler import compile as moec_compile
from moec.runtime.materialize import FreshInit, materialize


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=e2e.FULL["layers"], help="blocks")
    parser.add_argument("--device", help="where the tensors go (default: cuda if there is one)")
    parser.add_argument("--repeats", type=int, default=2, help="materializations timed")
    parser.add_argument("--cprofile", action="store_true", help="profile the last one")
    parser.add_argument("--json", type=Path, help="write the timings here")
    return parser


def main() -> None:
    args = arguments().parse_args()
    shape = dict(e2e.FULL, layers=args.layers, seq=256, micro=2)  # sizes of the tensors only
    with torch.device("meta"):
        dense = e2e.dense_model(shape)
    tokens = torch.zeros(shape["micro"], shape["seq"], dtype=torch.long, device="meta")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # bound for the device (its layouts), as the Trainer compiles
    program = moec_compile(dense, e2e.moe_plan(shape), (tokens,), init_device=device).program
    params = sum(p.numel() for p in program.graph.parameters())
    runs = []
    for i in range(args.repeats):
        profile = cProfile.Profile() if args.cprofile and i == args.repeats - 1 else None
        wall, cpu = time.perf_counter(), time.process_time()
        if profile:
            profile.enable()
        materialize(program, FreshInit(seed=0), device, dense)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if profile:
            profile.disable()
        run = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
        runs.append(run)
        print(f"materialize {i + 1}: {run['wall_s']:.2f} s wall, {run['cpu_s']:.2f} s CPU")
        if profile:
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(15)
            print(out.getvalue())
    print(
        f"{params / 1e9:.2f} B parameters on {device}, {args.layers} blocks, "
        f"{torch.get_num_threads()} CPU threads"
    )
    if args.json:
        report = {"parameters": params, "layers": args.layers, "device": str(device), "runs": runs}
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
