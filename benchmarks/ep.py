"""Expert parallelism per EP path: the MoE layer, the dispatch / combine transports, and the
training step, one process per GPU under torchrun (EP = the number of processes).

    torchrun --nproc-per-node N benchmarks/ep.py [--paths rowwise,sync_1d,a2a_capacity]
        [--no-step] [--json out.json]

- layer: the report's profiling-workload MoE layer on every rank (2 x 8192 tokens, d = 1536,
  32 routed experts top-8, SwiGLU width 1536, capacity factor 1.25; the shared expert is the
  same dense GEMM on every path and left out): router -> ``moec::route`` -> ``ep_layout`` ->
  ``ep_dispatch`` -> ``expert_mlp`` -> ``ep_combine``, forward + backward, bf16. Every path's
  output is first checked against ``a2a_capacity`` (which computes exactly EP = 1 on each
  rank's batch; the tests hold all three to EP = 1).
- dispatch / combine: the forward transport alone, in GB/s per GPU = the bytes of the rows this
  rank's routes send (or get back) / time, against NCCL ``all_to_all_single`` moving the same
  bytes in equal splits.
- step: ``benchmarks/scaling.py``'s training step of the e2e model at dp = ep = N per path.

Times are the slowest rank's median over CUDA-event-timed iterations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks import scaling
from benchmarks.e2e import FULL

ops = torch.ops.moec
LAYER = dict(tokens=2 * 8192, dim=1536, experts=32, top_k=8, width=1536, cf=1.25)
SMALL_LAYER = dict(tokens=256, dim=64, experts=8, top_k=2, width=64, cf=1.25)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the script


def timed(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``iters`` (CUDA events on GPUs), max over ranks."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if DEVICE == "cpu":
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    worst = torch.tensor([statistics.median(times)], device=DEVICE)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


class Layer:
    """This rank's batch, router and local experts, and the layer on one EP path."""

    def __init__(self, shape: dict, rank: int, world: int):
        self.s, self.world = shape, world
        g = torch.Generator(device=DEVICE).manual_seed(1 + rank)
        dim, local = shape["dim"], shape["experts"] // world
        bf16 = dict(device=DEVICE, dtype=torch.bfloat16, generator=g)
        self.x = torch.randn(shape["tokens"], dim, **bf16).requires_grad_()
        self.grad = torch.randn(shape["tokens"], dim, **bf16)
        shared = torch.Generator(device=DEVICE).manual_seed(0)  # one router for the group
        self.router = torch.randn(shape["experts"], dim, device=DEVICE, generator=shared) * 0.02
        self.w_up = (torch.randn(local, dim, 2 * shape["width"], **bf16) * 0.02).requires_grad_()
        self.w_down = (torch.randn(local, shape["width"], dim, **bf16) * 0.02).requires_grad_()
        self.group = dist.group.WORLD.group_name

    def route(self, path: str):
        logits = self.x.detach().float() @ self.router.t()
        _, weights, rows, offsets, _ = ops.route(
            logits, self.s["top_k"], self.s["cf"], "softmax", True, "learned"
        )
        layout = ops.ep_layout(rows, offsets, self.group, self.world, self.s["cf"], path)
        return weights.requires_grad_(), layout

    def forward(self, path: str) -> torch.Tensor:
        weights, (slots, recv, loffs, counts, sent, _) = self.route(path)
        comm = (self.group, self.world, path)
        buffer = ops.ep_dispatch(self.x, slots, recv, sent, counts, *comm)
        y, _ = ops.expert_mlp(buffer, self.w_up, self.w_down, loffs, None, None, "swiglu")
        return ops.ep_combine(y, weights, slots, recv, sent, counts, *comm)[0]

    def step(self, path: str) -> None:
        self.forward(path).backward(self.grad)

    def transports(self, path: str, iters: int) -> dict:
        """Dispatch and combine forward alone, and NCCL all-to-all of the same bytes."""
        weights, (slots, recv, loffs, counts, sent, dropped) = self.route(path)
        comm = (self.group, self.world, path)
        x = self.x.detach()
        buffer = ops.ep_dispatch(x, slots, recv, sent, counts, *comm)
        y = torch.randn_like(buffer)
        routes = int((slots >= 0).sum())  # outside the timed region
        nbytes = routes * x.shape[1] * x.element_size()
        rows = -(-routes // self.world) * self.world
        send = torch.randn(rows, x.shape[1], device=DEVICE, dtype=x.dtype)
        recv_nccl = torch.empty_like(send)
        ms = {
            "dispatch": timed(lambda: ops.ep_dispatch(x, slots, recv, sent, counts, *comm), iters),
            "combine": timed(
                lambda: ops.ep_combine(y, weights.detach(), slots, recv, sent, counts, *comm),
                iters,
            ),
            "nccl_all_to_all": timed(lambda: dist.all_to_all_single(recv_nccl, send), iters),
        }
        return {
            "bytes_per_gpu": nbytes,
            "dropped": int(dropped),
            **{f"{k}_ms": v for k, v in ms.items()},
            **{f"{k}_gbps": nbytes / v / 1e6 for k, v in ms.items()},
        }


def check_paths(layer: Layer, paths: list[str]) -> None:
    """Every path's output equals a2a_capacity's (bf16 tolerance), or the run stops."""
    with torch.no_grad():
        reference = layer.forward("a2a_capacity")
        for path in paths:
            torch.testing.assert_close(layer.forward(path), reference, rtol=2e-2, atol=2e-3)


def measure_layer(shape: dict, rank: int, world: int, paths: list[str], iters: int) -> dict:
    layer = Layer(shape, rank, world)
    check_paths(layer, paths)
    return {
        path: {
            "fwd_bwd_ms": timed(lambda p=path: layer.step(p), iters),
            **layer.transports(path, iters),
        }
        for path in paths
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default="rowwise,sync_1d,a2a_capacity")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-step", action="store_true", help="layer and transports only")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="a small shape (smoke run)")
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args()
    scaling.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    paths = args.paths.split(",")
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    layer = measure_layer(SMALL_LAYER if args.small else LAYER, rank, world, paths, args.iters)
    results = {"ep": world, "device": name, "layer": layer, "step": []}
    if not args.no_step:
        shape = scaling.SMALL if args.small else FULL
        for path in paths:
            results["step"].append(scaling.run(shape, world, 1, path, 1, args.steps, 2))
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    if rank == 0:
        report(results, paths)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    dist.destroy_process_group()


def report(results: dict, paths: list[str]) -> None:
    layer, base = results["layer"], results["layer"].get("sync_1d")
    print(f"\nEP = {results['ep']} on {results['device']}: MoE layer fwd+bwd and transports")
    print(f"{'path':14} {'layer ms':>9} {'vs sync_1d':>10} {'dispatch GB/s':>14} "
          f"{'combine GB/s':>13} {'NCCL a2a GB/s':>14} {'dropped':>8}")  # fmt: skip
    for path in paths:
        r = layer[path]
        ratio = "-" if base is None else f"{base['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x"
        print(
            f"{path:14} {r['fwd_bwd_ms']:9.2f} {ratio:>10} {r['dispatch_gbps']:14.0f} "
            f"{r['combine_gbps']:13.0f} {r['nccl_all_to_all_gbps']:14.0f} {r['dropped']:8d}"
        )
    if results["step"]:
        print("\ntraining step of the e2e model")
        scaling.report(results["step"], None)


if __name__ == "__main__":
    main()
