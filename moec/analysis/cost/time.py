"""Time model: seconds of GEMMs, attention, memory-bound work, collectives and pipeline bubbles.

The cost model gives FLOPs and bytes per node; this module turns them into seconds on one GPU
(:class:`~moec.analysis.gpus.GPUSpec`: its attainable ceilings, measured where known) through
efficiency factors (:class:`Efficiency`) that a profiled step calibrates (:func:`calibrate`):

- GEMM: ``flops / (ceiling(precision) * gemm * rows / (rows + gemm_half_rows))``: large GEMMs
  run at ``gemm`` of the ceiling, a GEMM of ``rows`` rows (an expert's share of the routed
  rows) at a fraction that halves at ``gemm_half_rows``. (H200, RESULTS.md: 16 groups of 256
  rows at ~0.72 of the dense ceiling, of 8192 rows at ~0.92: ``gemm_half_rows`` ~100.)
- attention: ``flops / (bf16 ceiling * attention)``;
- memory-bound ops: ``bytes / (HBM ceiling * memory)`` with ``bytes`` what the op reads and
  writes (the caller counts both);
- collectives over ``n`` ranks of a link (GB/s one direction): ring all-reduce moves
  ``2 (n-1)/n`` of the bytes, all-gather and reduce-scatter ``(n-1)/n``, all-to-all
  ``(n-1)/n`` per rank; each pays ``latency_s``; an EP exchange on a path runs at
  ``link * ep_path_factor[path]`` of the link;
- pipeline bubble (:func:`bubble_fraction`): idle share of a stage's busy time per step.

Calibration (:func:`calibrate`) fits the factors to measured :class:`OpSample` s: GEMM
``y = ceiling * t / flops = 1/gemm + (gemm_half_rows/gemm) / rows`` by least squares in
``1/rows``; attention and memory as total work over total time; collectives ``t = latency +
bytes / rate``. :func:`samples_from_trace` reads samples from a torch profiler trace (the
``trace_rank{r}.json`` of :mod:`moec.runtime.profiling`, recorded with ``record_shapes``): each
``aten::mm``/``addmm``/``bmm`` CPU op with its input shapes and the device time of the
kernels it launched, and each ``aten::copy_`` as memory traffic.
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
    """Collectives, of the link ceiling (the H200's is NCCL's measured all-to-all)."""
    latency_s: float = 20e-6
    """Fixed cost of one collective or exchange."""
    ep_path_factor: tuple[tuple[str, float], ...] = (
        ("rowwise", 0.66),
        ("a2a_capacity", 0.26),
        ("sync_1d", 0.27),
    )
    """EP exchange rate of each path over the link's all-to-all rate (2 H200s, RESULTS.md
    session 4: rowwise dispatch/combine 365/317 GB/s, a2a_capacity 122/143, sync_1d 135/149,
    against NCCL's 519 GB/s), and ``sync_1d``'s host waits are not modelled."""

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
    return eff.latency_s + moved / (link_gbps * 1e9 * eff.link)


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


def _least_squares(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of ``y = a + b x``; b = 0 when every x is equal."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return my - b * mx, b


def _fit_gemm(samples: list[OpSample], gpu: GPUSpec) -> dict[str, float]:
    xs = [1.0 / s.rows if s.rows > 0 else 0.0 for s in samples]
    ys = [gpu.gemm_ceiling(s.precision) * 1e12 * s.seconds / s.flops for s in samples]
    a, b = _least_squares(xs, ys)
    if a <= 0:
        raise CalibrationError(f"GEMM samples give a non-positive 1/efficiency ({a:.3g})")
    return {"gemm": 1.0 / a, "gemm_half_rows": max(b / a, 0.0)}


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


_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm")
_DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "int": 4, "long": 8}


def samples_from_trace(trace: dict[str, Any] | str | Path) -> list[OpSample]:
    """GEMM and copy samples of a torch profiler trace recorded with ``record_shapes`` (see
    module): a CPU op's device time is the sum of the kernels with its ``External id``."""
    if not isinstance(trace, dict):
        trace = json.loads(Path(trace).read_text())
    events = trace.get("traceEvents", [])
    device: dict[Any, float] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            ext = e.get("args", {}).get("External id")
            device[ext] = device.get(ext, 0.0) + float(e.get("dur", 0.0)) * 1e-6
    samples = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "cpu_op":
            continue
        args = e.get("args", {})
        seconds = device.get(args.get("External id"), 0.0)
        dims = args.get("Input Dims") or []
        if seconds <= 0:
            continue
        if e.get("name") in _GEMM_OPS:
            flops, rows = _gemm_flops(e["name"], dims)
            if flops:
                samples.append(OpSample("gemm", seconds, flops=flops, rows=rows))
        elif e.get("name") == "aten::copy_" and dims and dims[0]:
            types = args.get("Input type") or []
            size = _DTYPE_BYTES.get(types[0] if types else "", 2)
            src = _DTYPE_BYTES.get(types[1] if len(types) > 1 else "", size)
            numel = math.prod(dims[0])
            samples.append(OpSample("memory", seconds, nbytes=numel * (size + src)))
    return samples


def _gemm_flops(name: str, dims: list[list[int]]) -> tuple[float, float]:
    """(FLOPs, rows) of a matmul op from its input dims (0 when they are not matrices)."""
    a, b = (dims[1], dims[2]) if name == "aten::addmm" else (dims[0], dims[1])
    if len(a) < 2 or len(b) < 2:
        return 0.0, 0.0
    batch = math.prod(a[:-2]) if len(a) > 2 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1], float(a[-2])
