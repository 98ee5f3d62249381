"""The e2e benchmark model (``benchmarks/e2e.py``: the report's profiling workload) trained on
several GPUs, one process per GPU under torchrun: tokens/s/GPU and useful MFU, and the scaling
efficiency against a single-GPU run of the same model (Table 51).

    torchrun --nproc-per-node 2 benchmarks/scaling.py --ep 2 [--path rowwise]
    torchrun --nproc-per-node 2 benchmarks/scaling.py --pp 2 [--microbatches 4]
    ... --single results.json     # benchmarks/e2e.py --json output: prints the efficiency

``pp = 1``: the Trainer (data + expert parallel, dp = world, each rank 3 sequences of 8192 per
step). ``pp > 1``: ``CompiledModel.train_step`` (the pipeline runtime, 1F1B over
``--microbatches`` microbatches of 3 sequences, dp = world / pp), fused AdamW and clipping as the
Trainer does. Useful FLOPs per token come from moec's cost model of the compiled program (the
same count ``e2e.py`` uses); MFU divides by every GPU of the job.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import moec
from benchmarks.e2e import FULL, SMALL, dense_model, moe_plan, warm_up
from moec.analysis.cost import graph_cost
from moec.runtime.distributed import NO_MULTICAST_ENV, join_process_group
from moec.runtime.metrics import bf16_peak_tflops, useful_mfu
from moec.runtime.pipeline import build_pipeline_mesh, runtime_for
from moec.train import TrainConfig, Trainer


def parallel_plan(s: dict, world: int, ep: int, pp: int, path: str, microbatches: int):
    parallel = {"dp": world // pp, "ep": ep, "pp": pp, "ep_path": path}
    return moe_plan(s, parallel | ({"microbatches": microbatches} if pp > 1 else {}))


def trainer_step(s: dict, plan, device: torch.device) -> tuple[Callable, float, int]:
    """(step, useful FLOPs per step on this rank, tokens per step on this rank): the Trainer."""
    cfg = TrainConfig(
        steps=1000, batch_size=s["micro"], seq_len=s["seq"], device=str(device), synthetic=True,
        out=tempfile.mkdtemp(prefix="moec_scaling_"), plots=False,
    )  # fmt: skip
    trainer = Trainer(dense_model(s), plan, cfg)
    tokens = s["micro"] * s["seq"]
    return trainer.train_step, trainer.train_flops_per_token * tokens, tokens


def pipeline_step(s: dict, plan, device: torch.device) -> tuple[Callable, float, int]:
    """The same for a pipelined program; every rank of a pipeline counts its share of the
    pipeline's tokens, so the job's total is right when summed over ranks."""
    mesh = build_pipeline_mesh(plan)
    batch = plan.parallel.microbatches * s["micro"]
    seqs = torch.randint(0, s["vocab"], (batch, s["seq"] + 1), device=device)
    inputs, targets = seqs[:, :-1], seqs[:, 1:]
    compiled = moec.compile(dense_model(s).to(device), plan, (inputs[: s["micro"]],), mesh=mesh)
    flops_per_token = graph_cost(compiled.program).evaluate().train_flops_per_token
    runtime_for(
        compiled,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=device.type == "cuda"),
        grad_clip=1.0,
    )
    tokens = batch * s["seq"] / plan.parallel.pp
    return lambda: compiled.train_step((inputs, targets)), flops_per_token * tokens, tokens


def measure(step: Callable, device: torch.device, steps: int, warmup: int) -> dict:
    """Steady-state step time (the slowest rank's), host syncs, peak memory of this rank."""
    syncs = warm_up(step, device, warmup)
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


def run(s: dict, ep: int, pp: int, path: str, microbatches: int, steps: int, warmup: int) -> dict:
    """Build, warm up and time one parallel configuration; the job's totals on every rank."""
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")  # fmt: skip
    torch.manual_seed(0)  # the same dense init on every rank
    plan = parallel_plan(s, world, ep, pp, path, microbatches)
    build = pipeline_step if pp > 1 else trainer_step
    step, flops, tokens = build(s, plan, device)
    result = measure(step, device, steps, warmup)
    totals = torch.tensor([flops, tokens], device=device, dtype=torch.float64)
    dist.all_reduce(totals)
    flops, tokens = totals.tolist()
    seconds = result["step_s"]
    peak_mem = torch.tensor([result["peak_mem_gb"]], device=device)
    dist.all_reduce(peak_mem, op=dist.ReduceOp.MAX)
    return {
        "config": f"dp={world // pp} ep={ep} pp={pp}" + (f" {path}" if ep > 1 else ""),
        "gpus": world,
        **result,
        "peak_mem_gb": float(peak_mem),
        "tokens_per_s_per_gpu": tokens / seconds / world,
        "useful_mfu": useful_mfu(flops, seconds, world, bf16_peak_tflops(device)),
    }


def report(rows: list[dict], single: dict | None) -> None:
    print(f"{'':28} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>6} {'peak GB':>8} {'syncs':>6} "
          f"{'scaling':>8}")  # fmt: skip
    for r in rows:
        mfu = "-" if r["useful_mfu"] is None else f"{100 * r['useful_mfu']:.1f}%"
        eff = "-" if single is None else f"{r['tokens_per_s_per_gpu'] / single['tokens_per_s']:.2f}"
        print(
            f"{r['config']:28} {r['step_s']:8.3f} {r['tokens_per_s_per_gpu']:10.0f} {mfu:>6} "
            f"{r['peak_mem_gb']:8.1f} {r['host_syncs_per_step']!s:>6} {eff:>8}"
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
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a CPU-sized smoke run")
    parser.add_argument("--single", help="benchmarks/e2e.py --json output of one GPU")
    parser.add_argument("--json", help="write the result here (rank 0)")
    args = parser.parse_args()
    init()
    s = SMALL if args.small else FULL
    row = run(s, args.ep, args.pp, args.path, args.microbatches, args.steps, args.warmup)
    if dist.get_rank() == 0:
        report([row], single_gpu(args.single))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"shape": s, "result": row}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
