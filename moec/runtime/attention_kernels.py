"""The attention kernel a program runs, chosen for its device (``plan.lowering.attention``).

The passes, the cost model and the plan search see ``scaled_dot_product_attention`` whatever
runs it. When a program first runs, each of its SDPA calls that FlashAttention 4 takes (no mask,
no dropout, half-precision compute, head dims FA4 runs on the chip) becomes
``moec::flash_attention`` (and a read of its output), where the plan asks for ``fa4``, or for
``auto`` on a chip of :data:`AUTO_CHIPS` with flash-attn-4 installed; the others stay SDPA and
run on torch's backends in the plan's order (:func:`moec.runtime.autocast.attention_preference`).
A plan asking for ``fa4`` on a CUDA device FA4 does not run on is refused, naming why; on the
CPU (tests) the op runs its reference, and ``auto`` keeps SDPA.

The swap makes a new graph module over the same parameters and buffers; the original graph is
left as it is (a checkpoint, an export or another device sees SDPA).
"""

from __future__ import annotations

import copy
import operator
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.kernels import flash_attention as fa4
from moec.plan import PlanError

if TYPE_CHECKING:
    from moec.plan import Plan

SDPA = torch.ops.aten.scaled_dot_product_attention.default

AUTO_CHIPS = (9,)
"""Compute capability majors where ``auto`` runs FA4: Hopper, where it measured faster than
cuDNN's attention in the training step. Blackwell (10) is FA4's own target, but unmeasured here:
there ``fa4`` asks for it."""


def _device(inputs: Sequence[Any]) -> torch.device | None:
    return next((t.device for t in inputs if isinstance(t, torch.Tensor)), None)


def wants_fa4(plan: Plan, inputs: Sequence[Any]) -> bool:
    """Whether ``plan``'s program, run on ``inputs``' device, swaps its attention to FA4:
    under ``auto`` on a CUDA chip of :data:`AUTO_CHIPS` where FA4 runs; under ``fa4`` on a CUDA
    device or the CPU (where the op runs its reference: tests), raising where the CUDA device is
    one FA4 does not run on."""
    device = _device(inputs)
    chosen = plan.lowering.attention
    if chosen == "auto" and device is not None and device.type == "cuda":
        return fa4.device_why_not(device) is None and chip(inputs) in AUTO_CHIPS
    if chosen != "fa4" or device is None:
        return False
    if device.type != "cuda":
        return device.type == "cpu"
    why = fa4.device_why_not(device)
    if why is not None:
        raise PlanError("lowering.attention", "fa4", f"a device where FA4 runs ({why})")
    return True


def for_plan(graph: fx.GraphModule, plan: Plan, inputs: Sequence[Any]) -> fx.GraphModule:
    """``graph`` with its attention on the kernels ``plan`` chose for ``inputs``' device:
    :func:`with_fa4` where :func:`wants_fa4`, else ``graph`` itself."""
    if not wants_fa4(plan, inputs):
        return graph
    half = plan.precision.compute_dtype == "bf16"
    asked = plan.lowering.attention == "fa4"
    return with_fa4(graph, half, chip(inputs), asked)[0]


def chip(inputs: Sequence[Any]) -> int | None:
    """The compute capability major of ``inputs``' CUDA device (None off CUDA)."""
    device = _device(inputs)
    return torch.cuda.get_device_capability(device)[0] if device and device.type == "cuda" else None


def _fits(node: fx.Node, compute_half: bool, major: int | None) -> dict[str, Any] | None:
    """The SDPA call's arguments when FA4 takes it on a chip of compute capability ``major``.x
    (None: on either chip), else None."""
    root = node.graph.owning_module
    arguments = node.normalized_arguments(root, normalize_to_only_use_kwargs=True)
    if arguments is None:
        return None
    kwargs = arguments.kwargs
    q, k, v = (kwargs[name].meta.get("val") for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    if kwargs.get("attn_mask") is not None or kwargs.get("dropout_p", 0.0) != 0.0:
        return None
    if not (compute_half or q.dtype in fa4.HALF_DTYPES):
        return None
    if q.dim() == k.dim() == 4 and q.shape[1] != k.shape[1] and not kwargs.get("enable_gqa"):
        return None  # SDPA itself refuses unequal heads without enable_gqa
    causal = bool(kwargs.get("is_causal", False))
    if fa4.shapes_why_not(q.shape, k.shape, v.shape, causal, major) is not None:
        return None
    scale = kwargs.get("scale")
    return {**kwargs, "is_causal": causal, "scale": q.shape[-1] ** -0.5 if scale is None else scale}


def with_fa4(
    graph: fx.GraphModule, compute_half: bool, major: int | None = None, asked: bool = True
) -> tuple[fx.GraphModule, int]:
    """``graph`` with each SDPA call FA4 takes (on a chip of compute capability ``major``.x;
    None: either) swapped for ``moec::flash_attention``, in its own graph and in the sub-graphs
    it calls (recomputed blocks), and how many; ``graph`` itself where none is (with a warning,
    where the plan ``asked`` for FA4, if the graph has attention that all stays on SDPA)."""
    swapped, count, total = _swapped(graph, compute_half, major)
    if asked and total and not count:
        warnings.warn(
            f"moec: plan.lowering.attention = fa4, but none of the program's {total} attention "
            "calls fits FlashAttention 4 (it takes no mask or dropout, bf16 compute "
            "(precision.compute_dtype) or half inputs, and the head dims of "
            "moec.kernels.flash_attention.shapes_why_not); they run on torch's SDPA",
            stacklevel=3,
        )
    return swapped, count


def _swapped(
    graph: fx.GraphModule, compute_half: bool, major: int | None
) -> tuple[fx.GraphModule, int, int]:
    """(``graph`` swapped, calls swapped, SDPA calls seen), sub-graphs included."""
    children = {}
    count = total = 0
    for name, child in graph.named_children():
        if isinstance(child, fx.GraphModule):
            swapped_child, child_count, child_total = _swapped(child, compute_half, major)
            count, total = count + child_count, total + child_total
            if swapped_child is not child:
                children[name] = swapped_child
    sdpa = [n for n in graph.graph.nodes if n.op == "call_function" and n.target is SDPA]
    calls = [(n, fits) for n in sdpa for fits in [_fits(n, compute_half, major)] if fits]
    total += len(sdpa)
    if not calls and not children:
        return graph, count, total
    new_graph = copy.deepcopy(graph.graph)
    nodes = {n.name: n for n in new_graph.nodes}
    for call, kwargs in calls:
        node = nodes[call.name]
        q, k, v = (nodes[kwargs[name].name] for name in ("query", "key", "value"))
        with new_graph.inserting_before(node):
            attention = new_graph.call_function(
                torch.ops.moec.flash_attention.default,
                (q, k, v, kwargs["is_causal"], float(kwargs["scale"])),
            )
            out = new_graph.call_function(operator.getitem, (attention, 0))
        out.meta = dict(node.meta)
        node.replace_all_uses_with(out)
        new_graph.erase_node(node)
    new_graph.lint()
    module = fx.GraphModule(graph, new_graph)
    for name, child in children.items():
        setattr(module, name, child)
    return module, count + len(calls), total
