"""Where a training step's GPU time goes: top CUDA kernels of the moec step and the eager one.

Uses the e2e workload (``benchmarks/e2e.py``); prints the torch profiler's kernel table for one
steady-state step of each, and counts cudaStreamSynchronize / cudaEventSynchronize /
cudaMemcpy device-to-host calls in the trace (the report's B.6 check).

    python -m benchmarks.profile_step [--small] [--rows 25] [--shapes] [--moec-only]

``--shapes`` adds a table grouped by op and input shapes (which copies, which elementwise ops).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.e2e import FULL, LR, SMALL, EagerTrainer, dense_model, hand_written, moe_plan
from moec.train import TrainConfig, Trainer

BLOCKING = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def profile_step(name: str, step, rows: int, shapes: bool = False) -> None:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, record_shapes=shapes) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    blocking = {e.key: e.count for e in events if e.key in BLOCKING or "DtoH" in e.key}
    print(f"\n=== {name}: blocking host calls {blocking or 'none'}")
    print(events.table(sort_by="self_cuda_time_total", row_limit=rows))
    if shapes:
        by_shape = prof.key_averages(group_by_input_shape=True)
        table = by_shape.table(
            sort_by="cuda_time_total",
            row_limit=2 * rows,
            max_name_column_width=40,
            max_shapes_column_width=90,
        )
        print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--shapes", action="store_true", help="also group by input shapes")
    parser.add_argument("--moec-only", action="store_true", help="skip the eager baseline")
    args = parser.parse_args()
    s = SMALL if args.small else FULL
    cfg = TrainConfig(
        lr=LR,
        steps=100,
        batch_size=s["micro"],
        seq_len=s["seq"],
        device="cuda",
        synthetic=True,
        out=tempfile.mkdtemp(prefix="moec_profile_"),  # a fresh run directory per run
        plots=False,
    )
    torch.manual_seed(0)
    trainer = Trainer(dense_model(s), moe_plan(s), cfg)
    profile_step("moec", trainer.train_step, args.rows, args.shapes)
    if args.moec_only:
        return
    del trainer
    torch.cuda.empty_cache()
    eager = EagerTrainer(hand_written(s, dense_model(s)), s, torch.device("cuda"))
    profile_step("eager sort+grouped_mm", eager.train_step, args.rows, args.shapes)


if __name__ == "__main__":
    main()
