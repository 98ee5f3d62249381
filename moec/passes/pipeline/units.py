"""The units the ``pipeline`` pass splits at: one residual block each, with its costs.

A block is one the cost model finds (dense FFN regions and the MoE layers of the ``moe`` pass)
or one the ``recompute`` pass moved into a region; it ends at its **boundary**, the last
data-dependent node of the block's module. Unit k is the data-dependent compute after boundary
k-1 up to boundary k; the prologue (embedding) joins unit 0 and the epilogue (final norm, LM
head) the last unit. Nodes that depend on no input data (``sym_size``, slices of buffers) belong
to no unit: every stage that reads them recomputes them.

Per unit, at the example sizes (one microbatch): forward FLOPs (the last unit adds the loss the
runtime computes, ``CE_FLOPS_PER_LOGIT`` per logit) and (kept, transient) activation bytes: a
recompute region keeps its inputs (the cost model's rule) and, while recomputed in backward,
materialises what its sub-graph saves (the transient).
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from moec.analysis.cost import CostTotals, GraphCost, graph_cost, node_cost
from moec.analysis.structure import module_path
from moec.fx import called_graph, evaluate, nbytes, under
from moec.passes.pipeline.split import PipelinePassError
from moec.program import Program

aten = torch.ops.aten

_COMPUTE = ("call_function", "call_module")
"""Ops that compute in a unit: the ``fsdp`` pass's group and release calls are modules."""

CE_FLOPS_PER_LOGIT = 6
"""Cross-entropy on the last stage: max, subtract, exp, sum, log, gather per logit."""


def block_units(program: Program | fx.GraphModule) -> tuple[GraphCost, list[list[fx.Node]]]:
    """The cost model of ``program`` and its blocks' nodes, as the pass splits them."""
    cost = graph_cost(program)
    gm = program if isinstance(program, fx.GraphModule) else program.graph
    return cost, find_units(gm, cost)


def find_units(gm: fx.GraphModule, cost: GraphCost) -> list[list[fx.Node]]:
    """The data-dependent compute nodes of each block, prologue and epilogue merged in."""
    dependent = _data_dependent(gm)
    nodes = [n for n in gm.graph.nodes if n.op in _COMPUTE and n in dependent]
    ends = []
    for path in block_paths(gm, cost):
        owned = [i for i, n in enumerate(nodes) if under(module_path(n), path)]
        if not owned:
            raise PipelinePassError(f"block {path} has no compute nodes to split at")
        ends.append(owned[-1])
    if not ends:
        raise PipelinePassError("pipeline found no residual blocks (no FFN region) to split at")
    result, start = [], 0
    for end in ends:
        result.append(nodes[start : end + 1])
        start = end + 1
    result[-1] += nodes[start:]
    return result


def _data_dependent(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value depends on input data (not only on parameters, buffers and sizes)."""
    dependent: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            dependent.add(node)
        elif node.op in _COMPUTE and node.target is not aten.sym_size.int:
            if any(a in dependent for a in node.all_input_nodes):
                dependent.add(node)
    return dependent


def block_paths(gm: fx.GraphModule, cost: GraphCost) -> list[str]:
    """Residual blocks in graph order: the cost model's, and the blocks the ``recompute`` pass
    moved into regions (whose FFNs the structure finder can no longer see)."""
    first: dict[str, int] = {}
    paths = {b.path for b in cost.blocks}
    paths |= {module_path(n) for n in gm.graph.nodes if called_graph(n) is not None}
    for i, node in enumerate(gm.graph.nodes):
        path = module_path(node)
        for p in paths:
            if under(path, p):
                first.setdefault(p, i)
    return sorted(first, key=first.__getitem__)


def unit_costs(
    gm: fx.GraphModule, cost: GraphCost, units: list[list[fx.Node]]
) -> tuple[list[int], list[tuple[int, int]]]:
    """Per block (prologue/epilogue and loss included): forward FLOPs and (kept, transient)
    saved bytes per microbatch, at the example sizes."""
    values = cost.sizes()
    flops = [cost.value(CostTotals.of(cost.nodes, u).flops) for u in units]
    flops[-1] += cost.value(loss_flops(gm))
    return flops, [unit_saved_bytes(cost, u, values) for u in units]


def loss_flops(gm: fx.GraphModule) -> sympy.Expr:
    """FLOPs of the cross-entropy the runtime applies to the first user output (the logits;
    user outputs come before the passes' aux outputs)."""
    outputs = gm.graph.output_node().args[0]
    val = outputs[0].meta.get("val") if outputs and isinstance(outputs[0], fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return sympy.Integer(0)
    return CE_FLOPS_PER_LOGIT * (nbytes(val) / val.element_size())


def unit_saved_bytes(
    cost: GraphCost, unit: list[fx.Node], values: dict[sympy.Symbol, int]
) -> tuple[int, int]:
    """(bytes kept per microbatch between forward and backward, transient bytes): a recompute
    region keeps its inputs (the cost model's rule) and, while recomputed in backward,
    materialises what its sub-graph saves."""
    kept = evaluate(CostTotals.of(cost.nodes, unit).saved_bytes, values)
    return kept, max((_region_saved(n, values) for n in unit), default=0)


def _region_saved(node: fx.Node, values: dict[sympy.Symbol, int]) -> int:
    sub = called_graph(node)
    if sub is None:
        return 0
    costs = {n: node_cost(n) for n in sub.graph.nodes}
    return evaluate(CostTotals.of(costs, sub.graph.nodes).saved_bytes, values)
