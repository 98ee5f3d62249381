"""Step time that counts training steps only.

The loop does work between steps that is not training: checkpoint writes and held-out
evaluation (:mod:`moec.train.evaluation`). :class:`NonStepTime` times each such piece of work
under a named part, from an idle device to an idle device (the device's queued steps finish
before its clock starts, and its own device work before its clock stops), so that none of it
leaks into the steps around it.
A :class:`StepClock` measures an interval's step time: its wall time less the non-step time
spent inside it. The loop's log windows and its steady-state window are such clocks, so
``step_time_s`` and tokens/s in ``metrics.jsonl`` and ``summary.json`` cover the steps alone,
and each part's seconds are reported beside them (``checkpoint_s``, ``eval_s``).

:class:`FirstStepClock` times what comes before the steps: from the run's start to the end of
its first step, split into moec's compile phases, Inductor, kernel JIT and autotuning and the
step itself (``first_step_s`` and ``first_step`` in ``summary.json``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from moec import program_cache

NON_STEP_PARTS = ("checkpoint", "eval")
"""The kinds of work between steps, each reported as ``{part}_s``."""


def wait_for_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class NonStepTime:
    """Seconds spent between steps, by part (see module)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = dict.fromkeys(NON_STEP_PARTS, 0.0)

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Count the block's time, device work included, as ``part``. The waits on the device
        fall between steps, where the loop already reads it (a checkpoint copies the state to
        the host): no step gains a host sync."""
        if part not in self.seconds:
            raise ValueError(f"unknown non-step part {part!r}; known: {', '.join(self.seconds)}")
        wait_for_device(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            wait_for_device(self.device)
            self.seconds[part] += time.perf_counter() - start

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)

    def since(self, snapshot: dict[str, float]) -> dict[str, float]:
        """Seconds by part spent since ``snapshot`` was taken."""
        return {part: s - snapshot[part] for part, s in self.seconds.items()}

    def fields(self, seconds: dict[str, float] | None = None) -> dict[str, float]:
        """``{part}_s`` fields of a metrics record or summary: ``seconds`` by part (default:
        everything so far)."""
        seconds = self.seconds if seconds is None else seconds
        return {f"{part}_s": s for part, s in seconds.items()}


class StepClock:
    """An interval's step time: its wall time less the non-step time spent inside it."""

    def __init__(self, non_step: NonStepTime):
        self.non_step = non_step
        self.start = time.perf_counter()
        self.at_start = non_step.snapshot()

    def non_step_seconds(self) -> dict[str, float]:
        """Seconds by part spent between steps since the clock started."""
        return self.non_step.since(self.at_start)

    def step_seconds(self) -> float:
        """Seconds since the clock started, less the non-step time in them."""
        return time.perf_counter() - self.start - sum(self.non_step_seconds().values())


INDUCTOR_METRICS = ("_compile.compile_inner", "backward._backward_impl")
"""Dynamo's timers that cover a graph's compile: Dynamo's trace, AOTAutograd, Inductor and the
kernels it generates (the forward's frame; a backward compiled lazily, on its first call)."""


INDUCTOR_RUNTIME_AUTOTUNE = (
    "CachingAutotuner.benchmark_all_configs",
    "CachingAutotuner.coordinate_descent_tuning",
    "CachingAutotuner.combo_sequential_autotune",
)
"""Dynamo's timers of Inductor's kernels autotuned on their first run (in the step, after the
compile)."""


def inductor_state() -> dict[str, float]:
    """What torch.compile has done in this process so far: its compile seconds, its kernels'
    first-run autotuning seconds, and the FX graphs it compiled (``fxgraph_cache_miss``) or
    found in the cache (``fxgraph_cache_hit``)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    def seconds(names: tuple[str, ...]) -> float:
        return sum(sum(compilation_time_metrics.get(name, ())) for name in names)

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {
        "seconds": seconds(INDUCTOR_METRICS),
        "runtime_autotune_seconds": seconds(INDUCTOR_RUNTIME_AUTOTUNE),
        "graphs_compiled": inductor["fxgraph_cache_miss"],
        "graphs_cached": inductor["fxgraph_cache_hit"],
        "autograd_cache_hits": aot["autograd_cache_hit"],
    }


class FirstStepClock:
    """Seconds from a run's start (before its compile) to the end of its first step, by part:

    - ``target_s``, ``capture_s``, ``passes_s``, ``materialize_s``: moec's compile phases
      (:data:`moec.compiler.phase_seconds`: the machine's detection, which imports the kernel
      backends, then the build; under a memory check the program is built on the meta device
      and materialized from the model, so its materialization counts there);
    - ``inductor_s``: torch.compile (Dynamo, AOTAutograd, Inductor, its generated kernels);
    - ``kernels``: per backend (``triton``, ``cute``), moec's kernels' JIT (``jit_s``) and
      autotuning (``autotune_s``) (:mod:`moec.kernels.compile_clock`);
    - ``step_s``: the first step itself, its wall time less the compiling done inside it;
    - ``other_s``: the rest (model to the device, optimizer, data, checkpoint reads).

    The parts are disjoint, so they sum to ``total_s``; ``graphs_compiled`` / ``graphs_cached``
    count the FX graphs Inductor compiled or found in the cache (:mod:`moec.cache`),
    ``programs_cached`` the programs whose passes were found there (:mod:`moec.program_cache`:
    ``passes_s`` is then the load), and
    ``inductor_runtime_autotune_s`` is the part of ``step_s`` (and of Triton's JIT, for the
    configs compiled then) that Inductor spent autotuning its kernels on their first run.
    ``process_start_to_first_step_s`` adds what came before the clock (Python and torch
    imports, building the model; None where the process's start is unknown)."""

    def __init__(self, device: torch.device):
        from moec.compiler import phase_seconds
        from moec.kernels.compile_clock import KernelClock

        self.device = device
        self.start = time.perf_counter()
        started = process_start()
        self.before_s = None if started is None else max(0.0, time.time() - started)
        self.phases_at_start = dict(phase_seconds)
        self.programs_at_start = program_cache.counters["hits"]
        self.inductor_at_start = inductor_state()
        cute = device.type == "cuda"
        self.kernels = KernelClock().start(cute=cute)
        self.step_start: float | None = None
        self.compiling_at_step: float = 0.0
        self.result: dict[str, Any] | None = None

    def step_starts(self) -> None:
        """The first step begins now."""
        self.step_start = time.perf_counter()
        self.compiling_at_step = self._compiling()

    def finish(self) -> dict[str, Any]:
        """The first step has been launched: wait for it on the device and return the parts
        (see class); the same dict on later calls."""
        if self.result is not None:
            return self.result
        from moec.compiler import phase_seconds

        wait_for_device(self.device)
        end = time.perf_counter()
        if self.step_start is None:
            self.step_starts()
        inductor = inductor_state()
        kernels = self.kernels.stop()
        parts = {f"{p}_s": phase_seconds[p] - self.phases_at_start[p] for p in phase_seconds}
        parts["inductor_s"] = inductor["seconds"] - self.inductor_at_start["seconds"]
        step_compiling = self._compiling(kernels, inductor) - self.compiling_at_step
        parts["step_s"] = max(0.0, end - self.step_start - step_compiling)
        total = end - self.start
        known = sum(parts.values()) + _kernel_seconds(kernels)
        self.result = {
            "total_s": total,
            **parts,
            "kernels": kernels,
            "other_s": max(0.0, total - known),
            "graphs_compiled": inductor["graphs_compiled"]
            - self.inductor_at_start["graphs_compiled"],
            "graphs_cached": inductor["graphs_cached"] - self.inductor_at_start["graphs_cached"],
            "programs_cached": program_cache.counters["hits"] - self.programs_at_start,
            "inductor_runtime_autotune_s": inductor["runtime_autotune_seconds"]
            - self.inductor_at_start["runtime_autotune_seconds"],
            "process_start_to_first_step_s": None
            if self.before_s is None
            else self.before_s + total,
        }
        return self.result

    def _compiling(
        self, kernels: dict[str, dict[str, Any]] | None = None, inductor: dict | None = None
    ) -> float:
        """Seconds of compiling (Inductor, kernel JIT and autotuning) counted so far."""
        kernels = kernels or {b: dataclasses.asdict(t) for b, t in self.kernels.times.items()}
        inductor = inductor or inductor_state()
        return inductor["seconds"] - self.inductor_at_start["seconds"] + _kernel_seconds(kernels)


def process_start() -> float | None:
    """When this process started (seconds since the epoch, to about a second: the boot time
    is whole seconds), from Linux's ``/proc``; None elsewhere."""
    try:
        stat = Path("/proc/self/stat").read_text()
        boot = next(
            line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
    except (OSError, StopIteration):
        return None
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, after the name
    return int(boot.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")


def _kernel_seconds(kernels: dict[str, dict[str, Any]]) -> float:
    return sum(k["jit_s"] + k["autotune_s"] for k in kernels.values())


def format_first_step(parts: dict[str, Any]) -> str:
    """One line: the time to the first step and its parts (:class:`FirstStepClock`)."""
    kernels = ", ".join(
        f"{backend} JIT {k['jit_s']:.1f} ({k['kernels_compiled']} kernels) / autotune "
        f"{k['autotune_s']:.1f}"
        for backend, k in parts["kernels"].items()
        if k["kernels_compiled"] or k["configs_benchmarked"] or k["jit_s"]
    )
    launched = parts.get("process_start_to_first_step_s")
    since = "" if launched is None else f" ({launched:.1f} s from the process's start)"
    cached = parts.get("programs_cached", 0)
    return (
        f"first step after {parts['total_s']:.1f} s{since}: target {parts['target_s']:.1f}, "
        f"capture {parts['capture_s']:.1f}, "
        f"passes {parts['passes_s']:.1f}{' (program from the cache)' if cached else ''}, "
        f"materialize {parts['materialize_s']:.1f}, Inductor "
        f"{parts['inductor_s']:.1f} ({parts['graphs_compiled']} graphs compiled, "
        f"{parts['graphs_cached']} from the cache)"
        + (f", {kernels}" if kernels else ", no kernel compiled")
        + f", the step {parts['step_s']:.1f}, other {parts['other_s']:.1f}"
    )
