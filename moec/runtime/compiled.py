"""``CompiledModel``: the nn.Module a user trains after ``moec.compile``.

It captures the model (at construction when example inputs are given, else on the first call),
runs the passes the plan enables, and then calls the resulting flat graph with the user's
``(args, kwargs)``. The user's outputs come back unchanged; the extra outputs the passes added
(router losses, expert counts and offsets) stay on the device in ``self.aux_outputs`` until
``aux_loss()`` or ``routing_stats()`` reads them, so a training step never waits on the host.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from moec.frontend import signature, trace
from moec.ops.routing import capacity
from moec.passes.loss import forward_only
from moec.passes.manager import DumpHook, PassManager, PassResult, default_passes
from moec.plan import Plan
from moec.runtime.working_weights import WorkingWeights, gradient_dtype


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
        self.pass_results: dict[str, PassResult] = {}
        self.aux_outputs: dict[tuple[str, str], torch.Tensor] = {}
        self._forward_only: tuple[Any, Any] = (None, None)
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
        gm = trace(self._source[0], args, kwargs)
        passes = default_passes(self.plan, self.mesh)
        manager = PassManager(passes, verify=self._verify, dump=self._dump)
        self.graph_module, ctx = manager.run(gm, self.plan)
        self.pass_results = ctx.results
        self._source = ()
        copies = self.graph_module.meta.get("moec_working_weights")
        if copies:
            grad_dtype = gradient_dtype(self.plan.parallel.microbatches)
            self.working_weights = WorkingWeights(self.graph_module, copies, grad_dtype)

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

    def _program(self) -> fx.GraphModule:
        """The graph to run: under ``torch.no_grad()`` one whose fused LM-head losses skip the
        head's gradients (:func:`moec.passes.loss.forward_only`), built once per graph and set
        of buffers (the copy holds the buffers it was built with: ``.to()`` replaces them)."""
        if torch.is_grad_enabled():
            return self.graph_module
        built_for, program = self._forward_only
        key = (self.graph_module, *self.graph_module.buffers())
        if (
            built_for is None
            or len(built_for) != len(key)
            or any(a is not b for a, b in zip(built_for, key, strict=True))
        ):
            program = forward_only(self.graph_module)
            self._forward_only = (key, program)
        return program

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
