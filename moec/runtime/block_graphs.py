"""Compiling what repeats once: the lowered program cut at its residual blocks, and each
distinct block graph compiled once for every block that is the same computation.

Inductor's time grows with the graph it is given. A program of eight identical blocks compiled
whole is compiled as eight blocks; compiled block by block, with a block's parameters as inputs
of its graph rather than attributes, the eight calls are one ``torch.compile`` callable whose
guards (the inputs' shapes, dtypes, strides and ``requires_grad``) hold for all of them, so
Dynamo, AOTAutograd and Inductor run once (torchtitan compiles per block the same way).

:func:`partition` cuts a graph (the one :mod:`moec.runtime.lowering` compiles, its working
copies lifted to inputs) into **segments** in graph order: each residual block
(:func:`program_blocks`, the module paths of :func:`moec.analysis.cost.model.block_paths`: its
nodes, the recompute region's call included, and any node of no block between its first and
last node) and the **glue** between them (the embedding and what reads only the inputs before
the first block; the final norm, LM head and loss after the last). A segment is a graph of its
own whose placeholders are the values it reads: the graph's inputs, the parameters and buffers
(read from the program's tables at every call, so ``.to()`` and FSDP's swaps are seen) and the
values earlier segments made (tensors and sizes); a recompute region stays a sub-graph the
segment calls. A node of no block inside a block's span that reads no data (a size, a slice of
a RoPE table) runs in the glue before the block: a pipeline stage recomputes such values where
its first block reads them (:mod:`moec.passes.pipeline`), and the block keys the same as the
blocks that read them as inputs.

A pipeline stage (:mod:`moec.runtime.pipeline`) is cut the same way, at the blocks its pipeline
rank holds (:func:`stage_blocks`: its whole blocks and half blocks), and one compiled callable
serves every block of a key in all the rank's stages (two stages per rank under the
interleaved and V-shaped schedules); the stage's sends and receives run outside its graph.

Each block is compiled (``torch.compile``, one callable per distinct block graph); the glue
runs eagerly. Its work is the embedding's gather, the final norm and moec's LM-head loss:
compiling it would add two Inductor graphs (a forward and a backward each) to fuse one norm,
and each graph has a fixed cost (on the CPU, a C++ build) that measured more than what the
glue's fusion saves in a step. (A tiny Llama of 8 blocks, 1 dense then 7 MoE, on 2 CPU cores:
its first step took 103 s compiled whole, 80 s per block with the glue compiled, 64 s with
the glue eager.)

Each segment has a **structural key**: its nodes in order, each one's op, target and arguments
(nodes by position, constants by value: the bound ``impl`` of every ``moec::`` op, casts'
dtypes, dropout rates, the recompute level, the EP group's name), its inputs' shapes, dtypes,
strides and ``requires_grad`` (from their ``meta["val"]``; a parameter's or buffer's from
itself), and a recompute region's graph by its own key. Two segments
of equal key compute the same function of their inputs: :class:`BlockProgram` compiles the
first block of a key and calls that one compiled graph for every block of the key. So blocks
share a graph exactly where the plan makes them the same: same shapes, same precision scope,
same recompute policy, same bound implementations. A dense block and an MoE block differ, as
do blocks whose recompute levels differ (``recompute.policy: budget`` chooses per block); a
tensor attribute a block's graph reads (other than its parameters and buffers) or a constant
that is not a plain value makes its key its own. The compiled callable's guards check every
call's actual inputs, so an input the key misjudges (one without ``meta["val"]``, as the
profiler's block markers) costs a recompile, never a wrong result.

Where the program (or stage) is not cut (:class:`Whole`, its ``reason`` printed by ``moec
debug``, one line per stage):

- fewer than two blocks (in a pipeline, on the stage's rank): nothing repeats;
- nodes without module paths (a graph rebuilt from its code, e.g. unpickled): the blocks
  cannot be told apart;
- blocks whose nodes interleave (a node of one block between two nodes of another).

A user's own ``torch.compile`` around the compiled model traces the graph whole, with the
rest of its ``forward``. EP exchanges and the ``overlap`` pass's two-batch interleaving stay
inside their block, and ``experimental.cuda_graph`` captures the step around the compiled
segments: neither prevents the cut. A zero-bubble schedule's split backward does not either,
but a compiled block's backward is one autograd node, which its weight pass runs a second time
(``lowering.inductor: auto`` leaves those stages eager).

The alternative, each block compiled on its own as a graph of the same code, leaves the
sharing to Inductor's FX graph cache: it finds the repeated blocks' graphs, but Dynamo and
AOTAutograd still trace every block and every lookup is paid (the same Llama at 4 blocks: 87 s
against 70 s shared, 54 s whole, the glue compiled in both): one callable per key is cheaper.

What a cut costs in the step: no fusion across a boundary (the residual add of one block and
the norm of the next are two kernels instead of one), the glue's ops run one by one, and a
guard check per block call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from moec.fx import external_inputs, module_path, owning_path
from moec.program import Pipeline, Program

Compile = Callable[[fx.GraphModule], Callable[..., Any]]
"""What turns a segment's graph into the callable that runs it (``torch.compile`` of it)."""


def program_blocks(program: Program) -> list[str]:
    """Module paths of ``program``'s residual blocks in graph order
    (:func:`moec.analysis.cost.model.block_paths`); none for a graph whose nodes carry no
    meta (rebuilt from its code: the cost model needs their values)."""
    from moec.analysis.cost import graph_cost
    from moec.analysis.cost.model import block_paths

    if not any(module_path(n) for n in program.graph.graph.nodes):
        return []
    return block_paths(program.graph, graph_cost(program))


def stage_blocks(pipeline: Pipeline, stages: Sequence[int]) -> list[str]:
    """Module paths of the blocks whose nodes ``stages`` of ``pipeline`` hold (a half block's
    too: :attr:`moec.program.StageInfo.block_paths`), in stage order, each once: what the
    stage graphs of one pipeline rank are cut at, so that a block repeated in any of them is
    compiled once for all."""
    paths = (path for s in stages for path in pipeline.info[s].block_paths)
    return list(dict.fromkeys(paths))


@dataclasses.dataclass(frozen=True)
class Whole:
    """The graph is compiled whole, and why."""

    reason: str

    def describe(self) -> str:
        return f"Inductor compiles the program whole: {self.reason}"


@dataclasses.dataclass
class Segment:
    """A run of the graph's nodes compiled as one graph."""

    name: str
    """The block's module path, or ``prologue``/``epilogue``/``glue after <block>``."""
    block: bool
    graph: fx.GraphModule
    """The segment's nodes; one placeholder per value of ``inputs``, in order; returns the
    values of ``outputs`` as a tuple."""
    inputs: list[fx.Node]
    """The nodes of the whole graph whose values the segment reads."""
    outputs: list[fx.Node]
    """The nodes of the whole graph it makes that later segments or the output read."""
    key: tuple
    """Equal keys: the same function of the inputs (see the module)."""


@dataclasses.dataclass
class Partition:
    """A graph cut into segments (see the module)."""

    segments: list[Segment]

    def groups(self) -> dict[tuple, list[Segment]]:
        """The segments by key, in graph order of their first."""
        groups: dict[tuple, list[Segment]] = {}
        for segment in self.segments:
            groups.setdefault(segment.key, []).append(segment)
        return groups

    def describe(self) -> str:
        """Which blocks share a compiled graph (one line per distinct graph) and which glue
        runs eagerly."""
        groups = [g for g in self.groups().values() if g[0].block]
        blocks = sum(len(g) for g in groups)
        glue = [s.name for s in self.segments if not s.block]
        lines = [
            f"Inductor compiles the program per block: {blocks} blocks, {len(groups)} distinct "
            f"block graphs compiled once each; eager glue: {', '.join(glue) or 'none'}"
        ]
        for group in groups:
            digest = hashlib.sha1(repr(group[0].key).encode()).hexdigest()[:8]
            names = ", ".join(s.name for s in group)
            nodes = len(group[0].graph.graph.nodes)
            lines.append(f"  block graph {digest} ({nodes} nodes): {names}")
        return "\n".join(lines)


def partition(graph: fx.GraphModule, blocks: Sequence[str]) -> Partition | Whole:
    """``graph`` cut at its ``blocks`` (module paths, see the module), or why it is not."""
    nodes = [n for n in graph.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    if not any(module_path(n) for n in nodes):
        return Whole(
            "no node carries a module path (a graph rebuilt from its code, e.g. unpickled, has "
            "none), so its blocks cannot be told apart"
        )
    if len(blocks) < 2:
        return Whole(f"the program has {len(blocks)} residual block(s): nothing repeats")
    owners = [owning_path(module_path(n), set(blocks)) for n in nodes]
    if not any(owners):
        return Whole(f"no node runs under the blocks' module paths ({', '.join(blocks)})")
    runs = _runs(nodes, owners, _data_free(graph.graph))
    if isinstance(runs, Whole):
        return runs
    segments = []
    for i, (path, members) in enumerate(runs):
        name = path or _glue_name(runs, i)
        segments.append(_segment(graph, name, bool(path), members))
    return Partition(segments)


def _runs(
    nodes: list[fx.Node], owners: list[str | None], free: set[fx.Node]
) -> list[tuple[str, list]] | Whole:
    """The nodes in graph order as (block path, nodes) for each block's span (its first to its
    last node, the nodes of no block between them included, except those :func:`_hoisted`
    moves into the glue before it: ``free`` ones) and ("", nodes) for the glue between spans; a
    :class:`Whole` where two spans overlap."""
    span: dict[str, list[int]] = {}
    for i, owner in enumerate(owners):
        if owner is not None:
            span.setdefault(owner, [i, i])[1] = i
    ordered = sorted(span.items(), key=lambda item: item[1][0])
    for (first, (_, end)), (second, (start, _)) in zip(ordered, ordered[1:]):
        if start <= end:
            return Whole(
                f"blocks {first} and {second} interleave ({nodes[start].name} of {second} runs "
                f"before {nodes[end].name} of {first})"
            )
    runs: list[tuple[str, list]] = []
    at = 0
    for path, (start, end) in ordered:
        members = nodes[start : end + 1]
        hoisted = _hoisted(members, owners[start : end + 1], free)
        glue = nodes[at:start] + [n for n in members if n in hoisted]
        if glue:
            runs.append(("", glue))
        runs.append((path, [n for n in members if n not in hoisted]))
        at = end + 1
    if at < len(nodes):
        runs.append(("", nodes[at:]))
    return runs


def _hoisted(span: list[fx.Node], owners: list[str | None], free: set[fx.Node]) -> set[fx.Node]:
    """The nodes of no block in a block's ``span`` whose values are read and depend on no data
    (``free``: :func:`_data_free`) nor on anything else of the span. They run in the glue
    before the block, so that a block keys the same whether it computes them (a pipeline
    stage's first block, where the stage recomputes the values of this kind it reads:
    :mod:`moec.passes.pipeline`) or reads them as inputs (the blocks after it, and every block
    of an unsplit program, whose prologue computes them). A node whose value nothing reads runs
    for its effect (a profiler's range marker) and stays where it is."""
    inside = set(span)
    hoisted: set[fx.Node] = set()
    for node, owner in zip(span, owners, strict=True):
        if owner is not None or node not in free or not node.users:
            continue
        if all(a in hoisted for a in node.all_input_nodes if a in inside):
            hoisted.add(node)
    return hoisted


def _data_free(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose values depend on no input data: sizes (``sym_size``), parameters and
    buffers, and calls drawing no random numbers on such values alone (a RoPE table's slice)."""
    free: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr" or node.target is torch.ops.aten.sym_size.int:
            free.add(node)
        elif node.op == "call_function" and all(a in free for a in node.all_input_nodes):
            if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
                free.add(node)
    return free


def _glue_name(runs: list[tuple[str, list]], index: int) -> str:
    if index == 0:
        return "prologue"
    if index == len(runs) - 1:
        return "epilogue"
    return f"glue after {runs[index - 1][0]}"


def _segment(
    graph: fx.GraphModule,
    name: str,
    block: bool,
    members: list[fx.Node],
) -> Segment:
    """The segment of ``members`` (consecutive nodes of ``graph``)."""
    reads = external_inputs(members)
    inputs = [n for n in reads if not isinstance(_attribute(graph, n), fx.GraphModule)]
    inside = set(members)
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        env[node] = sub.placeholder(f"in_{i}")
        value = _attribute(graph, node) if node.op == "get_attr" else node.meta.get("val")
        env[node].meta["val"] = _on_meta(value) if node.op == "get_attr" else value
    for node in reads:
        if node not in env:  # a sub-graph the segment calls (a recompute region)
            env[node] = sub.get_attr(str(node.target))
    for node in members:
        env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(tuple(env[n] for n in outputs))
    module = fx.GraphModule(graph, sub, class_name="segment")
    return Segment(name, block, module, inputs, outputs, structural_key(module))


def _on_meta(value: Any) -> Any:
    """A tensor attribute's shape, strides, dtype and ``requires_grad`` without its storage
    (what its key needs; the segment reads the attribute itself at every call)."""
    if not isinstance(value, torch.Tensor):
        return value
    meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return meta.requires_grad_(value.requires_grad)


def _attribute(graph: fx.GraphModule, node: fx.Node) -> Any:
    """What a ``get_attr`` node reads (None for other nodes)."""
    return operator.attrgetter(str(node.target))(graph) if node.op == "get_attr" else None


# --- structural keys ---------------------------------------------------------------------------

PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout)
"""Constants a key holds by value."""


def structural_key(gm: fx.GraphModule) -> tuple:
    """What ``gm`` computes, as a hashable value: equal keys, the same function of inputs of
    the same kinds (see the module). Nodes are named by position; a tensor attribute or a
    constant of no plain type is keyed by its identity (so it is shared by no other graph)."""
    index: dict[fx.Node, int] = {}
    items: list[tuple] = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "placeholder":
            items.append(("input", _value_key(node.meta.get("val"))))
        elif node.op == "get_attr":
            items.append(("attr", _module_key(_attribute(gm, node))))
        else:
            target = _target_key(gm, node)
            items.append(
                (node.op, target, _arg_key(node.args, index), _arg_key(node.kwargs, index))
            )
    return tuple(items)


def _target_key(gm: fx.GraphModule, node: fx.Node) -> Any:
    """An ATen or ``moec::`` op by name, a called module by :func:`_module_key`, a Python
    function (``getitem``, ``recompute_region``) by identity."""
    if node.op == "call_module":
        return _module_key(gm.get_submodule(str(node.target)))
    if node.op == "call_function" and not isinstance(node.target, torch._ops.OpOverload):
        return ("fn", id(node.target))
    return _constant_key(node.target)


def _module_key(value: Any) -> tuple:
    """A sub-graph holding no tensor by its structure (a recompute region); anything else by
    its identity."""
    if isinstance(value, fx.GraphModule) and next(value.parameters(), None) is None:
        if next(value.buffers(), None) is None:
            return ("graph", structural_key(value))
    return ("object", id(value))


def _value_key(value: Any) -> tuple:
    """An input by what ``torch.compile`` guards on: a tensor's shape, strides, dtype, device
    and ``requires_grad``; a number's type and value."""
    if isinstance(value, torch.Tensor):
        sizes = tuple(str(s) for s in value.shape)
        strides = tuple(str(s) for s in value.stride())
        return ("tensor", sizes, strides, value.dtype, value.device.type, value.requires_grad)
    return ("value", type(value).__name__, str(value))


def _constant_key(value: Any) -> tuple:
    if isinstance(value, PLAIN) or isinstance(value, torch._ops.OpOverload):
        return (type(value).__name__, str(value) if isinstance(value, float) else value)
    return ("object", id(value))


def _arg_key(arg: Any, index: dict[fx.Node, int]) -> Any:
    if isinstance(arg, fx.Node):
        return ("node", index[arg])
    if isinstance(arg, (tuple, list)):
        return (type(arg).__name__, tuple(_arg_key(a, index) for a in arg))
    if isinstance(arg, dict):
        return ("dict", tuple((k, _arg_key(v, index)) for k, v in arg.items()))
    if isinstance(arg, slice):
        return ("slice", _arg_key((arg.start, arg.stop, arg.step), index))
    return _constant_key(arg)


# --- running -----------------------------------------------------------------------------------


class BlockProgram:
    """Runs a :class:`Partition` of ``lifted`` (a graph with ``graph``'s parameters and
    buffers, the one :mod:`moec.runtime.lowering` compiles) on ``lifted``'s inputs: each block
    through the callable ``compiled`` holds for its key, made by ``compile`` from the first
    block of that key (``compiled`` may be shared with other programs: a graph variant whose
    blocks are the same reuses them), the glue eagerly (see the module). Parameters and
    buffers are read from ``graph`` at every call."""

    def __init__(
        self,
        graph: fx.GraphModule,
        lifted: fx.GraphModule,
        cut: Partition,
        compiled: dict[tuple, Callable[..., Any]],
        compile: Compile,
    ) -> None:
        self.graph = graph
        nodes = lifted.graph.nodes
        self.inputs = [n for n in nodes if n.op == "placeholder"]
        read = {n for s in cut.segments for n in s.inputs if n.op == "get_attr"}
        self.attributes = [(n, operator.attrgetter(str(n.target))) for n in nodes if n in read]
        self.output = lifted.graph.output_node().args[0]
        self.runs: list[tuple[Segment, Callable[..., Any], list[fx.Node]]] = []
        for segment in cut.segments:
            if segment.block and segment.key not in compiled:
                compiled[segment.key] = compile(segment.graph)
        needed = set(_nodes_of(self.output))
        for segment in reversed(cut.segments):  # after each segment: the values no later reads
            run = compiled[segment.key] if segment.block else segment.graph
            self.runs.append((segment, run, [n for n in segment.inputs if n not in needed]))
            needed.update(segment.inputs)
        self.runs.reverse()

    def __call__(self, *args: Any) -> Any:
        env: dict[fx.Node, Any] = dict(zip(self.inputs, args, strict=True))
        for node, read in self.attributes:
            env[node] = read(self.graph)
        for segment, run, release in self.runs:
            outputs = run(*[env[n] for n in segment.inputs])
            env.update(zip(segment.outputs, outputs, strict=True))
            for node in release:
                del env[node]
        return fx.node.map_arg(self.output, env.__getitem__)


def _nodes_of(arg: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(arg, found.append)
    return found
