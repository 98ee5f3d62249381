"""Pass ``shared_stream``: each MoE layer's shared expert runs on a second CUDA stream.

Runs when ``plan.lowering.shared_expert_stream`` is true, after every other rewrite but
``pipeline``. Matches, in the graph and in every sub-GraphModule it calls (the ``recompute``
pass's regions), the residual sum the ``moe`` pass emits for a layer with a shared expert::

    y = ... shared expert (the dense FFN: up, activation, down) of x ...
    routed = moec.combine(moec.expert_mlp(moec.dispatch(x, rows), ...)[0], weights, rows)
    out = aten.add(y, routed)                                  # meta["from_pass"] == "moe"

The shared expert's nodes are the ``call_function`` nodes ``y`` depends on that the routed
output does not (casts of its weights included); ``x`` and what comes before it are shared.
Emits (:mod:`moec.ops.side_stream`)::

    side_stream_enter(x)                     # after the last of the stretch's inputs
    ... the shared expert's nodes, moved here in their order ...
    y_s = side_stream_leave(y)[0]
    ... the routed experts' nodes ...
    y_m = side_stream_join(y_s)[0]
    out = aten.add(y_m, routed)

so the shared expert's GEMMs (and, by autograd's stream semantics, their backward) run while
the routed experts' routing, dispatch, grouped GEMMs and combine run on the program's stream.

Left alone (named in ``left_alone``): a layer whose shared expert contains a collective (its
order across ranks is the program stream's), or one of whose nodes something besides the sum
reads (that reader would run on the program's stream without waiting).

Invariants: those of :mod:`moec.passes.rewrite`; values unchanged (the three calls return
their inputs; on the CPU they do nothing else); nodes only move later, never before an input;
no parameter added or removed; the cost model sees three zero-cost calls. Options: none (the
plan's flag selects the pass; :class:`moec.plan.LoweringPlan` refuses it beside ``inductor``,
which traces the graph whole, and beside FSDP sharding, whose gradient hooks assume one
stream). Statistics: ``layers`` (rewritten), ``in_regions`` (of them, inside sub-graphs),
``moved_nodes`` (shared-expert nodes per layer, summed), ``left_alone`` (sum node -> why).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from moec.fx import ancestors, external_inputs, graph_modules, node_order
from moec.ops.recompute import is_communication
from moec.ops.side_stream import side_stream_enter, side_stream_join, side_stream_leave
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.rewrite import GraphEditor
from moec.plan import Plan

aten = torch.ops.aten


def shared_expert_nodes(total: fx.Node) -> tuple[list[fx.Node], str | None]:
    """(the shared expert's nodes in graph order, None) for a ``moe`` residual sum, or ([],
    why the layer is left alone)."""
    shared_out, routed_out = total.args[:2]
    routed = ancestors(routed_out)
    nodes: set[fx.Node] = set()
    stack = [shared_out]
    while stack:
        node = stack.pop()
        if node in nodes or node in routed or node.op != "call_function":
            continue
        nodes.add(node)
        stack.extend(node.all_input_nodes)
    if shared_out not in nodes:
        return [], f"its shared output {shared_out.name} is not a node of its own"
    for node in nodes:
        readers = [u.name for u in node.users if u not in nodes and u is not total]
        if readers:
            return [], f"{node.name} of its shared expert is also read by {sorted(readers)}"
        if is_communication(node.target):
            return [], f"its shared expert runs the collective {node.name}"
    order = node_order(total.graph)
    return sorted(nodes, key=order.__getitem__), None


def _move_to_side_stream(
    sub: fx.GraphModule, total: fx.Node, nodes: list[fx.Node], name: str
) -> None:
    graph, edit = sub.graph, GraphEditor(sub, name)
    order = node_order(graph)
    inputs = external_inputs(nodes)
    anchor = max(inputs, key=order.__getitem__)
    activations = [n for n in inputs if n.op != "get_attr"]
    with graph.inserting_after(anchor):
        enter = edit.call(side_stream_enter, tuple(activations), total)
    cursor = enter
    for node in nodes:  # later, never before an input: every input is at or before the anchor
        cursor.append(node)
        cursor = node
    with graph.inserting_after(cursor):
        leave = edit.call(side_stream_leave, (nodes[-1],), total)
    with graph.inserting_after(leave):
        shared = edit.getitem(leave, 0)
    with graph.inserting_before(total):
        join = edit.call(side_stream_join, (shared,), total)
        arrived = edit.getitem(join, 0)
    total.replace_input_with(nodes[-1], arrived)


@register_pass
class SharedStreamPass(Pass):
    name = "shared_stream"
    after: tuple[str, ...] = ("combine_experts",)  # the last rewrites

    @staticmethod
    def applies(plan: Plan) -> bool:
        """lowering.shared_expert_stream is true and the MoE layers have a shared expert"""
        return plan.lowering.shared_expert_stream and plan.moe.shared_expert

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        layers = in_regions = moved = 0
        left_alone: dict[str, str] = {}
        for sub in graph_modules(gm):
            sums = [
                n
                for n in sub.graph.find_nodes(op="call_function", target=aten.add.Tensor)
                if n.meta.get("from_pass") == "moe"
            ]
            for total in sums:
                nodes, why = shared_expert_nodes(total)
                if why is not None:
                    left_alone[total.name] = why
                    continue
                _move_to_side_stream(sub, total, nodes, self.name)
                layers += 1
                in_regions += sub is not gm
                moved += len(nodes)
            if sums:
                sub.graph.lint()
                sub.recompile()
        stats = {
            "layers": layers,
            "in_regions": in_regions,
            "moved_nodes": moved,
            "left_alone": left_alone,
        }
        return PassResult(gm, layers > 0, stats)
