"""Activation memory: which stored tensors a node's backward keeps, and its backward workspace.

A saved tensor is named by a :class:`SavedRef` to the node that stores it: views, ``getitem``
of a view op and the working-weight alias resolve to their base (``stored_ref``), so a tensor
saved by two consumers counts once in totals. Parameters and buffers (``get_attr`` reads and
their views) are never activations.

:func:`backward_workspace` is what a node's backward holds besides saved tensors: the gradients
of its outputs that something reads and of its floating-point inputs, plus what the backward
allocates inside (``moec.expert_mlp``: the pre-activation's gradient [R, U] and the recomputed
activation [R, H]).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable
from typing import Any

import sympy
import torch
import torch.fx as fx

import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.analysis.structure import TRANSPOSE_OPS, VIEW_OPS
from moec.fx import nbytes, numel, sym
from moec.ops.working_weights import working_copy

aten = torch.ops.aten
ZERO = sympy.Integer(0)

VIEW_LIKE = (
    VIEW_OPS
    | TRANSPOSE_OPS
    | {
        aten.expand.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.slice.Tensor,
        aten.select.int,
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.chunk.default,
        aten.unbind.int,
        aten.detach.default,
        aten.sym_size.int,
        aten._assert_tensor_metadata.default,
        operator.getitem,
        working_copy,  # an alias of its first argument, the persistent copy
    }
)
"""Ops that write nothing: views, shape reads and aliases of their first argument."""


@dataclasses.dataclass(frozen=True)
class SavedRef:
    """One tensor kept for backward: output ``index`` of ``node`` (None for a single output)."""

    node: fx.Node
    index: int | None = None

    def nbytes(self) -> sympy.Expr:
        val = self.node.meta.get("val")
        return nbytes(val if self.index is None else val[self.index])


def value_of(arg: Any) -> Any:
    """``meta["val"]`` of a node argument, None for a constant."""
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


def _gathered_cast(node: fx.Node) -> bool:
    """``to.dtype`` of a parameter: what pass ``fsdp`` leaves where FSDP all-gathers the
    parameter in that dtype, so it returns its input (a parameter, never an activation)."""
    source = node.args[0] if node.args else None
    return node.target == aten.to.dtype and isinstance(source, fx.Node) and source.op == "get_attr"


def stored_ref(node: fx.Node) -> SavedRef:
    """The stored tensor ``node`` is (a view of): views and split pieces resolve to their base."""
    while node.op == "call_function" and (node.target in VIEW_LIKE or _gathered_cast(node)):
        if node.target is operator.getitem:
            producer, index = node.args
            if producer.target not in VIEW_LIKE:
                return SavedRef(producer, index)
            node = producer.args[0]
        else:
            node = node.args[0]
    return SavedRef(node)


def is_activation(arg: Any, floating: bool = True) -> bool:
    """A tensor node computed from the inputs (not a parameter or buffer read); with
    ``floating``, a floating-point one."""
    val = value_of(arg)
    if not isinstance(val, torch.Tensor) or stored_ref(arg).node.op == "get_attr":
        return False
    return val.is_floating_point() or not floating


def activation_refs(args: Iterable[Any], floating: bool = True) -> list[SavedRef]:
    """The stored tensors of the activations among ``args``."""
    return [stored_ref(a) for a in args if is_activation(a, floating)]


def _grad_bytes(val: Any) -> sympy.Expr:
    """Bytes of the gradients of ``val``'s floating-point tensors (integers get none)."""
    if isinstance(val, (tuple, list)):
        return sympy.Add(*(_grad_bytes(v) for v in val))
    if isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
        return nbytes(val)
    return ZERO


def backward_workspace(node: fx.Node) -> sympy.Expr:
    """Bytes live together while ``node``'s backward runs, besides saved tensors: the gradients
    of its outputs and of its floating inputs (a parameter's arrives in the dtype the op read
    before it is accumulated), plus what the backward allocates inside: ``moec.expert_mlp``
    (any recipe) holds the pre-activation's gradient [R, U] and the recomputed activation
    [R, H] as well, and with the combine inside (token rows in) also its rows' input gradient
    [R, D]."""
    if node.op != "call_function" or node.target in VIEW_LIKE:
        return ZERO
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):  # only the outputs something reads get a gradient
        read = {u.args[1] for u in node.users if u.target is operator.getitem}
        val = [v for i, v in enumerate(val) if i in read]
    grads = _grad_bytes(val) + sympy.Add(
        *(_grad_bytes(value_of(a)) for a in dict.fromkeys(node.all_input_nodes))
    )
    if node.target == torch.ops.moec.expert_mlp.default:
        x, w_up, w_down = (value_of(a) for a in node.args[:3])
        routes = expert_mlp_routes(node)
        width = sym(w_up.shape[-1]) + sym(w_down.shape[1])
        if routes is None:
            grads += sym(x.shape[0]) * width * x.element_size()
        else:  # also the rows' d_x
            grads += numel(routes) * (width + sym(x.shape[-1])) * x.element_size()
    return grads


def expert_mlp_routes(node: fx.Node) -> torch.Tensor | None:
    """The route table ``rows`` of a ``moec.expert_mlp`` node with the combine inside (its x
    then holds the tokens), else None."""
    rows = node.args[8] if len(node.args) > 8 else node.kwargs.get("rows")
    return None if rows is None else value_of(rows)
