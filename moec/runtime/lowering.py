"""Lowering the final program to Inductor (``plan.lowering.inductor``; by default on CUDA).

The graph the passes leave (the whole program, or one pipeline stage's) runs through
``torch.compile(backend="inductor")``: Dynamo traces the graph module's ``forward``, AOTAutograd
its backward, and Inductor fuses the dense ATen ops between moec's (norms, residual adds,
casts, attention glue) into generated kernels, while every ``moec::`` op (and its backward op)
stays an opaque custom-op call whose fake implementation gives the shapes. What the runtime does
around the graph is unchanged: autocast is entered outside the compiled call (Dynamo guards on
it), the working weights are refreshed before it, EP collectives run inside moec's ops, and a
pipeline stage is compiled on its own.

Sizes: the first call specializes on its shapes; a call with another batch or sequence length
recompiles once with those dimensions symbolic (``dynamic=None``), after which any size runs
without recompiling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

if TYPE_CHECKING:
    from moec.plan import Plan


class InductorGraphs:
    """What runs a graph under ``plan``: the graph itself where the plan does not lower to
    Inductor on the inputs' device (:meth:`moec.plan.Plan.lowers_to_inductor`), else its
    Inductor-compiled form, made once per graph object (a new graph, e.g. a mode variant rebuilt
    after ``.to()``, is compiled anew)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._compiled: dict[int, tuple[fx.GraphModule, Callable[..., Any]]] = {}

    def __call__(self, graph: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        if not self.plan.lowers_to_inductor(device_type(inputs)):
            return graph
        return self.compiled(graph)

    def compiled(self, graph: fx.GraphModule) -> Callable[..., Any]:
        """``graph``'s Inductor-compiled form."""
        held = self._compiled.get(id(graph))
        if held is None or held[0] is not graph:
            held = (graph, torch.compile(graph, backend="inductor", dynamic=None))
            self._compiled[id(graph)] = held
        return held[1]

    def clear(self) -> None:
        self._compiled.clear()


def device_type(inputs: Sequence[Any]) -> str:
    """The device type of the first tensor among a program's inputs ("cpu" without one)."""
    return next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), "cpu")
