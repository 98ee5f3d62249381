"""Time model: seconds of GEMMs, attention, memory-bound work, collectives and pipeline bubbles.

The cost model gives FLOPs and bytes per node; this module turns them into seconds on one GPU
(:class:`~moec.analysis.gpus.GPUSpec`: its attainable ceilings, measured where known) through
efficiency factors (:class:`Efficiency`) that a profiled step calibrates (:func:`calibrate`):

- GEMM: ``flops / (ceiling(precision) * gemm * rows / (rows + gemm_half_rows))``: large GEMMs
  run at ``gemm`` of the ceiling, a GEMM of ``rows`` rows (an expert's share of the routed
  rows) at a fraction that halves at ``gemm_half_rows``. (H200, RESULTS.md: 16 groups of 256
  rows at ~0.72 of the dense ceiling, of 8192 rows at ~0.92: ``gemm_half_rows`` ~100.) The
  dense matmuls run in bf16 but for the dense FFNs', which take the ``precision.scope``
  ``dense_ffn`` precision; the routed experts' fp8_rowwise GEMMs keep ``fp8_rowwise_experts``
  of the rate (:func:`expert_gemm_time`).
- attention: ``flops / (bf16 ceiling * attention)``;
- memory-bound ops: ``bytes / (HBM ceiling * memory)`` with ``bytes`` what the op reads and
  writes (the caller counts both);
- collectives over ``n`` ranks of a link (GB/s one direction): ring all-reduce moves
  ``2 (n-1)/n`` of the bytes, all-gather and reduce-scatter ``(n-1)/n``, all-to-all
  ``(n-1)/n`` per rank, at ``link * collective_factor[kind]`` of the link; each pays
  ``latency_s``; an EP exchange on a path runs at ``link * ep_path_factor[path]`` of the link;
- a one-stage program the default lowering leaves eager runs at ``eager`` of the rates;
- pipeline bubble (:func:`bubble_fraction`): idle share of a stage's busy time per step.

Calibration (:func:`calibrate`) fits the factors to measured :class:`OpSample` s: GEMM
``y = ceiling * t / flops = 1/gemm + (gemm_half_rows/gemm) / rows`` by least squares in
``1/rows`` weighted by time (one time-weighted factor when small GEMMs are no slower);
attention and memory as total work over total time; collectives ``t = latency + bytes / rate``.
:func:`read_trace` reads a torch profiler trace (the ``trace_rank{r}.json`` of
:mod:`moec.runtime.profiling`, recorded with ``record_shapes``): GEMM samples (``aten::mm``,
``addmm``, ``bmm``; each grouped expert MLP whole), attention samples, and the device time of
everything else, which :mod:`moec.autoplan.calibration` turns into the memory sample with the
bytes the cost model counts for the profiled step. The factors are JSON
(:func:`save_efficiency`, :func:`load_efficiency`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from moec.analysis.gpus import GPUSpec
from moec.errors import MoecError


class CalibrationError(MoecError, ValueError):
    """Samples that cannot calibrate the model (none of a kind, or malformed)."""


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Fractions of the GPU's attainable ceilings (defaults: H200 measurements, RESULTS.md)."""

    gemm: float = 0.95
    """Large GEMMs, of the GEMM ceiling (cuBLAS dense at 131072 rows is the H200's ceiling;
    moec's grouped GEMMs reach ~0.92 of it at 8192 rows per group)."""
    gemm_half_rows: float = 100.0
    """Rows per GEMM (per expert) at which a GEMM reaches half of ``gemm``."""
    attention: float = 0.55
    """Flash attention, of the bf16 ceiling (e2e profile: ~36 ms for the step's attention)."""
    memory: float = 0.6
    """Elementwise / norm / movement ops, of the HBM ceiling (fused kernels reach ~0.95,
    unfused torch ops less; the e2e profile's elementwise share gives ~0.6)."""
    link: float = 1.0
    """Collectives, of the link ceiling (the H200's is NCCL's measured all-to-all), on top of
    ``collective_factor`` (a calibration fits this one)."""
    collective_factor: tuple[tuple[str, float], ...] = (
        ("all_gather", 0.49),
        ("all_reduce", 0.59),
        ("all_to_all", 0.61),
        ("reduce_scatter", 0.48),
    )
    """Rate of each NCCL collective over the link ceiling, as the ring share of the bytes it
    moves (:data:`COLLECTIVE_SHARE`) per second, at a step's message sizes (2 H200s,
    ``benchmarks/collectives.py``, RESULTS.md session 15: float32 messages of 600 MiB per rank;
    ``all_reduce``: the gradient reducer's 2.4 GiB in 400 MiB buckets). Smaller messages run
    slower (25 MiB: 0.25-0.36)."""
    latency_s: float = 20e-6
    """Fixed cost of one collective or exchange."""
    device_busy: float = 1.0
    """Share of a step's compute time the GPU spends in kernels (the rest: launch and host gaps
    between them); a profiled CUDA step fits it (one H200, e2e step: ~0.9)."""
    pp_stage: float = 0.83
    """Share of the time model's rate a pipeline stage keeps (pp > 1): the P2P kernels running
    beside its compute and what a stage pass costs beyond its kernels. 2 H200s, e2e model, 16
    microbatches of 3 sequences (RESULTS.md, session 11): the slower stage took 150 ms per
    microbatch in the 1F1B step, where the time model priced 124.5 ms."""
    dp_hidden: float = 0.0
    """Share of the last backward that hides the data-parallel gradient reduction. 0: none
    (2 H200s, autoplan_validate.py: the e2e step at dp = 2 took 323-327 ms against 296 ms on
    one GPU, more than the whole ~16 ms reduction, though it is issued during backward)."""
    eager: float = 0.97
    """Share of the time model's rate a program that runs eagerly keeps, where the default
    lowering leaves it so (``lowering.inductor: auto`` skips FSDP and recompute plans): the
    model's rates are those of the Inductor-lowered e2e step, which measured 1.015-1.03x the
    eager one on one H200 (RESULTS.md, session 13). Pipeline stages run eagerly under ``auto``
    too; their ``pp_stage`` was measured so and includes it."""
    fp8_rowwise_experts: float = 0.725
    """Share of the fp8_rowwise rate the routed experts' MLPs keep. The ceiling is what a large
    dense FFN's FP8 linears reach, quantizers and bf16 weight gradients included; the expert
    MLPs' contraction is d (1536 in the e2e model), so their quantizers and bf16 weight
    gradients weigh more: on one H200 they ran at 686 TFLOP/s where the dense FFN's ran at 946
    (both scaled to the 768 bf16 ceiling; RESULTS.md sessions 14 and 21). MXFP8 is not
    measured and keeps its ceiling."""
    folded_experts: float = 0.99
    """Share of the expert GEMMs' rate kept where the MoE layers' dispatch and combine fold
    into them (``lowering.combine_in_experts``: row-indexed loads, the combine
    in the dgrad epilogue): the autotuned e2e step on one H200 measured 266.9 against 266.3 ms
    beside the unfolded one, ~0.6 ms over its ~71 ms of expert GEMMs; with autotuning off
    (each kernel's first config) the fold cost 8 ms (RESULTS.md, session 20)."""
    ep_path_factor: tuple[tuple[str, float], ...] = (
        ("rowwise", 0.66),
        ("a2a_capacity", 0.26),
        ("sync_1d", 0.27),
    )
    """EP exchange rate of each path over the link's all-to-all rate (2 H200s, RESULTS.md
    session 4: rowwise dispatch/combine 365/317 GB/s, a2a_capacity 122/143, sync_1d 135/149,
    against NCCL's 519 GB/s), and ``sync_1d``'s host waits are not modelled."""

    def collective_share(self, kind: str) -> float:
        factors = dict(self.collective_factor)
        if kind not in factors:
            raise CalibrationError(f"no collective factor for {kind!r}; known: {sorted(factors)}")
        return factors[kind]

    def path_factor(self, path: str) -> float:
        factors = dict(self.ep_path_factor)
        if path not in factors:
            raise CalibrationError(f"no EP path factor for {path!r}; known: {sorted(factors)}")
        return factors[path]


def gemm_time(
    flops: float, rows: float, gpu: GPUSpec, precision: str = "bf16", eff: Efficiency = Efficiency()
) -> float:
    """Seconds of GEMM work of ``flops`` in GEMMs of ``rows`` rows each (see module)."""
    if flops <= 0:
        return 0.0
    share = eff.gemm * rows / (rows + eff.gemm_half_rows) if rows > 0 else eff.gemm
    return flops / (gpu.gemm_ceiling(precision) * 1e12 * share)


def attention_time(flops: float, gpu: GPUSpec, eff: Efficiency = Efficiency()) -> float:
    return flops / (gpu.gemm_ceiling("bf16") * 1e12 * eff.attention) if flops > 0 else 0.0


def memory_time(nbytes: float, gpu: GPUSpec, eff: Efficiency = Efficiency()) -> float:
    """Seconds to move ``nbytes`` (read + written) through HBM."""
    return nbytes / (gpu.ceiling("hbm_gbps") * 1e9 * eff.memory) if nbytes > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class ForwardWork:
    """A piece of a program's forward by what prices it: the time model's inputs."""

    matmul_flops: float = 0.0
    attention_flops: float = 0.0
    expert_gemms: tuple[tuple[float, float], ...] = ()
    """(FLOPs, rows per expert) of each MoE layer's expert GEMMs."""
    moved_bytes: float = 0.0
    """Bytes the memory-bound ops read and write."""
    rows: float = 0.0
    """Rows of the dense GEMMs (the microbatch's tokens)."""
    dense_ffn_flops: float = 0.0
    """The dense FFNs' part of ``matmul_flops`` (what ``precision.scope: [dense_ffn]``
    quantizes)."""


def forward_work(
    matmul_flops: float,
    attention_flops: float,
    expert_flops: float,
    routing: list[tuple[int, int]],
    written_bytes: float,
    tokens: float,
    ep: int = 1,
    dense_ffn_flops: float = 0.0,
) -> ForwardWork:
    """The :class:`ForwardWork` of a piece of forward over ``tokens`` rows: ``expert_flops``
    shared evenly by its MoE layers, one ``(top_k, num_experts)`` each, whose local experts see
    ``tokens * top_k * ep / num_experts`` rows each (``ep`` ranks send to them); the other ops
    read and write what they write (``2 * written_bytes``); ``dense_ffn_flops`` of the
    ``matmul_flops`` are the dense FFNs'."""
    share = expert_flops / max(len(routing), 1)
    return ForwardWork(
        matmul_flops=matmul_flops,
        attention_flops=attention_flops,
        expert_gemms=tuple((share, tokens * k * ep / n) for k, n in routing),
        moved_bytes=2 * written_bytes,
        rows=tokens,
        dense_ffn_flops=dense_ffn_flops,
    )


def expert_gemm_time(
    flops: float, rows: float, gpu: GPUSpec, precision: str = "bf16", eff: Efficiency = Efficiency()
) -> float:
    """:func:`gemm_time` of routed expert GEMMs (fp8_rowwise at ``eff.fp8_rowwise_experts``)."""
    share = eff.fp8_rowwise_experts if precision == "fp8_rowwise" else 1.0
    return gemm_time(flops, rows, gpu, precision, eff) / share


def forward_time(
    work: ForwardWork,
    gpu: GPUSpec,
    eff: Efficiency = Efficiency(),
    expert_precision: str = "bf16",
    dense_ffn_precision: str = "bf16",
) -> float:
    """Seconds of ``work`` on one GPU, launch gaps included (``eff.device_busy``): the routed
    experts' GEMMs in ``expert_precision``, the dense FFNs' in ``dense_ffn_precision``."""
    dense = work.matmul_flops - work.dense_ffn_flops
    seconds = gemm_time(dense, work.rows, gpu, "bf16", eff)
    seconds += gemm_time(work.dense_ffn_flops, work.rows, gpu, dense_ffn_precision, eff)
    seconds += attention_time(work.attention_flops, gpu, eff)
    seconds += memory_time(work.moved_bytes, gpu, eff)
    seconds += sum(expert_gemm_time(f, r, gpu, expert_precision, eff) for f, r in work.expert_gemms)
    return seconds / eff.device_busy


COLLECTIVE_SHARE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
"""Share of a rank's bytes each collective moves over its link (ring algorithms)."""


def collective_time(
    kind: str, nbytes: float, ranks: int, link_gbps: float, eff: Efficiency = Efficiency()
) -> float:
    """Seconds of one collective of ``nbytes`` per rank over ``ranks`` ranks on a link of
    ``link_gbps`` (GB/s, one direction, already the ceiling); 0 for one rank."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if kind not in COLLECTIVE_SHARE:
        raise CalibrationError(f"unknown collective {kind!r}; known: {sorted(COLLECTIVE_SHARE)}")
    moved = nbytes * COLLECTIVE_SHARE[kind](ranks)
    return eff.latency_s + moved / (link_gbps * 1e9 * eff.link * eff.collective_share(kind))


def bubble_fraction(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> float:
    """Idle time of a pipeline rank over its busy time in one step: ``(pp - 1) / (v m)`` for
    GPipe and 1F1B (v = 1) and interleaved 1F1B; zero-bubble V schedules (``zbv``,
    ``dualpipev``) fill most of it with weight-gradient work: a third of it is left (the
    forward-only ramp), an estimate to calibrate."""
    if pp <= 1:
        return 0.0
    base = (pp - 1) / (virtual_stages * microbatches)
    return base / 3 if schedule in ("zbv", "dualpipev") else base


# --- calibration ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpSample:
    """One measured op: ``kind`` (``gemm``, ``attention``, ``memory``, ``comm``), its work
    (``flops`` or ``nbytes``), ``rows`` per GEMM, ``precision`` of a GEMM, ``link_gbps`` of a
    collective (bytes counted as :func:`collective_time` moves them), and its ``seconds``."""

    kind: str
    seconds: float
    flops: float = 0.0
    nbytes: float = 0.0
    rows: float = 0.0
    precision: str = "bf16"
    link_gbps: float = 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OpSample:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown or "kind" not in data or "seconds" not in data:
            raise CalibrationError(
                f"sample {data!r}: expected fields {sorted(known)} (kind and seconds required)"
            )
        return cls(**data)


def calibrate(
    samples: Iterable[OpSample], gpu: GPUSpec, base: Efficiency = Efficiency()
) -> Efficiency:
    """``base`` with the factors the samples measure refitted (kinds without samples keep
    ``base``'s); see the module for the fits."""
    by_kind: dict[str, list[OpSample]] = {}
    for s in samples:
        if s.seconds <= 0:
            raise CalibrationError(f"sample {s}: seconds must be > 0")
        by_kind.setdefault(s.kind, []).append(s)
    unknown = sorted(set(by_kind) - {"gemm", "attention", "memory", "comm"})
    if unknown:
        raise CalibrationError(f"unknown sample kinds {unknown}: gemm, attention, memory, comm")
    values: dict[str, Any] = {}
    if "gemm" in by_kind:
        values.update(_fit_gemm(by_kind["gemm"], gpu))
    if "attention" in by_kind:
        done = sum(s.flops for s in by_kind["attention"])
        spent = sum(s.seconds for s in by_kind["attention"])
        values["attention"] = done / (gpu.gemm_ceiling("bf16") * 1e12 * spent)
    if "memory" in by_kind:
        done = sum(s.nbytes for s in by_kind["memory"])
        spent = sum(s.seconds for s in by_kind["memory"])
        values["memory"] = done / (gpu.ceiling("hbm_gbps") * 1e9 * spent)
    if "comm" in by_kind:
        values.update(_fit_comm(by_kind["comm"]))
    return dataclasses.replace(base, **values)


def _least_squares(
    xs: list[float], ys: list[float], ws: list[float] | None = None
) -> tuple[float, float]:
    """(a, b) of ``y = a + b x`` (weighted by ``ws``); b = 0 when every x is equal."""
    ws = ws or [1.0] * len(xs)
    total = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / total
    my = sum(w * y for w, y in zip(ws, ys, strict=True)) / total
    var = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    if var == 0:
        return my, 0.0
    b = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True)) / var
    return my - b * mx, b


def _fit_gemm(samples: list[OpSample], gpu: GPUSpec) -> dict[str, float]:
    # weighted by time: the GEMMs that take the step's time decide the fit
    xs = [1.0 / s.rows if s.rows > 0 else 0.0 for s in samples]
    ys = [gpu.gemm_ceiling(s.precision) * 1e12 * s.seconds / s.flops for s in samples]
    ws = [s.seconds for s in samples]
    a, b = _least_squares(xs, ys, ws)
    if a > 0 and b >= 0:
        return {"gemm": 1.0 / a, "gemm_half_rows": b / a}
    # small GEMMs no slower per FLOP (or one size only): one factor, the time-weighted mean
    done = sum(s.flops for s in samples)
    spent = sum(gpu.gemm_ceiling(s.precision) * 1e12 * s.seconds for s in samples)
    if done <= 0:
        raise CalibrationError("GEMM samples with no FLOPs")
    return {"gemm": done / spent, "gemm_half_rows": 0.0}


def _fit_comm(samples: list[OpSample]) -> dict[str, float]:
    if any(s.link_gbps <= 0 for s in samples):
        raise CalibrationError("comm samples need link_gbps > 0")
    # t = latency + bytes / (link * eff): fit in x = bytes / link
    xs = [s.nbytes / (s.link_gbps * 1e9) for s in samples]
    a, b = _least_squares(xs, [s.seconds for s in samples])
    if b <= 0:
        raise CalibrationError("comm samples give a non-positive time per byte")
    return {"latency_s": max(a, 0.0), "link": 1.0 / b}


def load_samples(path: str | Path) -> list[OpSample]:
    """Samples from a JSON file: a list of :class:`OpSample` fields, or ``{"samples": [...]}``,
    or a torch profiler trace (an object with ``traceEvents``: :func:`samples_from_trace`)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"{str(path)!r}: not a readable JSON file ({exc})") from exc
    if isinstance(data, dict) and "traceEvents" in data:
        return samples_from_trace(data)
    rows = data.get("samples") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise CalibrationError(f"{str(path)!r}: expected a list of samples or a profiler trace")
    return [OpSample.from_dict(r) for r in rows]


# --- reading a profiler trace -----------------------------------------------------------------

_GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm"})
_EXPERT_OPS = ("moec::expert_mlp",)
_ATTENTION_ARGS = {
    # op -> (index of the query among its inputs, index of is_causal): query, key, value in
    # order (after the output gradient in aten's backwards)
    "aten::scaled_dot_product_attention": (0, 5),
    "aten::_scaled_dot_product_flash_attention": (0, 4),
    "aten::_scaled_dot_product_efficient_attention": (0, 6),
    "aten::_scaled_dot_product_cudnn_attention": (0, 6),
    "aten::_scaled_dot_product_flash_attention_for_cpu": (0, 4),
    "aten::_scaled_dot_product_flash_attention_backward": (1, 11),
    "aten::_scaled_dot_product_efficient_attention_backward": (1, 11),
    "aten::_scaled_dot_product_cudnn_attention_backward": (1, 14),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": (1, 7),
    "moec::flash_attention": (0, 3),  # lowering.attention fa4
    "moec::flash_attention_backward": (0, 6),
}
_PRECISIONS = ("bf16", "fp8_rowwise", "mxfp8")


@dataclasses.dataclass
class TraceOps:
    """What a profiler trace measured, by the time model's kinds (see :func:`read_trace`)."""

    samples: list[OpSample]
    """GEMM samples (``aten::mm``/``addmm``/``bmm``; each grouped expert MLP as one GEMM of
    ``rows / experts`` rows per expert) and attention samples (forward FLOPs, x2 for a
    backward: the time model's 3x forward over the pair)."""
    other_s: float
    """Device seconds of every other op (elementwise, norms, movement, loss, optimizer): the
    time model's memory-bound work, whose bytes the trace does not say."""
    comm_s: float
    """Device seconds of collectives (NCCL kernels), not fitted from a trace."""
    ops: list[dict[str, Any]]
    """Per (op, kind, input shapes): calls and device seconds, longest first."""
    device_time: bool
    """True when times are GPU kernel times; False: CPU self times (a CPU-only trace)."""
    busy_s: float = 0.0
    """Seconds in which some kernel ran (the union of the kernels' spans; 0 on a CPU trace)."""
    span_s: float = 0.0
    """Seconds from the first kernel's start to the last one's end (0 on a CPU trace)."""


def read_trace(trace: dict[str, Any] | str | Path) -> TraceOps:
    """The ops of a torch profiler trace recorded with ``record_shapes``. An op's time is the
    device time of the kernels launched under it (their ``External id``; on a CPU-only trace,
    its self time): kernels under a grouped expert MLP or an attention op (the outermost such
    op) count for it whole, kernels of a GEMM op count as that GEMM, the rest (and the CPU
    self time of ops that launch nothing on a CUDA trace: none) as memory-bound work."""
    if not isinstance(trace, dict):
        trace = json.loads(Path(trace).read_text())
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    parent = _parents(cpu_ops)
    own: dict[int, float] = {}  # cpu op index -> its seconds
    comm_s = 0.0
    if kernels:
        by_ext = {e.get("args", {}).get("External id"): i for i, e in enumerate(cpu_ops)}
        for k in kernels:
            seconds = float(k.get("dur", 0.0)) * 1e-6
            if "nccl" in k.get("name", "").lower():
                comm_s += seconds
                continue
            i = by_ext.get(k.get("args", {}).get("External id"))
            if i is not None:
                own[i] = own.get(i, 0.0) + seconds
    else:
        children: dict[int, float] = {}
        for i, p in enumerate(parent):
            if p is not None:
                children[p] = children.get(p, 0.0) + float(cpu_ops[i].get("dur", 0.0))
        for i, e in enumerate(cpu_ops):
            self_us = float(e.get("dur", 0.0)) - children.get(i, 0.0)
            if self_us > 0:
                own[i] = self_us * 1e-6
    work: dict[int, float] = {}  # classifying op index -> seconds
    for i, seconds in own.items():
        j = _classifier(i, cpu_ops, parent)
        work[j] = work.get(j, 0.0) + seconds
    samples, other_s = [], 0.0
    table: dict[tuple[str, str, str], list[float]] = {}
    for i, seconds in work.items():
        e = cpu_ops[i]
        sample = _sample(e, seconds)
        kind = sample.kind if sample is not None else "memory"
        if sample is not None:
            samples.append(sample)
        else:
            other_s += seconds
        shapes = json.dumps(e.get("args", {}).get("Input Dims") or [])
        row = table.setdefault((e.get("name", ""), kind, shapes), [0, 0.0])
        row[0] += 1
        row[1] += seconds
    ops = [
        {"name": n, "kind": k, "shapes": json.loads(sh), "calls": int(c), "seconds": t}
        for (n, k, sh), (c, t) in sorted(table.items(), key=lambda kv: -kv[1][1])
    ]
    busy_s, span_s = _busy(kernels)
    return TraceOps(samples, other_s, comm_s, ops, bool(kernels), busy_s, span_s)


def merged_spans(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as disjoint intervals, in order."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _busy(kernels: list[dict[str, Any]]) -> tuple[float, float]:
    """(union of the kernels' spans, first start to last end), seconds."""
    spans = merged_spans(
        [
            (float(k.get("ts", 0.0)), float(k.get("ts", 0.0)) + float(k.get("dur", 0.0)))
            for k in kernels
        ]
    )
    if not spans:
        return 0.0, 0.0
    busy = sum(b - a for a, b in spans)
    return busy * 1e-6, (spans[-1][1] - spans[0][0]) * 1e-6


def samples_from_trace(trace: dict[str, Any] | str | Path) -> list[OpSample]:
    """The GEMM and attention samples of a profiler trace (:func:`read_trace`)."""
    return read_trace(trace).samples


def _parents(ops: list[dict[str, Any]]) -> list[int | None]:
    """The enclosing op of each op on its thread (by time containment), or None."""
    parent: list[int | None] = [None] * len(ops)
    threads: dict[tuple[Any, Any], list[int]] = {}
    for i, e in enumerate(ops):
        threads.setdefault((e.get("pid"), e.get("tid")), []).append(i)
    for members in threads.values():
        members.sort(key=lambda i: (float(ops[i].get("ts", 0.0)), -float(ops[i].get("dur", 0.0))))
        stack: list[int] = []
        for i in members:
            ts = float(ops[i].get("ts", 0.0))
            while stack and ts >= float(ops[stack[-1]].get("ts", 0.0)) + float(
                ops[stack[-1]].get("dur", 0.0)
            ):
                stack.pop()
            parent[i] = stack[-1] if stack else None
            stack.append(i)
    return parent


def _is_compound(name: str) -> bool:
    return name.startswith(_EXPERT_OPS) or name in _ATTENTION_ARGS


def _classifier(i: int, ops: list[dict[str, Any]], parent: list[int | None]) -> int:
    """The op whose work op ``i``'s time is: its outermost expert-MLP or attention ancestor,
    else itself."""
    found, j = i, parent[i]
    while j is not None:
        if _is_compound(ops[j].get("name", "")):
            found = j
        j = parent[j]
    return found


def _sample(e: dict[str, Any], seconds: float) -> OpSample | None:
    """The GEMM or attention sample of op ``e`` taking ``seconds``; None for other ops."""
    name, args = e.get("name", ""), e.get("args", {})
    dims = args.get("Input Dims") or []
    concrete = args.get("Concrete Inputs") or []
    backward = name.endswith("_backward")
    if name in _GEMM_OPS:
        flops, rows = _gemm_flops(name, dims)
        return OpSample("gemm", seconds, flops=flops, rows=rows) if flops else None
    if name.startswith(_EXPERT_OPS) and len(dims) >= 3 and len(dims[1]) == 3:
        x, w_up, w_down = dims[0], dims[1], dims[2]
        if len(x) != 2 or len(w_down) != 3:
            return None
        flops = 2.0 * x[0] * (x[1] * w_up[2] + w_down[1] * w_down[2]) * (2 if backward else 1)
        precision = next((c for c in concrete if c in _PRECISIONS), "bf16")
        rows = x[0] / max(w_up[0], 1)
        return OpSample("gemm", seconds, flops=flops, rows=rows, precision=precision)
    if name in _ATTENTION_ARGS:
        first, arg = _ATTENTION_ARGS[name]
        q, k = (dims[first], dims[first + 1]) if len(dims) > first + 1 else ([], [])
        if len(q) < 3 or len(k) < 3:
            return None
        causal = len(concrete) <= arg or concrete[arg] != "False"  # unrecorded: causal (LMs)
        flops = 4.0 * math.prod(q[:-1]) * k[-2] * q[-1] / (2 if causal else 1)
        return OpSample("attention", seconds, flops=flops * (2 if backward else 1))
    return None


def _gemm_flops(name: str, dims: list[list[int]]) -> tuple[float, float]:
    """(FLOPs, rows) of a matmul op from its input dims (0 when they are not matrices); rows
    is its largest dimension (the tokens of a linear layer's forward and both backward GEMMs,
    as the time model counts a dense GEMM's rows)."""
    if name == "aten::addmm" and len(dims) >= 3:
        a, b = dims[1], dims[2]
    elif len(dims) >= 2:
        a, b = dims[0], dims[1]
    else:
        return 0.0, 0.0
    if len(a) < 2 or len(b) < 2:
        return 0.0, 0.0
    batch = math.prod(a[:-2]) if len(a) > 2 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1], float(max(a[-2], a[-1], b[-1]))


# --- efficiency factors as JSON ---------------------------------------------------------------


MAPPED_FACTORS = ("collective_factor", "ep_path_factor")
"""The :class:`Efficiency` fields that map names to factors (JSON objects)."""


def efficiency_to_dict(eff: Efficiency) -> dict[str, Any]:
    data = dataclasses.asdict(eff)
    for key in MAPPED_FACTORS:
        data[key] = dict(getattr(eff, key))
    return data


def efficiency_from_dict(data: dict[str, Any], source: str = "efficiency") -> Efficiency:
    """An :class:`Efficiency` from its fields (any subset: the others keep their defaults)."""
    if not isinstance(data, dict):
        raise CalibrationError(f"{source}: expected a JSON object of Efficiency fields")
    known = {f.name for f in dataclasses.fields(Efficiency)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise CalibrationError(f"{source}: unknown Efficiency fields {unknown}; known: "
                               f"{sorted(known)}")  # fmt: skip
    values = dict(data)
    for key, value in values.items():
        if key in MAPPED_FACTORS:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise CalibrationError(f"{source}: {key} = {value!r}; expected a number >= 0")
    for key in MAPPED_FACTORS:
        if key not in values:
            continue
        named = values[key]
        if not isinstance(named, dict):
            what = "EP paths" if key == "ep_path_factor" else "collectives"
            raise CalibrationError(f"{source}: {key} must map {what} to factors")
        values[key] = tuple(sorted((str(k), float(v)) for k, v in named.items()))
    return Efficiency(**values)


def save_efficiency(eff: Efficiency, path: str | Path) -> None:
    Path(path).write_text(json.dumps(efficiency_to_dict(eff), indent=2) + "\n")


def load_efficiency(path: str | Path) -> Efficiency:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"{str(path)!r}: not a readable JSON file ({exc})") from exc
    return efficiency_from_dict(data, str(path))


def format_efficiency(eff: Efficiency, base: Efficiency | None = None) -> str:
    """One line of the factors (with ``base``'s value where a factor changed)."""
    parts = []
    for key, value in efficiency_to_dict(eff).items():
        if key in MAPPED_FACTORS:
            continue
        old = None if base is None else getattr(base, key)
        text = f"{key} {value:.4g}"
        if old is not None and not math.isclose(old, value):
            text += f" (was {old:.4g})"
        parts.append(text)
    return ", ".join(parts)
