"""Pass ``fsdp``: the dense parameters become FSDP2 shards, gathered block by block.

Matches  every parameter that is not an expert slice (role ``dense`` or ``router``) and, in a
         bf16 program, that the graph reads only through bf16 casts (FSDP2 gathers a group in
         one dtype: a norm weight or embedding read in float32 stays whole on every rank, its
         gradient all-reduced as under DDP, so values equal DDP's); the residual blocks (as
         the ``pipeline`` pass finds them: :mod:`moec.passes.pipeline.units`)
         whose container module is a plain ``nn.Module`` (how capture leaves a submodule) and
         whose parameters no other block reads; in a bf16 program the casts ``shared_casts``
         put on these parameters: ``aten._to_copy(P, dtype=bf16)`` of a parameter's
         ``get_attr``, in the graph or in a recompute region it is passed to.
Emits    per such block (:mod:`moec.ops.param_groups`): its container becomes a ``ParamGroup``,
         called on the block's incoming activations before its first parameter read (the
         ``get_attr`` nodes of its parameters, and what is computed from them alone, move after
         that call), and a ``ReleaseParams`` child called on the block's output; the
         activations' later readers in the block read the group's outputs and the output's
         readers the release's. ``aten.to.dtype(P, bf16)`` in place of each cast: the runtime
         all-gathers these parameters in bf16 (FSDP2's ``MixedPrecisionPolicy``), so the cast
         is a no-op on what arrives where ``_to_copy`` would copy each unsharded weight each
         step. The program's ``data_parallel`` (:class:`moec.program.ShardedDataParallel`)
         names the sharded parameters, the blocks' groups, the replicate x shard layout and the
         gather dtype.
Keeps    values and gradients (the group and release calls are identities on values; the cast
         rounds the same float32 values to bf16, on the shard before the all-gather instead of
         on the whole tensor after it; ``to``'s backward casts back as ``_to_copy``'s does); the
         parameters and their names (a group is the module that already held them).
Runs after ``recompute`` (a region is one node of its block: its parameters arrive as its
arguments) and before ``pipeline``; ``working_weights`` leaves the sharded parameters' casts
alone (a persistent bf16 copy of a whole parameter would undo the sharding).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from moec.analysis.cost import graph_cost
from moec.analysis.cost.model import block_paths
from moec.fx import called_graph, module_path, under
from moec.ops.param_groups import ParamGroup, ReleaseParams
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.casts import is_bf16_cast
from moec.passes.pipeline.units import find_units
from moec.plan import Plan
from moec.program import Program, ShardedDataParallel

aten = torch.ops.aten

RELEASE = "release_params"
"""Name of a group's :class:`ReleaseParams` child."""


@register_pass
class FSDPPass(Pass):
    name = "fsdp"
    after: tuple[str, ...] = (
        "moe",
        "expert_parallel",
        "shared_casts",
        "working_weights",
        "recompute",
    )

    @staticmethod
    def applies(plan: Plan) -> bool:
        """parallel.dp_shard > 1"""
        return plan.parallel.dp_shard > 1

    @staticmethod
    def options(plan: Plan) -> str:
        p = plan.parallel
        return f"replicate={p.dp // p.dp_shard},shard={p.dp_shard}"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        program = ctx.require_program(self.name)
        p = ctx.plan.parallel
        expert_shard = p.dp // p.ep if p.shards_experts else 1
        experts = {n for n, _ in gm.named_parameters() if program.role(n) == "expert"}
        holders = {n.rpartition(".")[0] for n in experts} if expert_shard > 1 else set()
        # a parameter beside the experts in their module (the router) stays whole: FSDP manages
        # a module's parameters in one unit, and the experts' unit spans other ranks
        dense = {
            n
            for n, _ in gm.named_parameters()
            if n not in experts and not any(under(n, h) for h in holders)
        }
        bf16 = ctx.plan.precision.compute_dtype == "bf16"
        carriers = _carriers(gm)
        if bf16:  # gathered in bf16: only what the graph reads in bf16
            dense = {n for n in dense if _read_in_bf16_only(carriers.get(n, []))}
            experts = {n for n in experts if _read_in_bf16_only(carriers.get(n, []))}
        if expert_shard == 1:
            experts = set()
        sharded = tuple(n for n, _ in gm.named_parameters() if n in dense)
        sharded_experts = tuple(n for n, _ in gm.named_parameters() if n in experts)
        casts = _gather_casts(gm, carriers, dense | experts) if bf16 else 0
        groups, expert_groups = _insert_groups(gm, program, dense, experts, ctx.analysis)
        gm.recompile()
        program.data_parallel = ShardedDataParallel(
            replicate=p.dp // p.dp_shard,
            shard=p.dp_shard,
            params=sharded,
            groups=tuple(groups),
            gather_dtype="bfloat16" if bf16 else None,
            expert_shard=expert_shard if expert_groups else 1,
            expert_params=tuple(
                n for n in sharded_experts if any(under(n, g) for g in expert_groups)
            ),
            expert_groups=tuple(expert_groups),
        )
        stats = {
            "sharded": len(sharded),
            "groups": len(groups),
            "expert_groups": len(expert_groups),
            "casts_to_gather": casts,
        }
        return PassResult(gm, bool(casts or groups or expert_groups), stats)


def _carriers(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Per parameter, the nodes holding its value: its ``get_attr``, and in a region it is
    passed to (``recompute_region(region, level, *args)``) the placeholder it arrives as."""
    found: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            found.setdefault(str(node.target), []).append(node)
        sub = called_graph(node)
        if sub is not None:
            inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
            for arg, placeholder in zip(node.args[2:], inputs, strict=False):
                if isinstance(arg, fx.Node) and arg.op == "get_attr":
                    found.setdefault(str(arg.target), []).append(placeholder)
    return found


def _read_in_bf16_only(carriers: list[fx.Node]) -> bool:
    readers = [u for c in carriers for u in c.users if called_graph(u) is None]
    return bool(readers) and all(is_bf16_cast(r) for r in readers)


def _gather_casts(gm: fx.GraphModule, carriers: dict[str, list[fx.Node]], names: set[str]) -> int:
    """Turn the bf16 casts of the parameters ``names`` into ``to.dtype``, wherever they read
    them (see :func:`_carriers`)."""
    count = sum(_retarget_casts(c) for name in names for c in carriers.get(name, []))
    for node in gm.graph.nodes:
        sub = called_graph(node)
        if sub is not None:
            sub.recompile()
    return count


def _retarget_casts(param: fx.Node) -> int:
    casts = [u for u in param.users if u.target == aten._to_copy.default and is_bf16_cast(u)]
    for cast in casts:
        cast.target, cast.args, cast.kwargs = aten.to.dtype, (param, torch.bfloat16), {}
    return len(casts)


def _insert_groups(
    gm: fx.GraphModule,
    program: Program,
    dense: set[str],
    experts: set[str],
    analysis: Callable[..., Any],
) -> tuple[list[str], list[str]]:
    """Make each eligible block, then each module holding sharded experts, a parameter group
    (see the module docstring); their paths."""
    cost = analysis(graph_cost, program)
    units = find_units(gm, cost)
    dependent = {n for unit in units for n in unit} | {
        n for n in gm.graph.nodes if n.op == "placeholder"
    }
    blocks = list(zip(block_paths(gm, cost), units, strict=True))
    holders = sorted({n.rpartition(".")[0] for n in experts})
    expert_units = [(h, u) for h in holders for b, u in blocks if under(h, b)]
    made: tuple[list[str], list[str]] = ([], [])
    for kind, (names, candidates) in enumerate(((dense, blocks), (experts, expert_units))):
        for path, unit in candidates:
            container = gm.get_submodule(path) if path else None
            if type(container) is not nn.Module:
                continue
            params = [
                n
                for n in gm.graph.nodes
                if n.op == "get_attr" and n.target in names and under(str(n.target), path)
            ]
            derived = _derived(params, dependent)
            readers = {u for n in derived for u in n.users if u in dependent}
            if not params or not readers <= set(unit):
                continue  # another block reads them: they stay with the root
            if _make_group(gm, path, container, unit, derived, readers, dependent):
                made[kind].append(path)
    return made


def _derived(params: list[fx.Node], dependent: set[fx.Node]) -> list[fx.Node]:
    """``params`` and the nodes computed from parameters alone that read them (casts, views,
    the concatenated GLU weight), in graph order."""
    found: dict[fx.Node, None] = dict.fromkeys(params)
    for node in params[0].graph.nodes if params else []:
        if node not in found and node not in dependent and node.op == "call_function":
            if any(a in found for a in node.all_input_nodes):
                found[node] = None
    order = {n: i for i, n in enumerate(params[0].graph.nodes)} if params else {}
    return sorted(found, key=order.__getitem__)


def _make_group(
    gm: fx.GraphModule,
    path: str,
    container: nn.Module,
    unit: list[fx.Node],
    derived: list[fx.Node],
    readers: set[fx.Node],
    dependent: set[fx.Node],
) -> bool:
    graph = gm.graph
    entry = next(n for n in unit if n in readers)
    inside = [n for n in unit if under(module_path(n), path) and _float_tensor(n)]
    if not inside:  # nodes the passes made carry their caller's module (an expert op's FFN)
        outputs = readers | {u for r in readers for u in r.users if u.target is operator.getitem}
        inside = [n for n in unit if n in outputs and _float_tensor(n)]
    if not inside or unit.index(inside[-1]) < unit.index(entry):
        return False
    output = inside[-1]
    at_or_after = set(unit[unit.index(entry) : unit.index(output) + 1])  # the group's span
    order = {n: i for i, n in enumerate(graph.nodes)}
    live_in = [
        n
        for n in dict.fromkeys(a for m in at_or_after for a in m.all_input_nodes)
        if n in dependent and order[n] < order[entry] and _is_tensor(n)
    ]
    if not live_in:
        return False
    container.__class__ = ParamGroup
    container.add_module(RELEASE, ReleaseParams(container))
    with graph.inserting_before(entry):
        call = graph.call_module(path, tuple(live_in))
    _stamp(call, live_in[0], entry)
    if len(live_in) > 1:
        call.meta["val"] = tuple(n.meta["val"] for n in live_in)
    entered = [call]
    if len(live_in) > 1:
        entered = []
        for i, value in enumerate(live_in):
            with graph.inserting_after(entered[-1] if entered else call):
                item = graph.call_function(operator.getitem, (call, i))
            _stamp(item, value, entry)
            entered.append(item)
    for value, new in zip(live_in, entered, strict=True):
        value.replace_all_uses_with(new, delete_user_cb=lambda u: u in at_or_after)
    anchor = entered[-1]
    for node in derived:  # read after the gather, in their order
        anchor.append(node)
        anchor = node
    with graph.inserting_after(output):
        release = graph.call_module(f"{path}.{RELEASE}", (output,))
    _stamp(release, output, output)
    output.replace_all_uses_with(release, delete_user_cb=lambda u: u is not release)
    dependent.update([call, *entered, release])  # what later blocks read
    return True


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _float_tensor(node: fx.Node) -> bool:
    return _is_tensor(node) and node.meta["val"].is_floating_point()


def _stamp(node: fx.Node, value: fx.Node, like: fx.Node) -> None:
    """``node`` returns ``value``'s value and belongs to ``like``'s module."""
    node.meta["val"] = value.meta["val"]
    for key in ("nn_module_stack", "stack_trace"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
