"""Predicted per-rank memory (moec/analysis/rank_memory.py) against the measured peak.

The e2e model of ``benchmarks/e2e.py`` (or ``--small``) trained by the Trainer for a few steps;
prints the prediction by component, ``torch.cuda.max_memory_allocated`` over the steps, and
their ratio. The prediction leaves out allocator overhead and the temporaries of one op, so the
measured peak is expected above it; the ratio is what this benchmark tracks.

    python benchmarks/memory.py [--small] [--steps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from benchmarks.e2e import FULL, LR, SMALL, dense_model, moe_plan
from moec.analysis.rank_memory import GIB, rank_memory
from moec.train import TrainConfig, Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the small shape (CPU-sized)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    s = SMALL if args.small else FULL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TrainConfig(
        lr=LR,
        steps=args.steps + 1,
        batch_size=s["micro"],
        seq_len=s["seq"],
        device=str(device),
        synthetic=True,
        out=tempfile.mkdtemp(prefix="moec_memory_"),
        plots=False,
    )
    trainer = Trainer(dense_model(s), moe_plan(s), cfg)
    plan = trainer.plan
    micro = plan.parallel.microbatches
    predicted = rank_memory(trainer.compiled.program, micro, s["micro"] // micro, s["seq"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.steps):
        trainer.train_step()
    measured = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    rows = {what: size for what, size in predicted.rows()}
    print(f"per-rank memory, {s['micro']} x {s['seq']} tokens, device {device}")
    for what, size in rows.items():
        print(f"  predicted {what:<15} {size / GIB:8.2f} GiB")
    if measured is not None:
        print(f"  measured peak             {measured / GIB:8.2f} GiB")
        print(f"  measured / predicted total {measured / predicted.total:7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"predicted": rows, "measured_peak": measured}, f, indent=2)


if __name__ == "__main__":
    main()
