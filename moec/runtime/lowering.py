"""Lowering the final program to Inductor (``plan.lowering.inductor``).

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

from collections.abc import Callable
from typing import Any

import torch
from torch import fx


class InductorGraphs:
    """The Inductor-compiled form of each graph it is asked for, made once per graph object (a
    new graph, e.g. a mode variant rebuilt after ``.to()``, is compiled anew)."""

    def __init__(self) -> None:
        self._compiled: dict[int, tuple[fx.GraphModule, Callable[..., Any]]] = {}

    def __call__(self, graph: fx.GraphModule) -> Callable[..., Any]:
        held = self._compiled.get(id(graph))
        if held is None or held[0] is not graph:
            held = (graph, torch.compile(graph, backend="inductor", dynamic=None))
            self._compiled[id(graph)] = held
        return held[1]

    def clear(self) -> None:
        self._compiled.clear()
