"""Calibrating the time model from a profiled step: ``moec plan auto --calibrate RUN``.

``moec train --profile START:STEPS`` writes ``<run>/profile/ops_rank0.json``
(:meth:`moec.runtime.profiling.StepProfiler.ops_summary`): GEMM and attention samples, the
device time of every other op, and the window's shape (forward calls, microbatch [batch, seq],
steps). :func:`load_measurement` reads that file from a run directory, its ``profile`` folder or
the file itself; a profiler trace (``trace_rank0.json``, read by
:func:`~moec.analysis.cost.time.read_trace`) or a JSON list of
:class:`~moec.analysis.cost.time.OpSample` s work too.

:func:`fit` refits the :class:`~moec.analysis.cost.time.Efficiency` factors: GEMM and attention
from their samples, and ``memory`` from one sample made with the model's
:class:`~moec.autoplan.profile.ModelProfile`: the bytes the search prices for the profiled work
(``forward_calls`` x 3 (forward + backward) x 2 (read + written) x the units' written bytes at
the microbatch, plus the AdamW step's bytes per parameter element per step) over the other ops'
measured device time; ``device_busy`` as the kernels' busy time over their span (launch and
host gaps). The memory sample needs a one-rank, unpipelined profiled run of the same
model (the search's profile is at ``ep = pp = dp = 1``); otherwise it is left out and said so.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from moec.analysis.cost.time import (
    CalibrationError,
    Efficiency,
    OpSample,
    calibrate,
    read_trace,
)
from moec.analysis.gpus import GPUSpec
from moec.autoplan.profile import ModelProfile
from moec.autoplan.search import OPTIMIZER_BYTES

OPS_FILE = "ops_rank0.json"


@dataclasses.dataclass
class Measurement:
    """What a profiled step measured (see module); ``shape`` fields are None when the source
    does not say them (a bare trace or sample list)."""

    source: str
    samples: list[OpSample]
    other_s: float = 0.0
    forward_calls: int | None = None
    microbatch: tuple[int, int] | None = None
    steps: int | None = None
    world: int | None = None
    pipeline: bool = False
    device: str = ""
    busy_s: float = 0.0
    span_s: float = 0.0


@dataclasses.dataclass
class Fit:
    eff: Efficiency
    notes: list[str]
    """What was fitted from what, and what was left at its prior value and why."""


def load_measurement(path: str | Path) -> Measurement:
    """The measurement at ``path``: a run directory (``profile/ops_rank0.json``), a profile
    folder (``ops_rank0.json``), that file, a profiler trace or a JSON list of samples."""
    path = Path(path)
    if path.is_dir():
        for candidate in (path / "profile" / OPS_FILE, path / OPS_FILE):
            if candidate.is_file():
                path = candidate
                break
        else:
            raise CalibrationError(
                f"{str(path)!r}: no {OPS_FILE} in it or in its profile/ folder; profile a "
                "step first (moec train ... --profile START:STEPS) or pass the file"
            )
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"{str(path)!r}: not a readable JSON file ({exc})") from exc
    source = str(path)
    if isinstance(data, dict) and "traceEvents" in data:
        read = read_trace(data)
        return Measurement(
            source, read.samples, read.other_s, busy_s=read.busy_s, span_s=read.span_s
        )
    if isinstance(data, dict) and "ops" in data:
        micro = data.get("microbatch")
        return Measurement(
            source,
            [OpSample.from_dict(s) for s in data.get("samples", [])],
            float(data.get("other_s", 0.0)),
            data.get("forward_calls"),
            tuple(micro) if micro else None,
            data.get("steps"),
            data.get("world"),
            bool(data.get("pipeline", False)),
            str(data.get("device", "")),
            float(data.get("busy_s", 0.0)),
            float(data.get("span_s", 0.0)),
        )
    rows = data.get("samples") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise CalibrationError(
            f"{source!r}: expected {OPS_FILE} (moec train --profile), a profiler trace or a "
            "list of samples"
        )
    return Measurement(source, [OpSample.from_dict(r) for r in rows])


def memory_sample(
    measurement: Measurement, profile: ModelProfile, optimizer_bytes: float
) -> OpSample | str:
    """The memory sample of ``measurement`` priced with ``profile`` (see module), or why none."""
    m = measurement
    if m.other_s <= 0:
        return "no device time outside GEMMs and attention in the measurement"
    if m.forward_calls is None or m.microbatch is None or m.steps is None:
        return "the source does not say the profiled step's shape (use ops_rank0.json)"
    if (m.world or 1) > 1 or m.pipeline:
        return (
            f"the profiled run had {m.world} ranks{' and a pipeline' if m.pipeline else ''}; "
            "the memory fit needs a one-GPU run"
        )
    batch, seq = m.microbatch
    written = sum(u.other_bytes(batch, seq) for u in profile.units)
    params = sum(p.numel for u in profile.units for p in u.params if p.trainable)
    nbytes = m.forward_calls * 3 * 2 * written + m.steps * optimizer_bytes * params
    return OpSample("memory", m.other_s, nbytes=nbytes)


def fit(
    measurement: Measurement,
    gpu: GPUSpec,
    base: Efficiency | None = None,
    profile: ModelProfile | None = None,
    optimizer_bytes: float = OPTIMIZER_BYTES,
) -> Fit:
    """``base`` refitted to ``measurement`` (with ``profile``: the memory factor too)."""
    samples = list(measurement.samples)
    notes = []
    kinds = {k: sum(1 for s in samples if s.kind == k) for k in ("gemm", "attention")}
    for kind, n in kinds.items():
        notes.append(f"{kind}: {n} samples" if n else f"{kind}: no samples, kept")
    if profile is not None:
        mem = memory_sample(measurement, profile, optimizer_bytes)
        if isinstance(mem, OpSample):
            samples = [s for s in samples if s.kind != "memory"] + [mem]
            notes.append(
                f"memory: {mem.nbytes / 1e9:.3g} GB priced by the model in "
                f"{mem.seconds * 1e3:.4g} ms of other ops"
            )
        else:
            notes.append(f"memory: kept ({mem})")
    else:
        notes.append("memory: kept (no model profile to price the other ops' bytes)")
    if not samples:
        raise CalibrationError(f"{measurement.source}: nothing to calibrate from (no samples)")
    eff = calibrate(samples, gpu, base or Efficiency())
    m = measurement
    if m.busy_s > 0 and m.span_s >= m.busy_s:
        eff = dataclasses.replace(eff, device_busy=m.busy_s / m.span_s)
        notes.append(f"device_busy: kernels {m.busy_s * 1e3:.4g} of {m.span_s * 1e3:.4g} ms")
    else:
        notes.append("device_busy: kept (no kernel spans in the measurement)")
    return Fit(eff, notes)


def describe(measurement: Measurement) -> dict[str, Any]:
    """The measurement's totals by kind (seconds), for printing."""
    totals: dict[str, float] = {}
    for s in measurement.samples:
        totals[s.kind] = totals.get(s.kind, 0.0) + s.seconds
    totals["other"] = measurement.other_s
    return totals
