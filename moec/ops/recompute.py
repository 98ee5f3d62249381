"""Activation recompute at run time: a graph region run under selective activation checkpointing.

The ``recompute`` pass (:mod:`moec.passes.recompute`) wraps each chosen block into a sub-graph
and calls :func:`recompute_region` on it from the program; the runtime runs that call. A level
says which ops' outputs are cached rather than recomputed in backward:

- ``block``: only the routing decision and the expert-parallel exchanges (never run twice: a
  second run would route differently or exchange again);
- ``selective``: those and every GEMM (matmuls, attention, the expert MLPs).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import moec.ops.ep  # noqa: F401  (registers the moec::ep_* ops)

aten = torch.ops.aten
moec_ops = torch.ops.moec


def _overloads(namespace: Any, names: Iterable[str]) -> frozenset:
    return frozenset(getattr(namespace, n).default for n in names if hasattr(namespace, n))


EXCHANGES = _overloads(
    moec_ops,
    (
        "ep_layout",
        "ep_dispatch",
        "ep_combine",
        "ep_dispatch_issue",
        "ep_dispatch_wait",
        "ep_combine_issue",
        "ep_combine_wait",
    ),
)
"""The expert-parallel exchanges."""
NEVER_RECOMPUTE = EXCHANGES | _overloads(moec_ops, ("route",))
"""The routing decision and the EP exchanges: always cached, never run twice."""
GEMMS = (
    frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
    | _overloads(
        aten,
        (
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
        ),
    )
    | _overloads(
        moec_ops,
        (
            "expert_mlp",
            "quantized_linear",
            "flash_attention",
        ),
    )
)
"""GEMMs as the dispatcher sees them at run time (``linear``/``matmul`` decompose to these;
``moec::flash_attention`` is attention where the lowering chose FA4)."""
GRAPH_GEMMS = (
    frozenset({aten.linear.default, aten.matmul.default, aten.scaled_dot_product_attention.default})
    | GEMMS
)
"""GEMMs as they appear in the captured graph (for the prediction)."""


def is_communication(func: Any) -> bool:
    """An EP exchange or a functional collective: every rank must run it, in the same order."""
    return func in EXCHANGES or getattr(func, "namespace", "") == "_c10d_functional"


def _never_recomputed(func: Any) -> bool:
    return func in NEVER_RECOMPUTE or is_communication(func)


def saved_ops(level: str) -> Any:
    """The predicate "this op's output is cached" of a recompute level."""
    if level == "block":
        return _never_recomputed
    return lambda func: _never_recomputed(func) or func in GEMMS or func in GRAPH_GEMMS


def _sac_policy(level: str, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    saved = saved_ops(level)(func)
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def recompute_region(region: fx.GraphModule, level: str, *args: Any) -> tuple:
    """Run ``region(*args)`` under non-reentrant activation checkpointing at ``level``.

    Outputs of the ops ``level`` saves (routing, collectives, and GEMMs for ``selective``) are
    cached; the rest is recomputed in backward with the forward's RNG state. Without grad, or on
    fake tensors (the verifier's shape propagation), it is just ``region(*args)``.
    """
    if not torch.is_grad_enabled() or any(isinstance(a, FakeTensor) for a in args):
        return region(*args)
    policy = functools.partial(_sac_policy, level)
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    return checkpoint(
        region, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context
    )
