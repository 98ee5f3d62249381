"""Step time that counts training steps only.

The loop does work between steps that is not training: checkpoint writes and held-out
evaluation (:mod:`moec.train.evaluation`). :class:`NonStepTime` times each such piece of work
under a named part, from an idle device to an idle device (the device's queued steps finish
before its clock starts, and its own device work before its clock stops), so that none of it
leaks into the steps around it.
A :class:`StepClock` measures an interval's step time: its wall time less the non-step time
spent inside it. The loop's log windows and its steady-state window are such clocks, so
``step_time_s`` and tokens/s in ``metrics.jsonl`` and ``summary.json`` cover the steps alone,
and each part's seconds are reported beside them (``checkpoint_s``, ``eval_s``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

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
