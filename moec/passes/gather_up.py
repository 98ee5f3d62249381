"""Pass ``gather_up``: a MoE layer's dispatch folded into its experts' up projection.

Runs when ``plan.lowering.gather_up`` is true, after every other rewrite but ``pipeline`` (so
the cost model the ``recompute`` and ``fsdp`` passes plan with still sees the ops it prices).
Matches, in the graph and in every sub-GraphModule it calls (the ``recompute`` pass's regions),
with x: [*, D], rows: [*, K], R = T*K::

    buffer = moec.dispatch(x, rows)                                       # buffer: [R, D]
    y_h = moec.expert_mlp(buffer, w_up, w_down, offsets, b_up, b_down, activation)

where ``buffer`` is read by that ``moec.expert_mlp`` alone. Emits::

    y_h = moec.expert_mlp_gathered(x, rows, w_up, w_down, offsets, b_up, b_down, activation)

(:mod:`moec.ops.gathered_experts`): the up projection reads buffer row r as token row
``x[sources[r]]``, so where it runs on the CuTe DSL the [R, D] buffer is neither written nor
kept for backward.

Left alone: a dispatch with another reader (the buffer must exist anyway); the EP exchanges
(``moec.ep_*``: their receive buffer holds other ranks' rows); ``moec.quantized_expert_mlp``
(its GEMMs quantize the buffer); a dispatch and an expert MLP in different graphs (a
recompute region boundary between them: the region's input is the buffer).

Invariants: those of :mod:`moec.passes.rewrite`; the new node keeps the expert MLP's meta (its
module stack, so structure analyses and the runtime's profiling ranges place it in the same
layer) with its own ``val`` and ``from_pass``; values equal up to the GEMMs' summation order
(the same rows are multiplied, the same per-token sums form d_x); every parameter and gradient
kept; no parameter added or removed. Options: none (the plan's flag only selects the pass).
Statistics: ``fused`` (rewritten pairs), ``in_regions`` (of them, inside sub-graphs),
``left_alone`` (expert MLP node -> why).
"""

from __future__ import annotations

import torch
import torch.fx as fx

import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.fx import graph_modules
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.rewrite import GraphEditor
from moec.plan import Plan

moec_ops = torch.ops.moec


def _why_not(mlp: fx.Node) -> str | None:
    """Why the expert MLP ``mlp`` keeps its buffer, or None when its dispatch folds into it."""
    buffer = mlp.args[0]
    if not (isinstance(buffer, fx.Node) and buffer.target == moec_ops.dispatch.default):
        kind = buffer.target if isinstance(buffer, fx.Node) else type(buffer).__name__
        return f"its buffer is not a moec.dispatch output ({kind})"
    if len(buffer.users) != 1:
        return f"the buffer {buffer.name} has other readers: {sorted(u.name for u in buffer.users)}"
    return None


def _fold(sub: fx.GraphModule, mlp: fx.Node, pass_name: str) -> None:
    dispatch = mlp.args[0]
    x, rows = dispatch.args
    edit = GraphEditor(sub, pass_name)
    with sub.graph.inserting_before(mlp):
        gathered = edit.call(moec_ops.expert_mlp_gathered.default, (x, rows, *mlp.args[1:]), mlp)
    val = gathered.meta["val"]
    gathered.meta.update({k: v for k, v in mlp.meta.items() if k != "val"})
    gathered.meta.update(val=val, from_pass=pass_name)
    mlp.replace_all_uses_with(gathered)
    sub.graph.erase_node(mlp)
    sub.graph.erase_node(dispatch)


@register_pass
class GatherUpPass(Pass):
    name = "gather_up"
    after: tuple[str, ...] = (
        "moe",
        "expert_parallel",
        "precision",
        "overlap",
        "fused_loss",
        "shared_casts",
        "fuse_rope",
        "fuse_glu",
        "working_weights",
        "recompute",
        "fsdp",
    )

    @staticmethod
    def applies(plan: Plan) -> bool:
        """lowering.gather_up is true"""
        return plan.lowering.gather_up

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        fused = in_regions = 0
        left_alone: dict[str, str] = {}
        for sub in graph_modules(gm):
            mlps = sub.graph.find_nodes(op="call_function", target=moec_ops.expert_mlp.default)
            changed = False
            for mlp in list(mlps):
                reason = _why_not(mlp)
                if reason is not None:
                    left_alone[mlp.name] = reason
                    continue
                _fold(sub, mlp, self.name)
                fused += 1
                in_regions += sub is not gm
                changed = True
            if changed:
                sub.recompile()
        stats = {"fused": fused, "in_regions": in_regions, "left_alone": left_alone}
        return PassResult(gm, fused > 0, stats)
