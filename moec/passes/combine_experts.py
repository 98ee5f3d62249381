"""Pass ``combine_experts``: a MoE layer's dispatch and combine folded into its expert MLP.

Runs when ``plan.lowering.combine_in_experts`` is true, after every other rewrite but
``pipeline`` and ``bind`` (so the cost model the ``recompute`` and ``fsdp`` passes plan with
still sees the ops it prices). Matches, in the graph and in every sub-GraphModule it calls (the
``recompute`` pass's regions), with x: [*, D], rows and weights: [*, K]::

    buffer = moec.dispatch(x, rows)
    y, h = moec.expert_mlp(buffer, w_up, w_down, offsets, None, None, activation)   # bf16
    out = moec.combine(y, weights, rows)

where the buffer is read by that expert MLP alone, y by that combine alone (over the same
``rows``) and h by nothing. Emits::

    out, h = moec.expert_mlp(x, w_up, w_down, offsets, None, None, activation, "bf16", rows,
                             weights)

(the combine inside, :mod:`moec.ops.experts`): the up projection reads the token rows through
the route table, so on the CuTe DSL the [R, D] buffer is neither written nor kept for backward;
the backward applies the route weights, and reduces their gradient, in the down projection's
dgrad, so y is not kept for backward and the rows' output gradient is never written.

Left alone (named in ``left_alone``): an expert MLP with biases or a quantization recipe, one
whose input is not a ``moec.dispatch`` read by it alone (the EP exchanges ``moec.ep_*``: their
receive buffer holds other ranks' rows), one whose y has another reader or whose combine reads
other rows, one whose h is read, and one whose dispatch or combine is in another graph (a
recompute region boundary between them).

Invariants: those of :mod:`moec.passes.rewrite`; the combine's output node is replaced by the
new op's (its meta kept, with its own ``val`` and ``from_pass``); values equal up to summation
order; every parameter and gradient kept (the route weights' included); no parameter added or
removed. Options: none (the plan's flag only selects the pass). Statistics: ``fused``,
``in_regions`` (of them, inside sub-graphs), ``left_alone`` (expert MLP node -> why).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.fx import graph_modules
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.recompute import RecomputePass
from moec.passes.rewrite import GraphEditor
from moec.plan import Plan

moec_ops = torch.ops.moec


def _outputs(mlp: fx.Node) -> dict[int, list[fx.Node]]:
    """The getitem readers of ``mlp``'s outputs, by index."""
    out: dict[int, list[fx.Node]] = {0: [], 1: []}
    for user in mlp.users:
        if user.target is operator.getitem:
            out[user.args[1]].append(user)
    return out


def _combine_of(mlp: fx.Node) -> fx.Node | str:
    """The combine ``mlp`` folds into with its dispatch, or why it does not."""
    buffer, _, _, _, b_up, b_down, _ = mlp.args[:7]
    recipe = mlp.args[7] if len(mlp.args) > 7 else "bf16"
    if b_up is not None or b_down is not None:
        return "it has biases"
    if recipe != "bf16" or len(mlp.args) > 8:
        return f"its recipe is {recipe!r}, not bf16, or its combine is inside already"
    if not (isinstance(buffer, fx.Node) and buffer.target == moec_ops.dispatch.default):
        kind = buffer.target if isinstance(buffer, fx.Node) else type(buffer).__name__
        return f"its buffer is not a moec.dispatch output ({kind})"
    if len(buffer.users) != 1:
        return f"the buffer {buffer.name} has other readers: {sorted(u.name for u in buffer.users)}"
    if len(mlp.users) != sum(len(v) for v in _outputs(mlp).values()):
        return "an output is read whole"
    items = _outputs(mlp)
    if any(h.users for h in items[1]):
        return f"its h is read: {sorted(u.name for h in items[1] for u in h.users)}"
    readers = [u for y in items[0] for u in y.users]
    if len(items[0]) != 1 or len(readers) != 1:
        return f"its y has {len(readers)} readers, not one combine"
    combine = readers[0]
    if combine.target != moec_ops.combine.default:
        return f"its y is read by {combine.target}, not moec.combine"
    if combine.args[0] is not items[0][0] or combine.args[2] is not buffer.args[1]:
        return "its combine reads other rows"
    return combine


def _fold(sub: fx.GraphModule, mlp: fx.Node, combine: fx.Node, pass_name: str) -> None:
    dispatch = mlp.args[0]
    x, rows = dispatch.args[:2]
    _, w_up, w_down, offsets, _, _, activation = mlp.args[:7]
    weights = combine.args[1]
    edit = GraphEditor(sub, pass_name)
    with sub.graph.inserting_before(combine):
        fused = edit.call(
            moec_ops.expert_mlp.default,
            (x, w_up, w_down, offsets, None, None, activation, "bf16", rows, weights),
            mlp,
        )
        out = edit.getitem(fused, 0)
    val = out.meta["val"]
    out.meta.update({k: v for k, v in combine.meta.items() if k != "val"})
    out.meta.update(val=val, from_pass=pass_name)
    combine.replace_all_uses_with(out)
    for node in [combine, *reversed(list(mlp.users)), mlp, dispatch]:
        sub.graph.erase_node(node)


@register_pass
class CombineExpertsPass(Pass):
    name = "combine_experts"
    after: tuple[str, ...] = (*RecomputePass.after, "overlap", "recompute", "fsdp")

    @staticmethod
    def applies(plan: Plan) -> bool:
        """lowering.combine_in_experts is true"""
        return plan.lowering.combine_in_experts

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        fused = in_regions = 0
        left_alone: dict[str, str] = {}
        for sub in graph_modules(gm):
            target = moec_ops.expert_mlp.default
            mlps = sub.graph.find_nodes(op="call_function", target=target)
            for mlp in list(mlps):
                combine = _combine_of(mlp)
                if isinstance(combine, str):
                    left_alone[mlp.name] = combine
                    continue
                _fold(sub, mlp, combine, self.name)
                fused += 1
                in_regions += sub is not gm
            if mlps:
                sub.recompile()
        stats = {"fused": fused, "in_regions": in_regions, "left_alone": left_alone}
        return PassResult(gm, fused > 0, stats)
