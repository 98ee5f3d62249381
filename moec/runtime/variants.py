"""Variants of a program's graph the runtime derives: the other mode's, and the no-grad one.

- :func:`graph_in_mode`: the graph captured in train mode, run in eval mode (or back): the
  ``train`` argument of every ATen op that has one (``dropout``, ``native_dropout``,
  ``feature_dropout``, ``alpha_dropout``, ``feature_alpha_dropout``, the RNNs' inter-layer
  dropout) set to the mode and, in eval mode, the attention's ``dropout_p`` set to 0. Batch
  norm (a ``training`` argument or a running-statistics update) has no switch: a graph holding
  it raises :class:`ModeError` instead.
- :func:`forward_only`: the graph for calls under ``torch.no_grad()``, whose fused LM-head
  losses (``moec::linear_cross_entropy``) skip the head's gradients.

Each returns a copy sharing the graph's parameter and buffer tables and submodules (so a
parameter replaced in the graph, as FSDP2 does for each forward, is replaced in the copy), or
the graph itself when nothing changes; the graph it is given is never edited.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from moec.errors import MoecError


class ModeError(MoecError):
    """The compiled graph cannot run in the mode asked for (see the module docstring)."""


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
    return _sharing(gm, graph, regions)


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


def forward_only(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` for calls that need no gradients (``torch.no_grad()``): a copy whose fused losses
    run with ``with_grads=False`` (no head-gradient GEMMs), sharing ``gm``'s parameters and
    meta; ``gm`` itself when it has no fused loss."""
    fused = torch.ops.moec.linear_cross_entropy.default
    if not any(n.target is fused for n in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if node.target is fused:
            node.args = (*node.args[:6], False)
    return _sharing(gm, graph)


def _sharing(
    gm: fx.GraphModule, graph: fx.Graph, children: dict[str, fx.GraphModule] | None = None
) -> fx.GraphModule:
    """``graph`` run on ``gm``'s own parameter and buffer tables and submodules (``children``
    in place of some): a parameter put in ``gm`` later is the one the copy reads (FSDP2 puts
    the gathered parameters of its root in place of their shards for each forward of the
    root, whichever graph that forward runs)."""
    copy = fx.GraphModule(gm, graph)
    copy._parameters, copy._buffers = gm._parameters, gm._buffers
    copy._modules = {**gm._modules, **(children or {})}
    return copy
