"""Stage graphs: the full graph cut into ``S`` ``fx.GraphModule`` stages at unit boundaries.

Stage s holds the units ``[starts[s], starts[s+1])`` (:mod:`~moec.passes.pipeline.units`:
blocks or half blocks).
Values crossing a boundary become stage outputs and the next stage's inputs (threaded through
intermediate stages when used further on); stage 0 receives the graph's inputs and the last
stage sends the user outputs. A later stage that reads a graph input itself (the targets of a
program that computes its loss, e.g. ``moec::linear_cross_entropy`` in the last stage) takes it
as a trailing input after the values it receives: the runtime hands graph inputs to the stages
that read them (torch's schedules pass keyword inputs to every stage), so they are never sent
from stage to stage. Nodes that depend on no input data (``sym_size``, slices of
buffers such as RoPE tables) are recomputed in every stage that reads them, with sizes re-read
from the stage's own inputs; parameters live in the one stage that reads them (a parameter read
by two stages, e.g. tied embeddings, is a :class:`PipelinePassError` naming it). Aux outputs
(router losses, expert counts/offsets, EP drops) stay with the stage that makes them, after its
boundary outputs.

Each stage is a :class:`moec.program.Program` of its own (``Program.stage``): the roles, MoE
layers and working-weight copies (kept non-persistent) of its parameters and buffers, a
positional signature and its index.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from moec.analysis.cost import CostTotals, GraphCost
from moec.analysis.pipeline_schedule import stage_rank
from moec.fx import evaluate, node_order, parameter_count, placeholders_for
from moec.passes.pipeline.errors import PipelinePassError
from moec.passes.pipeline.units import loss_flops, unit_saved_bytes
from moec.passes.verify import verify_graph
from moec.plan import Plan
from moec.program import GraphSignature, Pipeline, Program, StageInfo

aten = torch.ops.aten


def _names_of(gm: fx.GraphModule, name: str) -> str:
    """Every name of parameter ``name`` (a tied one has several), quoted."""
    param = gm.get_parameter(name)
    names = [n for n, p in gm.named_parameters(remove_duplicate=False) if p is param]
    return " = ".join(map(repr, names))


def build_split(
    program: Program,
    cost: GraphCost,
    units: list[list[fx.Node]],
    names: list[str],
    seconds: list[float],
    starts: list[int],
    plan: Plan,
    in_flight: list[int],
    verify: bool,
) -> Pipeline:
    """The stage programs of ``units`` (named ``names``, ``seconds`` of predicted forward each)
    split at ``starts``, with their placement and costs at the example sizes; ``verify`` runs
    the verifier on every stage."""
    gm, sig = program.graph, program.signature
    p = plan.parallel
    values = cost.sizes()
    num_stages = len(starts)
    ends = starts[1:] + [len(units)]
    stage_of: dict[fx.Node, int] = {}
    for s, (i, j) in enumerate(zip(starts, ends, strict=True)):
        for unit in units[i:j]:
            stage_of.update(dict.fromkeys(unit, s))
    for node in gm.graph.find_nodes(op="placeholder"):
        stage_of[node] = -1  # defined before stage 0: stage 0's inputs
    outputs = list(gm.graph.output_node().args[0])
    user_outputs, aux = outputs[: sig.num_user_outputs], outputs[sig.num_user_outputs :]
    last_use = _last_use(stage_of, user_outputs, num_stages)
    order = node_order(gm.graph)
    live = [
        sorted(
            (n for n in stage_of if stage_of[n] < s <= last_use.get(n, -1)), key=order.__getitem__
        )
        for s in range(num_stages + 1)
    ]
    graph_inputs = list(gm.graph.find_nodes(op="placeholder"))
    live = [[n for n in values if n.op != "placeholder"] for values in live]  # never sent
    live[0] = graph_inputs
    stages, infos = [], []
    owners: dict[str, int] = {}
    for s in range(num_stages):
        mine = [n for n in gm.graph.nodes if stage_of.get(n) == s]
        stage_aux = [
            (a, key) for a, key in zip(aux, sig.aux_outputs, strict=True) if stage_of.get(a) == s
        ]
        sends = user_outputs if s == num_stages - 1 else live[s + 1]
        reads = {a for n in mine for a in n.all_input_nodes}
        side = [] if s == 0 else [n for n in graph_inputs if n in reads]
        inputs = live[s] + side
        stage = _stage_program(program, s, inputs, mine, sends, stage_aux, set(stage_of))
        if verify:
            verify_graph(stage.graph, f"pipeline (stage {s})", stage.signature)
        for name, _ in stage.graph.named_parameters():
            if owners.setdefault(name, s) != s:
                raise PipelinePassError(
                    f"parameter {_names_of(gm, name)} is read by stages {owners[name]} and {s} "
                    "(tied weights?); untie it (e.g. tie_embeddings=False) to pipeline this model"
                )
        stages.append(stage)
        infos.append(
            StageInfo(
                index=s,
                rank=stage_rank(s, p.pp, p.pp_schedule),
                blocks=names[starts[s] : ends[s]],
                inputs=[n.name for n in inputs],
                outputs=[n.name for n in sends],
                aux_outputs=[key for _, key in stage_aux],
                flops=evaluate(CostTotals.of(cost.nodes, mine).flops, values)
                + (evaluate(loss_flops(gm), values) if s == num_stages - 1 else 0),
                saved_bytes=evaluate(CostTotals.of(cost.nodes, mine).saved_bytes, values),
                transient_bytes=max(
                    unit_saved_bytes(cost, u, values)[1] for u in units[starts[s] : ends[s]]
                ),
                in_flight=in_flight[s],
                params=parameter_count(stage.graph),
                forward_s=sum(seconds[starts[s] : ends[s]]),
            )
        )
    return Pipeline(stages, infos, p.pp, p.virtual_stages, p.pp_schedule, p.microbatches)


def _last_use(
    stage_of: dict[fx.Node, int], user_outputs: list, num_stages: int
) -> dict[fx.Node, int]:
    """The last stage that reads each staged value (user outputs count for the last stage)."""
    last: dict[fx.Node, int] = {}
    for node, s in stage_of.items():
        readers = [stage_of[u] for u in node.users if u in stage_of]
        if node in user_outputs:
            readers.append(num_stages - 1)
        last[node] = max(readers, default=s)
    return last


def _stage_program(
    program: Program,
    index: int,
    inputs: list[fx.Node],
    mine: list[fx.Node],
    sends: list[fx.Node],
    aux: list[tuple[fx.Node, tuple[str, str]]],
    staged: set[fx.Node],
) -> Program:
    """The stage's program: ``inputs`` as placeholders, its own ``mine`` nodes, data-independent
    nodes (``staged`` are the data-dependent ones of every stage) recomputed where read."""
    graph = fx.Graph()
    env = placeholders_for(graph, inputs)

    def lookup(arg: fx.Node) -> fx.Node | int:
        if arg in env:
            return env[arg]
        if arg.op == "get_attr":
            new = graph.get_attr(arg.target)
            new.meta = dict(arg.meta)
        elif arg.op == "call_function" and arg.target is aten.sym_size.int:
            new = size_from_inputs(graph, arg, inputs, env, index)
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
    stage = fx.GraphModule(program.graph, graph, class_name=f"PipelineStage{index}")
    stage.graph.lint()
    signature = GraphSignature.positional(len(inputs), len(sends), [key for _, key in aux])
    result = program.stage(stage, signature, index)
    for buffer in result.working_weights:  # GraphModule copied it as persistent
        stage.register_buffer(buffer, stage.get_buffer(buffer), persistent=False)
    return result


def size_from_inputs(
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
