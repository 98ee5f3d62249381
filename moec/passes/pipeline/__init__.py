"""Pass ``pipeline``: split the graph into ``pp x v`` stage graphs at residual-block boundaries.

Runs last, when ``plan.parallel.pp > 1``. Matches the residual blocks the cost model finds
(:func:`moec.analysis.cost.graph_cost`: dense FFN regions and the MoE layers of the ``moe``
pass). A block ends at its **boundary**: the last node of the block's module (the residual add
after the FFN or the ``moec.combine`` output), e.g. for Llama with x: f32[B, S, D]::

    add_3 = add(add_2, linear_6)          # layers.0 ends: boundary 0
    ...
    add_7 = add(add_6, combine_default)   # layers.1 (MoE) ends: boundary 1

Unit k is everything after boundary k-1 up to boundary k; the embedding (prologue) joins unit 0
and the final norm + LM head (epilogue, with the loss the runtime adds) joins the last unit.

Emits ``S = pp * v`` ``fx.GraphModule`` stages, stored as ``gm.meta["moec_pipeline"]``
(:class:`PipelineSplit`); the full graph itself is returned unchanged (it still runs as one
program, e.g. for evaluation, until the pipeline runtime frees the parameters of the stages other
ranks hold: :attr:`PipelineSplit.freed`)::

    stage 0:   forward(tokens)          -> (add_3, aux...)        # embed, blocks [0, b1)
    stage s:   forward(add_k)           -> (add_m, aux...)        # blocks [bs, bs+1)
    stage S-1: forward(add_n)           -> (logits, aux...)       # last blocks, norm, lm_head

Values crossing a boundary become stage outputs and the next stage's inputs (threaded through
intermediate stages when used further on). Nodes that depend on no input data (``sym_size``,
slices of buffers such as RoPE tables) are recomputed in every stage that reads them, with sizes
re-read from the stage's own inputs; parameters live in the one stage that reads them. Aux
outputs (router losses, expert counts/offsets, EP drops) stay with the stage that makes them,
after its boundary outputs.

Balance: blocks are assigned to stages contiguously by exact dynamic programming, minimising the
most expensive stage's forward FLOPs (prologue and epilogue included; the loss estimated as
``CE_FLOPS_PER_LOGIT`` per logit), then its predicted activation memory. With a heavy LM head this
gives the last stage fewer blocks, the report's ``MINUS_LAST_STAGE``.

Activation memory (schedule-derived): each stage keeps ``in_flight`` microbatches of saved
activations at its peak, read from the schedule's per-rank action order (forward adds one;
full backward, or the weight backward of zero-bubble schedules, releases one), times the
stage's saved bytes per microbatch, plus the largest transient of recomputing one block in
backward. Recompute composes by reading the graph the ``recompute`` pass left: a recompute
region keeps its inputs (the cost model's rule) and its sub-graph's saved tensors are the
transient; tensors a selective region caches are not counted yet. Sizes are the captured
example's: one microbatch.

Zero-bubble release (zbv, dualpipev): torch's input backward (``stage_backward_input``) runs
``autograd.grad(retain_graph=True)`` and the weight backward re-runs only the nodes between the
weights and the parameter groups' intermediates, so a node on the input-gradient path alone
(activation, softmax, elementwise) keeps its saved tensors after both have run, until its
autograd graph is destroyed. torch drops its own references at W (the stage outputs and loss are
detached, the backward state popped), so the prediction holds only while the runtime keeps no
tensor attached to a finished microbatch's graph: the stage modules keep their aux outputs
detached (attached, they kept 118 KB of the previous microbatch alive through the next forward
on the last stage at the test shape, 1.28x the prediction).

Preconditions: the plan is splittable, else :class:`~moec.plan.PlanError` naming the field
(``parallel.pp`` when ``pp * v`` exceeds the blocks, ``parallel.virtual_stages`` for V-shaped or
interleaved schedules without 2+ stages per rank, ``parallel.microbatches`` when fewer than the
schedule needs); a parameter read by two stages (tied embeddings) is an error naming it.

Options: ``plan.parallel`` (pp, virtual_stages, pp_schedule, microbatches), ``plan.recompute``;
``PipelinePass(verify_stages=False)`` skips the per-stage verifier (re-splits of a verified graph).
Statistics: ``stages``, ``blocks_per_stage``, ``minus_last_stage`` (mean blocks per stage minus
the last stage's), ``imbalance`` (max / mean stage FLOPs), ``stage_table`` (per stage: blocks,
flops, saved bytes per microbatch, in-flight microbatches, predicted peak activation bytes,
params, rank), ``params_removed``/``params_added`` 0. Invariants: those of
:mod:`moec.passes.rewrite` on the full graph and on every stage (each is verified); the stages'
parameters partition the graph's.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from moec.analysis.cost import CostTotals, GraphCost, graph_cost, nbytes, node_cost
from moec.analysis.structure import module_path
from moec.frontend import GraphSignature, signature
from moec.passes.manager import PassContext, PassResult
from moec.plan import ParallelPlan, Plan, PlanError

aten = torch.ops.aten

CE_FLOPS_PER_LOGIT = 6
"""Cross-entropy on the last stage: max, subtract, exp, sum, log, gather per logit."""

V_SHAPED = ("zbv", "dualpipev")
MULTI_STAGE = ("interleaved_1f1b", *V_SHAPED)


class PipelinePassError(RuntimeError):
    """The graph cannot be split; the message names the node or parameter that stopped it."""


@dataclasses.dataclass
class StageInfo:
    index: int
    rank: int
    """Pipeline rank holding the stage (loop placement, or V-shaped for zbv/dualpipev)."""
    blocks: list[str]
    """Module paths of the blocks in this stage."""
    inputs: list[str]
    """Names (in the full graph) of the values the stage receives."""
    outputs: list[str]
    """Names of the values it sends on (the last stage: the user outputs)."""
    aux_outputs: list[tuple[str, str]]
    flops: int
    saved_bytes: int
    """Activation bytes kept per microbatch between its forward and backward (a recompute
    region keeps its inputs)."""
    transient_bytes: int
    """Bytes live only while one block is recomputed in backward (recompute regions), else 0."""
    in_flight: int
    """Microbatches whose activations the stage holds at its peak under the schedule."""
    params: int

    @property
    def peak_activation_bytes(self) -> int:
        return self.in_flight * self.saved_bytes + self.transient_bytes


@dataclasses.dataclass
class PipelineSplit:
    """What the runtime needs: the stage graphs and their placement."""

    stages: list[fx.GraphModule]
    info: list[StageInfo]
    pp: int
    virtual_stages: int
    schedule: str
    microbatches: int
    freed: dict[str, int] | None = None
    """Set by the runtime once this rank keeps only its own stages' parameters: the name and
    stage of every parameter it freed. None while every stage's parameters are present."""

    def local_stages(self, pp_rank: int) -> list[int]:
        """Stage indices held by ``pp_rank``, in increasing order."""
        return [s.index for s in self.info if s.rank == pp_rank]


class PipelinePass:
    name = "pipeline"

    def __init__(self, verify_stages: bool = True):
        # the verifier's fake propagation of every stage is most of the pass's time
        self.verify_stages = verify_stages

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        old = gm.meta.get("moec_pipeline")
        if old is not None and old.freed:
            name, stage = next(iter(old.freed.items()))
            raise PipelinePassError(
                f"cannot split again: this rank freed the parameters of the stages it does not "
                f"run (e.g. {name!r} of stage {stage}) when its pipeline runtime was built; "
                "compile the model again for another split"
            )
        plan = ctx.plan
        cost = graph_cost(gm)
        units = _units(gm, cost)
        num_stages = plan.parallel.pp * plan.parallel.virtual_stages
        check_splittable(plan.parallel, len(units))
        values = cost.sizes()
        flops, saved = unit_costs(gm, cost, units)
        in_flight = inflight_microbatches(plan.parallel)
        bounds = balance(flops, saved, num_stages, in_flight)
        split = _build(gm, cost, units, bounds, plan, in_flight, values, self.verify_stages)
        gm.meta["moec_pipeline"] = split
        return PassResult(gm, True, _stats(split))


# --- legality ----------------------------------------------------------------------------------


def check_splittable(p: ParallelPlan, num_blocks: int) -> None:
    """Raise :class:`PlanError` naming the field when ``p`` cannot split ``num_blocks`` blocks."""
    stages = p.pp * p.virtual_stages
    if stages > num_blocks:
        raise PlanError(
            "parallel.pp",
            p.pp,
            f"pp * virtual_stages = {stages} stages but the model has {num_blocks} blocks; "
            "use at most one stage per block",
        )
    if p.pp_schedule in V_SHAPED and p.virtual_stages != 2:
        raise PlanError(
            "parallel.virtual_stages",
            p.virtual_stages,
            f"2 for the V-shaped schedule {p.pp_schedule!r}",
        )
    if p.pp_schedule == "interleaved_1f1b" and p.virtual_stages < 2:
        raise PlanError(
            "parallel.virtual_stages", p.virtual_stages, "2 or more for interleaved_1f1b"
        )
    if p.pp_schedule in ("gpipe", "1f1b") and p.virtual_stages != 1:
        raise PlanError("parallel.virtual_stages", p.virtual_stages, f"1 for {p.pp_schedule!r}")
    need = 2 * p.pp if p.pp_schedule == "dualpipev" else p.pp
    if p.microbatches < need:
        raise PlanError(
            "parallel.microbatches",
            p.microbatches,
            f"at least {need} for {p.pp_schedule!r} with pp={p.pp}",
        )


# --- units: one residual block each ------------------------------------------------------------


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _data_dependent(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value depends on input data (not only on parameters, buffers and sizes)."""
    dependent: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            dependent.add(node)
        elif node.op == "call_function" and node.target is not aten.sym_size.int:
            if any(a in dependent for a in node.all_input_nodes):
                dependent.add(node)
    return dependent


def _units(gm: fx.GraphModule, cost: GraphCost) -> list[list[fx.Node]]:
    """The data-dependent compute nodes of each block, prologue and epilogue merged in."""
    dependent = _data_dependent(gm)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n in dependent]
    ends = []
    for path in _block_paths(gm, cost):
        owned = [i for i, n in enumerate(nodes) if _under(module_path(n), path)]
        if not owned:
            raise PipelinePassError(f"block {path} has no compute nodes to split at")
        ends.append(owned[-1])
    if not ends:
        raise PipelinePassError("pipeline found no residual blocks (no FFN region) to split at")
    units, start = [], 0
    for end in ends:
        units.append(nodes[start : end + 1])
        start = end + 1
    units[-1] += nodes[start:]
    return units


def unit_costs(
    gm: fx.GraphModule, cost: GraphCost, units: list[list[fx.Node]]
) -> tuple[list[int], list[tuple[int, int]]]:
    """Per block (prologue/epilogue and loss included): forward FLOPs and (kept, transient)
    saved bytes per microbatch, at the example sizes."""
    values = cost.sizes()
    flops = [cost.value(CostTotals.of(cost.nodes, u).flops) for u in units]
    flops[-1] += cost.value(_loss_flops(gm))
    return flops, [_saved(cost, u, values) for u in units]


def block_units(gm: fx.GraphModule) -> tuple[GraphCost, list[list[fx.Node]]]:
    """The cost model of ``gm`` and its blocks' nodes, as the pass splits them."""
    cost = graph_cost(gm)
    return cost, _units(gm, cost)


def _block_paths(gm: fx.GraphModule, cost: GraphCost) -> list[str]:
    """Residual blocks in graph order: the cost model's, and the blocks the ``recompute`` pass
    moved into regions (whose FFNs the structure finder can no longer see)."""
    first: dict[str, int] = {}
    paths = {b.path for b in cost.blocks}
    paths |= {module_path(n) for n in gm.graph.nodes if region_graph(n) is not None}
    for i, node in enumerate(gm.graph.nodes):
        path = module_path(node)
        for p in paths:
            if _under(path, p):
                first.setdefault(p, i)
    return sorted(first, key=first.__getitem__)


def region_graph(node: fx.Node) -> fx.GraphModule | None:
    """The sub-graph a ``recompute_region`` call runs (its first argument), else None."""
    first = node.args[0] if node.op == "call_function" and node.args else None
    if not (isinstance(first, fx.Node) and first.op == "get_attr"):
        return None
    sub = node.graph.owning_module
    for part in str(first.target).split("."):
        sub = getattr(sub, part, None)
    return sub if isinstance(sub, fx.GraphModule) else None


def _loss_flops(gm: fx.GraphModule) -> sympy.Expr:
    outputs = gm.graph.output_node().args[0][: signature(gm).num_user_outputs]
    val = outputs[0].meta.get("val") if outputs and isinstance(outputs[0], fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return sympy.Integer(0)
    return CE_FLOPS_PER_LOGIT * (nbytes(val) / val.element_size())


def _saved(cost: GraphCost, unit: list[fx.Node], values: dict) -> tuple[int, int]:
    """(bytes kept per microbatch between forward and backward, transient bytes): a recompute
    region keeps its inputs (the cost model's rule) and, while recomputed in backward,
    materialises what its sub-graph saves."""
    kept = evaluate(CostTotals.of(cost.nodes, unit).saved_bytes, values)
    return kept, max((_region_saved(n, values) for n in unit), default=0)


def _region_saved(node: fx.Node, values: dict) -> int:
    sub = region_graph(node)
    if sub is None:
        return 0
    costs = {n: node_cost(n) for n in sub.graph.nodes}
    return evaluate(CostTotals.of(costs, sub.graph.nodes).saved_bytes, values)


def evaluate(expr: Any, values: dict) -> int:
    return int(sympy.sympify(expr).xreplace({s: sympy.Integer(v) for s, v in values.items()}))


# --- schedule-derived in-flight microbatches ---------------------------------------------------


def stage_rank(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank holding ``stage``: loop placement, or V-shaped (0..pp-1, pp-1..0)."""
    if schedule in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def inflight_microbatches(p: ParallelPlan) -> list[int]:
    """Per stage, the most microbatches whose saved activations it holds at once.

    GPipe holds all of them, 1F1B ``pp - rank``. Multi-stage schedules replay each rank's
    action order as torch's schedule computes it: F adds one; B (full backward) or W (weight
    backward, after which the retained graph is freed) removes one.
    """
    if p.pp_schedule == "gpipe":
        return [p.microbatches] * p.pp
    if p.pp_schedule == "1f1b":  # warmup of pp - rank forwards, then one backward per forward
        return [min(p.microbatches, p.pp - rank) for rank in range(p.pp)]
    try:
        order = _pipeline_order(p)
    except AttributeError:  # another torch's planner needs other state: all in flight (bound)
        return [p.microbatches] * (p.pp * p.virtual_stages)
    peak = [0] * (p.pp * p.virtual_stages)
    for actions in order.values():
        live = [0] * len(peak)
        for action in _flatten(actions):
            kind = action.computation_type.name
            if kind == "FORWARD":
                live[action.stage_index] += 1
            elif kind in ("FULL_BACKWARD", "BACKWARD_WEIGHT"):
                live[action.stage_index] -= 1
            peak[action.stage_index] = max(peak[action.stage_index], live[action.stage_index])
    return peak


def _flatten(actions: list) -> list:
    flat = []
    for action in actions:
        if action is None:
            continue
        subs = getattr(action, "sub_actions", None)
        flat += list(subs) if subs else [action]
    return flat


def schedule_class(name: str) -> type:
    """The ``torch.distributed.pipelining`` schedule class for a plan's ``pp_schedule``."""
    from torch.distributed.pipelining import schedules

    names = {
        "gpipe": "ScheduleGPipe",
        "1f1b": "Schedule1F1B",
        "interleaved_1f1b": "ScheduleInterleaved1F1B",
        "zbv": "ScheduleZBVZeroBubble",
        "dualpipev": "ScheduleDualPipeV",
    }
    cls = getattr(schedules, names[name], None)
    if cls is None:
        raise PlanError(
            "parallel.pp_schedule",
            name,
            f"a schedule this torch {torch.__version__} provides ({names[name]} is missing)",
        )
    return cls


def _pipeline_order(p: ParallelPlan) -> dict[int, list]:
    """Every rank's action list, computed by the schedule class's own planner on a stand-in
    (no process group needed)."""
    cls = schedule_class(p.pp_schedule)
    stages = p.pp * p.virtual_stages
    microbatches_per_round = p.pp
    me = types.SimpleNamespace(
        pp_group_size=p.pp,
        _n_microbatches=p.microbatches,
        _num_stages=stages,
        num_stages=stages,
        n_local_stages=p.virtual_stages,
        microbatches_per_round=microbatches_per_round,
        number_of_rounds=max(1, p.microbatches // microbatches_per_round),
    )
    order = {}
    for rank in range(p.pp):
        me.rank = rank
        order[rank] = cls._calculate_single_rank_operations(me, rank)
    return order


# --- balance -----------------------------------------------------------------------------------


def balance(
    flops: list[int], saved: list[tuple[int, int]], num_stages: int, in_flight: list[int]
) -> list[int]:
    """Start index of every stage (contiguous blocks) minimising (max stage FLOPs, max stage
    predicted activation bytes), by dynamic programming over prefixes."""
    n = len(flops)
    prefix = [0]
    for f in flops:
        prefix.append(prefix[-1] + f)

    def stage_cost(s: int, i: int, j: int) -> tuple[int, int]:
        kept = sum(k for k, _ in saved[i:j])
        transient = max(t for _, t in saved[i:j])
        return prefix[j] - prefix[i], in_flight[s] * kept + transient

    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0, 0)
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf:
                    continue
                f, m = stage_cost(s - 1, i, j)
                cand = (max(best[s - 1][i][0], f), max(best[s - 1][i][1], m))
                if cand < best[s][j]:
                    best[s][j], choice[s][j] = cand, i
    starts, j = [], n
    for s in range(num_stages, 0, -1):
        j = choice[s][j]
        starts.append(j)
    return starts[::-1]


# --- stage graphs ------------------------------------------------------------------------------


def _build(
    gm: fx.GraphModule,
    cost: GraphCost,
    units: list[list[fx.Node]],
    starts: list[int],
    plan: Plan,
    in_flight: list[int],
    values: dict,
    verify: bool,
) -> PipelineSplit:
    p = plan.parallel
    num_stages = len(starts)
    ends = starts[1:] + [len(units)]
    paths = _block_paths(gm, cost)
    stage_of: dict[fx.Node, int] = {}
    for s, (i, j) in enumerate(zip(starts, ends, strict=True)):
        for unit in units[i:j]:
            stage_of.update(dict.fromkeys(unit, s))
    for node in gm.graph.find_nodes(op="placeholder"):
        stage_of[node] = -1  # defined before stage 0: stage 0's inputs
    sig = signature(gm)
    outputs = list(gm.graph.output_node().args[0])
    user_outputs, aux = outputs[: sig.num_user_outputs], outputs[sig.num_user_outputs :]
    last_use = _last_use(gm, stage_of, user_outputs, num_stages)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    live = [
        sorted(
            (n for n in stage_of if stage_of[n] < s <= last_use.get(n, -1)), key=order.__getitem__
        )
        for s in range(num_stages + 1)
    ]
    live[0] = list(gm.graph.find_nodes(op="placeholder"))
    stages, infos = [], []
    owners: dict[str, int] = {}
    for s in range(num_stages):
        mine = [n for n in gm.graph.nodes if stage_of.get(n) == s]
        stage_aux = [
            (a, key) for a, key in zip(aux, sig.aux_outputs, strict=True) if stage_of.get(a) == s
        ]
        sends = user_outputs if s == num_stages - 1 else live[s + 1]
        stage = _stage_graph(gm, s, live[s], mine, sends, stage_aux, set(stage_of), verify)
        for name, _ in stage.named_parameters():
            if owners.setdefault(name, s) != s:
                raise PipelinePassError(
                    f"parameter {name!r} is read by stages {owners[name]} and {s} (tied "
                    "weights?); untie it (e.g. tie_embeddings=False) to pipeline this model"
                )
        stages.append(stage)
        blocks = paths[starts[s] : ends[s]]
        kept = evaluate(CostTotals.of(cost.nodes, mine).saved_bytes, values)
        transient = max(_saved(cost, u, values)[1] for u in units[starts[s] : ends[s]])
        infos.append(
            StageInfo(
                index=s,
                rank=stage_rank(s, p.pp, p.pp_schedule),
                blocks=blocks,
                inputs=[n.name for n in live[s]],
                outputs=[n.name for n in sends],
                aux_outputs=[key for _, key in stage_aux],
                flops=evaluate(CostTotals.of(cost.nodes, mine).flops, values)
                + (evaluate(_loss_flops(gm), values) if s == num_stages - 1 else 0),
                saved_bytes=kept,
                transient_bytes=transient,
                in_flight=in_flight[s],
                params=sum(p.numel() for p in stage.parameters()),
            )
        )
    return PipelineSplit(stages, infos, p.pp, p.virtual_stages, p.pp_schedule, p.microbatches)


def _last_use(
    gm: fx.GraphModule, stage_of: dict[fx.Node, int], user_outputs: list, num_stages: int
) -> dict[fx.Node, int]:
    """The last stage that reads each staged value (user outputs count for the last stage)."""
    last: dict[fx.Node, int] = {}
    for node, s in stage_of.items():
        readers = [stage_of[u] for u in node.users if u in stage_of]
        if node in user_outputs:
            readers.append(num_stages - 1)
        last[node] = max(readers, default=s)
    return last


def _stage_graph(
    gm: fx.GraphModule,
    index: int,
    inputs: list[fx.Node],
    mine: list[fx.Node],
    sends: list[fx.Node],
    aux: list[tuple[fx.Node, tuple[str, str]]],
    staged: set[fx.Node],
    verify: bool,
) -> fx.GraphModule:
    """The stage's graph: ``inputs`` as placeholders, its own ``mine`` nodes, data-independent
    nodes (``staged`` are the data-dependent ones of every stage) recomputed where read."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)

    def lookup(arg: fx.Node) -> fx.Node | int:
        if arg in env:
            return env[arg]
        if arg.op == "get_attr":
            new = graph.get_attr(arg.target)
            new.meta = dict(arg.meta)
        elif arg.op == "call_function" and arg.target is aten.sym_size.int:
            new = _size_from_inputs(graph, arg, inputs, env, index)
        elif arg.op == "call_function" and arg not in staged:
            new = graph.node_copy(arg, lookup)
        else:
            raise PipelinePassError(
                f"stage {index}: {arg.name} ({arg.target}) is computed in another stage but "
                "was not sent to this one"
            )
        env[arg] = new
        return new

    for node in mine:
        env[node] = graph.node_copy(node, lookup)
    outs = [lookup(n) for n in sends] + [env[a] for a, _ in aux]
    graph.output(tuple(outs))
    stage = fx.GraphModule(gm, graph, class_name=f"PipelineStage{index}")
    _stage_meta(gm, stage, len(inputs), len(sends), [key for _, key in aux], index)
    stage.graph.lint()
    if verify:
        from moec.passes.verify import verify_graph

        verify_graph(stage, f"pipeline (stage {index})")
    return stage


def _size_from_inputs(
    graph: fx.Graph, node: fx.Node, inputs: list[fx.Node], env: dict, index: int
) -> fx.Node | int:
    """``sym_size`` of the same symbol, read from one of this stage's own inputs; a size the
    capture specialized (its value is an int) is that int."""
    source, dim = node.args
    if source in env:
        new = graph.call_function(aten.sym_size.int, (env[source], dim))
        new.meta = dict(node.meta)
        return new
    want = node.meta["val"]
    if is_concrete_int(want):  # an int, or a symbol a guard pinned to one value
        return int(want)
    for inp in inputs:
        val = inp.meta.get("val")
        for d, size in enumerate(getattr(val, "shape", ())):
            if isinstance(size, torch.SymInt) and str(size) == str(want):
                new = graph.call_function(aten.sym_size.int, (env[inp], d))
                new.meta = dict(node.meta)
                return new
    raise PipelinePassError(
        f"stage {index}: size {node.name} = {want} of {source.name} cannot be read from the "
        f"stage's inputs {[n.name for n in inputs]}"
    )


def _stage_meta(
    gm: fx.GraphModule, stage: fx.GraphModule, n_in: int, n_out: int, aux: list, index: int
) -> None:
    names = {name for name, _ in stage.named_parameters()}
    roles = gm.meta.get("moec_param_roles", {})
    stage.meta["moec_param_roles"] = {k: v for k, v in roles.items() if k in names}
    stage.meta["moec_moe_layers"] = [
        m for m in gm.meta.get("moec_moe_layers", []) if any(_under(n, m.path) for n in names)
    ]
    stage.meta["moec_signature"] = GraphSignature(
        pytree.tree_flatten(((0,) * n_in, {}))[1],
        pytree.tree_flatten((0,) * n_out)[1],
        n_out,
        list(aux),
    )
    stage.meta["moec_stage"] = index
    copies = gm.meta.get("moec_working_weights", {})
    stage.meta["moec_working_weights"] = {b: ps for b, ps in copies.items() if hasattr(stage, b)}
    for buffer in stage.meta["moec_working_weights"]:  # GraphModule copied it as persistent
        stage.register_buffer(buffer, stage.get_buffer(buffer), persistent=False)


# --- statistics --------------------------------------------------------------------------------


def _stats(split: PipelineSplit) -> dict[str, Any]:
    info = split.info
    flops = [s.flops for s in info]
    mean_flops = sum(flops) / len(flops)
    blocks = [len(s.blocks) for s in info]
    return {
        "stages": len(info),
        "schedule": split.schedule,
        "blocks_per_stage": blocks,
        "minus_last_stage": round(sum(blocks) / len(blocks) - blocks[-1], 3),
        "imbalance": round(max(flops) / mean_flops, 4),
        "stage_table": [stage_row(s) for s in info],
        "params_added": 0,
        "params_removed": 0,
    }


def stage_row(s: StageInfo) -> dict[str, Any]:
    return {
        "stage": s.index,
        "rank": s.rank,
        "blocks": f"{s.blocks[0]}..{s.blocks[-1]}" if len(s.blocks) > 1 else s.blocks[0],
        "flops": s.flops,
        "saved_bytes_per_mb": s.saved_bytes,
        "in_flight": s.in_flight,
        "peak_activation_bytes": s.peak_activation_bytes,
        "params": s.params,
    }


def format_stage_table(split: PipelineSplit) -> str:
    """The stage cost table as aligned text (``moec debug`` prints the stats' rows)."""
    from moec.analysis.cost import format_count

    head = f"{'stage':>5} {'rank':>4} {'blocks':<24} {'flops':>8} {'saved/mb':>9} {'in-flt':>6} "
    lines = [head + f"{'peak act':>9} {'params':>8}"]
    for s in split.info:
        row = stage_row(s)
        lines.append(
            f"{s.index:>5} {s.rank:>4} {row['blocks']:<24} {format_count(s.flops):>8} "
            f"{format_count(s.saved_bytes):>9} {s.in_flight:>6} "
            f"{format_count(s.peak_activation_bytes):>9} {format_count(s.params):>8}"
        )
    return "\n".join(lines)
