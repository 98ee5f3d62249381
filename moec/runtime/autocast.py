"""The context every program of a plan runs in (whole programs and pipeline stages): its
precision (bf16 autocast)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from moec.plan import Plan


def program_context(plan: Plan, inputs: list[Any]) -> contextlib.AbstractContextManager:
    """Everything a plan's program runs under: :func:`compute_autocast`."""
    return compute_autocast(plan, inputs)


def compute_autocast(plan: Plan, inputs: list[Any]) -> contextlib.AbstractContextManager:
    """bf16 autocast around a bf16 plan's program, on the device of its first tensor input:
    ops on autocast's float32 list then compute as they were captured."""
    if plan.precision.compute_dtype != "bf16":
        return contextlib.nullcontext()
    device = next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), "cpu")
    return torch.autocast(device, dtype=torch.bfloat16)
