"""The typed program: what the passes produce and everything after them reads.

A :class:`Program` is a flat ATen graph (``fx.GraphModule``, the calling convention of
:class:`GraphSignature`) together with what running, checkpointing, costing and dumping it
needs: each parameter's role, the MoE layers, the bf16 working-weight copies, this rank's
expert-parallel layout and, once the graph is split, the pipeline stages (each a
:class:`Program` of its own). Capture (:func:`moec.frontend.capture`) makes one; each pass
edits its graph and records what it did in its fields (among them where each parameter's
initial value comes from: its :data:`ParamSource`); the runtime (:mod:`moec.runtime`)
receives the final one. Nothing else crosses from the passes to the runtime.

Invariants kept by every pass:

- every key of ``param_roles`` is a parameter of ``graph`` (a parameter without an entry is
  ``dense``);
- ``signature.num_user_outputs + len(signature.aux_outputs)`` is the number of graph outputs;
- every buffer of ``working_weights`` is a buffer of ``graph``, and its parameters are
  parameters of ``graph``;
- every key of ``provenance`` is a parameter of ``graph`` (a parameter without an entry is
  ``FromSource(its name)``: the source model's tensor of that name);
- a stage program holds only its stage's parameters, layers and copies.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from moec.errors import MoecError
from moec.fx import VALUE_META, under

if TYPE_CHECKING:
    from moec.kernels.target import Target

ParamRole = Literal["dense", "router", "expert"]
"""``expert``: sliced over the EP group and reduced over the expert-data-parallel group;
``router`` and ``dense``: replicated over every data-parallel rank."""


class SignatureError(MoecError, ValueError):
    """Inputs do not have the structure (or a size) the program was captured with."""


@dataclasses.dataclass(frozen=True)
class FixedSize:
    """A size of an input that the program runs at only: the capture (or a pass) made it a
    number, e.g. a model that loops over its sequence in Python."""

    input: int
    """The input's position among the flat inputs."""
    name: str
    """The input's name (its placeholder's)."""
    dim: int
    size: int
    reason: str
    """Why it is a number, e.g. where the model's code needs it constant."""

    def describe(self) -> str:
        return f"{self.name}.size({self.dim}) = {self.size} ({self.reason})"


@dataclasses.dataclass
class GraphSignature:
    """How the user's ``(args, kwargs)`` and outputs map to the flat graph's inputs/outputs."""

    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    num_user_outputs: int
    aux_outputs: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(module path, kind) of every output past the user's, in order, added by passes."""
    fixed_sizes: list[FixedSize] = dataclasses.field(default_factory=list)
    """The input sizes the program runs at only; the others are symbolic."""

    def flatten_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        """The flat inputs; a :class:`SignatureError` if their structure, or a size in
        ``fixed_sizes``, is not the captured one."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise SignatureError(
                "inputs do not have the structure the model was captured with:\n"
                f"  captured: {self.in_spec}\n  called:   {spec}\n"
                "call with the same arguments (tensor sizes may differ) or compile again"
            )
        for fixed in self.fixed_sizes:
            value = flat[fixed.input]
            if not isinstance(value, torch.Tensor) or value.dim() <= fixed.dim:
                continue
            if value.shape[fixed.dim] != fixed.size:
                raise SignatureError(
                    f"input {fixed.name} has size {value.shape[fixed.dim]} in dim {fixed.dim}, "
                    f"but the program runs only at {fixed.describe()}: call it at that size, "
                    "or compile the model again from example inputs of the size you need"
                )
        return flat

    def unflatten_outputs(self, flat: tuple) -> Any:
        return pytree.tree_unflatten(list(flat[: self.num_user_outputs]), self.out_spec)

    @classmethod
    def positional(cls, num_inputs: int, num_outputs: int, aux: list) -> GraphSignature:
        """A flat signature of ``num_inputs`` positional inputs (a pipeline stage's)."""
        return cls(
            pytree.tree_flatten(((0,) * num_inputs, {}))[1],
            pytree.tree_flatten((0,) * num_outputs)[1],
            num_outputs,
            list(aux),
        )


@dataclasses.dataclass(frozen=True)
class MoELayer:
    """One MoE block of the program: what the runtime and the cost model need to know."""

    path: str
    """Module path of the block's new parameters (``<ffn module>.moe``)."""
    block: int
    dim: int
    expert_width: int
    num_experts: int
    top_k: int
    capacity_factor: float | None
    activation: str
    shared_expert: bool
    expert_bias: str | None = None
    """The buffer of the block's selection bias (``moe.balance: aux_free``), else None."""


@dataclasses.dataclass(frozen=True)
class EPGroup:
    """This rank's place in its expert-parallel group: what the passes need, nothing global."""

    rank: int
    size: int
    group: str
    """Process group name (``ProcessGroup.group_name``), resolved by the EP ops at run time."""
    device_type: str = "cpu"


@dataclasses.dataclass(frozen=True)
class ExpertParallelLayout:
    """What the ``expert_parallel`` pass decided: the group and the resolved exchange path."""

    group: EPGroup
    path: str


@dataclasses.dataclass(frozen=True)
class ShardedDataParallel:
    """What the ``fsdp`` pass decided: the dense parameters are FSDP2-sharded.

    ``shard`` consecutive data-parallel ranks each hold 1/shard of every parameter in
    ``params`` (dim 0); ``replicate`` such groups hold the same shards (HSDP when > 1).
    Parameters not listed (expert slices) stay whole on their rank."""

    replicate: int
    shard: int
    params: tuple[str, ...]
    """Names of the sharded parameters (every parameter but the experts)."""
    groups: tuple[str, ...]
    """Module paths of the blocks whose parameters are gathered and freed around the block
    (``moec.ops.param_groups``); the other sharded parameters are gathered for the whole step."""
    gather_dtype: str | None
    """dtype the shards are all-gathered in ("bfloat16" in bf16 programs: the graph reads
    them in bf16), None: their own dtype."""
    expert_shard: int = 1
    """Ranks each expert parameter in ``expert_params`` is split over (dim 1): the
    expert-data-parallel group, ``dp / ep``, when the plan shards (1: experts whole)."""
    expert_params: tuple[str, ...] = ()
    expert_groups: tuple[str, ...] = ()
    """Module paths holding the sharded experts, each an FSDP unit over the expert-data-parallel
    group, gathered around the experts' op like a block's group."""

    def restricted_to(self, names: set[str]) -> ShardedDataParallel:
        """The layout of the parameters ``names`` (a pipeline stage's)."""
        params = tuple(n for n in self.params if n in names)
        groups = tuple(g for g in self.groups if any(under(n, g) for n in params))
        experts = tuple(n for n in self.expert_params if n in names)
        expert_groups = tuple(g for g in self.expert_groups if any(under(n, g) for n in experts))
        return dataclasses.replace(
            self, params=params, groups=groups, expert_params=experts, expert_groups=expert_groups
        )


PRE_FFN, FFN = " (pre-FFN)", " (FFN)"
"""Suffixes of a block's half-units' names (after the block's module path): the pipeline pass's
``sublayer`` units (:mod:`moec.passes.pipeline.units`)."""


@dataclasses.dataclass
class StageInfo:
    index: int
    rank: int
    """Pipeline rank holding the stage (loop placement, or V-shaped for zbv/dualpipev)."""
    blocks: list[str]
    """The units in this stage: blocks' module paths, or ``<path> (pre-FFN)`` / ``<path> (FFN)``
    for half blocks."""
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
    forward_s: float = 0.0
    """Predicted forward seconds per microbatch (the time model's, what balanced the stages)."""

    @property
    def peak_activation_bytes(self) -> int:
        return self.in_flight * self.saved_bytes + self.transient_bytes

    @property
    def block_paths(self) -> list[str]:
        """The module paths of the blocks whose nodes the stage holds (a half block's too), in
        order, each once."""
        paths = (unit.removesuffix(PRE_FFN).removesuffix(FFN) for unit in self.blocks)
        return list(dict.fromkeys(paths))


@dataclasses.dataclass
class Pipeline:
    """The pipeline split of a program: stage programs and their placement."""

    stages: list[Program]
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


# --- provenance: where each parameter's initial value comes from ------------------------------

Span = tuple[int, int]
"""A half-open index range ``[start, stop)``."""


@dataclasses.dataclass(frozen=True)
class FromSource:
    """The source model's (or dense checkpoint's) tensor ``name``, optionally as (in, out) and
    cut: the value is ``T[rows, cols]`` where ``T`` is the stored tensor, or with ``transpose``
    the stored ``[out, in, 1...]`` weight flattened to 2-D and transposed."""

    name: str
    rows: Span | None = None
    cols: Span | None = None
    transpose: bool = False


@dataclasses.dataclass(frozen=True)
class StdOf:
    """The standard deviation of the float32 concatenation of ``parts`` along dim 1."""

    parts: tuple[ParamSource, ...]


@dataclasses.dataclass(frozen=True)
class MeanOf:
    """The mean of the float32 concatenation of ``parts`` along dim 1."""

    parts: tuple[ParamSource, ...]


@dataclasses.dataclass(frozen=True)
class Fresh:
    """A freshly initialized float32 tensor: zeros, or normal(mean, std) drawn on the CPU from a
    generator seeded with ``seed`` alone (so it does not depend on anything else drawn)."""

    kind: Literal["normal", "zeros"]
    shape: tuple[int, ...]
    std: float | StdOf = 0.0
    seed: int = 0
    mean: float | MeanOf = 0.0


@dataclasses.dataclass(frozen=True)
class Scaled:
    """``of`` times ``scale``."""

    of: ParamSource
    scale: float


@dataclasses.dataclass(frozen=True)
class Concat:
    """The concatenation of ``parts`` along ``dim``."""

    parts: tuple[ParamSource, ...]
    dim: int


@dataclasses.dataclass(frozen=True)
class Repeated:
    """``count`` copies of ``of`` stacked on a new leading (expert) dim."""

    of: ParamSource
    count: int


@dataclasses.dataclass(frozen=True)
class Stacked:
    """``parts`` stacked on a new leading (expert) dim: one source per expert."""

    parts: tuple[ParamSource, ...]


@dataclasses.dataclass(frozen=True)
class RepeatedRows:
    """Each row (dim 0) of ``of`` ``count`` times in a row (``repeat_interleave``)."""

    of: ParamSource
    count: int


@dataclasses.dataclass(frozen=True)
class DrawnUnits:
    """``count`` of the indices ``0 .. size - 1``: the first ``count`` of a random permutation
    drawn on the CPU from a generator seeded with ``seed`` alone, in that order."""

    size: int
    count: int
    seed: int


@dataclasses.dataclass(frozen=True)
class Redrawn:
    """``of`` with its slices ``units`` along ``dim`` (0: rows, 1: columns) replaced by those of
    ``fill`` (``of``'s shape with ``units.count`` along ``dim``): the i-th slice of ``fill``
    goes to index ``units``' i-th."""

    of: ParamSource
    dim: int
    units: DrawnUnits
    fill: Fresh


@dataclasses.dataclass(frozen=True)
class ExpertSlice:
    """Experts ``[start, stop)`` (leading-dim rows) of the global expert tensor ``of``."""

    start: int
    stop: int
    of: ParamSource


ParamSource = (
    FromSource | Fresh | Scaled | Concat | Repeated | Stacked | RepeatedRows | Redrawn | ExpertSlice
)
"""Where a parameter's initial value comes from, as a recipe over the source model's tensors."""

SourceReader = Callable[[str, "slice | None", "slice | None"], torch.Tensor]
"""``read(name, rows, cols)``: the source tensor ``name`` cut to ``[rows, cols]`` (None: all)."""


def cut(tensor: torch.Tensor, rows: slice | None, cols: slice | None) -> torch.Tensor:
    """``tensor[rows, cols]`` (None: the whole dim; ``cols`` needs a tensor of 2 dims or more)."""
    if rows is not None:
        tensor = tensor[rows]
    return tensor if cols is None else tensor[:, cols]


def fresh_seed(seed: int, name: str, expert: int | None = None) -> int:
    """A generator seed that depends only on (``seed``, parameter ``name``, ``expert``)."""
    key = f"{seed}/{name}/{'' if expert is None else expert}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & (2**63 - 1)


class TensorBuilder:
    """Builds parameters' values from their sources, reading through ``read`` (each distinct
    read and statistic made once per builder); ``Fresh`` tensors are drawn on the CPU in
    float32 and moved to ``device`` (on ``meta``: only their shape). The experts of a
    ``Stacked`` tensor of normal draws are drawn in parallel threads, each into its rows of one
    tensor (CPU draws are serial per generator; each expert has its own), giving the values
    drawn one at a time would."""

    def __init__(self, read: SourceReader, device: torch.device | str) -> None:
        self.read, self.device = read, torch.device(device)
        self.memo: dict[ParamSource, torch.Tensor] = {}
        self.statistics: dict[StdOf | MeanOf, float] = {}

    def tensor(self, source: ParamSource, dtype: torch.dtype) -> torch.Tensor:
        """The value of ``source`` as a new contiguous ``dtype`` tensor on the device."""
        value = self.build(source)
        return torch.empty(value.shape, dtype=dtype, device=self.device).copy_(value)

    def build(self, source: ParamSource) -> torch.Tensor:
        if source not in self.memo:
            self.memo[source] = self._build(source)
        return self.memo[source]

    def _build(self, source: ParamSource) -> torch.Tensor:
        if isinstance(source, FromSource):
            return self._read(source)
        if isinstance(source, Fresh):
            return self._fresh(source)
        if isinstance(source, Scaled):
            return self.build(source.of) * source.scale
        if isinstance(source, Concat):
            return torch.cat([self.build(p) for p in source.parts], dim=source.dim)
        if isinstance(source, Repeated):
            one = self.build(source.of)
            return one.unsqueeze(0).expand(source.count, *one.shape)
        if isinstance(source, Stacked):
            parts = source.parts
            if self.device.type != "meta" and parts and all(map(_normal_draw, parts)):
                return self._drawn_experts(parts)
            return torch.stack([self.build(p) for p in source.parts])
        if isinstance(source, RepeatedRows):
            return self.build(source.of).repeat_interleave(source.count, dim=0)
        if isinstance(source, Redrawn):
            return self._redrawn(source)
        return self.build(experts(source.of, source.start, source.stop))

    def _redrawn(self, source: Redrawn) -> torch.Tensor:
        base = self.build(source.of)
        units = source.units
        order = torch.randperm(units.size, generator=_generator(units.seed))
        fill = self.build(source.fill).to(base.dtype)
        return base.index_copy(source.dim, order[: units.count].to(base.device), fill)

    def _read(self, source: FromSource) -> torch.Tensor:
        rows, cols = (None if s is None else slice(*s) for s in (source.rows, source.cols))
        if not source.transpose:
            return self.read(source.name, rows, cols)
        return self.read(source.name, cols, rows).flatten(1).t()

    def _fresh(self, source: Fresh) -> torch.Tensor:
        if source.kind == "zeros":
            return torch.zeros(source.shape, device=self.device)
        if self.device.type == "meta":
            return torch.empty(source.shape, device=self.device)
        return self._drawn_experts((source,))[0]

    def _drawn_experts(self, parts: tuple[Fresh, ...]) -> torch.Tensor:
        """``parts`` (normal draws of one shape) stacked: each drawn on the CPU by its own
        generator, in parallel, then scaled and shifted by its statistics, as ``randn * std +
        mean`` would (the same two roundings), and moved to the device at once."""
        drawn = torch.empty(len(parts), *parts[0].shape)

        def draw(i: int) -> None:  # a thread each: randn releases the GIL
            torch.randn(parts[i].shape, generator=_generator(parts[i].seed), out=drawn[i])

        with ThreadPoolExecutor(min(len(parts), torch.get_num_threads())) as pool:
            list(pool.map(draw, range(len(parts))))
        for row, part in zip(drawn, parts, strict=True):  # multithreaded ops: on this thread
            row.mul_(self._statistic(part.std)).add_(self._statistic(part.mean))
        return drawn.to(self.device)

    def _statistic(self, value: float | StdOf | MeanOf) -> float:
        if isinstance(value, float | int):
            return value
        if value not in self.statistics:
            joined = torch.cat([self.build(p) for p in value.parts], 1).float()
            stat = joined.std() if isinstance(value, StdOf) else joined.mean()
            self.statistics[value] = float(stat)
        return self.statistics[value]


def source_reads(source: ParamSource) -> list[str]:
    """The source tensors a :class:`TensorBuilder` reads to build ``source``, in the order it
    reads them (a tensor read twice is listed twice)."""
    if isinstance(source, FromSource):
        return [source.name]
    if isinstance(source, ExpertSlice):
        return source_reads(experts(source.of, source.start, source.stop))
    reads = []
    for field in dataclasses.fields(source):
        value = getattr(source, field.name)
        for part in value if isinstance(value, tuple) else (value,):
            if dataclasses.is_dataclass(part) and not isinstance(part, type):
                reads += source_reads(part)
    return reads


def _normal_draw(source: ParamSource) -> bool:
    return isinstance(source, Fresh) and source.kind == "normal"


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def experts(source: ParamSource, start: int, stop: int) -> ParamSource:
    """The source of experts ``[start, stop)`` of the expert tensor ``source``, built without
    building the others."""
    if isinstance(source, Repeated):
        return Repeated(source.of, stop - start)
    if isinstance(source, Stacked):
        return Stacked(source.parts[start:stop])
    if isinstance(source, Fresh) and source.kind == "zeros":
        return Fresh("zeros", (stop - start, *source.shape[1:]))
    if isinstance(source, ExpertSlice):
        return experts(source.of, source.start + start, source.start + stop)
    raise MoecError(
        f"cannot take experts [{start}, {stop}) of {source}: an expert tensor's source must be "
        "Repeated, Stacked, zeros or an ExpertSlice of one"
    )


@dataclasses.dataclass
class Program:
    """A graph and what running it needs (see the module's invariants)."""

    graph: fx.GraphModule
    signature: GraphSignature
    param_roles: dict[str, ParamRole] = dataclasses.field(default_factory=dict)
    moe_layers: list[MoELayer] = dataclasses.field(default_factory=list)
    working_weights: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    """Buffer name -> the parameters whose bf16 rows it holds, in row order."""
    expert_parallel: ExpertParallelLayout | None = None
    provenance: dict[str, ParamSource] = dataclasses.field(default_factory=dict)
    """Parameter name -> where its initial value comes from (default: ``FromSource(name)``)."""
    data_parallel: ShardedDataParallel | None = None
    """Set by the ``fsdp`` pass when the plan shards the dense parameters (parallel.dp_shard)."""
    pipeline: Pipeline | None = None
    stage_index: int | None = None
    """Set on a pipeline stage's own program: its index in ``Pipeline.stages``."""
    captured_training: bool = True
    """The mode the source model was captured in (its dropouts are in the graph when True)."""
    pass_pipeline: str = ""
    """The pass-pipeline string of the passes that made this program (``moe{...},...``)."""
    pass_results: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What each pass that ran reported (``moec.passes.base.PassResult`` by pass name)."""
    target: Target | None = None
    """The machine the program is compiled for (the compiler sets it; pass ``bind`` binds
    every ``moec::`` node's implementation against it)."""
    bindings: dict[str, str] = dataclasses.field(default_factory=dict)
    """Set by pass ``bind``: each ``moec::`` node (``name``, or ``submodule.name`` inside a
    sub-graph) -> ``op: impl`` and what that implementation is (the node's ``impl`` argument
    holds the same name; ``moec debug`` prints them)."""

    def role(self, name: str) -> ParamRole:
        """The role of parameter ``name`` (a name in ``graph``)."""
        return self.param_roles.get(name, "dense")

    def source(self, name: str) -> ParamSource:
        """Where parameter ``name``'s initial value comes from."""
        return self.provenance.get(name, FromSource(name))

    def copy(self) -> Program:
        """A copy for passes to rewrite, leaving this program as it is: the graph module, its
        parameters and buffers (meta tensors are copied without data; real ones with theirs),
        every node's metadata and the fields are copied, and the values of the capture's
        fake mode (:data:`moec.fx.VALUE_META`) shared: passes replace those, never change
        them in place."""
        shared: dict[int, Any] = {}
        for node in self.graph.graph.nodes:
            for key in VALUE_META:
                for leaf in pytree.tree_leaves(node.meta.get(key)):
                    shared[id(leaf)] = leaf
        return copy.deepcopy(self, shared)

    def stage(self, graph: fx.GraphModule, signature: GraphSignature, index: int) -> Program:
        """The program of one pipeline stage cut from this one: ``graph`` holds a subset of
        this program's parameters and buffers under the same names."""
        params = {name for name, _ in graph.named_parameters()}
        return Program(
            graph=graph,
            signature=signature,
            param_roles={k: v for k, v in self.param_roles.items() if k in params},
            moe_layers=[m for m in self.moe_layers if any(under(n, m.path) for n in params)],
            working_weights={
                b: names for b, names in self.working_weights.items() if hasattr(graph, b)
            },
            expert_parallel=self.expert_parallel,
            data_parallel=self.data_parallel
            and dataclasses.replace(
                self.data_parallel,
                params=tuple(n for n in self.data_parallel.params if n in params),
            ),
            provenance={k: v for k, v in self.provenance.items() if k in params},
            stage_index=index,
            captured_training=self.captured_training,
            pass_pipeline=self.pass_pipeline,
            target=self.target,
        )
