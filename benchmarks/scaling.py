"""The e2e benchmark model (``benchmarks/e2e.py``: the report's profiling workload) trained on
several GPUs, one process per GPU under torchrun: tokens/s/GPU and useful MFU, and the scaling
efficiency against a single-GPU run of the same model (Table 51).

    torchrun --nproc-per-node 2 benchmarks/scaling.py --ep 2 [--path rowwise]
    torchrun --nproc-per-node 2 benchmarks/scaling.py --pp 2 [--microbatches 4 8 16]
    ... --pp 2 --schedule interleaved_1f1b      # or zbv / dualpipev (2 stages per rank)
    ... --single results.json     # benchmarks/e2e.py --json output: prints the efficiency
    ... --sync-trace              # where each host sync of one steady step comes from
    ... --inductor auto|true|false  # plan.lowering.inductor (auto, the default: Inductor on CUDA
                                    # except for pipelines; true compiles each stage per block)
    ... --timeline PREFIX         # one profiled step per rank: where its GPU idles (JSON)
    ... --dp-shard N              # parallel.dp_shard: FSDP (HSDP below dp)

``pp = 1``: the Trainer (data + expert parallel, dp = world, each rank 3 sequences of 8192 per
step). ``pp > 1``: ``CompiledModel.train_step`` (the pipeline runtime, 1F1B over each of
``--microbatches`` counts of microbatches of 3 sequences, dp = world / pp), one row per count.
The pipelined program is what the Trainer compiles at PP = 1: ``LanguageModelWithLoss(model)``
on (inputs, targets), so the ``fused_loss`` pass puts ``moec::linear_cross_entropy`` in the last
stage (``--unfused-loss``: ``loss.fused: false``, the unfused head and float32 cross-entropy),
stepped by ``moec.optim.AdamW`` writing the bf16 working copies with its step counters on the
device, clipped by the global norm through the optimizer's ``grad_scale``, as the Trainer does.
``--schedule`` picks ``parallel.pp_schedule`` (2 stages per rank for all but gpipe and 1f1b).
The ``bubble`` column is the schedule's idle fraction, (pp - 1) / (v x microbatches + pp - 1)
for gpipe, 1f1b and interleaved 1F1B with v stages per rank ("-" for zbv and dualpipev). Below
each pipelined row: every rank's forward + backward of one microbatch through its stages alone
(the inputs it received, replayed without P2P or optimizer), their balance, and the step the
schedule would take at the slowest rank's pace, (microbatches + (pp - 1) / v) x max: what the
step has beyond it is P2P waits, the optimizer and clipping, and host time.
Useful FLOPs per token come from moec's cost model of the compiled program (the same count
``e2e.py`` uses); MFU divides by every GPU of the job.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.e2e import FULL, LR, SMALL, dense_model, moe_plan, warm_up
from moec.analysis.cost.time import merged_spans
from moec.analysis.pipeline_schedule import V_SHAPED
from moec.runtime.distributed import NO_MULTICAST_ENV, join_process_group
from moec.runtime.metrics import bf16_peak_tflops, sync_debug_mode, useful_mfu
from moec.runtime.pipeline import runtime_for
from moec.train import TrainConfig, Trainer

ONE_STAGE_PER_RANK = ("gpipe", "1f1b")
ZERO_BUBBLE = V_SHAPED


INDUCTOR_CHOICES: dict[str, bool | str] = {"auto": "auto", "true": True, "false": False}
"""``--inductor`` -> ``plan.lowering.inductor``."""


def parallel_plan(
    s: dict,
    world: int,
    ep: int,
    pp: int,
    path: str,
    microbatches: int,
    fused_loss: bool = True,
    schedule: str = "1f1b",
    inductor: bool | str = "auto",
    dp_shard: int = 1,
):
    parallel = {"dp": world // pp, "ep": ep, "pp": pp, "ep_path": path, "dp_shard": dp_shard}
    if pp > 1:
        v = 1 if schedule in ONE_STAGE_PER_RANK else 2
        parallel |= {"microbatches": microbatches, "pp_schedule": schedule, "virtual_stages": v}
    plan = moe_plan(s, parallel)
    plan.loss.fused = fused_loss
    plan.lowering.inductor = inductor
    return plan


def trainer_step(s: dict, plan, device: torch.device) -> tuple[Callable, float, int]:
    """(step, useful FLOPs per step on this rank, tokens per step on this rank): the Trainer's
    step, for every layout. A pipelined plan's batch is its microbatches of ``s["micro"]``, and
    every rank of a pipeline counts its share of the pipeline's tokens, so the job's total is
    right when summed over ranks."""
    pp = plan.parallel.pp
    batch = s["micro"] * (plan.parallel.microbatches if pp > 1 else 1)
    cfg = TrainConfig(
        lr=LR,
        steps=1000, batch_size=batch, seq_len=s["seq"], device=str(device), synthetic=True,
        out=tempfile.mkdtemp(prefix="moec_scaling_"), plots=False,
    )  # fmt: skip
    trainer = Trainer(dense_model(s), plan, cfg)
    tokens = batch * s["seq"] / pp

    def step() -> torch.Tensor:
        return trainer.train_step()

    if trainer.pipeline is not None:
        compiled = trainer.compiled
        step.stage_ms = lambda: stage_ms(compiled, step, device)  # type: ignore[attr-defined]
        step.stage_pass = lambda: stage_pass(compiled, step)  # type: ignore[attr-defined]
    return step, trainer.train_flops_per_token * tokens, tokens


def stage_pass(compiled, step: Callable) -> Callable[[], None]:
    """Forward + backward of one microbatch through this rank's stages alone (no P2P, no
    bubble, no optimizer): the inputs each stage received in one more ``step``, replayed."""
    runtime = runtime_for(compiled)
    seen: dict[int, tuple] = {}
    handles = [
        m.register_forward_pre_hook(
            lambda module, args, kwargs: seen.__setitem__(module.index, (args, kwargs)),
            with_kwargs=True,
        )
        for m in runtime.modules
    ]
    step()
    for handle in handles:
        handle.remove()

    def once() -> None:
        for module in runtime.modules:
            args, kwargs = seen[module.index]
            args = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
            out = module(*args, **kwargs)
            outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return once


def stage_ms(compiled, step: Callable, device: torch.device, reps: int = 3) -> float:
    """:func:`stage_pass` in ms; across ranks it shows the stage imbalance 1F1B runs at the
    pace of."""
    once = stage_pass(compiled, step)
    once()
    if device.type == "cuda":
        torch.cuda.synchronize()  # outside any timed step
    start = time.perf_counter()
    for _ in range(reps):
        once()
    if device.type == "cuda":
        torch.cuda.synchronize()
    compiled.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / reps * 1e3


def kernel_times(fn: Callable[[], None], trace: str | None = None) -> dict[str, float]:
    """Device microseconds per kernel name over one call of ``fn`` (torch profiler), and the
    host's blocking CUDA calls (``host:<name>``: allocations, synchronizations) by time;
    ``trace``: also write the profiler's Chrome trace there."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()  # the profiled window's end (outside any timed step)
    times: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            key = event.name
        elif event.name.startswith(("cudaMalloc", "cudaFree", "cudaStreamSynchronize",
                                    "cudaEventSynchronize", "cudaDeviceSynchronize")):  # fmt: skip
            key = f"host:{event.name}"
        else:
            continue
        times[key] = times.get(key, 0.0) + (
            event.device_time if event.device_type == torch.autograd.DeviceType.CUDA
            else event.cpu_time_total
        )  # fmt: skip
    if trace:
        prof.export_chrome_trace(trace)
    return times


COMM_KERNELS = ("nccl", "push_rows", "barrier")
"""Name parts of the kernels that move data between ranks (NCCL's P2P and collectives, the
rowwise EP transport's pushes and barriers)."""


def profiled_kernels(fn: Callable[[], object]) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every CUDA kernel one ``fn()`` of this rank ran, in start
    order (torch profiler; the device drained before and after)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()  # the profiled window's end (outside any timed step)
    return sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0
    )


def ms_by_kernel(kernels: list[tuple[float, float, str]], width: int) -> dict[str, float]:
    """Milliseconds per kernel name (its first ``width`` characters), longest first."""
    by_name: dict[str, float] = collections.defaultdict(float)
    for a, b, name in kernels:
        by_name[name[:width]] += (b - a) / 1e3
    return dict(sorted(by_name.items(), key=lambda kv: -kv[1]))


def step_timeline(step: Callable, gaps: int = 12) -> dict:
    """One ``step()`` of this rank under the profiler: from its first kernel's start to its last
    kernel's end, the ms in which a compute kernel runs, in which only communication kernels
    run, and in which none runs (idle), with the ``gaps`` longest idle gaps and the kernels on
    either side of each (what the GPU waited between), and ms per kernel name (to set beside
    ``--kernels``' table of the stages run alone)."""
    kernels = profiled_kernels(step)
    if not kernels:
        return {}
    is_comm = [any(k in name.lower() for k in COMM_KERNELS) for _, _, name in kernels]
    compute = merged_spans([(a, b) for (a, b, _), c in zip(kernels, is_comm) if not c])
    busy = merged_spans([(a, b) for a, b, _ in kernels])
    span = kernels[-1][1] - kernels[0][0]
    compute_us = sum(b - a for a, b in compute)
    busy_us = sum(b - a for a, b in busy)
    holes = sorted(
        ((nxt[0] - prev[1], prev[1], nxt[0]) for prev, nxt in zip(busy, busy[1:])), reverse=True
    )[:gaps]

    def last_before(t: float) -> str:
        return max((k for k in kernels if k[1] <= t), key=lambda k: k[1])[2][:80]

    def first_after(t: float) -> str:
        return min((k for k in kernels if k[0] >= t), key=lambda k: k[0])[2][:80]

    return {
        "span_ms": span / 1e3,
        "compute_ms": compute_us / 1e3,
        "comm_only_ms": (busy_us - compute_us) / 1e3,
        "idle_ms": (span - busy_us) / 1e3,
        "kernels": len(kernels),
        "ms_by_kernel": ms_by_kernel(kernels, 120),
        "longest_gaps": [
            {
                "ms": gap / 1e3,
                "at_ms": (start - kernels[0][0]) / 1e3,
                "after": last_before(start),
                "before": first_after(end),
            }  # fmt: skip
            for gap, start, end in holes
        ],
    }


def sync_trace(step: Callable, device: torch.device) -> list[str]:
    """Run ``step`` once in CUDA's sync debug mode and return, per synchronizing call, the
    innermost frames of moec, benchmarks or torch.distributed that made it (empty on CPU)."""
    if device.type != "cuda":
        return []
    found: list[str] = []
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "called a synchronizing CUDA operation" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [
            f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()[:-1]
            if any(k in f.filename for k in ("moec/", "benchmarks/", "torch/distributed/"))
        ]
        found.append(" <- ".join(reversed(frames[-4:])))

    with warnings.catch_warnings(), sync_debug_mode("warn"):
        warnings.simplefilter("always")
        warnings.showwarning = record
        step()
    return found


def measure(
    step: Callable, device: torch.device, steps: int, warmup: int, trace: bool = False
) -> dict:
    """Steady-state step time (the slowest rank's), host syncs, peak memory of this rank;
    ``trace``: where this rank's syncs come from (printed)."""
    syncs, _, _ = warm_up(step, device, warmup)
    if trace:
        for where, count in collections.Counter(sync_trace(step, device)).items():
            print(f"rank {dist.get_rank()}: {count} x sync at {where}", flush=True)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()  # the end of the timed window (outside any step)
    seconds = torch.tensor([(time.perf_counter() - start) / steps], device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return {"step_s": float(seconds), "host_syncs_per_step": syncs, "peak_mem_gb": peak}


def run(
    s: dict,
    ep: int,
    pp: int,
    path: str,
    microbatches: int,
    steps: int,
    warmup: int,
    fused_loss: bool = True,
    trace: bool = False,
    schedule: str = "1f1b",
    inductor: bool | str = "auto",
    kernels: str | None = None,
    timeline: str | None = None,
    dp_shard: int = 1,
) -> dict:
    """Build, warm up and time one parallel configuration; the job's totals on every rank.
    ``kernels``: write this rank's kernel times of one stage pass (pp > 1) or one step to
    ``{kernels}_pp{pp}_mb{microbatches}_rank{r}.json`` (its profiler trace to ``.trace``);
    ``timeline``: this rank's :func:`step_timeline` of one step to
    ``{timeline}_pp{pp}_mb{microbatches}_rank{r}.json``."""
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")  # fmt: skip
    torch.manual_seed(0)  # the same dense init on every rank
    plan = parallel_plan(
        s, world, ep, pp, path, microbatches, fused_loss, schedule, inductor, dp_shard
    )
    v = plan.parallel.virtual_stages
    step, flops, tokens = trainer_step(s, plan, device)
    result = measure(step, device, steps, warmup, trace)
    if pp > 1:  # every rank's stage time, in rank order (rank = pipeline rank * dp + dp rank)
        mine = torch.tensor([step.stage_ms()], device=device, dtype=torch.float64)
        ranks = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(ranks, mine)
        result["stage_ms_by_rank"] = [round(float(t), 1) for t in ranks]
    if kernels and device.type == "cuda":
        out = f"{kernels}_pp{pp}_mb{microbatches}_rank{dist.get_rank()}.json"
        times = kernel_times(step.stage_pass() if pp > 1 else step, out.replace(".json", ".trace"))
        with open(out, "w") as f:
            json.dump(times, f, indent=1)
    if timeline and device.type == "cuda":
        out = f"{timeline}_pp{pp}_mb{microbatches}_rank{dist.get_rank()}.json"
        with open(out, "w") as f:
            json.dump(step_timeline(step), f, indent=1)
    del step  # the compiled model and its runtime: freed before the next configuration
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    totals = torch.tensor([flops, tokens], device=device, dtype=torch.float64)
    dist.all_reduce(totals)
    flops, tokens = totals.tolist()
    seconds = result["step_s"]
    peak_mem = torch.tensor([result["peak_mem_gb"]], device=device)
    dist.all_reduce(peak_mem, op=dist.ReduceOp.MAX)
    config = f"dp={world // pp} ep={ep} pp={pp}" + (f" {path}" if ep > 1 else "")
    config += f" shard={dp_shard}" if dp_shard > 1 else ""
    if pp > 1:
        config += f" {schedule} mb={microbatches}" + ("" if fused_loss else " unfused")
    return {
        "config": config,
        "gpus": world,
        "pp": pp,
        "microbatches": microbatches,
        "virtual_stages": v,
        "bubble": None if schedule in ZERO_BUBBLE else (pp - 1) / (v * microbatches + pp - 1),
        **result,
        "peak_mem_gb": float(peak_mem),
        "tokens_per_s_per_gpu": tokens / seconds / world,
        "useful_mfu": useful_mfu(flops, seconds, world, bf16_peak_tflops(device)),
    }


def report(rows: list[dict], single: dict | None) -> None:
    print(f"{'':44} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>6} {'peak GB':>8} {'syncs':>6} "
          f"{'bubble':>7} {'scaling':>8}")  # fmt: skip
    for r in rows:
        mfu = "-" if r["useful_mfu"] is None else f"{100 * r['useful_mfu']:.1f}%"
        eff = "-" if single is None else f"{r['tokens_per_s_per_gpu'] / single['tokens_per_s']:.2f}"
        bubble = "-" if r["bubble"] is None else f"{100 * r['bubble']:.1f}%"
        print(
            f"{r['config']:44} {r['step_s']:8.3f} {r['tokens_per_s_per_gpu']:10.0f} {mfu:>6} "
            f"{r['peak_mem_gb']:8.1f} {r['host_syncs_per_step']!s:>6} "
            f"{bubble:>7} {eff:>8}"
        )
        if "stage_ms_by_rank" in r:  # the 1F1B step the stage times alone predict
            times = r["stage_ms_by_rank"]
            slots = r["microbatches"] + (r["pp"] - 1) / r["virtual_stages"]
            print(
                f"{'':4}stages' fwd+bwd per microbatch, ms by rank: {times}; balance (mean/max) "
                f"{sum(times) / len(times) / max(times):.3f}; (microbatches + (pp - 1) / v) x "
                f"max = {slots * max(times) / 1e3:.3f} s"
            )


def single_gpu(path: str | None) -> dict | None:
    """The moec row of a ``benchmarks/e2e.py --json`` result."""
    if path is None:
        return None
    with open(path) as f:
        return next(r for r in json.load(f)["results"] if r["name"] == "moec")


def init() -> None:
    for name, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(name, value)
    join_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--path", default="auto", help="EP path (rowwise on CUDA by default)")
    parser.add_argument(
        "--microbatches",
        type=int,
        nargs="+",
        default=[4],
        help="pipeline microbatches per step; several counts: one row each (e.g. 4 8 16)",
    )
    parser.add_argument(
        "--schedule",
        default="1f1b",
        choices=["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"],
        help="pp > 1: parallel.pp_schedule (2 stages per rank for the last three)",
    )
    parser.add_argument(
        "--unfused-loss", action="store_true", help="pp > 1: loss.fused false (the old path)"
    )
    parser.add_argument(
        "--sync-trace", action="store_true", help="print where each rank's host syncs come from"
    )
    parser.add_argument(
        "--inductor",
        choices=list(INDUCTOR_CHOICES),
        default="auto",
        help="plan.lowering.inductor (auto: Inductor on CUDA except for pipelines)",
    )
    parser.add_argument(
        "--kernels",
        metavar="PREFIX",
        help="write each rank's kernel times (one stage pass, or one step at pp = 1) to "
        "PREFIX_pp{pp}_mb{microbatches}_rank{r}.json and its profiler trace to .trace",
    )
    parser.add_argument(
        "--timeline",
        metavar="PREFIX",
        help="profile one step per rank: compute, communication-only and idle ms and the "
        "longest idle gaps, to PREFIX_pp{pp}_mb{microbatches}_rank{r}.json",
    )
    parser.add_argument("--dp-shard", type=int, default=1, help="parallel.dp_shard (FSDP)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a CPU-sized smoke run")
    parser.add_argument("--single", help="benchmarks/e2e.py --json output of one GPU")
    parser.add_argument("--json", help="write the result here (rank 0)")
    args = parser.parse_args()
    init()
    s = SMALL if args.small else FULL
    counts = args.microbatches if args.pp > 1 else args.microbatches[:1]
    rows = []
    for microbatches in counts:
        rows.append(
            run(
                s,
                args.ep,
                args.pp,
                args.path,
                microbatches,
                args.steps,
                args.warmup,
                fused_loss=not args.unfused_loss,
                trace=args.sync_trace,
                schedule=args.schedule,
                inductor=INDUCTOR_CHOICES[args.inductor],
                kernels=args.kernels,
                timeline=args.timeline,
                dp_shard=args.dp_shard,
            )
        )
        if dist.get_rank() == 0:  # each row as soon as it is measured
            report(rows[-1:], single_gpu(args.single))
    if dist.get_rank() == 0:
        if len(rows) > 1:
            print("\nall rows:")
            report(rows, single_gpu(args.single))
        if args.json:
            with open(args.json, "w") as f:
                result = rows[0] if len(rows) == 1 else rows
                json.dump({"shape": s, "result": result}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
