"""The context every program of a plan runs in (whole programs and pipeline stages): its
precision (bf16 autocast) and its attention backend preference (``plan.lowering.attention``)."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from moec.plan import Plan, PlanError

ATTENTION_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
"""``plan.lowering.attention`` -> torch's backend; after the chosen one the others are tried in
this order (``auto``: torch's own order)."""
_ORDERS_BACKENDS = "set_priority" in inspect.signature(sdpa_kernel).parameters
"""Whether this torch's ``sdpa_kernel`` can put a backend first."""


def program_context(plan: Plan, inputs: list[Any]) -> contextlib.AbstractContextManager:
    """Everything a plan's program runs under: :func:`compute_autocast` and
    :func:`attention_preference`."""
    stack = contextlib.ExitStack()
    stack.enter_context(compute_autocast(plan, inputs))
    stack.enter_context(attention_preference(plan.lowering.attention))
    return stack


def compute_autocast(plan: Plan, inputs: list[Any]) -> contextlib.AbstractContextManager:
    """bf16 autocast around a bf16 plan's program, on the device of its first tensor input:
    ops on autocast's float32 list then compute as they were captured."""
    if plan.precision.compute_dtype != "bf16":
        return contextlib.nullcontext()
    device = next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), "cpu")
    return torch.autocast(device, dtype=torch.bfloat16)


def attention_preference(chosen: str) -> contextlib.AbstractContextManager:
    """The attention backend ``chosen`` (a ``plan.lowering.attention`` value) first, then the
    others in :data:`ATTENTION_BACKENDS`' order (``sdpa``, and the attention ``auto`` and ``fa4``
    leave on SDPA: torch's own order)."""
    if chosen in ("auto", "sdpa", "fa4"):
        return contextlib.nullcontext()
    if not _ORDERS_BACKENDS:
        raise PlanError(
            "lowering.attention",
            chosen,
            f"'auto' on torch {torch.__version__}, whose sdpa_kernel cannot order the backends",
        )
    first = ATTENTION_BACKENDS[chosen]
    order = [first, *(b for b in ATTENTION_BACKENDS.values() if b != first)]
    return sdpa_kernel(order, set_priority=True)
