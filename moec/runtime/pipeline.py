"""Pipelined forward/backward on ``torch.distributed.pipelining``: stages, schedules, mesh.

The ``pipeline`` pass leaves the program's ``pipeline`` (:class:`moec.program.Pipeline`: the
stage programs and their ranks); this module runs the stages this rank holds. The mesh is ``(pp,
dp // ep, ep)`` with names ``("pp", "edp", "ep")``: rank = pp_index * dp + dp_index, so an EP
group (and the data-parallel group the gradient reducer uses) lives inside one pipeline rank and
runs the same stages in the same schedule order. The runtime is the part of a training step
that differs from PP = 1: the schedule's forward and backward over the microbatches (and a
forward-only pass for evaluation). The rest of the step (learning rate, clipping by the norm
over every stage, skip guards, the optimizer, checkpoints) is the Trainer's
(:mod:`moec.train.trainer`), the same for every layout. Under torchrun::

    mesh = build_pipeline_mesh(plan)                    # after init_process_group
    model = moec.compile(LanguageModelWithLoss(dense), plan, (inputs_mb, targets_mb), mesh=mesh)
    runtime = runtime_for(model)                        # frees the other ranks' stages
    loss = runtime.forward_backward(inputs, targets)    # loss on the last stage's ranks, else None

Schedules (``plan.parallel.pp_schedule``): ``gpipe``, ``1f1b`` (one stage per rank),
``interleaved_1f1b`` (v stages per rank, loop placement), ``zbv`` and ``dualpipev`` (v = 2,
V-shaped placement: rank r holds stages r and 2 pp - 1 - r). The batch is split into
``plan.parallel.microbatches`` along dim 0. Each microbatch's objective is the cross-entropy on
the last stage plus the aux losses of every stage: a scalar accumulator travels with the
activations (stage s adds ``lbl_coef * LBL + z_loss_coef * z`` of its MoE blocks), so the
backward reaches every router. The cross-entropy is the program's own when it computes its
loss (compiled from ``moec.train.LanguageModelWithLoss(model)`` on ``(inputs, targets)``: the
``fused_loss`` pass makes the last stage ``moec::linear_cross_entropy``, no logits), else the
runtime's, an unfused float32 cross-entropy on the last stage's logits; either is the mean over
the microbatch's tokens, as at PP = 1. Graph inputs a later stage reads (the targets) go to it
by keyword through the schedule, never from stage to stage. Gradients are averaged over
microbatches by the schedule and over data-parallel ranks by
:class:`moec.runtime.distributed.GradientReducer` per stage.
Other aux outputs (expert counts, offsets, EP drops) stay on their stage's module (detached).

Memory: building the runtime frees the parameters (and buffers) that only other ranks' stages
read, so a rank's parameters, gradients and optimizer state scale as 1/pp. They leave the
compiled model (``compiled.named_parameters()`` is this rank's stages' parameters, under the
full graph's names, which do not depend on pp) and their storage is released: the
source model, which shares its tensors with the compiled program (``moec.trace``), keeps them
as empty tensors. The full graph then no longer runs on this rank (its forward raises, naming a
freed parameter), nor can it be split again.

From a checkpoint (``moec.compile(meta_model, plan, example, init_from=..., mesh=mesh)``):
:func:`moec.runtime.materialize.materialize` builds only the parameters and buffers of this
pipeline rank's stages (``mesh.pp_rank``) and leaves the others on the meta device; building
the runtime frees those like any other stage's (nothing to release), and refuses a program
whose own stages still hold a meta tensor (materialized for another pipeline rank, or never).

FSDP (``parallel.dp_shard > 1``, ``program.data_parallel``): the mesh adds the FSDP (or HSDP)
mesh of this pipeline rank's data-parallel ranks (``mesh.moe.fsdp_mesh``, laid out as
``build_mesh`` lays out a PP = 1 job's), and the runtime shards each local stage
(:func:`moec.runtime.fsdp.shard_dense_parameters`: the stage's block groups, then its
``StageModule`` as the root) before building the optimizer; the compiled model's parameters
become the same ``DTensor`` shards (state dicts and checkpoints see them). torch's
``PipelineStage`` drives the microbatches: every backward accumulates unsharded gradients
(``set_requires_gradient_sync(False)``, also ``set_reshard_after_backward(False)``: a group
gathered by a backward stays so until the block's next forward releases it) and the schedule's
last step reduce-scatters them once and divides by the microbatch count. The zero-bubble
schedules (``zbv``, ``dualpipev``) are refused with FSDP, and where this torch cannot split the
backward, by the ``pipeline`` pass (:func:`moec.analysis.pipeline_schedule.check_schedule_runs`).

Inductor (``plan.lowering.inductor``): the local stages' graphs run through one
:func:`~moec.runtime.lowering.stage_lowering` per rank, each cut at its blocks, one compiled
graph per distinct block over all of them (:mod:`moec.runtime.block_graphs`). Under the
zero-bubble schedules a step runs with AOTAutograd's donated buffers off
(:func:`~moec.runtime.lowering.retained_backward`): their input pass retains the graph.

Routing: each stage keeps the aux outputs of its last forward and a
:class:`~moec.runtime.router_losses.RouterBalance` over its MoE blocks, fed after the schedule
with the step's microbatches (the schedule's first step also runs each stage once on placeholder
values to infer shapes: those forwards are not counted); :meth:`PipelineRuntime.finish_step`
ends the balance's step and :meth:`PipelineRuntime.routing_stats` gives this rank's blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moec.analysis.pipeline_schedule import (
    MULTI_STAGE,
    SPLIT_BACKWARD,
    schedule_class,
)
from moec.plan import Plan
from moec.program import EPGroup, Pipeline, Program
from moec.runtime.autocast import program_context
from moec.runtime.compiled import routing_stats
from moec.runtime.distributed import DistributedError, GradientReducer, MoEMesh, fsdp_mesh_dims
from moec.runtime.fsdp import shard_dense_parameters
from moec.runtime.lowering import InductorGraphs, retained_backward, stage_lowering
from moec.runtime.router_losses import RouterBalance, router_loss_objective
from moec.runtime.variants import graph_in_mode
from moec.runtime.working_weights import WorkingWeights, gradient_dtype


@dataclasses.dataclass
class PipelineMesh:
    """The (pp, edp, ep) mesh: this rank's pipeline group and its (dp, ep) groups."""

    device_mesh: DeviceMesh
    pp_group: dist.ProcessGroup
    pp_rank: int
    moe: MoEMesh
    """Data/expert-parallel groups among the ranks of this pipeline rank."""

    @property
    def pp(self) -> int:
        return dist.get_world_size(self.pp_group)

    @property
    def ep_info(self) -> EPGroup:
        """What the ``expert_parallel`` pass needs (so this mesh can go to ``moec.compile``)."""
        return self.moe.ep_info


def build_pipeline_mesh(plan: Plan, device_type: str | None = None) -> PipelineMesh:
    """The (pp, edp, ep) mesh over the default process group (world = pp * dp), with this
    pipeline rank's FSDP mesh when ``parallel.dp_shard > 1``."""
    if not dist.is_initialized():
        raise DistributedError(
            "no process group: call torch.distributed.init_process_group (or "
            "moec.runtime.distributed.init_from_env under torchrun) before build_pipeline_mesh"
        )
    p, world = plan.parallel, dist.get_world_size()
    if world != p.pp * p.dp:
        fix = f"set dp={world // p.pp}" if world % p.pp == 0 else f"pp must divide {world}"
        raise DistributedError(
            f"parallel.pp={p.pp} x parallel.dp={p.dp} = {p.pp * p.dp} ranks but the job has "
            f"{world}: launch {p.pp * p.dp} processes (torchrun --nproc-per-node), or {fix}"
        )
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(
        device_type, (p.pp, p.dp // p.ep, p.ep), mesh_dim_names=("pp", "edp", "ep")
    )
    fsdp_mesh = None
    if p.dp_shard > 1:  # this pipeline rank's dp ranks, as build_mesh lays them out at PP = 1
        shape, names = fsdp_mesh_dims(plan)
        pp_mesh = init_device_mesh(device_type, (p.pp, *shape), mesh_dim_names=("pp", *names))
        fsdp_mesh = pp_mesh[names]
    dp_groups = [dist.new_group(list(range(i * p.dp, (i + 1) * p.dp))) for i in range(p.pp)]
    pp_rank = mesh.get_local_rank("pp")
    ep_group = mesh.get_group("ep")
    info = EPGroup(mesh.get_local_rank("ep"), p.ep, ep_group.group_name, device_type)
    # this pipeline rank's (edp, ep) slice: what a PP = 1 job's mesh is (checkpoints shard on it)
    expert_fsdp_mesh = mesh["edp"] if p.shards_experts else None
    moe = MoEMesh(
        mesh["edp", "ep"],
        dp_groups[pp_rank],
        ep_group,
        mesh.get_group("edp"),
        info,
        fsdp_mesh,
        expert_fsdp_mesh,
    )
    return PipelineMesh(mesh, mesh.get_group("pp"), pp_rank, moe)


# --- measuring saved activations ---------------------------------------------------------------


class SavedTensorMeter:
    """Live bytes of the tensors autograd saves for backward (parameters and buffers excluded,
    each storage once) and their peak: the measured counterpart of the pass's prediction."""

    def __init__(self, module: nn.Module):
        constants = [*module.parameters(), *module.buffers()]
        self._constants = {t.untyped_storage().data_ptr() for t in constants}
        self._refs: dict[int, int] = {}
        self.live = self.peak = 0

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._constants or tensor.device.type == "meta":
            return tensor
        if self._refs.get(key, 0) == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        return _Saved(tensor.detach(), self, key, storage.nbytes())  # no cycle via grad_fn

    def release(self, key: int, size: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= size


class _Saved:
    __slots__ = ("tensor", "meter", "key", "size")

    def __init__(self, tensor: torch.Tensor, meter: SavedTensorMeter, key: int, size: int):
        self.tensor, self.meter, self.key, self.size = tensor, meter, key, size

    def __del__(self) -> None:
        self.meter.release(self.key, self.size)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed


# --- stages ------------------------------------------------------------------------------------


class StageModule(nn.Module):
    """One stage graph, with the aux-loss accumulator when the model has MoE blocks.

    ``forward(*received, **graph_inputs) -> sends``: received = the boundary values
    (+ accumulator unless first stage); ``graph_inputs`` = the program's inputs by keyword
    (:func:`graph_input_key`), of which a later stage takes those it reads (``side_inputs``,
    e.g. the targets of a fused loss) after the received values; sends = the next stage's inputs
    (+ accumulator), or on the last stage the user outputs (+ accumulator), which the loss
    function reads. In eval mode it runs the stage graph in eval mode
    (:func:`~moec.runtime.variants.graph_in_mode`, made once).
    """

    def __init__(
        self,
        program: Program,
        carries_aux: bool,
        plan: Plan,
        lowering: InductorGraphs,
        side_inputs: Sequence[int] = (),
        dp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.graph_module, self.index = program.graph, program.stage_index
        self.program, self.carries_aux, self.plan = program, carries_aux, plan
        self.side_inputs = [graph_input_key(i) for i in side_inputs]
        self.aux_outputs: dict[tuple[str, str], torch.Tensor] = {}
        """The last forward's aux outputs (detached)."""
        self.step_aux: list[dict[tuple[str, str], torch.Tensor]] = []
        """The aux outputs of this step's training forwards (placeholder runs included)."""
        micro = plan.parallel.microbatches
        self.balance = RouterBalance(plan.moe, program.moe_layers, micro, dp_group, program.graph)
        self.meter: SavedTensorMeter | None = None
        self.lowering = lowering
        """What runs the stage graph (:mod:`moec.runtime.lowering`): the runtime's, shared by
        the rank's stages (:func:`~moec.runtime.lowering.stage_lowering`)."""
        self._other_mode: fx.GraphModule | None = None
        self.instrument: Callable[[fx.GraphModule], fx.GraphModule] | None = None
        """A profile window's rewrite (:meth:`PipelineRuntime.set_instrument`)."""
        self._instrumented: dict[bool, tuple[Callable, fx.GraphModule]] = {}

    def forward(self, *received: torch.Tensor, **graph_inputs: torch.Tensor) -> Any:
        acc = None
        if self.carries_aux and self.index > 0:
            *received, acc = received
        args = [*received, *(graph_inputs[key] for key in self.side_inputs)]
        graph = self._graph()
        with self.meter.track() if self.meter else contextlib.nullcontext():
            with program_context(self.plan, args):
                outputs = self.lowering(graph, args)(*args)
            sig = self.program.signature
            sends = list(outputs[: sig.num_user_outputs])
            aux = dict(zip(sig.aux_outputs, outputs[sig.num_user_outputs :]))
            if self.carries_aux:
                sends.append(self._accumulate(acc, aux, sends[0]))
        # Kept for reading only, detached: an attached tensor keeps this microbatch's autograd
        # graph alive until the next forward replaces it, and under zero-bubble schedules that
        # graph still holds the saved tensors of the nodes only the input backward ran (see
        # "Zero-bubble release" in moec.passes.pipeline).
        self.aux_outputs = {key: value.detach() for key, value in aux.items()}
        if self.training and torch.is_grad_enabled():
            self.step_aux.append(self.aux_outputs)
        return tuple(sends) if len(sends) > 1 else sends[0]

    def _graph(self) -> fx.GraphModule:
        """The stage graph in this module's mode, through :attr:`instrument` when one is set
        (each made once)."""
        graph = self.graph_module
        if self.training != self.program.captured_training:
            if self._other_mode is None:
                self._other_mode = graph_in_mode(self.graph_module, self.training)
            graph = self._other_mode
        if self.instrument is None:
            return graph
        rewrite, made = self._instrumented.get(self.training, (None, None))
        if rewrite is not self.instrument or made is None:
            made = self.instrument(graph)
            self._instrumented[self.training] = (self.instrument, made)
        return made

    def _accumulate(
        self, acc: torch.Tensor | None, aux: dict[tuple[str, str], torch.Tensor], like: torch.Tensor
    ) -> torch.Tensor:
        total = torch.zeros((), device=like.device) if acc is None else acc
        losses = router_loss_objective(aux, self.plan.moe)
        return total if losses is None else total + losses

    def count_step(self, microbatches: int) -> None:
        """Feed the step's last ``microbatches`` training forwards to the balance (the earlier
        ones ran on the schedule's placeholder values) and end its step."""
        for aux in self.step_aux[-microbatches:]:
            self.balance.after_forward(aux, True)
        self.step_aux.clear()
        self.balance.finish_step()


def graph_input_key(index: int) -> str:
    """The keyword under which the runtime hands graph input ``index`` to the stages (not the
    input's name: that could be one of the schedule's own keywords, e.g. ``target``)."""
    return f"graph_input_{index}"


class PipelineRuntime:
    """The local stages of a compiled pipelined program, their schedule and gradient reducers:
    the forward and backward of one step over its microbatches (:meth:`forward_backward`), and
    the forward-only pass of an evaluation (:meth:`evaluate`). The optimizer, clipping and the
    rest of the step are the caller's (the Trainer's): the stages' parameters are the compiled
    model's (``compiled.named_parameters()`` after the runtime is built), and
    :attr:`working_weights` tracks the stages' bf16 working copies (give it to
    ``moec.optim.AdamW``, which then writes them; they are refreshed before each step otherwise).

    Two kinds of program: one whose model returns logits (``forward(inputs)``), to which the
    runtime applies an unfused float32 cross-entropy on the last stage; and one that computes
    its loss (``forward(inputs, targets) -> loss``, e.g. :class:`moec.train.LanguageModelWithLoss`
    with the ``fused_loss`` pass's ``moec::linear_cross_entropy``), whose last stage returns the
    loss and reads the targets itself (``loss_in_program``)."""

    def __init__(
        self, program: Program, plan: Plan, mesh: PipelineMesh, *, measure_memory: bool = False
    ):
        split = program.pipeline
        if split is None:
            raise DistributedError("no pipeline stages: compile with plan.parallel.pp > 1")
        if mesh.pp != split.pp:
            raise DistributedError(f"pipeline group has {mesh.pp} ranks, plan has pp={split.pp}")
        self.split, self.plan, self.mesh = split, plan, mesh
        self.local = split.local_stages(mesh.pp_rank)
        self.num_stages = len(split.stages)
        if unbuilt := _on_meta(split, self.local):
            raise DistributedError(
                f"{unbuilt[0]!r} of pipeline stage {unbuilt[1]}, which pipeline rank "
                f"{mesh.pp_rank} runs, is on the meta device: compile a meta model with "
                "init_from=<checkpoint> and this mesh (build_pipeline_mesh(plan)), which "
                "materializes the stages of the mesh's pipeline rank"
            )
        if split.freed is None:
            _free_other_stages(program.graph, split, mesh.pp_rank)
        elif missing := [(n, s) for n, s in split.freed.items() if s in self.local]:
            raise DistributedError(_not_held(split, *missing[0]))
        self.loss_in_program = _returns_loss(split)
        names = [n.name for n in program.graph.graph.find_nodes(op="placeholder")]
        if self.loss_in_program and len(names) != 2:
            raise DistributedError(
                f"the pipelined program computes its loss, so a step takes (inputs, targets) "
                f"as its two graph inputs, but the graph takes {len(names)}: {names}"
            )
        carries_aux = bool(program.moe_layers)
        dp_group = mesh.moe.dp_group if mesh.moe.dp > 1 else None
        self.lowering = stage_lowering(plan, split, mesh.pp_rank)
        """Runs the local stages' graphs, per block where the plan lowers to Inductor (one
        compiled graph per distinct block over all of them: :mod:`moec.runtime.lowering`)."""
        self.modules = [
            StageModule(
                split.stages[s],
                carries_aux,
                plan,
                self.lowering,
                _side_inputs(split, s, names),
                dp_group,
            )
            for s in self.local
        ]
        self._side_inputs = sorted({i for s in self.local for i in _side_inputs(split, s, names)})
        if program.data_parallel is not None:
            _shard_stages(program.graph, self.modules, mesh)
        if measure_memory:
            for module in self.modules:
                module.meter = SavedTensorMeter(module)
        self.schedule = self._schedule(split, mesh)
        self.reducers = (
            [GradientReducer(m, mesh.moe) for m in self.modules] if mesh.moe.dp > 1 else []
        )
        self.working_weights = _working_weights(self.modules, plan)
        self._ce: list[torch.Tensor] = []

    def _schedule(self, split: Pipeline, mesh: PipelineMesh) -> Any:
        from torch.distributed.pipelining import PipelineStage

        device = _device(mesh)
        stages = [
            PipelineStage(m, s, self.num_stages, device, group=mesh.pp_group)
            for m, s in zip(self.modules, self.local, strict=True)
        ]
        cls = schedule_class(split.schedule)
        target = stages if split.schedule in MULTI_STAGE else stages[0]
        return cls(target, split.microbatches, loss_fn=self._loss)

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        value, acc = output if self.modules[-1].carries_aux else (output, None)
        if self.loss_in_program:  # the last stage's output is the microbatch's loss
            ce = value
        else:
            ce = F.cross_entropy(value.float().flatten(0, 1), target.flatten())
        self._ce.append(ce.detach())
        return ce if acc is None else ce + acc

    @property
    def is_first(self) -> bool:
        return 0 in self.local

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.local

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One pipelined forward + backward over all microbatches; gradients averaged over
        microbatches and data-parallel ranks, the routers' step balance ended. Returns the mean
        cross-entropy on ranks holding the last stage, else None."""
        if self.working_weights is not None:  # the optimizer may not have written them
            self.working_weights.refresh()
        with contextlib.ExitStack() as stack:
            for reducer in self.reducers:
                stack.enter_context(reducer.no_sync())
            if self.split.schedule in SPLIT_BACKWARD:  # its input pass retains the graph
                stack.enter_context(retained_backward())
            loss = self._run(self.schedule.step, inputs, targets)
        for reducer in self.reducers:
            reducer.finish()
        for module in self.modules:
            module.count_step(self.split.microbatches)
        return loss

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """The mean cross-entropy over the microbatches of ``(inputs, targets)``, forward only
        in eval mode without gradients, on the ranks holding the last stage (else None). The
        stages' aux outputs (the routing statistics of the last training forward) and modes
        are kept."""
        kept = [(m.training, m.aux_outputs) for m in self.modules]
        try:
            for module in self.modules:
                module.eval()
            with torch.no_grad():
                return self._run(self._forward_only, inputs, targets)
        finally:
            for module, (training, aux) in zip(self.modules, kept, strict=True):
                module.train(training)
                module.aux_outputs = aux

    def _forward_only(self, *args: Any, **kwargs: Any) -> None:
        """The schedule's step without its backward, as torch's ``schedule.eval`` runs it, but
        without merging the last stage's outputs (scalar losses, which do not concatenate)."""
        schedule, kept = self.schedule, self.schedule._has_backward
        schedule._has_backward = False
        try:
            schedule.step(*args, **kwargs)
        finally:
            schedule._has_backward = kept

    def _run(
        self, run: Callable[..., Any], inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor | None:
        """``run`` (the schedule's ``step`` or ``eval``) on the whole batch; the mean
        cross-entropy of its microbatches on the last stage's ranks, else None."""
        self._ce.clear()
        graph_inputs = [inputs, targets] if self.loss_in_program else [inputs]
        # torch's stages check each microbatch's strides against the traced contiguous ones
        graph_inputs = [t.contiguous() for t in graph_inputs]
        args = tuple(graph_inputs) if self.is_first else ()
        # graph inputs a later local stage reads (the targets of a fused loss), by keyword: the
        # schedule splits them into microbatches and hands them to every local stage
        kwargs: dict[str, Any] = {graph_input_key(i): graph_inputs[i] for i in self._side_inputs}
        if self.is_last:
            kwargs |= {"target": targets, "losses": []}
        if _STEP_TAKES_RETURN_OUTPUTS:
            kwargs["return_outputs"] = False  # the loss is all we need of the last stage
        run(*args, **kwargs)
        if not self.is_last:
            return None
        # the first step's shape inference may run the loss once more, on placeholder values
        return torch.stack(self._ce[-self.split.microbatches :]).mean()

    def set_instrument(self, rewrite: Callable[[fx.GraphModule], fx.GraphModule] | None) -> None:
        """Run the stage graphs through ``rewrite`` (a profile window's ranges; None: plain),
        the rewritten copies made now, outside the steps. Not under the zero-bubble schedules
        (:data:`~moec.analysis.pipeline_schedule.SPLIT_BACKWARD`): their input backward
        detaches the stage outputs in place, which the ranges' views refuse, so their stages
        are traced without block ranges."""
        if self.split.schedule in SPLIT_BACKWARD:
            return
        for module in self.modules:
            module.instrument = rewrite
            module._instrumented.clear()
            if rewrite is not None:
                module._graph()

    def routing_stats(self) -> dict[str, dict[str, Any]]:
        """:func:`~moec.runtime.compiled.routing_stats` of this rank's stages' MoE blocks (the
        other pipeline ranks hold the others). Reads the device: not in a step."""
        stats: dict[str, dict[str, Any]] = {}
        for module in self.modules:
            layers = module.program.moe_layers
            if layers:
                stats |= routing_stats(layers, module.aux_outputs, module.balance)
        return stats

    def measured_peak_bytes(self) -> dict[int, int]:
        """Peak saved-activation bytes per local stage (``measure_memory=True``)."""
        return {m.index: m.meter.peak for m in self.modules if m.meter is not None}


def _returns_loss(split: Pipeline) -> bool:
    """Whether the last stage's user output is a loss (a float scalar) rather than logits."""
    last = split.stages[-1]
    outputs = last.graph.graph.output_node().args[0]
    val = outputs[0].meta.get("val") if outputs and isinstance(outputs[0], fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point()


def _side_inputs(split: Pipeline, stage: int, graph_inputs: list[str]) -> list[int]:
    """Indices of the graph inputs stage ``stage`` (after the first) reads itself: its trailing
    inputs (see :mod:`moec.passes.pipeline.stages`)."""
    if stage == 0:
        return []
    return [graph_inputs.index(n) for n in split.info[stage].inputs if n in graph_inputs]


def _working_weights(modules: list[StageModule], plan: Plan) -> WorkingWeights | None:
    """One registry over the local stages' working copies (names prefixed by stage slot)."""
    graphs = nn.ModuleList([m.graph_module for m in modules])
    copies = {
        f"{i}.{buffer}": [f"{i}.{name}" for name in names]
        for i, module in enumerate(modules)
        for buffer, names in module.program.working_weights.items()
    }
    grad_dtype = gradient_dtype(plan.parallel.microbatches)
    return WorkingWeights(graphs, copies, grad_dtype) if copies else None


def _shard_stages(graph_module: nn.Module, modules: list[StageModule], mesh: PipelineMesh) -> None:
    """FSDP2 over each local stage's dense parameters (its groups, then the stage module as the
    root), and the full graph module made to hold the same sharded parameters, so that the
    compiled model's parameters (state dicts, checkpoints) are the ones the stages train."""
    for module in modules:
        shard_dense_parameters(module, module.program.data_parallel, mesh.moe, module.graph_module)
        for name, param in module.graph_module.named_parameters():
            *path, leaf = name.split(".")
            owner = graph_module.get_submodule(".".join(path))
            if owner._parameters.get(leaf) is not param:  # an owner the stage graph copied
                owner.register_parameter(leaf, param)


def _free_other_stages(graph_module: nn.Module, split: Pipeline, pp_rank: int) -> None:
    """Free every parameter and buffer that no stage of ``pp_rank`` reads: delete it from the
    full graph module and from the other stages' graphs and release its storage (``.data``
    becomes an empty tensor, for the source model that shares it too; one still on the meta
    device, never materialized on this rank, has none); record the parameters in
    ``split.freed`` and make the full graph's forward raise naming one."""
    local = set(split.local_stages(pp_rank))
    stages = [stage.graph for stage in split.stages]
    kept = {id(t) for s in local for t in _tensors(stages[s])}
    split.freed = {
        name: s
        for s, stage in enumerate(stages)
        if s not in local
        for name, _ in stage.named_parameters()
    }
    freed: dict[int, torch.Tensor] = {}
    others = [stage for s, stage in enumerate(stages) if s not in local]
    for module in (graph_module, *others):
        for name, tensor in [
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        ]:
            if id(tensor) not in kept:
                *path, leaf = name.split(".")
                delattr(module.get_submodule(".".join(path)), leaf)
                freed[id(tensor)] = tensor
    for tensor in freed.values():
        tensor.grad = None
        tensor.data = tensor.new_empty(0)

    def refuse(module: nn.Module, args: Any) -> None:
        raise DistributedError(_not_held(split, *next(iter(split.freed.items()))))

    if split.freed:
        graph_module.register_forward_pre_hook(refuse)


def _on_meta(split: Pipeline, stages: list[int]) -> tuple[str, int] | None:
    """The name and stage of a parameter or buffer of ``stages`` on the meta device, if any."""
    for s in stages:
        graph = split.stages[s].graph
        for name, tensor in [*graph.named_parameters(), *graph.named_buffers()]:
            if tensor.device.type == "meta":
                return name, s
    return None


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _not_held(split: Pipeline, name: str, stage: int) -> str:
    return (
        f"parameter {name!r} of pipeline stage {stage} (pipeline rank {split.info[stage].rank}) "
        "was freed on this process, which keeps only the parameters of the stages its pipeline "
        "runtime runs; train it with moec.train (the Trainer), or compile without parallel.pp to "
        "run the whole model in one process"
    )


def _step_takes_return_outputs() -> bool:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    return "return_outputs" in inspect.signature(_PipelineSchedule.step).parameters


_STEP_TAKES_RETURN_OUTPUTS = _step_takes_return_outputs()


def _device(mesh: PipelineMesh) -> torch.device:
    if mesh.device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_mesh.device_type)


def runtime_for(compiled: Any, *, measure_memory: bool = False) -> PipelineRuntime:
    """The (cached) runtime of a compiled pipelined model; building it frees the parameters of
    the stages other ranks run (see the module docstring), so build it before the optimizer."""
    runtime = getattr(compiled, "_pipeline_runtime", None)
    if runtime is None:
        if not isinstance(compiled.mesh, PipelineMesh):
            raise DistributedError(
                "a pipeline runtime needs a pipelined program: compile with plan.parallel.pp > 1 "
                "and mesh=moec.runtime.pipeline.build_pipeline_mesh(plan)"
            )
        runtime = PipelineRuntime(
            compiled.program, compiled.plan, compiled.mesh, measure_memory=measure_memory
        )
        compiled._pipeline_runtime = runtime
        # the full graph no longer runs (other ranks' stages are freed); the runtime keeps the
        # copies of its own stages
        compiled.working_weights = None
    return runtime
