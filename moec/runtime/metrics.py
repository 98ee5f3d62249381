"""Training metrics as the report's Table 51 defines them.

- step time: wall time of an optimizer step in steady state (after warm-up steps);
- useful tokens/s/GPU: tokens that enter the loss per step / step time / GPUs
  (:func:`tokens_per_s`, recorded as :data:`THROUGHPUT`, shown as :func:`throughput_label`);
- useful-model MFU (Eq. 95): useful active-model FLOPs per step / (GPUs * step time * peak),
  with the dense BF16 peak of the GPU; recompute and inactive experts add nothing;
- host syncs per step: device->host waits counted by CUDA's sync debug mode over one step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch

from moec.analysis.gpus import spec_of_device

THROUGHPUT = "tokens_per_s_per_device"
"""The training throughput's key in ``metrics.jsonl`` (over the log window) and
``summary.json`` (over the steady steps): :func:`tokens_per_s` of one rank, on one device."""


def tokens_per_s(tokens: float, step_seconds: float) -> float:
    """Throughput: the training tokens one rank (one device) ran through its steps, per second
    of step time (checkpoint writes and evaluation are not step time:
    :mod:`moec.train.timing`)."""
    return tokens / step_seconds


def throughput_label(gpu: bool) -> str:
    """How :func:`tokens_per_s` is shown: per GPU on GPUs only."""
    return "tokens/s/GPU" if gpu else "tokens/s"


def bf16_peak_tflops(device: torch.device | str) -> float | None:
    """The dense BF16 tensor-core peak of ``device`` (``GPUSpec.bf16_tflops``, not the
    2:4-sparse figure), or None when it is not a GPU :mod:`moec.analysis.gpus` holds."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    spec = spec_of_device(torch.cuda.get_device_name(device))
    return None if spec is None else spec.bf16_tflops


def useful_mfu(
    flops_per_step: float, step_seconds: float, gpus: int, peak_tflops: float | None
) -> float | None:
    """Eq. 95; None when the peak is unknown (we do not guess)."""
    if peak_tflops is None or step_seconds <= 0:
        return None
    return flops_per_step / (gpus * step_seconds * peak_tflops * 1e12)


@contextlib.contextmanager
def sync_debug_mode(mode: str) -> Iterator[None]:
    """CUDA's sync debug mode set to ``mode`` ("warn", "error") inside, the previous one after."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def count_host_syncs(step: Callable[[], object], device: torch.device | str) -> int | None:
    """Run ``step`` once and count the synchronizing CUDA calls it makes (None on CPU).

    Uses ``torch.cuda.set_sync_debug_mode("warn")``, which sees ``.item()``, ``nonzero``,
    blocking copies and the like, but not ``torch.cuda.synchronize``, collectives or custom
    kernels (those are kept out by review).
    """
    if torch.device(device).type != "cuda":
        step()
        return None
    with warnings.catch_warnings(record=True) as caught, sync_debug_mode("warn"):
        warnings.simplefilter("always")
        step()
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def run_without_host_sync(step: Callable[[], object], steps: int) -> list[object]:
    """Run ``step`` ``steps`` times with CUDA's sync debug mode at "error": any synchronizing
    call it sees raises."""
    with sync_debug_mode("error"):
        return [step() for _ in range(steps)]
