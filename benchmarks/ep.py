"""Expert parallelism per EP path: the MoE layer, the dispatch / combine transports, and the
training step, one process per GPU under torchrun (EP = the number of processes).

    torchrun --nproc-per-node N benchmarks/ep.py [--paths rowwise,sync_1d,a2a_capacity]
        [--no-step] [--json out.json] [--overlap]

- layer: the report's profiling-workload MoE layer on every rank (2 x 8192 tokens, d = 1536,
  32 routed experts top-8, SwiGLU width 1536, capacity factor 1.25; the shared expert is the
  same dense GEMM on every path and left out): router -> ``moec::route`` -> ``ep_layout`` ->
  ``ep_dispatch`` -> ``expert_mlp`` -> ``ep_combine``, forward + backward, bf16. Every path's
  output is first checked against ``a2a_capacity`` (which computes exactly EP = 1 on each
  rank's batch; the tests hold all three to EP = 1).
- dispatch / combine: the forward transport alone, in GB/s per GPU = the bytes of the rows this
  rank sends (or gets back: a row per accepted route, on ``rowwise`` a row per token and rank
  its routes reach) / time, against NCCL ``all_to_all_single`` moving the same bytes in equal
  splits.
- step: ``benchmarks/scaling.py``'s training step of the e2e model at dp = ep = N per path
  the plan offers (``parallel.ep_path``). ``sync_1d``, the report's synchronized baseline, is
  this benchmark's alone: the layer and transports run it through the ops; a plan cannot name
  it, so it has no step row.
- ``--overlap`` (issue #22), per path but ``sync_1d``: the layer as two batch halves in one run
  three ways: ``whole`` (the layer above), ``halves`` (each half's fused exchanges, one after the
  other) and ``two_batch`` (pass overlap's schedule: split exchanges, each wait after the other
  half's experts); each half is routed on its own (the pass keeps the whole's routing: the same
  work), and two_batch is first checked against halves. ``two_batch/N``: rowwise with its split
  copies on N programs per column tile (``--split-programs``). ``exposed ms``: time the profiler
  saw exchange kernels (NCCL, the rowwise push and barrier) run with no other kernel running,
  one fwd+bwd; ``predicted``: what :mod:`moec.analysis.cost.overlap` predicts for it from this
  run's probe (the exchange kernels of the whole's dispatch and combine, profiled alone, give
  the rate, the local experts' forward and backward the compute to hide under; issue #22's
  check, within 20%). The step part then
  runs the e2e step with ``parallel.overlap`` none and
  two_batch (``--step-micro`` sequences per rank, default 4: the pass halves an even batch;
  rowwise dropless, since pass overlap keeps rowwise only where its rank capacity cannot bind).

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
from moec.analysis.cost.time import merged_spans
from moec.ops.ep.index import token_ranks_reached
from moec.runtime.metrics import bf16_peak_tflops, useful_mfu

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

    def route(self, path: str, x: torch.Tensor | None = None):
        logits = (self.x if x is None else x).detach().float() @ self.router.t()
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

    def two_batch(self, path: str, overlap: bool, copy_programs: int | None = None) -> torch.Tensor:
        """The layer as two batch halves, each routed on its own: their fused exchanges one after
        the other, or (``overlap``) pass overlap's schedule of split exchanges, asynchronous on
        CUDA, the rowwise copy kernel of ``copy_programs`` a tile (what pass ``bind`` gives a
        program from its target: ``moec.ops.ep.split.Split``)."""
        half = self.x.shape[0] // 2
        xs = [self.x[:half], self.x[half:]]
        routed = [self.route(path, x) for x in xs]  # both layouts first, as the pass issues them
        weights = [w for w, _ in routed]
        comm = [
            (s, r, sent, c, self.group, self.world, path) for _, (s, r, _, c, sent, _) in routed
        ]
        local = [layout[2] for _, layout in routed]

        def experts(buffer, h):
            return ops.expert_mlp(buffer, self.w_up, self.w_down, local[h], None, None, "swiglu")[0]

        if not overlap:
            outs = [
                ops.ep_combine(experts(ops.ep_dispatch(xs[h], *comm[h]), h), weights[h], *comm[h])
                for h in (0, 1)
            ]
            return torch.cat([o for o, _ in outs])
        comm = [(*c, None, DEVICE == "cuda", copy_programs) for c in comm]  # poison, Split
        pending = [ops.ep_dispatch_issue(xs[h], None, *comm[h]) for h in (0, 1)]
        returning = []
        for h in (0, 1):  # B's dispatch runs under A's experts, A's combine under B's
            y = experts(ops.ep_dispatch_wait(pending[h], *comm[h]), h)
            returning.append(ops.ep_combine_issue(y, weights[h], *comm[h])[0])
        outs = [ops.ep_combine_wait(returning[h], weights[h], *comm[h])[0] for h in (0, 1)]
        return torch.cat(outs)

    def expert_ms(self, path: str, iters: int) -> tuple[float, float]:
        """(forward, backward) ms of the local experts on the whole batch's dispatched rows:
        the compute an exchange can hide under."""
        _, (slots, recv, loffs, counts, sent, _) = self.route(path)
        comm = (self.group, self.world, path)
        buffer = ops.ep_dispatch(self.x.detach(), slots, recv, sent, counts, *comm)
        buffer.requires_grad_()

        def forward() -> torch.Tensor:
            return ops.expert_mlp(buffer, self.w_up, self.w_down, loffs, None, None, "swiglu")[0]

        grad = torch.randn_like(buffer)
        fwd = timed(forward, iters)
        both = timed(lambda: forward().backward(grad), iters)
        return fwd, max(both - fwd, 0.0)

    def transports(self, path: str, iters: int) -> dict:
        """Dispatch and combine forward alone, and NCCL all-to-all of the same bytes."""
        weights, (slots, recv, loffs, counts, sent, dropped) = self.route(path)
        comm = (self.group, self.world, path)
        x = self.x.detach()
        buffer = ops.ep_dispatch(x, slots, recv, sent, counts, *comm)
        y = torch.randn_like(buffer)
        moved = slots.view(-1) >= 0  # a row per accepted route (outside the timed region)
        if path == "rowwise":  # a row per (token, rank) its accepted routes reach
            top_k, buffer_rows = slots.shape[-1], recv.shape[0]
            moved = token_ranks_reached(slots.view(-1), buffer_rows, top_k, self.world)
        routes = int(moved.sum())
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


def profiled(fn: Callable[[], object]) -> tuple[float | None, dict[str, float]]:
    """One ``fn()`` under the profiler (this rank): the milliseconds in which an exchange kernel
    runs and no other kernel does, and milliseconds per kernel name (None, {} on CPU)."""
    if DEVICE != "cuda":
        return None, {}
    kernels = scaling.profiled_kernels(fn)
    comm, compute = [], []
    for start, end, name in kernels:
        is_comm = any(k in name.lower() for k in scaling.COMM_KERNELS)
        (comm if is_comm else compute).append((start, end))
    exposed = 0.0
    busy = merged_spans(compute)
    for start, end in merged_spans(comm):
        covered = sum(max(0, min(end, b) - max(start, a)) for a, b in busy)
        exposed += end - start - covered
    return exposed / 1e3, scaling.ms_by_kernel(kernels, 60)


def exchange_kernel_ms(layer: Layer, path: str) -> float | None:
    """Milliseconds the exchange kernels of one forward dispatch + combine of the whole run
    with no other kernel beside them (None on the CPU): the probe's moving time."""
    weights, (slots, recv, _, counts, sent, _) = layer.route(path)
    comm = (layer.group, layer.world, path)
    x, w = layer.x.detach(), weights.detach()

    def both() -> None:
        buffer = ops.ep_dispatch(x, slots, recv, sent, counts, *comm)
        ops.ep_combine(buffer, w, slots, recv, sent, counts, *comm)

    both()  # warm
    return profiled(both)[0]


def predicted_exposed(layer: Layer, path: str, iters: int) -> dict[str, float]:
    """The cost model's exposed exchange ms (``moec.analysis.cost.overlap``), forward + backward,
    for the whole layer, its halves one after the other and two_batch, from this run's probe:
    the whole's dispatch and combine alone (their rate) and the local experts' time."""
    from moec.analysis.cost.overlap import exposed_comm, two_batch_half_share
    from moec.ops.routing import capacity

    probe = layer.transports(path, iters)
    exchanged = 2 * probe["bytes_per_gpu"]  # dispatch + combine (rows as transports counts)
    # the rate of what the profile counts as exchange: its kernels' time (the ops' packing
    # and local copies are compute the experts' stream runs), or the ops' wall time on the CPU
    moving = exchange_kernel_ms(layer, path)
    rate = exchanged / ((moving or probe["dispatch_ms"] + probe["combine_ms"]) / 1e3)
    s = layer.s
    cap = (
        capacity(s["tokens"], s["top_k"], s["experts"], s["cf"]) if path == "a2a_capacity" else None
    )
    share = two_batch_half_share(path, s["tokens"], cap)
    forward, backward = layer.expert_ms(path, iters)
    result = {}
    for label, overlap, halves in (
        ("whole", "none", 1),
        ("halves", "none", 2),
        ("two_batch", "two_batch", 1),
    ):
        moved = exchanged * (share if halves == 2 else 1)
        total = sum(
            halves * exposed_comm(moved, rate, compute / 1e3 / halves, overlap, 0.0, share).exposed
            for compute in (forward, backward)
        )
        result[label] = 1e3 * total
    return result


def measure_overlap(
    shape: dict, rank: int, world: int, paths: list[str], iters: int, split_programs: list[int]
) -> dict:
    """Per path: the layer whole, as halves one after the other, and as pass overlap's two
    batches (fwd+bwd ms, exposed exchange ms); rowwise two_batch also with each cap of its copy
    kernel's grid in ``split_programs`` (row ``two_batch/N``)."""
    layer = Layer(shape, rank, world)
    results = {}
    for path in paths:
        with torch.no_grad():
            torch.testing.assert_close(
                layer.two_batch(path, True), layer.two_batch(path, False), rtol=2e-2, atol=2e-3
            )
        runs = {
            "whole": lambda p=path: layer.step(p),
            "halves": lambda p=path: layer.two_batch(p, False).backward(layer.grad),
        }
        results[path] = {}
        predicted = predicted_exposed(layer, path, iters)
        for cap in [None] + (split_programs if path == "rowwise" else []):  # cap: of the copy
            runs["two_batch"] = lambda p=path, c=cap: layer.two_batch(p, True, c).backward(
                layer.grad
            )
            for name, run in runs.items():
                if cap is not None and name != "two_batch":
                    continue
                label = name if cap is None else f"{name}/{cap}"
                ms = timed(run, iters)
                exposed, kernels = profiled(run)
                results[path][label] = {
                    "fwd_bwd_ms": ms,
                    "exposed_ms": exposed,
                    "predicted_exposed_ms": predicted.get(label),
                    "kernel_ms": kernels,
                }
        if ops_pending():
            raise RuntimeError(f"{path}: exchanges issued and never waited for")
    return results


def ops_pending() -> int:
    from moec.ops.ep import pending_exchanges

    return pending_exchanges()


def measure_step(shape: dict, world: int, path: str, overlap: str, steps: int) -> dict:
    """The e2e training step at dp = ep = world with ``parallel.overlap`` = ``overlap``."""
    device = torch.device(DEVICE, torch.cuda.current_device()) if DEVICE == "cuda" else \
        torch.device("cpu")  # fmt: skip
    torch.manual_seed(0)  # the same dense init on every rank
    plan = scaling.parallel_plan(shape, world, world, 1, path, 1)
    plan.parallel.overlap = overlap
    if path == "rowwise":
        plan.moe.capacity_factor = None  # dropless: pass overlap keeps rowwise only so
    step, flops, tokens = scaling.trainer_step(shape, plan, device)
    result = scaling.measure(step, device, steps, 2)
    del step
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    totals = torch.tensor([flops, tokens], device=device, dtype=torch.float64)
    dist.all_reduce(totals)
    flops, tokens = totals.tolist()
    cf = "dropless" if plan.moe.capacity_factor is None else f"cf={plan.moe.capacity_factor}"
    return {
        "config": f"dp=ep={world} {path} {cf} b={shape['micro']} overlap={overlap}",
        **result,
        "tokens_per_s_per_gpu": tokens / result["step_s"] / world,
        "useful_mfu": useful_mfu(flops, result["step_s"], world, bf16_peak_tflops(device)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default="rowwise,sync_1d,a2a_capacity")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-step", action="store_true", help="layer and transports only")
    parser.add_argument("--no-layer", action="store_true", help="the step only")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="a small shape (smoke run)")
    parser.add_argument("--json", help="write the results here (rank 0)")
    parser.add_argument(
        "--overlap", action="store_true", help="two-batch overlap against none (layer and step)"
    )
    parser.add_argument("--step-micro", type=int, default=4, help="--overlap step: batch/rank")
    parser.add_argument(
        "--kernels", type=int, default=0, help="--overlap: print the N largest kernel-time changes"
    )
    parser.add_argument(
        "--split-programs",
        default="8,32",
        help="--overlap: rowwise two_batch also with its copy kernel capped to N programs/tile",
    )
    args = parser.parse_args()
    scaling.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    paths = args.paths.split(",")
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    shape = SMALL_LAYER if args.small else LAYER
    results = {"ep": world, "device": name, "step": [], "kernels": args.kernels}
    if args.overlap:
        paths = [p for p in paths if p != "sync_1d"]  # it synchronizes: nothing to split
        caps = [int(c) for c in args.split_programs.split(",") if c]
        if not args.no_layer:
            results["overlap"] = measure_overlap(shape, rank, world, paths, args.iters, caps)
    elif not args.no_layer:
        results["layer"] = measure_layer(shape, rank, world, paths, args.iters)
    if not args.no_step:
        step_shape = scaling.SMALL if args.small else FULL
        for path in paths:
            if args.overlap:
                step_shape = {**step_shape, "micro": args.step_micro}
                for overlap in ("none", "two_batch"):
                    row = measure_step(step_shape, world, path, overlap, args.steps)
                    results["step"].append(row)
            elif path != "sync_1d":  # a baseline of the ops, not a path a plan can name
                results["step"].append(scaling.run(step_shape, world, 1, path, 1, args.steps, 2))
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    if rank == 0:
        (report_overlap if args.overlap else report)(results, paths)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    dist.destroy_process_group()


def report(results: dict, paths: list[str]) -> None:
    layer = results.get("layer", {})
    base = layer.get("sync_1d")
    if layer:
        print(f"\nEP = {results['ep']} on {results['device']}: MoE layer fwd+bwd and transports")
        print(f"{'path':14} {'layer ms':>9} {'vs sync_1d':>10} {'dispatch GB/s':>14} "
              f"{'combine GB/s':>13} {'NCCL a2a GB/s':>14} {'dropped':>8}")  # fmt: skip
    for path in paths if layer else []:
        r = layer[path]
        ratio = "-" if base is None else f"{base['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x"
        print(
            f"{path:14} {r['fwd_bwd_ms']:9.2f} {ratio:>10} {r['dispatch_gbps']:14.0f} "
            f"{r['combine_gbps']:13.0f} {r['nccl_all_to_all_gbps']:14.0f} {r['dropped']:8d}"
        )
    if results["step"]:
        print("\ntraining step of the e2e model")
        scaling.report(results["step"], None)


def report_overlap(results: dict, paths: list[str]) -> None:
    if "overlap" in results:
        where = f"EP = {results['ep']} on {results['device']}"
        print(f"\n{where}: MoE layer fwd+bwd, two-batch overlap")
        print(f"{'path':14} {'schedule':12} {'ms':>8} {'exposed ms':>11} {'predicted':>10} "
              f"{'pred / exp':>10} {'whole / this':>13}")  # fmt: skip
    for path in paths if "overlap" in results else []:
        rows = results["overlap"][path]
        for name, r in rows.items():
            exposed = "-" if r["exposed_ms"] is None else f"{r['exposed_ms']:.2f}"
            pred = r.get("predicted_exposed_ms")
            versus = f"{pred / r['exposed_ms']:.2f}" if pred and r["exposed_ms"] else "-"
            pred = "-" if pred is None else f"{pred:.2f}"
            ratio = rows["whole"]["fwd_bwd_ms"] / r["fwd_bwd_ms"]
            print(
                f"{path:14} {name:12} {r['fwd_bwd_ms']:8.2f} {exposed:>11} {pred:>10} "
                f"{versus:>10} {ratio:12.2f}x"
            )
        for name in ("halves", "two_batch") if results.get("kernels") else ():
            whole, this = rows["whole"]["kernel_ms"], rows[name]["kernel_ms"]
            delta = {k: this.get(k, 0.0) - whole.get(k, 0.0) for k in {*whole, *this}}
            print(f"  {path} {name} - whole, kernel ms (summed over streams), largest changes:")
            for k in sorted(delta, key=lambda k: -abs(delta[k]))[: results["kernels"]]:
                was, now = whole.get(k, 0.0), this.get(k, 0.0)
                print(f"    {delta[k]:+8.3f}  {was:8.3f} -> {now:8.3f}  {k}")
    if results["step"]:
        print("\ntraining step of the e2e model, overlap none vs two_batch")
        print(
            f"{'':52} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>6} {'syncs':>6} {'none / this':>12}"
        )
        base = {}
        for r in results["step"]:
            key = r["config"].rsplit(" overlap=", 1)[0]
            base.setdefault(key, r["step_s"])
            mfu = "-" if r["useful_mfu"] is None else f"{100 * r['useful_mfu']:.1f}%"
            print(
                f"{r['config']:52} {r['step_s']:8.3f} {r['tokens_per_s_per_gpu']:10.0f} "
                f"{mfu:>6} {r['host_syncs_per_step']!s:>6} {base[key] / r['step_s']:11.2f}x"
            )


if __name__ == "__main__":
    main()
