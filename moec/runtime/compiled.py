"""``CompiledModel``: the nn.Module a user trains after ``moec.compile``.

It runs a compiled :class:`~moec.program.Program`, given by the driver (:mod:`moec.compiler`)
or built on the first call by the function the driver gives it, with the user's
``(args, kwargs)``. The user's outputs come back unchanged; the extra outputs the passes added
(router losses, expert counts and offsets) stay on the device in ``self.aux_outputs`` until
``aux_loss()`` or ``routing_stats()`` reads them, so a training step never waits on the host.
The routers' balance over an optimizer step (the step's expert loads, the global-batch loss,
the ``aux_free`` bias, MaxVio: :mod:`moec.runtime.router_losses`) is kept in ``self.balance``:
every forward in train mode with gradients on is a microbatch of the current step, and
``finish_step()`` ends the step after its backwards.

It keeps the ``nn.Module`` contract:

- Names: the program's parameters, buffers and submodules are the compiled model's own, under
  the graph's names (no prefix): a dense parameter keeps its name in the source model
  (``layers.0.attn.q_proj.weight``), parameters the passes made get the pass's names. So
  ``named_parameters()``, ``state_dict()``/``load_state_dict()`` and ``.to()`` work on them
  directly, and a state dict loads into any model compiled from the same model and plan.
- Modes: the program is captured in train mode (every dropout in the graph at its training
  rate; the compiled model starts in the source model's mode). The other mode's graph is
  derived from it (:func:`moec.runtime.variants.graph_in_mode`), once per mode and set of
  buffers. A program holding batch norm is captured in the compiled model's mode, and
  ``train()``/``eval()`` into the other mode raise :class:`~moec.runtime.variants.ModeError`.
  Other random ops (``bernoulli``, ``rand``) run as captured in both modes.
- Pickling: ``torch.save(compiled)`` / ``torch.load(path, weights_only=False)`` round trip
  (with ``moec`` importable), except for models compiled with a process-group ``mesh``. The
  loaded graph is rebuilt from its code (``fx.GraphModule`` pickling): it runs and trains, but
  its nodes lose their ``meta`` (no further passes, pipeline split or cost model on it). A
  model not captured yet cannot be pickled (it holds the source model's build function).
- ``plan.lowering.inductor`` runs the graph through Inductor (:mod:`moec.runtime.lowering`).
- ``torch.compile(compiled)`` runs forward and backward with the ``inductor`` backend (and
  ``eager``/``aot_eager``): Dynamo traces ``forward`` and the graph it runs, AOTAutograd the
  backward, and every ``moec::`` op, with the backward ops its autograd formula calls
  (``moec::*_backward``), is an opaque custom-op call whose fake gives exact shapes, dtypes and
  strides; kernels and EP collectives run only inside those ops, on real tensors. Inductor's FX
  graph cache does not key on the ops' Python fakes: clear it after changing one. The working
  copies are made outside the traced graph (:mod:`moec.runtime.lowering`), one graph break.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from moec.errors import MoecError
from moec.ops.routing import capacity
from moec.plan import Plan
from moec.program import MoELayer, Program
from moec.runtime.autocast import program_context
from moec.runtime.block_graphs import program_blocks
from moec.runtime.fsdp import shard_dense_parameters
from moec.runtime.lowering import InductorGraphs, pipeline_layout
from moec.runtime.router_losses import RouterBalance
from moec.runtime.variants import forward_only, graph_in_mode
from moec.runtime.working_weights import WorkingWeights, gradient_dtype

Build = Callable[[tuple, dict, bool], Program]
"""``build(args, kwargs, training) -> Program``: compiles the source model on these inputs, for
a first run in mode ``training`` (see :func:`moec.compiler.build_program`)."""


class CompiledModel(nn.Module):
    def __init__(
        self,
        plan: Plan,
        program: Program | None = None,
        *,
        build: Build | None = None,
        mesh: Any = None,
        training: bool = True,
        initialize: Callable[[Program], None] | None = None,
    ):
        super().__init__()
        if (program is None) == (build is None):
            raise TypeError("CompiledModel takes a program or a function that builds one")
        self.plan = plan
        self._build = build
        self.mesh = mesh  # moec.runtime.distributed.MoEMesh / PipelineMesh when distributed
        self.__dict__["program"] = None  # not a submodule: its graph's contents become ours
        self.training = training
        self.aux_outputs: dict[tuple[str, str], torch.Tensor] = {}
        self.balance: RouterBalance | None = None
        """The routers' balance over the current optimizer step (built with the program)."""
        self._variants: dict[tuple, tuple[tuple, fx.GraphModule]] = {}
        self.working_weights: WorkingWeights | None = None
        self.instrument: Callable[[fx.GraphModule], fx.GraphModule] | None = None
        """Set by :mod:`moec.runtime.profiling` while a profile window is open
        (:meth:`set_instrument`): the graph runs through this rewrite (its block and op
        ranges), made once per graph."""
        self._initialize = initialize
        self._lowering = self._new_lowering()
        """``plan.lowering.inductor``: what runs each graph (:mod:`.lowering`), compiled block
        by block where the program allows (:mod:`.block_graphs`)."""
        if program is not None:
            self._adopt(program)

    def _new_lowering(self) -> InductorGraphs:
        return InductorGraphs(self.plan, blocks=lambda: program_blocks(self.program))

    @property
    def graph_module(self) -> fx.GraphModule | None:
        """The program's graph (None until captured)."""
        return None if self.program is None else self.program.graph

    @property
    def pass_results(self) -> dict[str, Any]:
        return {} if self.program is None else self.program.pass_results

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [] if self.program is None else self.program.moe_layers

    def capture(self, args: tuple, kwargs: dict) -> None:
        """Build the program for these inputs (done once). The build function, and with it the
        source model, is let go afterwards: the program holds the tensors it reads, and what
        the passes replaced (a dense FFN's weights) is freed once the caller drops the model."""
        if self._build is None:
            raise MoecError("this CompiledModel was captured already; compile the model again")
        program = self._build(args, kwargs, self.training)
        self._build = None
        self._adopt(program)

    def _adopt(self, program: Program) -> None:
        """Make ``program`` ours: its graph's parameter, buffer and submodule tables become this
        module's own (the same dicts, so ``.to()``, ``load_state_dict`` and pipeline freeing act
        on both), its dense parameters FSDP-sharded when it says so, its parameters given their
        values by ``initialize`` (a checkpoint's, for a program captured on the meta device)
        and its working-weight copies tracked."""
        gm = program.graph
        self.__dict__["program"] = program
        self._parameters, self._buffers, self._modules = gm._parameters, gm._buffers, gm._modules
        group = getattr(self.mesh, "dp_group", None)  # the data-parallel ranks of a PP = 1 job
        micro = self.plan.parallel.microbatches
        self.balance = RouterBalance(self.plan.moe, program.moe_layers, micro, group, gm)
        self._non_persistent_buffers_set = gm._non_persistent_buffers_set
        self._variants = {}
        for module in gm.modules():
            if isinstance(module, fx.GraphModule):
                module._tracer_cls, module._tracer_extras = ProgramTracer, {}
        if program.pipeline is None:  # a pipelined program's stages: by its PipelineRuntime
            shard_dense_parameters(self, program.data_parallel, self.mesh)
        if self._initialize is not None:
            self._initialize(program)
            self._initialize = None
        if program.working_weights:
            grad_dtype = gradient_dtype(self.plan.parallel.microbatches)
            self.working_weights = WorkingWeights(gm, program.working_weights, grad_dtype)
        self.train(self.training)  # checks that the graph can run in the current mode

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.program is None:
            self.capture(args, kwargs)
        sig = self.program.signature
        flat = sig.flatten_inputs(args, kwargs)
        if self.working_weights is not None:
            self.working_weights.refresh()
        graph = self._graph()
        run = self._lowering(graph, flat)
        with program_context(self.plan, flat):
            outputs = run(*flat)
        self.aux_outputs = dict(zip(sig.aux_outputs, outputs[sig.num_user_outputs :]))
        self.balance.after_forward(self.aux_outputs, self.training and torch.is_grad_enabled())
        return sig.unflatten_outputs(outputs)

    def lowering_layout(self) -> str:
        """How Inductor compiles the program's graph (where the plan lowers it): per block,
        with which blocks share one compiled graph, or whole and why
        (:mod:`moec.runtime.block_graphs`); a pipelined program's stage by stage (once its
        runtime freed the other ranks' stages, this rank's). Needs the program (captured)."""
        pipeline = self.program.pipeline
        if pipeline is not None:
            rank = None if pipeline.freed is None else self.mesh.pp_rank
            return pipeline_layout(self.plan, pipeline, rank)
        return self._lowering.partition(self.program.graph).describe()

    def train(self, mode: bool = True) -> CompiledModel:
        """Set the mode (see the module docstring); raises
        :class:`~moec.runtime.variants.ModeError` when the program cannot run in ``mode``."""
        if self.program is not None:
            self._graph_in_mode(mode)
        return super().train(mode)

    def _graph(self) -> fx.GraphModule:
        """The graph to run: the one for the current mode, and under ``torch.no_grad()`` its
        variant whose fused LM-head losses skip the head's gradients; in a profile window, that
        graph with ranges (``self.instrument``)."""
        graph = self._graph_in_mode(self.training)
        if not torch.is_grad_enabled():
            graph = self._variant(("forward_only", self.training), graph, forward_only)
        if self.instrument is not None:
            key = ("instrumented", self.training, torch.is_grad_enabled())
            graph = self._variant(key, graph, self.instrument)
        return graph

    def set_instrument(self, rewrite: Callable[[fx.GraphModule], fx.GraphModule] | None) -> None:
        """Run the graphs through ``rewrite`` from the next forward on (None: plain again), and
        make the rewritten copy of the training graph now, outside the steps; for a pipelined
        program, its runtime's stage graphs (:mod:`moec.runtime.pipeline`)."""
        self.instrument = rewrite
        runtime = getattr(self, "_pipeline_runtime", None)
        if runtime is not None:
            runtime.set_instrument(rewrite)
        elif rewrite is not None:
            self._graph()

    def _graph_in_mode(self, training: bool) -> fx.GraphModule:
        if training == self.program.captured_training:
            return self.program.graph
        return self._variant(
            ("mode", training), self.program.graph, lambda gm: graph_in_mode(gm, training)
        )

    def _variant(
        self,
        key: tuple,
        base: fx.GraphModule,
        build: Callable[[fx.GraphModule], fx.GraphModule],
    ) -> fx.GraphModule:
        """``build(base)``, made once per ``base`` and set of its buffers (a copy holds the
        buffers it was built with: ``.to()`` replaces them, so the copy is made again)."""
        identity = (base, *base.buffers())
        built_for, graph = self._variants.get(key, ((), None))
        if len(built_for) != len(identity) or any(
            a is not b for a, b in zip(built_for, identity, strict=True)
        ):
            graph = build(base)
            self._variants[key] = (identity, graph)
        return graph

    # --- pickling ----------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        if self.mesh is not None:
            raise MoecError(
                "cannot pickle a CompiledModel compiled with a mesh (process groups do not "
                "pickle): save its state_dict() and load it into a model compiled with the "
                "same model, plan and mesh"
            )
        if self.program is None:
            raise MoecError(
                "cannot pickle a CompiledModel before its first call (it holds the source "
                "model's build function): call it once, or compile with example_inputs"
            )
        state = self.__dict__.copy()
        state.update(
            _variants={}, aux_outputs={}, working_weights=None, instrument=None, balance=None
        )
        state["_lowering"] = None  # compiled code does not pickle
        # the passes' reports hold their intermediate graphs: not part of the trained model
        state["program"] = dataclasses.replace(self.program, pass_results={})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("instrument", None)
        super().__setstate__(state)
        self._lowering = self._new_lowering()
        self._adopt(self.program)  # unpickling rebuilt the graph module's tables

    def aux_loss(self) -> torch.Tensor:
        """``lbl_coef * LBL + z_loss_coef * z`` summed over MoE blocks, from the last forward
        (the LBL of ``plan.moe.balance``: :meth:`RouterBalance.objective`)."""
        total = None if self.balance is None else self.balance.objective(self.aux_outputs)
        if total is None:
            raise MoecError("no aux losses: run a forward pass of a model with MoE blocks first")
        return total

    def detach_aux_outputs(self) -> None:
        """Detach the last forward's aux outputs (after its backward): nothing then keeps that
        step's autograd graph alive, whose parameters' gradient accumulators would pin the
        stream of the step that made them (a CUDA graph capture needs its own)."""
        self.aux_outputs = {key: value.detach() for key, value in self.aux_outputs.items()}

    def finish_step(self) -> None:
        """End the optimizer step whose microbatches ran since the last call, after their
        backwards: the step's global expert loads and MaxVio, the ``aux_free`` bias update
        (:meth:`RouterBalance.finish_step`; on the device, a collective in a job). Nothing to
        do before the first call has captured the program."""
        if self.balance is not None:
            self.balance.finish_step()

    def routing_stats(self) -> dict[str, dict[str, Any]]:
        """:func:`routing_stats` of the program's MoE blocks, from the last forward on this
        rank and the last finished step; for a pipelined program, of the blocks of this rank's
        stages (its runtime's, :mod:`moec.runtime.pipeline`). Reads the device: not in a
        step."""
        runtime = getattr(self, "_pipeline_runtime", None)
        if runtime is not None:
            return runtime.routing_stats()
        if not self.moe_layers:
            return {}
        return routing_stats(self.moe_layers, self.aux_outputs, self.balance)


def routing_stats(
    layers: list[MoELayer], aux: dict[tuple[str, str], torch.Tensor], balance: RouterBalance
) -> dict[str, dict[str, Any]]:
    """Per MoE block of ``layers``, from the last forward's ``aux`` outputs: the LBL of
    ``plan.moe.balance`` (``lbl``), z-loss, offered and accepted routes, drop rate, load
    imbalance, capacity use, routes per expert (``expert_load``); from the last step
    ``balance`` finished, summed over its microbatches and the data-parallel ranks: MaxVio
    (``max_vio``) and routes per expert (``step_load``), None before the first. Reads the
    device."""
    stats: dict[str, dict[str, Any]] = {}
    lbl = balance.lbl_values(aux).float().cpu().tolist()
    finished = balance.finished()
    for i, layer in enumerate(layers):
        losses = aux[(layer.path, "router_losses")].detach().float().cpu()
        counts = aux[(layer.path, "expert_counts")].detach().cpu()
        accepted = int(aux[(layer.path, "expert_offsets")][-1].item())
        offered = int(counts.sum())
        tokens = offered // layer.top_k
        cap = capacity(tokens, layer.top_k, layer.num_experts, layer.capacity_factor or 0.0)
        stats[layer.path] = {
            "lbl": lbl[i],
            "max_vio": None if finished is None else finished[0][i],
            "z_loss": float(losses[1]),
            "offered": offered,
            "accepted": accepted,
            "drop_rate": 1.0 - accepted / max(offered, 1),
            "load_imbalance": float(counts.max()) / max(offered / layer.num_experts, 1e-9),
            "capacity_use": accepted / max(cap * layer.num_experts, 1),
            "top_k": layer.top_k,
            "expert_load": counts.tolist(),
            "step_load": None if finished is None else finished[1][i],
        }
    return stats


class ProgramTracer(fx.Tracer):
    """Rebuilds a program's graph from its code when it is unpickled (``fx.GraphModule`` pickles
    code, not graphs): the code is a flat graph already, so every plain Python function it calls
    (``working_copy``, ``recompute_region``) stays one call node instead of being traced into."""

    def trace(self, root: nn.Module | Callable[..., Any], concrete_args: Any = None) -> fx.Graph:
        forward = type(root).forward if isinstance(root, nn.Module) else root
        self._autowrap_function_ids.update(
            id(f) for f in forward.__globals__.values() if isinstance(f, types.FunctionType)
        )
        return super().trace(root, concrete_args)
