"""Helpers every pass uses to edit a graph while keeping its invariants.

Invariants (checked by :mod:`moec.passes.verify` after every pass):

- every ``call_function`` and ``get_attr`` node has ``meta["val"]`` (a FakeTensor or a tuple of
  them) equal to what fake propagation computes;
- every new node has ``meta["nn_module_stack"]`` (copied from the node it replaces or extends)
  and ``meta["from_pass"]`` naming the pass that made it;
- every ``get_attr`` target exists, and every parameter is read by some ``get_attr``, except
  those the captured model never read (an unused ``nn.Linear``: they stay parameters);
- outputs past the user's (aux losses, routing statistics) are listed in the signature.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from moec.fx import (
    ensure_submodule,
    fake_mode,
    node_order,
    propagate_fake,
    symbolic_dispatch,
)

__all__ = ["GraphEditor", "delete_attribute", "erase_unused", "fake_mode", "refresh_meta"]


class GraphEditor:
    """Creates nodes with fake values and provenance for one pass on one graph."""

    def __init__(self, gm: fx.GraphModule, pass_name: str):
        self.gm, self.graph, self.pass_name = gm, gm.graph, pass_name
        self.mode = fake_mode(gm)

    def call(self, target: Any, args: tuple, like: fx.Node, kwargs: dict | None = None) -> fx.Node:
        """A ``call_function`` node; ``like`` donates its module stack."""
        kwargs = kwargs or {}
        node = self.graph.call_function(target, args, kwargs)
        fake_args, fake_kwargs = pytree.tree_map_only(
            fx.Node, lambda n: n.meta["val"], (args, kwargs)
        )
        with symbolic_dispatch(self.mode):
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        self._stamp(node, like)
        return node

    def getitem(self, node: fx.Node, index: int) -> fx.Node:
        item = self.graph.call_function(operator.getitem, (node, index))
        item.meta["val"] = node.meta["val"][index]
        self._stamp(item, node)
        return item

    def parameter(self, path: str, value: torch.Tensor, like: fx.Node) -> fx.Node:
        """Register ``value`` as a Parameter at dotted ``path`` and read it with a get_attr."""
        return self._attribute(
            path, like, lambda owner, name: owner.register_parameter(name, nn.Parameter(value))
        )

    def buffer(
        self, path: str, value: torch.Tensor, like: fx.Node, persistent: bool = False
    ) -> fx.Node:
        """Register ``value`` as a buffer at dotted ``path`` (state the runtime keeps, not a
        parameter; in ``state_dict``, and so in checkpoints, only when ``persistent``) and read
        it with a get_attr."""
        return self._attribute(
            path,
            like,
            lambda owner, name: owner.register_buffer(name, value, persistent=persistent),
        )

    def _attribute(
        self, path: str, like: fx.Node, register: Callable[[nn.Module, str], None]
    ) -> fx.Node:
        owner_path, _, name = path.rpartition(".")
        owner = ensure_submodule(self.gm, owner_path)
        if hasattr(owner, name):
            raise RuntimeError(f"pass {self.pass_name}: attribute {path!r} already exists")
        register(owner, name)
        node = self.graph.get_attr(path)
        node.meta["val"] = self.mode.from_tensor(getattr(owner, name), static_shapes=True)
        self._stamp(node, like)
        return node

    def _stamp(self, node: fx.Node, like: fx.Node) -> None:
        node.meta["nn_module_stack"] = dict(like.meta.get("nn_module_stack") or {})
        node.meta["from_pass"] = self.pass_name


def refresh_meta(gm: fx.GraphModule) -> None:
    """Recompute every node's ``meta["val"]`` by fake propagation from the placeholders' (after
    a rewrite that changes dtypes or shapes downstream of the nodes it made)."""
    propagate_fake(gm)


def delete_attribute(gm: fx.GraphModule, path: str) -> None:
    owner_path, _, name = path.rpartition(".")
    delattr(gm.get_submodule(owner_path) if owner_path else gm, name)


def erase_unused(gm: fx.GraphModule, nodes: list[fx.Node]) -> list[str]:
    """Erase ``nodes`` (in reverse order), then whatever fed only them: pure calls left without
    users (a parameter's transpose or cast) and get_attrs; return the parameter targets whose
    attributes were deleted."""
    removed_params: list[str] = []
    order = node_order(gm.graph)
    left = sorted(nodes, key=order.__getitem__, reverse=True)
    while left:
        node = left.pop(0)
        inputs = [a for a in node.all_input_nodes]
        gm.graph.erase_node(node)
        for inp in inputs:
            if inp.users or inp in left:
                continue
            if inp.op == "call_function" and not inp.is_impure():
                left.append(inp)
            elif inp.op == "get_attr":
                target = str(inp.target)
                gm.graph.erase_node(inp)
                if not any(n.op == "get_attr" and n.target == target for n in gm.graph.nodes):
                    delete_attribute(gm, target)
                    removed_params.append(target)
    return removed_params
