"""Lowering the final program to Inductor (``plan.lowering.inductor``; by default on CUDA).

The graph the passes leave (the whole program, or one pipeline stage's) runs through
``torch.compile(backend="inductor")``: Dynamo traces the graph module's ``forward``, AOTAutograd
its backward, and Inductor fuses the dense ATen ops between moec's (norms, residual adds,
casts, attention glue) into generated kernels, while every ``moec::`` op (and its backward op)
stays an opaque custom-op call whose fake implementation gives the shapes. Given the program's
blocks (``blocks``: a :class:`~moec.runtime.compiled.CompiledModel`'s), the graph is cut at
its residual blocks and each distinct block graph is compiled once for all the blocks that are
the same computation, the glue between them run eagerly (:mod:`moec.runtime.block_graphs`,
which also says where a graph stays whole: :meth:`InductorGraphs.partition`). A pipeline rank's
stages are cut the same way, stage by stage, by one :class:`InductorGraphs` for all of them
(:func:`stage_lowering`): a block repeated within a stage, or across the stages an interleaved
or V-shaped schedule gives the rank, is compiled once. What the runtime does around the graph
is unchanged: autocast is entered outside the compiled call (Dynamo guards on it), the working
weights are refreshed before it, EP collectives run inside moec's ops, and a pipeline stage's
sends and receives run outside its graph.

Working weights: each ``working_copy(buffer, [P, ...])`` call is lifted out of the compiled graph
and made in front of it, and the graph takes the bf16 copy as an input. Traced inside, the
copy's backward hands float32 parameters a bf16 gradient, which AOTAutograd casts to the
parameters' dtype in the compiled backward, and which the engine then casts back to the
parameters' ``grad_dtype``: 12 bytes moved per parameter for nothing. Outside, the compiled
backward returns the copy's gradient as computed (bf16) and the engine hands it on. A user's
own ``torch.compile`` around the compiled model (which traces this module's call with the rest
of ``forward``) gets the same: the lifted graph, its copies made in a function Dynamo does not
trace (one graph break in front of the program).

Sizes: the first call specializes on its shapes; a call with another batch or sequence length
recompiles once with those dimensions symbolic (``dynamic=None``), after which any size runs
without recompiling.

Failures: under ``inductor: auto`` a graph Inductor fails to compile (forward or backward: the
backward is compiled with the forward, so its failure surfaces there too) runs eagerly from
then on, with a warning naming the graph and the error; ``inductor: true`` raises it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch._functorch.config
from torch import fx
from torch._dynamo.exc import BackendCompilerFailed

from moec.ops.working_weights import working_copy
from moec.runtime.block_graphs import BlockProgram, Partition, Whole, partition, stage_blocks

if TYPE_CHECKING:
    from moec.plan import Plan
    from moec.program import Pipeline


class InductorGraphs:
    """What runs a graph under ``plan``: the graph itself where the plan does not lower to
    Inductor on the inputs' device (:meth:`moec.plan.Plan.lowers_to_inductor`), else its
    Inductor-compiled form, made once per graph object (a new graph, e.g. a mode variant rebuilt
    after ``.to()``, is compiled anew). The graph's kernels (FA4's attention included) are the
    ones pass ``bind`` bound; nothing here chooses them."""

    def __init__(
        self,
        plan: Plan,
        backend: str | Callable[..., Any] = "inductor",
        blocks: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        self.plan = plan
        self.backend = backend
        """``torch.compile``'s backend (tests pass one that fails)."""
        self._blocks = blocks
        """The module paths of the program's residual blocks
        (:func:`moec.runtime.block_graphs.program_blocks`), asked for once; None: every graph
        is compiled whole."""
        self._block_paths: Sequence[str] | None = None
        # what is made once per graph object (:func:`_per_graph`), by graph id
        self._compiled: dict[int, tuple[fx.GraphModule, Callable[..., Any]]] = {}
        self._lifted: dict[int, tuple[fx.GraphModule, Lifted]] = {}
        self._partitions: dict[int, tuple[fx.GraphModule, Partition | Whole]] = {}
        self._segments: dict[tuple, Callable[..., Any]] = {}
        """Each distinct segment's compiled graph, by structural key, for all graphs."""

    def __call__(self, graph: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        if torch.compiler.is_compiling():  # a user's torch.compile traces the model's forward
            return functools.partial(_with_lifted_copies, self, graph)
        if not self.plan.lowers_to_inductor(device_type(inputs)):
            return graph
        compiled = self.compiled(graph)
        if compiled is graph or self.plan.lowering.inductor is True:
            return compiled
        return functools.partial(self._or_eager, graph, compiled)

    def compiled(self, graph: fx.GraphModule) -> Callable[..., Any]:
        """``graph``'s Inductor-compiled form (the graph itself once compiling it failed), its
        working copies made outside it (see the module)."""

        def compile_graph() -> Callable[..., Any]:
            inner, copies = self.lifted(graph)
            cut = self.partition(graph)
            if isinstance(cut, Whole):
                compiled = self._compile(inner)
            else:
                compiled = BlockProgram(graph, inner, cut, self._segments, self._compile)
            return functools.partial(_with_copies, graph, copies, compiled) if copies else compiled

        return _per_graph(self._compiled, graph, compile_graph)

    def partition(self, graph: fx.GraphModule) -> Partition | Whole:
        """How ``graph`` (lifted) is compiled: cut at its blocks, each distinct block graph
        compiled once (:mod:`moec.runtime.block_graphs`), or whole and why."""

        def cut() -> Partition | Whole:
            if self._blocks is None:
                return Whole("it is given no blocks")
            if self._block_paths is None:
                self._block_paths = list(self._blocks())
            return partition(self.lifted(graph)[0], self._block_paths)

        return _per_graph(self._partitions, graph, cut)

    def _compile(self, graph: fx.GraphModule) -> Callable[..., Any]:
        return torch.compile(graph, backend=self.backend, dynamic=None)

    def lifted(self, graph: fx.GraphModule) -> Lifted:
        """:func:`lift_working_copies` of ``graph``, made once per graph object."""
        return _per_graph(self._lifted, graph, lambda: lift_working_copies(graph))

    @torch._dynamo.disable
    def lifted_with_copies(self, graph: fx.GraphModule) -> tuple[fx.GraphModule, list[Any]]:
        """``graph``'s lifted form and its working copies, made outside any traced graph."""
        inner, copies = self.lifted(graph)
        return inner, _working_copies(graph, copies)

    def _or_eager(self, graph: fx.GraphModule, compiled: Callable[..., Any], *args: Any) -> Any:
        """``compiled(*args)``; where compiling fails, a warning, and ``graph`` runs instead,
        now and from then on."""
        try:
            with _backward_compiled_with_forward():
                return compiled(*args)
        except BackendCompilerFailed as error:
            warnings.warn(
                f"moec: Inductor could not compile the program's graph ({_first_line(error)}); "
                "it runs eagerly. Set plan.lowering.inductor to false to skip the attempt, or "
                "to true to raise the error",
                stacklevel=2,
            )
            self._compiled[id(graph)] = (graph, graph)
            return graph(*args)

    def clear(self) -> None:
        self._compiled.clear()
        self._lifted.clear()
        self._partitions.clear()
        self._segments.clear()


def stage_lowering(plan: Plan, pipeline: Pipeline, pp_rank: int) -> InductorGraphs:
    """What runs the stage graphs of pipeline rank ``pp_rank``: one :class:`InductorGraphs` for
    all of them, cut at the blocks of those stages (:func:`~moec.runtime.block_graphs.
    stage_blocks`), so that blocks of equal key share one compiled graph across the stages."""
    local = pipeline.local_stages(pp_rank)
    return InductorGraphs(plan, blocks=lambda: stage_blocks(pipeline, local))


def pipeline_layout(plan: Plan, pipeline: Pipeline, pp_rank: int | None = None) -> str:
    """How Inductor compiles each stage of ``pipeline`` (of pipeline rank ``pp_rank`` only,
    where given: the only stages whose parameters a rank keeps once its runtime is built), one
    line per stage with the rank that runs it, as that rank's :func:`stage_lowering` cuts it:
    the block graphs of a rank's stages with the same digest are one compiled graph."""
    ranks = sorted({info.rank for info in pipeline.info}) if pp_rank is None else [pp_rank]
    lines = []
    for rank in ranks:
        graphs = stage_lowering(plan, pipeline, rank)
        for s in pipeline.local_stages(rank):
            layout = graphs.partition(pipeline.stages[s].graph).describe()
            lines.append((s, f"stage {s} (pipeline rank {rank}): {layout}"))
    head = (
        "pipeline stages, each cut on its own (the block graphs of one rank's stages with the "
        "same digest are one compiled graph):"
    )
    return "\n".join([head, *(line for _, line in sorted(lines))])


WorkingCopy = tuple[str, tuple[str, ...]]
"""A lifted ``working_copy`` call: the buffer's target and its parameters' targets."""
Lifted = tuple[fx.GraphModule, list[WorkingCopy]]
"""A graph with its working copies lifted out, and what those copies were."""
T = TypeVar("T")


def _per_graph(
    cache: dict[int, tuple[fx.GraphModule, T]], graph: fx.GraphModule, make: Callable[[], T]
) -> T:
    """``make()``, once per graph object (keyed by id; another object at a reused id is made
    anew)."""
    held = cache.get(id(graph))
    if held is None or held[0] is not graph:
        held = cache[id(graph)] = (graph, make())
    return held[1]


def lift_working_copies(graph: fx.GraphModule) -> Lifted:
    """``graph`` with each top-level ``working_copy`` call replaced by an input after its own
    (in graph order), and what those calls were. A graph without one is returned as it is."""
    calls = [n for n in graph.graph.nodes if n.op == "call_function" and n.target is working_copy]
    if not calls:
        return graph, []
    lifted = copy.deepcopy(graph.graph)
    nodes = {n.name: n for n in lifted.nodes}
    inputs = [n for n in lifted.nodes if n.op == "placeholder"]
    copies: list[WorkingCopy] = []
    for call in calls:
        buffer, params = call.args
        copies.append((str(buffer.target), tuple(str(p.target) for p in params)))
        where = lifted.inserting_after(inputs[-1]) if inputs else lifted.inserting_before()
        with where:
            inputs.append(lifted.placeholder(f"{call.name}_input"))
        node = nodes[call.name]
        node.replace_all_uses_with(inputs[-1])
        lifted.erase_node(node)
    for node in reversed(lifted.nodes):  # the copies' get_attrs, now unread
        if node.op == "get_attr" and not node.users:
            lifted.erase_node(node)
    return fx.GraphModule(graph, lifted), copies


def _working_copies(graph: fx.GraphModule, copies: list[WorkingCopy]) -> list[Any]:
    """The lifted ``working_copy`` calls, made from ``graph``'s current buffers and parameters."""
    return [
        working_copy(graph.get_buffer(buffer), [graph.get_parameter(p) for p in params])
        for buffer, params in copies
    ]


def _with_copies(
    graph: fx.GraphModule, copies: list[WorkingCopy], compiled: Callable[..., Any], *args: Any
) -> Any:
    """``compiled`` (a :func:`lift_working_copies` graph) on ``args`` and the working copies."""
    return compiled(*args, *_working_copies(graph, copies))


def _with_lifted_copies(graphs: InductorGraphs, graph: fx.GraphModule, *args: Any) -> Any:
    """``graph`` on ``args`` as its lifted form, traced by a user's ``torch.compile``, and the
    working copies that :meth:`InductorGraphs.lifted_with_copies` makes outside the trace."""
    inner, made = graphs.lifted_with_copies(graph)
    return inner(*args, *made)


def retained_backward() -> contextlib.AbstractContextManager[Any]:
    """AOTAutograd's donated buffers off, for graphs compiled and run backward inside it. A
    compiled backward that donates the saved tensors it no longer needs refuses
    ``retain_graph=True``, which a zero-bubble schedule's input pass (torch's
    ``stage_backward_input``) passes: it keeps the graph for the weight pass, which runs the
    compiled backward once more (one autograd node computes a compiled graph's input and
    parameter gradients together). AOTAutograd reads the setting both when it compiles and when
    the backward runs."""
    return torch._functorch.config.patch(donated_buffer=False)


def _backward_compiled_with_forward() -> contextlib.AbstractContextManager[Any]:
    """AOTAutograd compiles the backward with the forward, so a backward that Inductor cannot
    compile fails in the forward call (by default it would fail in the first backward, after
    the compiled forward ran)."""
    config = torch._functorch.config
    if not hasattr(config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return config.patch(force_non_lazy_backward_lowering=True)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def device_type(inputs: Sequence[Any]) -> str:
    """The device type of the first tensor among a program's inputs ("cpu" without one)."""
    return next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), "cpu")
