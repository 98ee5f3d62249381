"""Pass ``recompute``: residual blocks -> checkpointed regions, recomputed in backward.

Matches every residual block the cost model finds (``graph_cost(gm).blocks``: the nodes whose
module path is under ``layers.3``), e.g. after ``moe`` on x: f32[B, S, D]::

    rms_norm = aten.rms_norm(add_6, [D], w)               # layers.1.attn_norm ... attention ...
    linear_default = aten.linear(rms_norm_3, router_weight)
    route_default = moec.route(linear_default, K, cf, "softmax", True, "learned")
    ... dispatch, expert_mlp, combine, router_losses ...
    add_7 = aten.add(add_6, combine_default)               # the block's residual output

Emits, for each block the policy recomputes, one sub-GraphModule holding the block's nodes
(parameters and their working copies come in as arguments, so every ``get_attr`` and
``working_copy`` stays in the outer graph, where the Inductor lowering lifts the copies out of
the compiled graph: :mod:`moec.runtime.lowering`)::

    recompute_layers_1 = self.recompute_layers_1           # fx.GraphModule of the block
    recompute_region = moec.ops.recompute.recompute_region(
        recompute_layers_1, "selective", add_6, slice_1, ..., layers_1_ffn_moe_w_up, ...)
    getitem_30 = recompute_region[0]                       # add_7; then losses, counts, offsets

``recompute_region`` (:mod:`moec.ops.recompute`) runs the block under ``torch.utils.checkpoint``
(non-reentrant, ``preserve_rng_state=True``) with a selective-checkpoint policy: an op marked
MUST_SAVE is run once and its output cached for backward, everything else is recomputed in
backward.

- ``block``: MUST_SAVE only for the routing decision (``moec.route``) and the communication ops
  (``moec.ep_*``, ``_c10d_functional``); the rest of the block is recomputed (per-layer AC).
- ``selective``: MUST_SAVE also for GEMMs (``mm``/``addmm``/``bmm``, attention, expert and
  quantized GEMMs); norms, activations, RoPE, casts, dispatch/combine are recomputed.
- ``budget``: per block the cheapest of none / selective / block (recompute FLOPs from the cost
  model) such that the predicted peak activation memory fits ``plan.recompute.budget_bytes``
  (greedy on bytes saved per recomputed FLOP). A budget below what ``block`` on every block
  reaches raises :class:`PlanError` on ``recompute.budget_bytes`` with that minimum.

Routing and collectives are never recomputed (their outputs are cached), so random routing
replays its choices and no EP exchange runs twice; other random ops replay through the
preserved RNG state.

Prediction (from the cost model's saved-tensor refs, at the example sizes): a block left
alone keeps what ``node_cost(n).saved`` says (with the corrections of :func:`saved_refs`); a
recomputed block keeps its activation inputs (the checkpoint holds them) and every output of its
MUST_SAVE ops. ``predicted_peak_bytes`` adds, for the block whose backward needs most, the
bytes live at its worst node (:attr:`BlockRegion.backward_peak`: the residual gradient, the
recomputed tensors saved up to that node, that node's gradients from
:func:`moec.analysis.cost.backward_workspace`).

Preconditions: no node between a block's first and last node reads a value of the block
without belonging to it; a block that breaks this is left alone and named in
``blocks_skipped``.
Invariants: those of :mod:`moec.passes.rewrite` (the region's nodes keep their meta inside the
sub-GraphModule; the ``get_attr`` of a region module carries ``meta["val"] = None``: a module
has no tensor value); user and aux outputs are unchanged; no parameter is added or removed.
Options: ``plan.recompute.policy``, ``plan.recompute.budget_bytes``.
Statistics: ``policy``, ``blocks_recomputed``, ``block_policies`` (path -> policy),
``predicted_saved_bytes_before`` / ``predicted_saved_bytes_after`` (bytes kept for backward),
``predicted_peak_bytes_before`` / ``predicted_peak_bytes`` (without recompute / with it),
``recompute_flops`` (forward FLOPs run again in backward),
``memory_table`` (per block and policy: saved bytes and recompute FLOPs), ``blocks_skipped``.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

import moec.ops.ep  # noqa: F401  (registers the moec::ep_* ops)
from moec.analysis.cost import GraphCost, SavedRef, backward_workspace, graph_cost, node_cost
from moec.analysis.cost.memory import is_activation, stored_ref
from moec.analysis.structure import module_path
from moec.fx import external_inputs, nbytes, node_order, placeholders_for, under
from moec.ops.recompute import recompute_region, saved_ops
from moec.ops.working_weights import working_copy
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.plan import Plan, PlanError

aten = torch.ops.aten
moec_ops = torch.ops.moec

LEVELS = ("none", "selective", "block")
"""Per-block choices, from least to most recompute."""


SCALE_OPS = frozenset({aten.mul.Tensor, aten.div.Tensor})


# --- prediction --------------------------------------------------------------------------------


@dataclasses.dataclass
class BlockRegion:
    """One residual block: its nodes in graph order and what each level keeps and recomputes."""

    path: str
    nodes: list[fx.Node]
    saved: dict[str, set[SavedRef]]
    """Per level, the stored tensors the block's backward keeps."""
    recompute_flops: dict[str, int]
    backward_peak: dict[str, int]
    """Per level, bytes the block's backward adds at its worst node ``n``: the gradient of the
    block's inputs (the residual stream's, live throughout), what the recompute holds when
    ``n``'s backward runs (the tensors nodes up to ``n`` save at level ``none`` and the level does
    not keep anyway: later nodes' are freed by then) and ``n``'s gradients
    (:func:`backward_workspace`)."""
    skipped: str | None = None
    """Why the block cannot be recomputed, or None."""

    def inputs(self) -> list[fx.Node]:
        return external_inputs(self.nodes)


def _outputs(node: fx.Node) -> list[SavedRef]:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return [SavedRef(node, i) for i, v in enumerate(val) if isinstance(v, torch.Tensor)]
    return [SavedRef(node)] if isinstance(val, torch.Tensor) else []


@dataclasses.dataclass(frozen=True)
class NormalizedRef(SavedRef):
    """The normalized tensor an ``rms_norm``'s weight multiply keeps: output-sized, but not the
    output (a distinct ref, so it is not merged with a consumer's saved copy of the output)."""


def saved_refs(node: fx.Node) -> tuple[SavedRef, ...]:
    """``node_cost(node).saved`` with two corrections autograd shows (to move into the cost
    model's rules): a ``mul``/``div`` by a tensor that needs no grad (a buffer, RoPE's cos/sin)
    keeps only that tensor, no activation; ``rms_norm`` runs as a composite whose weight multiply
    also keeps the normalized input (output-sized)."""
    refs = node_cost(node).saved
    if node.target in SCALE_OPS and any(
        isinstance(a, fx.Node) and not is_activation(a, floating=False) for a in node.args[:2]
    ):
        return ()
    if node.target == aten.rms_norm.default and len(node.args) > 2 and node.args[2] is not None:
        return (*refs, NormalizedRef(node))
    return refs


def _level_saved(nodes: list[fx.Node], level: str) -> set[SavedRef]:
    if level == "none":
        return {ref for n in nodes for ref in saved_refs(n)}
    kept = {stored_ref(i) for i in external_inputs(nodes) if is_activation(i, floating=False)}
    cached = saved_ops(level)
    return kept | {ref for n in nodes if cached(n.target) for ref in _outputs(n)}


def _level_flops(nodes: list[fx.Node], level: str, cost: GraphCost) -> int:
    if level == "none":
        return 0
    cached = saved_ops(level)
    return cost.value(sum((cost.nodes[n].flops for n in nodes if not cached(n.target)), 0))


def _bytes(refs: Iterable[SavedRef], cost: GraphCost) -> int:
    return cost.value(sum((ref.nbytes() for ref in refs), 0))


def _backward_peak(
    nodes: list[fx.Node], workspace: list[int], kept: set[SavedRef], cost: GraphCost
) -> int:
    """The largest, over the block's nodes, of what the recompute holds when the node's backward
    runs plus the node's ``workspace`` (see :attr:`BlockRegion.backward_peak`, less the input
    gradient); ``kept``: what the level keeps for backward anyway."""
    seen: set[SavedRef] = set()
    held, peak = 0, 0
    for node, own in zip(nodes, workspace, strict=True):
        for ref in saved_refs(node):
            if ref not in kept and ref not in seen:
                seen.add(ref)
                held += cost.value(ref.nbytes())
        peak = max(peak, held + own)
    return peak


def _interleaved(nodes: list[fx.Node]) -> fx.Node | None:
    """A node outside ``nodes`` placed before their last one that reads one of them, if any
    (the region would have to be called before its own inputs exist)."""
    member = set(nodes)
    order = node_order(nodes[0].graph)
    last = max(order[n] for n in nodes)
    users = (u for n in nodes for u in n.users if u not in member and order[u] < last)
    return next(users, None)


def block_regions(gm: fx.GraphModule, cost: GraphCost | None = None) -> list[BlockRegion]:
    """Every residual block with its per-level prediction (at the example sizes)."""
    cost = cost or graph_cost(gm)
    regions = []
    for block in cost.blocks:
        nodes = [
            n
            for n in gm.graph.nodes
            if n.op == "call_function"
            and n.target is not working_copy  # an alias: the region takes it as an argument
            and under(module_path(n), block.path)
        ]
        saved = {level: _level_saved(nodes, level) for level in LEVELS}
        flops = {level: _level_flops(nodes, level, cost) for level in LEVELS}
        user = _interleaved(nodes)
        skipped = None if user is None else f"{user.name}, between its nodes, reads the block"
        # the inputs' gradient (the residual stream's) lives through the block's backward
        activations = [i for i in external_inputs(nodes) if is_activation(i, floating=False)]
        inputs = cost.value(sum((nbytes(i.meta["val"]) for i in activations), 0))
        workspace = [cost.value(backward_workspace(n)) for n in nodes]
        peak = {lv: inputs + _backward_peak(nodes, workspace, saved[lv], cost) for lv in LEVELS}
        regions.append(BlockRegion(block.path, nodes, saved, flops, peak, skipped))
    return regions


@dataclasses.dataclass
class Prediction:
    """Activation memory of one assignment of levels to blocks."""

    saved_bytes: int
    peak_bytes: int
    recompute_flops: int


def predict(
    regions: list[BlockRegion], outside: set[SavedRef], levels: dict[str, str], cost: GraphCost
) -> Prediction:
    """Saved bytes (stored tensors counted once), peak and recompute FLOPs of ``levels``."""
    refs = set(outside)
    for region in regions:
        refs |= region.saved[levels[region.path]]
    backward = [r.backward_peak[levels[r.path]] for r in regions]
    saved = _bytes(refs, cost)
    flops = sum(r.recompute_flops[levels[r.path]] for r in regions)
    return Prediction(saved, saved + max(backward, default=0), flops)


def outside_refs(gm: fx.GraphModule, regions: list[BlockRegion]) -> set[SavedRef]:
    member = {n for r in regions for n in r.nodes}
    return {ref for n in gm.graph.nodes if n not in member for ref in saved_refs(n)}


def policy_levels(policy: str, regions: list[BlockRegion]) -> dict[str, str]:
    """Per block level of the fixed policies (``none``, ``block``, ``selective``)."""
    return {r.path: "none" if r.skipped else policy for r in regions}


def choose_budget(
    regions: list[BlockRegion], outside: set[SavedRef], budget: int, cost: GraphCost
) -> dict[str, str]:
    """Fewest recompute FLOPs whose predicted peak fits ``budget`` (greedy, see module)."""
    floor = predict(regions, outside, policy_levels("block", regions), cost).peak_bytes
    if budget < floor:
        raise PlanError(
            "recompute.budget_bytes",
            budget,
            f"at least {floor} bytes: the predicted activation peak with every block "
            "recomputed (policy 'block'); raise the budget or shrink the batch/sequence",
        )
    levels = policy_levels("none", regions)
    while predict(regions, outside, levels, cost).peak_bytes > budget:
        levels = _best_step(regions, levels, cost)
    return levels


def _best_step(regions: list[BlockRegion], levels: dict[str, str], cost: GraphCost) -> dict:
    """The one-block change of level that frees the most bytes per recomputed FLOP."""
    best, best_rate = None, -1.0
    for region in regions:
        if region.skipped:
            continue
        now = levels[region.path]
        for level in LEVELS[LEVELS.index(now) + 1 :]:
            freed = _bytes(region.saved[now], cost) - _bytes(region.saved[level], cost)
            extra = region.recompute_flops[level] - region.recompute_flops[now]
            rate = freed / max(extra, 1)
            if freed > 0 and rate > best_rate:
                best, best_rate = (region.path, level), rate
    if best is None:  # cannot happen above the floor; guards against a non-terminating loop
        raise RuntimeError("pass recompute: no block level frees memory, yet the budget fits")
    return {**levels, best[0]: best[1]}


def memory_table(
    regions: list[BlockRegion], levels: dict[str, str], cost: GraphCost
) -> list[dict[str, Any]]:
    """Per block: predicted saved bytes and recompute FLOPs of every level, and the chosen one."""
    rows = []
    for region in regions:
        row: dict[str, Any] = {"block": region.path, "chosen": levels[region.path]}
        for level in LEVELS:
            row[f"{level}_saved_bytes"] = _bytes(region.saved[level], cost)
            row[f"{level}_recompute_flops"] = region.recompute_flops[level]
        rows.append(row)
    return rows


# --- rewriting ---------------------------------------------------------------------------------


def _wrap(gm: fx.GraphModule, region: BlockRegion, level: str) -> None:
    """Move ``region``'s nodes into a sub-GraphModule called through ``recompute_region``."""
    nodes, member = region.nodes, set(region.nodes)
    inputs = region.inputs()
    outputs = [n for n in nodes if any(u not in member for u in n.users)]
    sub = fx.Graph()
    env = placeholders_for(sub, inputs)
    for node in nodes:
        env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(tuple(env[n] for n in outputs))
    name = "recompute_" + region.path.replace(".", "_")
    gm.add_submodule(name, fx.GraphModule(torch.nn.Module(), sub, class_name=name))
    owner = min(nodes, key=lambda n: len(module_path(n)))
    with gm.graph.inserting_before(nodes[-1].next):
        attr = gm.graph.get_attr(name)
        call = gm.graph.call_function(recompute_region, (attr, level, *inputs))
        items = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    attr.meta["val"] = None
    call.meta["val"] = tuple(n.meta["val"] for n in outputs)
    for node, item in zip(outputs, items, strict=True):
        item.meta["val"] = node.meta["val"]
    for node in (attr, call, *items):
        node.meta["nn_module_stack"] = dict(owner.meta.get("nn_module_stack") or {})
        node.meta["from_pass"] = RecomputePass.name
    for node, item in zip(outputs, items, strict=True):
        node.replace_all_uses_with(item, delete_user_cb=lambda user: user not in member)
    for node in reversed(nodes):
        gm.graph.erase_node(node)


@register_pass
class RecomputePass(Pass):
    name = "recompute"
    after: tuple[str, ...] = (
        "moe",
        "expert_parallel",
        "precision",
        "fused_loss",
        "shared_casts",
        "fuse_rope",
        "fuse_glu",
        "working_weights",
    )

    @staticmethod
    def applies(plan: Plan) -> bool:
        """recompute.policy is not none"""
        return plan.recompute.policy != "none"

    @staticmethod
    def options(plan: Plan) -> str:
        return plan.recompute.policy

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        plan = ctx.plan.recompute
        cost = ctx.analysis(graph_cost, ctx.program or gm)
        regions = block_regions(gm, cost)
        outside = outside_refs(gm, regions)
        if plan.policy == "budget":
            levels = choose_budget(regions, outside, plan.budget_bytes, cost)
        else:
            levels = policy_levels(plan.policy, regions)
        before = predict(regions, outside, policy_levels("none", regions), cost)
        after = predict(regions, outside, levels, cost)
        for region in regions:
            if levels[region.path] != "none":
                _wrap(gm, region, levels[region.path])
        gm.recompile()
        stats = {
            "policy": plan.policy,
            "blocks_recomputed": sum(level != "none" for level in levels.values()),
            "block_policies": levels,
            "predicted_saved_bytes_before": before.saved_bytes,
            "predicted_saved_bytes_after": after.saved_bytes,
            "predicted_peak_bytes_before": before.peak_bytes,
            "predicted_peak_bytes": after.peak_bytes,
            "recompute_flops": after.recompute_flops,
            "memory_table": memory_table(regions, levels, cost),
            "blocks_skipped": {r.path: r.skipped for r in regions if r.skipped},
        }
        return PassResult(gm, stats["blocks_recomputed"] > 0, stats)
