"""``CompiledModel``: the nn.Module a user trains after ``moec.compile``.

It captures the model (at construction when example inputs are given, else on the first call),
runs the passes the plan enables, and then calls the resulting flat graph with the user's
``(args, kwargs)``. The user's outputs come back unchanged; the extra outputs the passes added
(router losses, expert counts and offsets) stay on the device in ``self.aux_outputs`` until
``aux_loss()`` or ``routing_stats()`` reads them, so a training step never waits on the host.

It keeps the ``nn.Module`` contract:

- Names: the program's parameters, buffers and submodules are the compiled model's own, under
  the graph's names (no prefix): a dense parameter keeps its name in the source model
  (``layers.0.attn.q_proj.weight``), parameters the passes made get the pass's names. So
  ``named_parameters()``, ``state_dict()``/``load_state_dict()`` and ``.to()`` work on them
  directly, and a state dict loads into any model compiled from the same model and plan.
- Modes: the source model is captured in train mode, so every dropout is in the graph at its
  training rate (its own mode is restored afterwards; the compiled model starts in it). The
  other mode's graph is derived from the captured one by setting the ``train`` argument of
  every ATen op that has one (``dropout``, ``native_dropout``, ``feature_dropout``,
  ``alpha_dropout``, ``feature_alpha_dropout``, the RNNs' inter-layer dropout) and, in eval
  mode, the attention's ``dropout_p`` to 0; built once per mode and set of buffers. Batch norm
  (a ``training`` argument or a running-statistics update) cannot be switched: a model holding
  batch-norm modules is captured in the compiled model's mode instead, and
  ``train()``/``eval()`` into the other mode raise :class:`ModeError`. Other random ops
  (``bernoulli``, ``rand``) run as captured in both modes.
- Pickling: ``torch.save(compiled)`` / ``torch.load(path, weights_only=False)`` round trip
  (with ``moec`` importable), except for models compiled with a process-group ``mesh``. The
  loaded graph is rebuilt from its code (``fx.GraphModule`` pickling): it runs and trains, but
  its nodes lose their ``meta`` (no further passes, pipeline split or cost model on it).
- ``torch.compile(compiled)`` works, backward included: dynamo traces ``forward`` and the graph
  it runs; the ``moec::`` ops stay opaque custom ops (their fake impls give the shapes).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from moec.errors import MoecError
from moec.frontend import signature, trace
from moec.ops.routing import capacity
from moec.passes.loss import forward_only
from moec.passes.manager import DumpHook, PassManager, PassResult, default_passes
from moec.plan import Plan
from moec.runtime.working_weights import WorkingWeights, gradient_dtype


class ModeError(MoecError):
    """The compiled graph cannot run in the mode asked for (see the module docstring)."""


class CompiledModel(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        plan: Plan | None = None,
        example_inputs: tuple | Any = None,
        example_kwargs: dict | None = None,
        *,
        dump: DumpHook | None = None,
        verify: bool = True,
        mesh: Any = None,
    ):
        super().__init__()
        self.plan = plan or Plan()
        self._source = (model,)  # a tuple keeps it out of this module's parameters
        self._dump, self._verify = dump, verify
        self.mesh = mesh  # moec.runtime.distributed.MoEMesh, needed when parallel.ep > 1
        self.graph_module: fx.GraphModule | None = None
        self.captured_training = model.training
        self.training = model.training
        self.pass_results: dict[str, PassResult] = {}
        self.aux_outputs: dict[tuple[str, str], torch.Tensor] = {}
        self._programs: dict[tuple[str, bool], tuple[tuple, fx.GraphModule]] = {}
        self.working_weights: WorkingWeights | None = None
        if example_inputs is not None:
            args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
            self.capture(args, example_kwargs or {})

    def capture(self, args: tuple, kwargs: dict) -> None:
        """Trace the source model on these inputs and run the passes (done once). The source
        model is let go afterwards: the program holds the tensors it reads, and what the passes
        replaced (a dense FFN's weights) is freed once the caller drops the model too."""
        if not self._source:
            raise RuntimeError("this CompiledModel was captured already; compile the model again")
        model = self._source[0]
        self.captured_training = self.training if has_batch_norm(model) else True
        with in_mode(model, self.captured_training):
            gm = trace(model, args, kwargs)
        passes = default_passes(self.plan, self.mesh)
        manager = PassManager(passes, verify=self._verify, dump=self._dump)
        program, ctx = manager.run(gm, self.plan)
        self.pass_results = ctx.results
        self._source = ()
        self._adopt(program)
        self.train(self.training)  # checks that the graph can run in the current mode

    def _adopt(self, gm: fx.GraphModule) -> None:
        """Make ``gm`` the program: its parameter, buffer and submodule tables become this
        module's own (the same dicts, so ``.to()``, ``load_state_dict`` and pipeline freeing act
        on both), and its working-weight copies are tracked."""
        self.__dict__["graph_module"] = gm  # not a submodule: its contents are ours, unprefixed
        self._parameters, self._buffers, self._modules = gm._parameters, gm._buffers, gm._modules
        self._non_persistent_buffers_set = gm._non_persistent_buffers_set
        self._programs = {}
        for module in gm.modules():
            if isinstance(module, fx.GraphModule):
                module._tracer_cls, module._tracer_extras = ProgramTracer, {}
        copies = gm.meta.get("moec_working_weights")
        if copies:
            grad_dtype = gradient_dtype(self.plan.parallel.microbatches)
            self.working_weights = WorkingWeights(gm, copies, grad_dtype)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.graph_module is None:
            self.capture(args, kwargs)
        sig = signature(self.graph_module)
        flat = sig.flatten_inputs(args, kwargs)
        if self.working_weights is not None:
            self.working_weights.refresh()
        with compute_autocast(self.plan, flat):
            outputs = self._program()(*flat)
        self.aux_outputs = dict(zip(sig.aux_outputs, outputs[sig.num_user_outputs :]))
        return sig.unflatten_outputs(outputs)

    def train(self, mode: bool = True) -> CompiledModel:
        """Set the mode (see the module docstring); raises :class:`ModeError` when the captured
        graph cannot run in ``mode``."""
        if self.graph_module is not None:
            self._graph_in_mode(mode)
        return super().train(mode)

    def _program(self) -> fx.GraphModule:
        """The graph to run: the one for the current mode, and under ``torch.no_grad()`` a copy
        whose fused LM-head losses skip the head's gradients
        (:func:`moec.passes.loss.forward_only`)."""
        graph = self._graph_in_mode(self.training)
        if torch.is_grad_enabled():
            return graph
        return self._derived(("forward_only", self.training), graph, forward_only)

    def _graph_in_mode(self, training: bool) -> fx.GraphModule:
        if training == self.captured_training:
            return self.graph_module
        return self._derived(
            ("mode", training), self.graph_module, lambda gm: graph_in_mode(gm, training)
        )

    def _derived(
        self,
        key: tuple[str, bool],
        base: fx.GraphModule,
        build: Callable[[fx.GraphModule], fx.GraphModule],
    ) -> fx.GraphModule:
        """``build(base)``, made once per ``base`` and set of its buffers (a copy holds the
        buffers it was built with: ``.to()`` replaces them, so the copy is made again)."""
        identity = (base, *base.buffers())
        built_for, program = self._programs.get(key, ((), None))
        if len(built_for) != len(identity) or any(
            a is not b for a, b in zip(built_for, identity, strict=True)
        ):
            program = build(base)
            self._programs[key] = (identity, program)
        return program

    # --- pickling ----------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        if self.mesh is not None:
            raise MoecError(
                "cannot pickle a CompiledModel compiled with a mesh (process groups do not "
                "pickle): save its state_dict() and load it into a model compiled with the "
                "same model, plan and mesh"
            )
        state = self.__dict__.copy()
        state.update(_programs={}, aux_outputs={}, working_weights=None)
        gm = self.graph_module
        state["graph_meta"] = None if gm is None else gm.meta  # fx pickling drops gm.meta
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        meta = state.pop("graph_meta")
        super().__setstate__(state)
        if self.graph_module is not None:
            self.graph_module.meta.update(meta)
            self._adopt(self.graph_module)  # unpickling rebuilt the graph module's tables

    @property
    def moe_layers(self) -> list:
        return (
            [] if self.graph_module is None else self.graph_module.meta.get("moec_moe_layers", [])
        )

    def aux_loss(self) -> torch.Tensor:
        """``lbl_coef * LBL + z_loss_coef * z`` summed over MoE blocks, from the last forward."""
        lbl_coef, z_coef = self.plan.moe.lbl_coef, self.plan.moe.z_loss_coef
        total = None
        for (_, kind), value in self.aux_outputs.items():
            if kind == "router_losses":
                term = lbl_coef * value[0] + z_coef * value[1]
                total = term if total is None else total + term
        if total is None:
            raise RuntimeError("no aux losses: run a forward pass of a model with MoE blocks first")
        return total

    def routing_stats(self) -> dict[str, dict[str, Any]]:
        """Per MoE block: losses, load, drops, capacity use. Reads the device: not in a step."""
        stats: dict[str, dict[str, Any]] = {}
        for layer in self.moe_layers:
            losses = self.aux_outputs[(layer.path, "router_losses")].detach().float().cpu()
            counts = self.aux_outputs[(layer.path, "expert_counts")].detach().cpu()
            accepted = int(self.aux_outputs[(layer.path, "expert_offsets")][-1].item())
            offered = int(counts.sum())
            tokens = offered // layer.top_k
            cap = capacity(tokens, layer.top_k, layer.num_experts, layer.capacity_factor or 0.0)
            stats[layer.path] = {
                "lbl": float(losses[0]),
                "z_loss": float(losses[1]),
                "offered": offered,
                "accepted": accepted,
                "drop_rate": 1.0 - accepted / max(offered, 1),
                "load_imbalance": float(counts.max()) / max(offered / layer.num_experts, 1e-9),
                "capacity_use": accepted / max(cap * layer.num_experts, 1),
                "expert_load": counts.tolist(),
            }
        return stats

    # --- pipelined programs (moec.runtime.pipeline) ---------------------------------------------

    def train_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
        """One optimizer step of a pipelined program (``plan.parallel.pp > 1``, compiled with
        ``mesh=build_pipeline_mesh(plan)``): ``batch = (inputs, targets)`` split into the plan's
        microbatches. Returns the mean loss on the ranks holding the last stage, else None."""
        from moec.runtime.pipeline import runtime_for

        return runtime_for(self).train_step(*batch)


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


def has_batch_norm(model: nn.Module) -> bool:
    """Whether ``model`` holds batch or instance norm modules (mode-dependent running stats)."""
    return any(isinstance(m, nn.modules.batchnorm._NormBase) for m in model.modules())


@contextlib.contextmanager
def in_mode(model: nn.Module, training: bool):
    """``model`` (all its submodules) in ``training`` mode; each module's own mode restored."""
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield model
    finally:
        for module, mode in modes:
            module.training = mode


def _argument_names(node: fx.Node) -> list[str]:
    schema = getattr(node.target, "_schema", None)
    return [] if schema is None else [a.name for a in schema.arguments]


def _fixed_mode(node: fx.Node) -> bool:
    """An op whose mode cannot be switched by an argument: batch norm with its statistics."""
    name = getattr(node.target, "__name__", "")
    return "training" in _argument_names(node) or "batch_norm" in name


MODE_ARGUMENTS: dict[str, Callable[[Any, bool], Any]] = {
    "train": lambda value, training: training,
    "dropout_p": lambda value, training: value if training else 0.0,
}
"""Op arguments that carry the mode, and their value in a mode given the captured value:
``train`` (dropout and its variants, RNNs) is the mode; ``dropout_p`` (attention) is 0 in eval
mode and as captured in train mode."""


def graph_in_mode(gm: fx.GraphModule, training: bool) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its parameters, buffers and meta) whose ops, its sub-graphs'
    (recompute regions) included, run in mode ``training`` (see :data:`MODE_ARGUMENTS`); ``gm``
    itself when no op depends on the mode. Raises :class:`ModeError` when ``gm`` holds an op
    whose mode cannot be switched."""
    fixed = [
        node
        for module in gm.modules()
        if isinstance(module, fx.GraphModule)
        for node in module.graph.nodes
        if node.op == "call_function" and _fixed_mode(node)
    ]
    if fixed:
        names = ", ".join(f"{n.name} ({n.target})" for n in fixed[:3])
        raise ModeError(
            f"this program cannot run in {'train' if training else 'eval'} mode: nodes {names} "
            f"were captured in {'eval' if training else 'train'} mode and have no `train` "
            "argument to switch (batch norm's running statistics). Compile the model in the "
            "mode you will run it in (model.train() or model.eval() before moec.compile)"
        )
    return _copy_in_mode(gm, training)


def _copy_in_mode(gm: fx.GraphModule, training: bool) -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    switched = [_switch_mode(node, training) for node in graph.nodes if node.op == "call_function"]
    regions = {
        name: _copy_in_mode(child, training)
        for name, child in gm.named_children()
        if isinstance(child, fx.GraphModule)
    }
    regions = {name: copy for name, copy in regions.items() if copy is not gm.get_submodule(name)}
    if not any(switched) and not regions:
        return gm
    copy = fx.GraphModule(gm, graph)
    for name, region in regions.items():
        setattr(copy, name, region)
    copy.meta.update(gm.meta)
    return copy


def _switch_mode(node: fx.Node, training: bool) -> bool:
    """Set ``node``'s mode arguments given in the graph for mode ``training`` (a defaulted
    ``dropout_p`` is 0 already); whether it has any."""
    names = _argument_names(node)
    found = False
    for name, value_in in MODE_ARGUMENTS.items():
        if name not in names:
            continue
        index = names.index(name)
        if index < len(node.args):
            value = value_in(node.args[index], training)
            node.args = (*node.args[:index], value, *node.args[index + 1 :])
        elif name in node.kwargs:
            node.kwargs = {**node.kwargs, name: value_in(node.kwargs[name], training)}
        else:
            continue
        found = True
    return found


def compute_autocast(plan: Plan, inputs: list[Any]) -> contextlib.AbstractContextManager:
    """bf16 autocast around a bf16 plan's program (pipeline stages too), on the device of its
    first tensor input: ops on autocast's float32 list then compute as they were captured."""
    if plan.precision.compute_dtype != "bf16":
        return contextlib.nullcontext()
    device = next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), "cpu")
    return torch.autocast(device, dtype=torch.bfloat16)


def compile(
    model: nn.Module,
    plan: Plan | dict | None = None,
    example_inputs: tuple | Any = None,
    example_kwargs: dict | None = None,
    **options: Any,
) -> CompiledModel:
    """Compile a dense model into the MoE training program ``plan`` describes."""
    if isinstance(plan, dict):
        plan = Plan.from_dict(plan)
    return CompiledModel(model, plan, example_inputs, example_kwargs, **options)
