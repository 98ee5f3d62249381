"""Two profiled steps side by side (``benchmarks/scaling.py --timeline`` JSON): span, compute,
communication-only and idle milliseconds, and the kernels whose time changed most.

    python -m benchmarks.timeline_diff tl_pp1_mb4_rank0.json tl1_pp1_mb4_rank0.json [--rows 25]

The first file is the step under study (e.g. a rank of the EP = 2 step), the second its
reference (the one-GPU step); kernel names are cut to ``--width`` characters.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PHASES = ("span_ms", "compute_ms", "comm_only_ms", "idle_ms")


def load(path: str) -> dict:
    data = json.loads(Path(path).read_text())
    missing = [k for k in (*PHASES, "ms_by_kernel") if k not in data]
    if missing:
        raise SystemExit(f"{path}: not a scaling.py --timeline file (missing {missing})")
    return data


def kernel_deltas(study: dict, reference: dict, width: int) -> list[tuple[float, float, str]]:
    """(ms in ``study``, ms in ``reference``, name) per kernel name cut to ``width``, largest
    change first."""
    merged: dict[str, list[float]] = {}
    for which, data in enumerate((study, reference)):
        for name, ms in data["ms_by_kernel"].items():
            merged.setdefault(name[:width], [0.0, 0.0])[which] += ms
    rows = [(a, b, name) for name, (a, b) in merged.items()]
    return sorted(rows, key=lambda r: -abs(r[0] - r[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study")
    parser.add_argument("reference")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--width", type=int, default=90)
    args = parser.parse_args()
    study, reference = load(args.study), load(args.reference)
    print(f"{'':14} {'study':>9} {'reference':>9} {'change':>9}")
    for key in PHASES:
        a, b = study[key], reference[key]
        print(f"{key:14} {a:9.1f} {b:9.1f} {a - b:+9.1f}")
    print(f"\n{'study ms':>9} {'ref ms':>9} {'change':>9}  kernel")
    for a, b, name in kernel_deltas(study, reference, args.width)[: args.rows]:
        print(f"{a:9.2f} {b:9.2f} {a - b:+9.2f}  {name}")


if __name__ == "__main__":
    main()
