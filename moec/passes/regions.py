"""Pass ``regions``: a graph break after every residual block, so Inductor compiles the
program block by block.

Runs last, when ``plan.lowering.regions`` is ``blocks`` (``parallel.pp = 1``: the plan refuses
it for pipelines, whose stages are compiled one by one already). Matches the residual blocks
of the ``pipeline`` pass (:func:`moec.passes.pipeline.units.pipeline_units`: dense FFN regions,
the ``moe`` pass's layers, the ``recompute`` pass's regions; the prologue joins the first block
and the epilogue the last). Emits, after the last node of every block but the last, a call
that takes and returns nothing, e.g. for Llama with x: f32[B, S, D]::

    add_3 = add(add_2, linear_6)          # layers.0 ends
    graph_break = torch._dynamo.graph_break()
    ...                                   # layers.1

Eagerly the call does nothing. Under ``torch.compile`` (:mod:`moec.runtime.lowering`) Dynamo
ends a graph at each one, so every block is one Inductor graph and one AOTAutograd backward
node: its parameters' gradients are accumulated as soon as its backward ends, and the
data-parallel reducer's buckets (:class:`moec.runtime.distributed.GradientReducer`) are
all-reduced behind the backward of the blocks before it. With the program whole, its one
backward hands every gradient over at its end. What it costs: no fusion across a boundary, and
a guard check per graph and call.

Invariants: the data flow is unchanged (no value is read or written by the calls); parameters,
inputs and outputs are unchanged; the calls are the graph's last pass (a dead-code elimination
would remove them). A graph with no residual block to cut at stays whole, with the reason in
``declined``. Options: ``plan.lowering.regions``. Statistics: ``regions`` (graphs Dynamo will
compile), ``boundaries`` (the nodes after which a graph ends), ``declined``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from moec.analysis.cost import graph_cost
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.pipeline.split import PipelinePassError
from moec.passes.pipeline.units import pipeline_units
from moec.plan import Plan

BREAK = torch._dynamo.graph_break
"""What ends a Dynamo graph; eagerly a no-op."""


@register_pass
class RegionsPass(Pass):
    name = "regions"
    after: tuple[str, ...] = (
        "recompute",
        "fsdp",
        "combine_experts",
        "shared_stream",
        "pipeline",
    )

    @staticmethod
    def applies(plan: Plan) -> bool:
        """lowering.regions == 'blocks'"""
        return plan.lowering.regions == "blocks"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        program = ctx.require_program(self.name)
        try:
            _, blocks = pipeline_units(gm, ctx.analysis(graph_cost, program))
        except PipelinePassError as exc:  # no residual block to cut at: one graph it stays
            return PassResult(gm, False, {"regions": 1, "boundaries": [], "declined": str(exc)})
        ends = [block[-1] for block in blocks[:-1]]
        for end in ends:
            with gm.graph.inserting_after(end):
                node = gm.graph.call_function(BREAK)
            node.meta["val"] = None
        gm.recompile()
        stats = {"regions": len(blocks), "boundaries": [end.name for end in ends]}
        return PassResult(gm, bool(ends), stats)
