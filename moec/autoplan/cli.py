"""``moec plan auto``: capture the model once, search, print the best plans, write the chosen one.

The time model's factors start from ``--efficiency FILE`` (JSON, as ``--efficiency-out``
writes it) or the defaults, and ``--calibrate RUN`` refits them to a profiled step
(:mod:`~moec.autoplan.calibration`: a run of ``moec train --profile``, its ``ops_rank0.json``,
a profiler trace or a list of samples) before the search; the factors used are printed.

:func:`capture` (:func:`capture_model` for a model made by a function) captures the model the
trainer compiles (model + next-token loss) on the meta device once and builds its program at
one rank, at ``dp = dp_shard = 2`` (to learn FSDP's layout) and with the combine folded into the
experts, and profiles them (:func:`profile_of`); the plans the search reports are priced on
that same capture; :func:`auto_plan` runs the
search; :func:`cmd_plan_auto` runs the subcommand, whose parser :mod:`moec.cli` builds (without
importing torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from moec.analysis.cost.time import (
    Efficiency,
    format_efficiency,
    load_efficiency,
    save_efficiency,
)
from moec.analysis.gpus import gpu_spec
from moec.analysis.rank_memory import GIB, RankMemory
from moec.autoplan.calibration import Fit, fit, load_measurement
from moec.autoplan.memory import CapturedModel, ModelLoader, plan_memory, without_named_code
from moec.autoplan.profile import ModelProfile, profile_program
from moec.autoplan.search import Prediction, Request, Search
from moec.plan import Plan


@dataclasses.dataclass
class AutoPlanResult:
    base: Plan
    best: list[Prediction]
    request: Request
    evaluated: int
    capture_s: float
    search_s: float
    prior: Efficiency = Efficiency()
    """The factors before calibration (``request.eff`` holds those the search used)."""
    fit: Fit | None = None


def _one_rank(plan: Plan, **parallel: int) -> Plan:
    data = plan.to_dict()
    data["parallel"] = {**ParallelDefaults, **parallel}
    data["recompute"] = {"policy": "none", "budget_bytes": None}
    data["precision"] = {**data["precision"], "compute_dtype": "bf16", "gemm": "bf16"}
    return Plan.from_dict(data)


ParallelDefaults = {"dp": 1, "dp_shard": 1, "ep": 1, "pp": 1, "microbatches": 1}


def capture(model_spec: str, plan: Plan) -> ModelProfile:
    """The profile of ``model_spec`` (a zoo name or ``file.py:factory``) under ``plan``'s MoE
    section, built on the meta device (any size works)."""
    return capture_model(_loader(model_spec), plan, model_spec)


def capture_model(load: ModelLoader, plan: Plan, name: str = "model") -> ModelProfile:
    """The profile of the model ``load()`` returns (``(model, args, kwargs)``, called under
    the meta device, its example one token tensor [batch, seq] of distinct sizes) with the
    next-token loss, under ``plan``'s MoE section."""
    return profile_of(CapturedModel(load, name), plan)


def profile_of(model: CapturedModel, plan: Plan) -> ModelProfile:
    """The profile of ``model`` under ``plan``'s MoE section: its programs at one rank, at
    ``dp = dp_shard = 2`` and with the combine folded into the experts, built on one capture."""
    folded = _one_rank(plan).to_dict()
    folded["lowering"] = {**folded["lowering"], "combine_in_experts": True}
    one_rank = (_one_rank(plan), _one_rank(plan, dp=2, dp_shard=2), Plan.from_dict(folded))
    return profile_program(*map(model.program, one_rank))


def auto_plan(
    model: str,
    world: int,
    gpu: str,
    global_batch: int,
    seq: int,
    plan: Plan | None = None,
    probe: str | None = None,
    inter_node_gbps: float | None = None,
    calibration: str | None = None,
    memory_fraction: float = 0.92,
    top: int = 5,
    efficiency: str | Efficiency | None = None,
    min_micro_seqs: int = 1,
    pp: int | None = None,
) -> AutoPlanResult:
    """Search the plans of ``model`` (a zoo name or ``file.py:factory``; see
    :mod:`moec.autoplan`) with the time model's factors ``efficiency`` (an :class:`Efficiency`
    or its JSON file; default: the defaults), refitted to the profiled step ``calibration``
    when given; ``pp`` forces the pipeline degree. The plans a pass would turn down are not
    candidates; the best ones are priced as ``moec plan show`` prices them
    (:func:`~moec.autoplan.memory.plan_memory`)."""
    base = plan or Plan()
    load = _loader(model)
    spec = gpu_spec(gpu, probe, inter_node_gbps)
    prior = load_efficiency(efficiency) if isinstance(efficiency, (str, Path)) else efficiency
    prior = prior or Efficiency()
    measurement = load_measurement(calibration) if calibration is not None else None
    start = time.perf_counter()
    captured_model = CapturedModel(load, model)  # the profile's programs and each priced plan's
    profile = profile_of(captured_model, base)
    captured = time.perf_counter()
    fitted = fit(measurement, spec, prior, profile) if measurement is not None else None
    eff = fitted.eff if fitted is not None else prior
    request = Request(
        world, spec, global_batch, seq, memory_fraction, eff, min_micro_seqs=min_micro_seqs, pp=pp
    )
    search = Search(profile, request, base)

    def price(candidate: Plan, micro_seqs: int) -> RankMemory:
        return plan_memory(captured_model, without_named_code(candidate), micro_seqs, seq)[0]

    best = search.priced(top, price)
    done = time.perf_counter()
    return AutoPlanResult(
        base, best, request, search.evaluated, captured - start, done - captured, prior, fitted
    )


def _loader(model_spec: str) -> ModelLoader:
    from moec.models.zoo import load_model

    return lambda: load_model(model_spec)


SCOPE_NAMES = {"routed_experts": "experts", "dense_ffn": "dense FFNs"}


def _scope(scope: tuple[str, ...]) -> str:
    """``precision.scope`` in the table's few words ("-" for bf16)."""
    return "+".join(SCOPE_NAMES.get(s, s) for s in scope) or "-"


def format_predictions(result: AutoPlanResult) -> str:
    """The best plans as a table: layout, step time broken down, tokens/s, MFU, memory."""
    req = result.request
    head = (
        f"{'#':>2} {'pp':>3} {'v':>2} {'sched':<16} {'dp':>4} {'shard':>5} {'ep':>4} "
        f"{'path':<12} {'mb':>3} {'m':>4} {'recomp':<6} {'gemm':<11} {'low-prec scope':<14} "
        f"{'overlap':<9} {'fold':<4} "
        f"{'step ms':>9} {'comp':>8} {'comm':>8} {'bubble':>8} {'recmp':>8} "
        f"{'tok/s/GPU':>10} {'MFU':>6} {'GiB':>7}"
    )
    lines = [head]
    for i, p in enumerate(result.best):
        lay = p.layout
        lines.append(
            f"{i + 1:>2} {lay.pp:>3} {lay.virtual_stages:>2} {lay.schedule:<16} {lay.dp:>4} "
            f"{lay.dp_shard:>5} {lay.ep:>4} {lay.ep_path:<12} {lay.micro_seqs:>3} "
            f"{lay.microbatches:>4} {lay.recompute:<6} {lay.gemm:<11} {_scope(lay.scope):<14} "
            f"{lay.overlap:<9} "
            f"{'yes' if lay.fold_experts else 'no':<4} "
            f"{p.step_s * 1e3:>9.4g} {p.compute_s * 1e3:>8.4g} {p.exposed_comm_s * 1e3:>8.4g} "
            f"{p.bubble_s * 1e3:>8.4g} {p.recompute_s * 1e3:>8.4g} "
            f"{p.tokens_per_s / req.world:>10.0f} "
            f"{p.mfu:>6.1%} {p.memory.total / GIB:>7.1f}"
            + (f"  units/stage {list(p.pp_layout)}" if p.pp_layout else "")
        )
    lines.append(
        f"{req.world} x {req.gpu.name} ({req.gpu.memory_bytes / GIB:.1f} GiB, "
        f"{req.memory_fraction:.0%} usable), global batch {req.global_batch} tokens at seq "
        f"{req.seq}; mb = sequences per microbatch, m = microbatches; low-prec scope = the GEMMs "
        "in the gemm precision; fold = dispatch and "
        "combine folded into the expert MLPs (lowering.combine_in_experts); MFU on "
        f"{req.gpu.bf16_tflops:.0f} TFLOP/s; {result.evaluated} candidates evaluated in "
        f"{result.search_s:.2f} s (capture {result.capture_s:.1f} s)"
    )
    return "\n".join(lines)


def format_factors(result: AutoPlanResult) -> str:
    """The time model's factors the search used (and how a calibration changed them)."""
    if result.fit is None:
        return f"time model factors: {format_efficiency(result.request.eff)}"
    return (
        f"time model factors, calibrated ({'; '.join(result.fit.notes)}):\n  "
        + format_efficiency(result.request.eff, result.prior)
    )


def plan_yaml(result: AutoPlanResult, model: str) -> str:
    """The chosen plan as YAML (every choice, ``parallel.microbatch_size`` included), after a
    comment with its prediction and the ``moec plan show`` line that prices it again."""
    best, req = result.best[0], result.request
    plan = best.plan(result.base)
    return (
        f"# moec plan auto for {model} on {req.world} x {req.gpu.name}: "
        f"{best.layout.micro_seqs} x {req.seq} tokens per microbatch, "
        f"{best.memory.total / GIB:.1f} GiB per rank predicted\n"
        f"# moec plan show PLAN.yaml --model {model} --seq {req.seq}\n" + plan.to_yaml()
    )


def cmd_plan_auto(args: argparse.Namespace) -> int:
    if args.probe_out:
        from moec.analysis.gpus import probe_gpu

        probe_gpu(args.probe_out)
        print(f"wrote {args.probe_out}")
        if args.probe is None:
            args.probe = args.probe_out
    base = Plan.load(args.plan) if args.plan else None
    result = auto_plan(
        args.model,
        args.world,
        args.gpu,
        args.global_batch,
        args.seq,
        base,
        args.probe,
        args.inter_node_gbps,
        args.calibrate,
        args.memory_fraction,
        args.top,
        args.efficiency,
        args.min_micro_seqs,
        args.pp,
    )
    print(format_factors(result))
    if args.efficiency_out:
        save_efficiency(result.request.eff, args.efficiency_out)
        print(f"wrote the factors to {args.efficiency_out}")
    print(format_predictions(result))
    if args.out:
        Path(args.out).write_text(plan_yaml(result, args.model))
        print(f"wrote the chosen plan to {args.out}")
    return 0
