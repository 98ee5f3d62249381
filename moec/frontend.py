"""Capture a model as a flat, trainable ATen-level ``fx.GraphModule``.

``trace(model, example_inputs)`` runs ``torch.export.export(strict=False)`` with every input
dimension marked ``Dim.AUTO`` (so batch and sequence lengths stay symbolic), takes the exported
program's ``.module()`` (parameters as ``get_attr`` nodes, shared with ``model``) and rewrites its
calling convention to a flat one: ``forward(*flat_inputs) -> tuple(flat_outputs)``. The pytree
specs that map the user's ``(args, kwargs)`` and outputs to and from that flat form are kept in
``gm.meta`` (see :class:`GraphSignature`); passes may append extra outputs after the user's.

``method="symbolic_trace"`` first runs ``torch.fx.symbolic_trace`` (for plain modules that
should be checked for FX traceability) and exports the result, so the IR is the same.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export import Dim


class CaptureError(RuntimeError):
    """The model could not be captured; the message says why and what to try."""


@dataclasses.dataclass
class GraphSignature:
    """How user inputs/outputs map to the flat graph. Stored as ``gm.meta["moec_signature"]``."""

    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    num_user_outputs: int
    aux_outputs: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(module path, kind) of every output past the user's, in order, added by passes."""

    def flatten_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise CaptureError(
                "inputs do not have the structure the model was captured with:\n"
                f"  captured: {self.in_spec}\n  called:   {spec}\n"
                "call with the same arguments (tensor sizes may differ) or compile again"
            )
        return flat

    def unflatten_outputs(self, flat: tuple) -> Any:
        return pytree.tree_unflatten(list(flat[: self.num_user_outputs]), self.out_spec)


def signature(gm: fx.GraphModule) -> GraphSignature:
    sig = gm.meta.get("moec_signature")
    if sig is None:
        raise CaptureError("this GraphModule was not made by moec.trace (no moec_signature)")
    return sig


def trace(
    model: torch.nn.Module,
    example_inputs: tuple | Any,
    example_kwargs: dict | None = None,
    *,
    method: str = "export",
    dynamic: bool = True,
) -> fx.GraphModule:
    """Capture ``model(*example_inputs, **example_kwargs)`` as a flat ATen graph (see module)."""
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"moec.trace needs an nn.Module, got {type(model).__name__}")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    if method == "symbolic_trace":
        try:
            model = fx.symbolic_trace(model)
        except Exception as exc:
            raise CaptureError(
                f"torch.fx.symbolic_trace failed on {type(model).__name__}: {exc}\n"
                "use method='export' (the default), which handles data-dependent Python"
            ) from exc
    elif method != "export":
        raise CaptureError(f"unknown capture method {method!r}; use 'export' or 'symbolic_trace'")
    _check_example_sizes(args, kwargs, dynamic)
    dynamic_shapes = _auto_dims(model, args, kwargs) if dynamic else None
    try:
        program = torch.export.export(
            model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes
        )
    except Exception as exc:
        raise CaptureError(_explain(model, exc, dynamic)) from exc
    gm = program.module()
    in_spec, out_spec = gm._in_spec, gm._out_spec
    gm._forward_pre_hooks.clear()
    _drop_input_guards(gm)
    gm.graph._codegen = fx.graph.CodeGen()
    output = gm.graph.output_node()
    flat_outputs = tuple(output.args[0])
    output.args = (flat_outputs,)
    gm.recompile()
    gm.meta["moec_signature"] = GraphSignature(in_spec, out_spec, len(flat_outputs))
    gm.meta["moec_param_roles"] = {}
    return gm


def _drop_input_guards(gm: fx.GraphModule) -> None:
    """Remove export's ``_guards_fn`` call: neither fake propagation nor our flat calling
    convention can run it. Inputs outside the sizes the model supports (a sequence longer than
    its position table) still fail, with the shape error of the op that cannot take them."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
            delattr(gm, "_guards_fn")


def _auto_dims(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``Dim.AUTO`` on every dimension of every tensor input, keyed by parameter name."""

    def spec(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return {d: Dim.AUTO for d in range(x.dim())}
        return None

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {
        name: pytree.tree_map(spec, value, is_leaf=lambda x: x is None)
        for name, value in bound.arguments.items()
    }


def _check_example_sizes(args: tuple, kwargs: dict, dynamic: bool) -> None:
    if not dynamic:
        return
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and 1 in leaf.shape[:2]:
            raise CaptureError(
                f"example input of shape {tuple(leaf.shape)} has a batch or sequence size of 1; "
                "export would specialise that dimension to 1 and every other size would "
                "recapture. Give examples with batch >= 2 and sequence >= 2"
            )


def _explain(model: torch.nn.Module, exc: Exception, dynamic: bool) -> str:
    name = type(model).__name__
    hints = [
        "check that model(*example_inputs) runs eagerly",
        "data-dependent Python control flow (if on tensor values) cannot be captured: "
        "rewrite it with torch.where / torch.cond",
    ]
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        hints.insert(0, "this looks like a transformers model: build it with use_cache=False")
    if dynamic:
        hints.append("if the error is about dynamic shapes, try dynamic=False")
    lines = "\n".join(f"  - {h}" for h in hints)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"could not capture {name} with torch.export (strict=False): {first}\ntry:\n{lines}"
