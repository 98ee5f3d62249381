"""moec's program cache: the e2e program compiled in fresh processes on one cache, cold then warm.

Each launch is a new Python process that compiles ``benchmarks/e2e.py``'s dense model (the
report's Table 47 shape; ``--layers`` fewer blocks), built on the meta device, to its MoE
program as ``moec train --init-from fresh`` does (capture, then the passes; no
materialization, no lowering), with moec's cache (:mod:`moec.cache`) in one folder, empty
before the first launch. The first launch runs the passes and stores the program
(:mod:`moec.program_cache`); the later ones find it, so their ``passes`` seconds are the load
and its fake propagation. Printed per launch: the capture's and the passes' seconds
(:data:`moec.compiler.phase_seconds`), whether the program came from the cache, and the
process's CPU seconds for the compile.

    python benchmarks/program_cache.py [--launches 3] [--layers N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=3, help="processes, one after another")
    parser.add_argument("--layers", type=int, help="blocks (default: the e2e workload's 8)")
    parser.add_argument("--json", type=Path, help="write the launches' reports here")
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)  # a launch writes here
    return parser


def main() -> None:
    args = arguments().parse_args()
    if args.report:
        args.report.write_text(json.dumps(launch(args.layers)))
        return
    folder = tempfile.mkdtemp(prefix="moec_program_cache_")
    env = {**os.environ, "MOEC_CACHE_DIR": folder, "PYTHONPATH": str(ROOT)}
    reports = []
    for n in range(args.launches):
        with tempfile.TemporaryDirectory() as scratch:
            out = Path(scratch) / "report.json"
            command = [sys.executable, __file__, "--report", str(out)]
            command += ["--layers", str(args.layers)] if args.layers else []
            subprocess.run(command, env=env, check=True, cwd=ROOT)
            reports.append(json.loads(out.read_text()))
        r = reports[-1]
        print(
            f"launch {n + 1}: capture {r['capture_s']:.2f} s, passes {r['passes_s']:.2f} s "
            f"({'program from the cache' if r['programs_cached'] else 'passes run'}), "
            f"compile {r['compile_s']:.2f} s wall, {r['compile_cpu_s']:.2f} s CPU"
        )
    print(f"{reports[0]['nodes']} nodes, {reports[0]['layers']} blocks, cache {folder}")
    if args.json:
        args.json.write_text(json.dumps({"cache": folder, "launches": reports}, indent=2))


def launch(layers: int | None) -> dict:
    """One launch (in its own process): compile the program, report the phases."""
    import torch

    from benchmarks import e2e
    from moec import cache, compiler, program_cache

    cache.setup()
    shape = dict(e2e.FULL, layers=layers or e2e.FULL["layers"])
    with torch.device("meta"):
        dense = e2e.dense_model(shape)
    tokens = torch.zeros(shape["micro"], shape["seq"], dtype=torch.long, device="meta")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wall, cpu = time.perf_counter(), time.process_time()
    program = compiler.compile(dense, e2e.moe_plan(shape), (tokens,), init_device=device).program
    return {
        "compile_s": time.perf_counter() - wall,
        "compile_cpu_s": time.process_time() - cpu,
        "capture_s": compiler.phase_seconds["capture"],
        "passes_s": compiler.phase_seconds["passes"],
        "programs_cached": program_cache.counters["hits"],
        "nodes": len(program.graph.graph.nodes),
        "layers": shape["layers"],
        "device": device,
    }


if __name__ == "__main__":
    main()
