"""``moec plan auto`` against measurement (issue #23): predicted vs measured step time of the
e2e model's plans on 1 or N GPUs.

The model is ``benchmarks/e2e.py``'s (``dense_model`` + ``moe_plan``: FULL, SMALL with
``--small``); the global batch is ``--global-seqs`` sequences of e2e's length (default: e2e's 3
per GPU). The plans:

- the search's ``--top`` best (default 3), with the default time model, and with ``--calibrate``
  also the best of the calibrated search;
- every plan of ``examples/plans/`` whose adapted layout fits the GPU (:func:`adapt`): its
  parallel, precision and recompute sections on the e2e model (its ``moe`` section is the
  model's, not the plan's: the model under test stays e2e's), with ``pp`` the largest divisor
  of the world <= the plan's, ``dp = world / pp``, ``ep`` the largest divisor of dp (and of the
  experts) <= the plan's, ``dp_shard`` kept if it divides dp (the plan's full FSDP stays full),
  the microbatch count the divisor of the rank's sequences nearest the plan's (>= pp when
  pipelined; >= 2 sequences each, as the search's plans), ``mxfp8`` the GPU's native low
  precision where it has no MXFP8 MMA (sm90: ``fp8_rowwise``), ``interleaved_1f1b`` for zbv /
  dualpipev where this torch cannot run them (``schedule_runs``), the precision scope the
  routed experts (the time model prices low precision there only), ``ep_path: auto`` as
  ``rowwise``. Plans that adapt to the same layout are measured once.

Each plan is compiled once (the Trainer for ``pp = 1``; for ``pp > 1`` the step of
``benchmarks/scaling.py``: ``CompiledModel.train_step`` with the loss in the last stage, the
pipeline runtime, moec's AdamW and clipping), run
``--warmup`` steps and one more counting host syncs, then ``--steps`` timed steps (the slowest
rank's mean). Printed (rank 0): predicted vs measured step time, predicted / measured, whether
within 15%, and whether the chosen plan (the search's first) was the fastest measured.

``--calibrate``: first profile one step of the one-GPU plan (e2e's: one rank, e2e's microbatch,
on rank 0 while the others wait) with :class:`moec.runtime.profiling.StepProfiler`, fit the
time model to it (:mod:`moec.autoplan.calibration`) and print both predictions; its
``ops_rank0.json`` is kept under ``--out`` so ``--calibrate PATH`` reuses it (a run directory of
``moec train --profile``, or the file).

    python benchmarks/autoplan_validate.py [--calibrate] [--json out.json]
    torchrun --standalone --nproc-per-node 2 benchmarks/autoplan_validate.py --calibrate
    python benchmarks/autoplan_validate.py --small        # CPU, tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.e2e import FULL, LR, SMALL, dense_model, moe_plan, warm_up
from moec.analysis.cost.time import Efficiency, format_efficiency
from moec.analysis.gpus import GPUSpec, gpu_spec
from moec.analysis.pipeline_schedule import schedule_runs
from moec.analysis.rank_memory import GIB
from moec.autoplan.calibration import fit, load_measurement
from moec.autoplan.cli import capture_model
from moec.autoplan.profile import ModelProfile
from moec.autoplan.search import Layout, Prediction, Request, Search
from moec.plan import Plan

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "plans"
TOLERANCE = 0.15
PROFILE_FLOPS: dict[str, float] = {}
"""The search profile's useful FLOPs per token, checked against each compiled program's."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def adapt(plan: Plan, world: int, seqs: int, experts: int, gpu: GPUSpec) -> Layout:
    """``plan``'s layout on ``world`` GPUs for ``seqs`` sequences per step (see module)."""
    p = plan.parallel
    pp = max(d for d in _divisors(world) if d <= p.pp)
    dp = world // pp
    if seqs % dp:
        raise ValueError(f"{seqs} sequences do not split over dp = {dp}")
    ep = max(d for d in _divisors(dp) if d <= p.ep and experts % d == 0)
    shard = dp if p.dp_shard > 1 and p.dp_shard == p.dp else p.dp_shard
    shard = shard if dp % shard == 0 else 1
    v, schedule = (p.virtual_stages, p.pp_schedule) if pp > 1 else (1, "1f1b")
    if not schedule_runs(schedule, shard):
        schedule = "interleaved_1f1b"  # the v = 2 schedule this torch runs (the search's too)
    per_rank = seqs // dp
    counts = [
        m
        for m in _divisors(per_rank)
        if (pp == 1 or (m >= pp and (v == 1 or m % pp == 0))) and per_rank // m >= 2
    ]
    if not counts:
        raise ValueError(
            f"no microbatch count of {per_rank} sequences per rank suits pp = {pp} with >= 2 "
            "sequences per microbatch (moec captures at the microbatch)"
        )
    m = min(counts, key=lambda c: (abs(c - p.microbatches), c))
    micro = per_rank // m
    gemm = plan.precision.gemm
    if gemm == "mxfp8" and gpu.mxfp8_tflops is None:
        gemm = gpu.low_precision()
    path = p.ep_path if p.ep_path in ("rowwise", "a2a_capacity") else "rowwise"
    recompute = plan.recompute.policy if plan.recompute.policy in ("none", "block") else "block"
    overlap = p.overlap if ep > 1 and micro % 2 == 0 else "none"
    scope = () if gemm == "bf16" else tuple(plan.precision.scope)
    return Layout(
        pp, v, schedule, dp, ep, path if ep > 1 else "auto", shard, micro, m, recompute, gemm,
        overlap, scope=scope,
    )  # fmt: skip


def describe(lay: Layout) -> str:
    """A layout in one short phrase."""
    parts = [f"pp{lay.pp}" + (f"x{lay.virtual_stages}" if lay.virtual_stages > 1 else "")]
    if lay.pp > 1:
        parts.append(lay.schedule)
    parts.append(f"dp{lay.dp}" + (f"/shard{lay.dp_shard}" if lay.dp_shard > 1 else ""))
    parts.append(f"ep{lay.ep}" + (f" {lay.ep_path}" if lay.ep > 1 else ""))
    parts.append(f"{lay.micro_seqs}x{lay.microbatches}")
    gemm = lay.gemm + (f":{'+'.join(lay.scope)}" if lay.scope else "")
    parts += [f"rc:{lay.recompute}", gemm] + (["2batch"] if lay.overlap != "none" else [])
    return " ".join(parts + (["folded"] if lay.fold_experts else []))


@dataclasses.dataclass
class Candidate:
    layout: Layout
    sources: list[str]
    predicted: Prediction
    calibrated: Prediction | None = None
    measured: dict[str, Any] | None = None


# --- distributed helpers ------------------------------------------------------------------------


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def job_max(value: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def say(*args: Any) -> None:
    if rank() == 0:
        print(*args, flush=True)


# --- building and timing one plan ---------------------------------------------------------------


def build(s: dict, plan: Plan, lay: Layout, device: torch.device, out: Path) -> tuple:
    """(step, holder): one training step of ``plan`` and the object that owns its state."""
    torch.manual_seed(0)  # the same dense init on every rank
    if lay.pp == 1:
        from moec.train import TrainConfig, Trainer

        cfg = TrainConfig(
            lr=LR,
            steps=10**6, batch_size=lay.micro_seqs * lay.microbatches, seq_len=s["seq"],
            device=str(device), synthetic=True, plots=False,
            out=tempfile.mkdtemp(prefix=f"rank{rank()}_", dir=out),
        )  # fmt: skip
        trainer = Trainer(dense_model(s), plan, cfg)
        compiled = trainer.train_flops_per_token
        searched = PROFILE_FLOPS.get("per_token", compiled)
        if abs(searched / compiled - 1) > 0.05:  # the search priced another model than runs
            say(f"    warning: the search's profile has {searched / 1e9:.3f} useful "
                f"GFLOP/token, the compiled program {compiled / 1e9:.3f}")  # fmt: skip
        return trainer.train_step, trainer
    from benchmarks.scaling import pipeline_step  # the loss in the last stage, moec's AdamW

    step, _, _ = pipeline_step({**s, "micro": lay.micro_seqs}, plan, device)
    return step, step


def release(device: torch.device) -> None:
    """Free what the plans measured so far left: call it once the caller holds no reference to
    them (a trainer's reference cycles outlive ``del`` until a collection; a plan measured
    beside the previous plan's 36 GiB of state reports that state in its peak)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(step: Callable, device: torch.device, steps: int, warmup: int) -> dict[str, Any]:
    """The slowest rank's mean step time over ``steps`` after ``warmup`` (+1 counting host
    syncs), and the job's peak memory."""
    syncs, _, _ = warm_up(step, device, warmup)
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()  # the end of the timed window (outside any step)
    seconds = job_max((time.perf_counter() - start) / steps, device)
    peak = torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None
    peak = job_max(peak, device) if peak is not None else None
    return {"step_s": seconds, "host_syncs_per_step": syncs, "peak_gib": peak}


def profile_one_gpu_step(s: dict, device: torch.device, out: Path, warmup: int) -> Path:
    """Profile one step of the one-GPU plan on rank 0 (the others wait); its ops_rank0.json."""
    from moec.runtime.profiling import ProfileWindow, StepProfiler

    path = out / "calibration" / "profile" / "ops_rank0.json"
    if rank() == 0:
        lay = Layout(1, 1, "1f1b", 1, 1, "auto", 1, s["micro"], 1, "none", "bf16", "none")
        step, trainer = build(s, moe_plan(s), lay, device, out)  # e2e's plan: one rank
        profiler = StepProfiler(
            ProfileWindow(warmup, 1), trainer.compiled, path.parent, device=device, say=None
        )
        for i in range(warmup + 1):
            with profiler.step(i):
                step()
        trainer.batches.close()
        del step, trainer, profiler
        release(device)
    barrier()
    return path


# --- the validation ---------------------------------------------------------------------------


def candidates(
    profile: ModelProfile,
    request: Request,
    calibrated: Efficiency | None,
    top: int,
    examples: bool,
    experts: int,
) -> tuple[list[Candidate], list[str], Search, Search | None]:
    """The plans to measure (search's top, calibrated top, fitting examples), fastest predicted
    first, and the examples left out with why."""
    search = Search(profile, request)
    cal = Search(profile, dataclasses.replace(request, eff=calibrated)) if calibrated else None
    found: dict[Layout, Candidate] = {}

    def add(lay: Layout, source: str) -> None:
        if lay not in found:
            found[lay] = Candidate(lay, [], search.evaluate(lay))
            if cal is not None:
                found[lay].calibrated = cal.evaluate(lay)
        found[lay].sources.append(source)

    for i, p in enumerate(search.best(top)):
        add(p.layout, f"search #{i + 1}")
    if cal is not None:
        for i, p in enumerate(cal.best(top)):
            add(p.layout, f"calibrated #{i + 1}")
    skipped = []
    seqs = request.global_batch // request.seq
    for path in sorted(EXAMPLES.glob("*.yaml")) if examples else []:
        try:
            lay = adapt(Plan.load(path), request.world, seqs, experts, request.gpu)
        except ValueError as exc:
            skipped.append(f"{path.name}: {exc}")
            continue
        pred = search.evaluate(lay)
        if pred.memory.total > search.capacity:
            skipped.append(
                f"{path.name} ({describe(lay)}): predicted {pred.memory.total / GIB:.1f} GiB "
                f"per rank, more than {search.capacity / GIB:.1f} GiB"
            )
            continue
        add(lay, path.name)
    ordered = sorted(found.values(), key=lambda c: c.predicted.step_s)
    return ordered, skipped, search, cal


def verdict(rows: list[Candidate], key: str, chosen: Layout) -> str:
    """``N/M within 15%``, and whether ``chosen`` measured fastest."""
    done = [c for c in rows if c.measured and "step_s" in c.measured]
    within = [c for c in done if abs(_ratio(c, key) - 1) <= TOLERANCE]
    if not done:
        return "no plan was measured"
    fastest = min(done, key=lambda c: c.measured["step_s"])
    pick = next((c for c in done if c.layout == chosen), None)
    picked = "not measured" if pick is None else f"{pick.measured['step_s'] * 1e3:.1f} ms"
    return (
        f"{len(within)}/{len(done)} within {TOLERANCE:.0%}; chosen {describe(chosen)} "
        f"({picked}), fastest measured {describe(fastest.layout)} "
        f"({fastest.measured['step_s'] * 1e3:.1f} ms): chosen is fastest: "
        f"{'yes' if pick is fastest else 'no'}"
    )


def _ratio(c: Candidate, key: str) -> float:
    pred = c.predicted if key == "predicted" else c.calibrated
    return pred.step_s / c.measured["step_s"]


def table(rows: list[Candidate], calibrated: bool) -> str:
    head = f"{'plan':<44} {'from':<34} {'pred ms':>8} {'meas ms':>8} {'pred/meas':>9} {'15%':>4}"
    if calibrated:
        head += f" {'cal ms':>8} {'cal/meas':>8} {'15%':>4}"
    head += f" {'syncs':>5} {'peak GiB':>8} {'pred GiB':>8}"
    lines = [head]
    for c in rows:
        m = c.measured or {}
        ok = "step_s" in m
        cells = [f"{describe(c.layout):<44}", f"{', '.join(c.sources)[:34]:<34}"]
        cells.append(f"{c.predicted.step_s * 1e3:>8.4g}")
        cells.append(f"{m['step_s'] * 1e3:>8.4g}" if ok else f"{'-':>8}")
        for key, pred in [("predicted", c.predicted)] + (
            [("calibrated", c.calibrated)] if calibrated else []
        ):
            if key == "calibrated":
                cells.append(f"{pred.step_s * 1e3:>8.4g}")
            if ok:
                r = _ratio(c, key)
                cells += [f"{r:>{9 if key == 'predicted' else 8}.3f}"]
                cells += [f"{'yes' if abs(r - 1) <= TOLERANCE else 'no':>4}"]
            else:
                cells += [f"{'-':>{9 if key == 'predicted' else 8}}", f"{'-':>4}"]
        cells.append(f"{m.get('host_syncs_per_step')!s:>5}" if ok else f"{'-':>5}")
        peak = m.get("peak_gib")
        cells.append(f"{peak:>8.1f}" if peak is not None else f"{'-':>8}")
        cells.append(f"{c.predicted.memory.total / GIB:>8.1f}")
        lines.append(" ".join(cells))
        if not ok and m.get("error"):
            lines.append(f"    failed: {m['error']}")
    return "\n".join(lines)


def init() -> None:
    if "WORLD_SIZE" in os.environ:
        from moec.runtime.distributed import NO_MULTICAST_ENV, join_process_group

        for name, value in NO_MULTICAST_ENV.items():
            os.environ.setdefault(name, value)
        join_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run)")
    parser.add_argument("--gpu", default="h200", help="the GPU spec the search uses")
    parser.add_argument("--global-seqs", type=int, help="sequences per step (default 3/GPU)")
    parser.add_argument("--top", type=int, default=3, help="search plans to measure")
    parser.add_argument("--pp", type=int, help="search only plans of this pipeline degree")
    parser.add_argument("--no-examples", action="store_true", help="skip examples/plans")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per plan")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing")
    parser.add_argument(
        "--calibrate",
        nargs="?",
        const="",
        metavar="PATH",
        help="calibrate the time model first: alone, from a profiled step of the one-GPU plan "
        "run here; with PATH, from that ops_rank0.json or moec train --profile run",
    )
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=0.92,
        help="usable share of the GPU's memory the search assumes (lower: a memory-bound search)",
    )
    parser.add_argument("--out", help="folder for the runs and the profile (default: a temp)")
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    init()
    s = SMALL if args.small else FULL
    world = world_size()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    out = Path(args.out or tempfile.mkdtemp(prefix="moec_autoplan_validate_"))
    out.mkdir(parents=True, exist_ok=True)
    seqs = args.global_seqs or s["micro"] * world
    gpu = gpu_spec(args.gpu)

    def example() -> tuple:  # at e2e's microbatch (meta tensors: any size is free)
        return dense_model(s), (torch.randint(0, s["vocab"], (s["micro"], s["seq"])),), {}

    start = time.perf_counter()
    profile = capture_model(example, moe_plan(s), "e2e")
    PROFILE_FLOPS["per_token"] = profile.useful_flops_per_token(1, s["seq"])
    say(f"captured the e2e model ({'SMALL' if args.small else 'FULL'}) in "
        f"{time.perf_counter() - start:.1f} s: "
        f"{profile.useful_flops_per_token(1, s['seq']) / 1e9:.3f} useful GFLOP/token")  # fmt: skip
    request = Request(
        world,
        gpu,
        seqs * s["seq"],
        s["seq"],
        args.memory_fraction,
        min_micro_seqs=2,
        pp=args.pp,
    )
    calibrated = None
    if args.calibrate is not None:
        source = (
            Path(args.calibrate)
            if args.calibrate
            else profile_one_gpu_step(s, device, out, args.warmup)
        )
        fitted = fit(load_measurement(source), gpu, request.eff, profile)
        calibrated = fitted.eff
        say(f"calibrated from {source} ({'; '.join(fitted.notes)}):")
        say(f"  {format_efficiency(calibrated, request.eff)}")
    rows, skipped, search, _ = candidates(
        profile, request, calibrated, args.top, not args.no_examples, s["experts"]
    )
    for line in skipped:
        say(f"left out: {line}")
    say(f"{len(rows)} plans to measure on {world} x {device.type}, {seqs} x {s['seq']} tokens")
    for c in rows:
        step = holder = None
        plan = c.predicted.plan(moe_plan(s))
        t0 = time.perf_counter()
        say(f"  measuring {describe(c.layout)} ...")  # a run cut short shows where it was
        try:
            step, holder = build(s, plan, c.layout, device, out)
            say(f"    built in {time.perf_counter() - t0:.0f} s")
            c.measured = measure(step, device, args.steps, args.warmup)
        except Exception as exc:  # one plan's failure is a result, the others still run
            c.measured = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            print(f"rank {rank()}: {describe(c.layout)} failed:\n{traceback.format_exc()}",
                  flush=True)  # fmt: skip
            if c.layout.pp > 1 and world > 1:
                # a pipeline rank that failed mid-step leaves its peers waiting in a P2P
                # transfer that never comes: stop here (torchrun ends the others) rather than hang
                raise
        finally:
            batches = getattr(holder, "batches", None)
            if batches is not None:
                batches.close()
            step = holder = None
            release(device)
        barrier()
        c.measured["wall_s"] = time.perf_counter() - t0
        say(f"  {describe(c.layout)}: {c.measured}")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    say(f"\nplan auto vs measurement: e2e model, {world} x {name}, {seqs} x {s['seq']} tokens "
        f"per step, {args.steps} timed steps after {args.warmup} + 1 warm-up")  # fmt: skip
    say(table(rows, calibrated is not None))
    chosen = search.best(1)[0].layout
    say(f"uncalibrated: {verdict(rows, 'predicted', chosen)}")
    if calibrated is not None:
        cal_chosen = Search(profile, dataclasses.replace(request, eff=calibrated)).best(1)[0]
        say(f"calibrated:   {verdict(rows, 'calibrated', cal_chosen.layout)}")
    say(f"total {time.perf_counter() - began:.0f} s")
    if args.json and rank() == 0:
        result = {
            "device": name,
            "world": world,
            "shape": s,
            "global_seqs": seqs,
            "calibrated_efficiency": calibrated and dataclasses.asdict(calibrated),
            "left_out": skipped,
            "plans": [
                {
                    "layout": dataclasses.asdict(c.layout),
                    "sources": c.sources,
                    "predicted_s": c.predicted.step_s,
                    "calibrated_s": c.calibrated.step_s if c.calibrated else None,
                    "predicted_gib": c.predicted.memory.total / GIB,
                    **(c.measured or {}),
                }
                for c in rows
            ],
        }
        Path(args.json).write_text(json.dumps(result, indent=2))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
