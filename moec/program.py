"""The typed program: what the passes produce and everything after them reads.

A :class:`Program` is a flat ATen graph (``fx.GraphModule``, the calling convention of
:class:`GraphSignature`) together with what running, checkpointing, costing and dumping it
needs: each parameter's role, the MoE layers, the bf16 working-weight copies, this rank's
expert-parallel layout and, once the graph is split, the pipeline stages (each a
:class:`Program` of its own). Capture (:func:`moec.frontend.capture`) makes one; each pass
edits its graph and records what it did in its fields; the runtime (:mod:`moec.runtime`)
receives the final one. Nothing else crosses from the passes to the runtime.

Invariants kept by every pass:

- every key of ``param_roles`` is a parameter of ``graph`` (a parameter without an entry is
  ``dense``);
- ``signature.num_user_outputs + len(signature.aux_outputs)`` is the number of graph outputs;
- every buffer of ``working_weights`` is a buffer of ``graph``, and its parameters are
  parameters of ``graph``;
- a stage program holds only its stage's parameters, layers and copies.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch.fx as fx
import torch.utils._pytree as pytree

from moec.errors import MoecError
from moec.fx import under

ParamRole = Literal["dense", "router", "expert"]
"""``expert``: sliced over the EP group and reduced over the expert-data-parallel group;
``router`` and ``dense``: replicated over every data-parallel rank."""


class SignatureError(MoecError, ValueError):
    """Inputs do not have the structure the program was captured with."""


@dataclasses.dataclass
class GraphSignature:
    """How the user's ``(args, kwargs)`` and outputs map to the flat graph's inputs/outputs."""

    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    num_user_outputs: int
    aux_outputs: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(module path, kind) of every output past the user's, in order, added by passes."""

    def flatten_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise SignatureError(
                "inputs do not have the structure the model was captured with:\n"
                f"  captured: {self.in_spec}\n  called:   {spec}\n"
                "call with the same arguments (tensor sizes may differ) or compile again"
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
    pipeline: Pipeline | None = None
    stage_index: int | None = None
    """Set on a pipeline stage's own program: its index in ``Pipeline.stages``."""
    captured_training: bool = True
    """The mode the source model was captured in (its dropouts are in the graph when True)."""
    pass_pipeline: str = ""
    """The pass-pipeline string of the passes that made this program (``moe{...},...``)."""
    pass_results: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What each pass that ran reported (``moec.passes.base.PassResult`` by pass name)."""

    def role(self, name: str) -> ParamRole:
        """The role of parameter ``name`` (a name in ``graph``)."""
        return self.param_roles.get(name, "dense")

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
            stage_index=index,
            captured_training=self.captured_training,
            pass_pipeline=self.pass_pipeline,
        )
