"""The units the ``pipeline`` pass splits at: residual blocks or their halves, with their costs.

A block is one the cost model finds (dense FFN regions and the MoE layers of the ``moe`` pass)
or one the ``recompute`` pass moved into a region; it ends at its **boundary**, the last
data-dependent node of the block's module. Block k is the data-dependent compute after boundary
k-1 up to boundary k; the prologue (embedding) joins block 0 and the epilogue (final norm, LM
head) the last block. Nodes that depend on no input data (``sym_size``, slices of buffers) belong
to no unit: every stage that reads them recomputes them.

Units (:func:`pipeline_units`) are the blocks, or with ``sublayers`` each block cut once more
before its FFN, at the point where the fewest values cross (the residual stream after the
attention's add: one tensor, the same a block boundary sends): ``layers.3 (pre-FFN)`` holds the
norm, attention and their residual add, ``layers.3 (FFN)`` the FFN's norm, the FFN or MoE layer
and its add. Half-block units let a balanced split move an attention's worth of work between
stages instead of a block's. A recompute region is one call and an FSDP group (the ``fsdp``
pass) gathers the block's parameters in one call: both stay whole.

Per unit, at the example sizes (one microbatch): its forward work by kind
(:func:`unit_work`, which the time model prices; the last unit adds the cross-entropy the
runtime computes, ``CE_FLOPS_PER_LOGIT`` per logit), forward FLOPs and (kept, transient)
activation bytes: a recompute region keeps its inputs (the cost model's rule) and, while
recomputed in backward, materialises what its sub-graph saves (the transient).
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from moec.analysis.cost import CostTotals, GraphCost, node_cost, work_by_kind
from moec.analysis.cost.model import block_paths
from moec.analysis.cost.time import ForwardWork, forward_work
from moec.analysis.structure import module_path
from moec.fx import called_graph, evaluate, nbytes, under
from moec.ops.param_groups import ParamGroup
from moec.passes.pipeline.errors import PipelinePassError
from moec.program import FFN, PRE_FFN, MoELayer

aten = torch.ops.aten

_COMPUTE = ("call_function", "call_module")
"""Ops that compute in a unit: the ``fsdp`` pass's group and release calls are modules."""

CE_FLOPS_PER_LOGIT = 6
"""Cross-entropy on the last stage: max, subtract, exp, sum, log, gather per logit."""


def find_units(gm: fx.GraphModule, cost: GraphCost) -> list[list[fx.Node]]:
    """The data-dependent compute nodes of each block, prologue and epilogue merged in."""
    return pipeline_units(gm, cost)[1]


def pipeline_units(
    gm: fx.GraphModule, cost: GraphCost, sublayers: bool = False
) -> tuple[list[str], list[list[fx.Node]]]:
    """(names, nodes) of the units: the blocks (named by their module path), or with
    ``sublayers`` their pre-FFN and FFN halves (see module)."""
    dependent = _data_dependent(gm)
    nodes = [n for n in gm.graph.nodes if n.op in _COMPUTE and n in dependent]
    paths = block_paths(gm, cost)
    ends = []
    for path in paths:
        owned = [i for i, n in enumerate(nodes) if under(module_path(n), path)]
        if not owned:
            raise PipelinePassError(f"block {path} has no compute nodes to split at")
        ends.append(owned[-1])
    if not ends:
        raise PipelinePassError("pipeline found no residual blocks (no FFN region) to split at")
    ends[-1] = len(nodes) - 1  # the epilogue joins the last block
    names, cuts = [], []
    ffn_paths = {b.path: b.ffn.path for b in cost.blocks}
    crossing = _crossing(nodes) if sublayers else []
    start = 0
    for path, end in zip(paths, ends, strict=True):
        whole = not sublayers or _gathers_params(gm, nodes[start : end + 1])
        cut = None if whole else _ffn_cut(nodes, crossing, start, end, ffn_paths.get(path))
        if cut is None:
            names.append(path)
        else:
            names += [path + PRE_FFN, path + FFN]
            cuts.append(cut)
        cuts.append(end)
        start = end + 1
    units, start = [], 0
    for cut in cuts:
        units.append(nodes[start : cut + 1])
        start = cut + 1
    return names, units


def _gathers_params(gm: fx.GraphModule, block: list[fx.Node]) -> bool:
    """Whether the block is an FSDP group: its parameters are gathered together (one call
    before the block's first read), so its halves cannot run in different stages."""
    return any(
        n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), ParamGroup)
        for n in block
    )


def _crossing(nodes: list[fx.Node]) -> list[int]:
    """``crossing[p]``: how many values a cut after ``nodes[p]`` sends on (defined at or before
    ``p``, read after it or by the output; graph inputs aside: they are never sent)."""
    index = {n: i for i, n in enumerate(nodes)}
    change = [0] * (len(nodes) + 1)
    for i, node in enumerate(nodes):
        reads = [index.get(u, len(nodes)) for u in node.users if u.op == "output" or u in index]
        last = max(reads, default=i)
        if last > i:
            change[i] += 1
            change[last] -= 1
    crossing, live = [], 0
    for delta in change[:-1]:
        live += delta
        crossing.append(live)
    return crossing


def _ffn_cut(
    nodes: list[fx.Node], crossing: list[int], start: int, end: int, ffn_path: str | None
) -> int | None:
    """The last node of a block's pre-FFN half (``nodes[start:end + 1]`` is the block): of the
    positions before the FFN's first node, the latest after which the fewest values cross.
    None when the block has no FFN nodes of its own to cut before (a recompute region) or
    nothing before them, or when more values would cross than at a block boundary."""
    if ffn_path is None:
        return None
    first = next((i for i in range(start, end + 1) if under(module_path(nodes[i]), ffn_path)), None)
    if first is None or first == start:
        return None
    fewest = min(crossing[start:first])
    boundary = crossing[start - 1] if start > 0 else crossing[end]
    if fewest > boundary:
        return None
    return max(p for p in range(start, first) if crossing[p] == fewest)


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


def unit_work(
    gm: fx.GraphModule,
    cost: GraphCost,
    units: list[list[fx.Node]],
    layers: list[MoELayer],
    ep: int = 1,
) -> list[ForwardWork]:
    """Per unit, its forward work at the example sizes, as the time model prices it: a MoE
    layer's expert GEMMs at the rows each local expert sees (``ep`` ranks send to it)."""
    values = cost.sizes()
    tokens = float(cost.value(cost.tokens))
    result = []
    for i, unit in enumerate(units):
        flops, other = work_by_kind(cost.nodes[n] for n in unit)
        if i == len(units) - 1:  # the loss reads its fp32 logits
            other += loss_flops(gm) * 4 / CE_FLOPS_PER_LOGIT
        kinds = {kind: float(evaluate(f, values)) for kind, f in flops.items()}
        routing = [(m.top_k, m.num_experts) for m in moe_layers_in(unit, layers)]
        written = float(evaluate(other, values))
        result.append(
            forward_work(
                kinds["matmul"], kinds["attention"], kinds["experts"], routing, written, tokens, ep
            )
        )
    return result


def moe_layers_in(nodes: list[fx.Node], layers: list[MoELayer]) -> list[MoELayer]:
    """The MoE layers that run in ``nodes`` (a layer's parameters live at ``<ffn>.moe``, its
    nodes in the FFN's module)."""
    paths = {module_path(n) for n in nodes}
    return [m for m in layers if any(under(p, m.path.rpartition(".")[0]) for p in paths)]


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
