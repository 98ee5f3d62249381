"""NCCL collectives at the sizes a training step moves, one process per GPU under torchrun: the
rates the plan search's time model charges (issue #23), measured beside the gradient reducer's
own pattern (issue #22).

    torchrun --standalone --nproc-per-node 2 benchmarks/collectives.py [--json out.json]

- ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``all_to_all`` of float32 messages of each
  ``--mib`` size per rank: milliseconds (the slowest rank's median) and the rate the time model
  uses, ``bytes x share / seconds`` with ``share`` the ring algorithms' share of a rank's bytes
  on its link (:data:`moec.analysis.cost.time.COLLECTIVE_SHARE`), and that rate over the GPU
  spec's link ceiling (the ``Efficiency.collective_factor`` the search would need).
- ``bucketed``: ``--total-mib`` of float32 gradients reduced as the
  :class:`moec.runtime.distributed.GradientReducer` does at the end of a compiled backward:
  ``--bucket-mib`` buckets issued back to back, asynchronously, then waited for; against one
  all-reduce of the whole.

Times are CUDA events around each call on the current stream (NCCL's stream is joined by the
work's wait), a barrier before each timed call (:func:`benchmarks.ep.timed`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.ep import timed
from moec.analysis.cost.time import COLLECTIVE_SHARE
from moec.analysis.gpus import gpu_spec
from moec.runtime.distributed import NO_MULTICAST_ENV, join_process_group

MIB = 2**20


def collective(kind: str, numel: int, device: torch.device) -> Callable[[], object]:
    """One ``kind`` collective of ``numel`` float32 elements per rank."""
    world = dist.get_world_size()
    x = torch.randn(numel, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x)
    if kind == "reduce_scatter":
        out = x.new_empty(numel // world)
        return lambda: dist.reduce_scatter_tensor(out, x)
    if kind == "all_gather":
        part = x[: numel // world].clone()
        return lambda: dist.all_gather_into_tensor(x, part)
    if kind == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x)
    raise ValueError(f"unknown collective {kind!r}; known: {sorted(COLLECTIVE_SHARE)}")


def bucketed(total: int, bucket: int, device: torch.device) -> Callable[[], None]:
    """``total`` float32 elements reduced in ``bucket``-element all-reduces, issued back to back
    asynchronously and then waited for (the reducer after a compiled backward)."""
    buckets = [torch.randn(min(bucket, total - s), device=device) for s in range(0, total, bucket)]

    def run() -> None:
        for work in [dist.all_reduce(b, async_op=True) for b in buckets]:
            work.wait()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[4, 25, 100, 600])
    parser.add_argument("--total-mib", type=float, default=2400, help="bucketed: gradient MiB")
    parser.add_argument("--bucket-mib", type=float, nargs="+", default=[25, 100, 400])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--gpu", default="h200", help="the GPU spec whose link ceiling divides")
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args()
    for name, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(name, value)
    join_process_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    link = gpu_spec(args.gpu).ceiling("nvlink_gbps")
    rows = []
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"):
        for mib in args.mib:
            numel = int(mib * MIB) // 4 // world * world
            ms = timed(collective(kind, numel, device), args.iters)
            rate = numel * 4 * COLLECTIVE_SHARE[kind](world) / (ms / 1e3) / 1e9
            rows.append({"kind": kind, "mib": mib, "ms": ms, "gbps": rate, "of_link": rate / link})
    total = int(args.total_mib * MIB) // 4
    whole = timed(collective("all_reduce", total, device), args.iters)
    pattern = {"total_mib": args.total_mib, "whole_ms": whole, "buckets": {}}
    for mib in args.bucket_mib:
        pattern["buckets"][mib] = timed(bucketed(total, int(mib * MIB) // 4, device), args.iters)
    if rank == 0:
        name = torch.cuda.get_device_name() if cuda else "cpu"
        print(f"{world} x {name}: float32 collectives, rate = bytes x ring share / time; "
              f"of link: over the spec's {link:.0f} GB/s")  # fmt: skip
        print(f"{'collective':16} {'MiB/rank':>9} {'ms':>8} {'GB/s':>8} {'of link':>8}")
        for r in rows:
            print(f"{r['kind']:16} {r['mib']:9.0f} {r['ms']:8.3f} {r['gbps']:8.1f} "
                  f"{r['of_link']:8.2f}")  # fmt: skip
        print(f"\ngradient pattern: {args.total_mib:.0f} MiB all-reduced whole {whole:.2f} ms; "
              + ", ".join(f"in {m:.0f} MiB buckets {t:.2f} ms"
                          for m, t in pattern["buckets"].items()))  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": name, "world": world, "rows": rows, "pattern": pattern}, f,
                          indent=1)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
