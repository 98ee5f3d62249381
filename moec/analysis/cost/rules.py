"""Per-node cost rules: FLOPs, bytes written and the activations a node's backward keeps.

Every quantity is a sympy expression in the graph's size symbols. A rule is registered for
its ops with :func:`cost_rule` in :data:`RULES` (keyed by the op overload); the ``aten`` rules
live here, the ``moec::`` ops' in :mod:`moec.analysis.cost.moec_rules`, beside each other and
apart from the ops, which import no analysis. Rules (forward pass; a FLOP is a multiply or an
add):

- matmuls (``linear``, ``addmm``, ``mm``, ``matmul``, ``bmm``, ``baddbmm``): 2*M*N*K, i.e.
  2 * numel(out) * K; saved: the operands that are activations (not parameters);
- ``scaled_dot_product_attention``: 2*B*H*Sq*Sk*(Dqk + Dv) (= 4*B*H*Sq*Sk*Dh), halved when
  ``is_causal``; saved: q, k, v and the output;
- embeddings: data movement, saving the indices; softmax: 5 FLOPs per element, saving its
  output; norms: a few FLOPs per element (:data:`NORM_FLOPS`), saving the input;
- ops without a rule: pointwise ops numel(out), saving their floating-point inputs unless the
  op is linear (:data:`LINEAR_POINTWISE`); reductions numel(in); anything else nothing;
- views, getitem and shape ops (:data:`~moec.analysis.cost.memory.VIEW_LIKE`): nothing;
- a call of a sub-graph (a recompute region) costs what its nodes cost and keeps its tensor
  inputs.

``bytes_out`` is what a node writes (every output tensor; views write nothing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import sympy
import torch
import torch.fx as fx

from moec.analysis.cost.memory import (
    VIEW_LIKE,
    SavedRef,
    activation_refs,
    value_of,
)
from moec.analysis.structure import MATMUL_OPS
from moec.fx import called_graph, nbytes, numel, sym

aten = torch.ops.aten
Expr = sympy.Expr
ZERO = sympy.Integer(0)

MATMUL_KINDS = frozenset({"matmul", "attention", "experts"})
"""Node kinds whose FLOPs are tensor-core GEMM work (the report's model FLOPs)."""
LINEAR_POINTWISE = {
    aten.add.Tensor,
    aten.add.Scalar,
    aten.sub.Tensor,
    aten.sub.Scalar,
    aten.rsub.Scalar,
    aten.neg.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten.dropout.default,
}
"""Pointwise ops whose backward needs none of their inputs."""
NORM_FLOPS = {
    aten.rms_norm.default: 4,
    aten.layer_norm.default: 5,
    aten.native_layer_norm.default: 5,
    aten.group_norm.default: 5,
}
"""FLOPs per element of the normalisations (square/subtract, mean, rsqrt, scale, affine)."""
SOFTMAX_FLOPS = 5


@dataclasses.dataclass(frozen=True)
class NodeCost:
    flops: Expr
    bytes_out: Expr
    saved_bytes: Expr
    kind: str
    """``matmul``, ``attention``, ``experts``, ``routing``, ``movement``, ``elementwise``,
    ``norm``, ``reduction``, ``view``, ``region`` or ``other``."""
    saved: tuple[SavedRef, ...] = ()
    """The activations this node's backward keeps (parameters excluded), views resolved."""
    region_matmul_flops: Expr = ZERO
    """For a ``region`` (a sub-graph call, e.g. a recomputed block): its matmul FLOPs."""

    @property
    def matmul_flops(self) -> Expr:
        if self.kind == "region":
            return self.region_matmul_flops
        return self.flops if self.kind in MATMUL_KINDS else ZERO


RuleResult = tuple[Expr, str, list[SavedRef]]
"""(forward FLOPs, kind, saved tensors) of one node."""
Rule = Callable[[fx.Node], RuleResult]

RULES: dict[Any, Rule] = {}
"""Cost rules by op overload; ops not listed fall back to the pointwise / reduction / other
rules."""


def cost_rule(*ops: Any) -> Callable[[Rule], Rule]:
    """Register the decorated function as the cost rule of ``ops`` (op overloads)."""

    def register(rule: Rule) -> Rule:
        for op in ops:
            if op in RULES:
                raise ValueError(f"{op} already has the cost rule {RULES[op].__name__}")
            RULES[op] = rule
        return rule

    return register


@cost_rule(*MATMUL_OPS)
def matmul_rule(node: fx.Node) -> RuleResult:
    operands = (
        node.args[1:3]
        if node.target in (aten.addmm.default, aten.baddbmm.default)
        else (node.args[:2])
    )
    k = sym(value_of(operands[0]).shape[-1])
    return 2 * numel(value_of(node)) * k, "matmul", activation_refs(operands)


@cost_rule(aten.scaled_dot_product_attention.default)
def _attention(node: fx.Node) -> RuleResult:
    q, k, v = (value_of(a) for a in node.args[:3])
    causal = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
    rows = numel(q) / sym(q.shape[-1])  # B * H * Sq
    flops = 2 * rows * sym(k.shape[-2]) * (sym(q.shape[-1]) + sym(v.shape[-1]))
    return flops / 2 if causal else flops, "attention", activation_refs([*node.args[:3], node])


@cost_rule(aten.embedding.default)
def _embedding(node: fx.Node) -> RuleResult:
    return ZERO, "movement", activation_refs(node.args[1:2], floating=False)


@cost_rule(aten._softmax.default, aten.softmax.int)
def _softmax(node: fx.Node) -> RuleResult:
    return SOFTMAX_FLOPS * numel(value_of(node)), "elementwise", [SavedRef(node)]


@cost_rule(*NORM_FLOPS)
def _norm(node: fx.Node) -> RuleResult:
    flops = NORM_FLOPS[node.target] * numel(value_of(node.args[0]))
    return flops, "norm", activation_refs(node.args[:1])


def _fallback(node: fx.Node) -> RuleResult:
    target = node.target
    tags = getattr(target, "tags", ())
    if torch.Tag.pointwise in tags:
        saved = [] if target in LINEAR_POINTWISE else activation_refs(node.args)
        return numel(value_of(node)), "elementwise", saved
    if torch.Tag.reduction in tags and isinstance(value_of(node.args[0]), torch.Tensor):
        return numel(value_of(node.args[0])), "reduction", []
    return ZERO, "other", []


def _rule_result(node: fx.Node) -> RuleResult:
    if node.target in VIEW_LIKE:
        return ZERO, "view", []
    return RULES.get(node.target, _fallback)(node)


def _region_cost(node: fx.Node, region: fx.GraphModule) -> NodeCost:
    """A sub-graph call costs what its nodes cost; the call itself keeps its tensor inputs."""
    inner = [node_cost(n) for n in region.graph.nodes]
    saved = tuple(dict.fromkeys(activation_refs(node.args[2:])))
    return NodeCost(
        sympy.Add(*(c.flops for c in inner)),
        nbytes(node.meta.get("val")),
        sympy.Add(*(ref.nbytes() for ref in saved)),
        "region",
        saved,
        sympy.Add(*(c.matmul_flops for c in inner)),
    )


def node_cost(node: fx.Node) -> NodeCost:
    """FLOPs, bytes written and activation bytes saved for backward by one node."""
    if node.op != "call_function":
        return NodeCost(ZERO, ZERO, ZERO, "view" if node.op == "get_attr" else "other")
    region = called_graph(node)
    if region is not None:
        return _region_cost(node, region)
    flops, kind, saved = _rule_result(node)
    bytes_out = ZERO if kind == "view" else nbytes(node.meta.get("val"))
    saved = tuple(dict.fromkeys(saved))
    saved_bytes = sympy.Add(*(ref.nbytes() for ref in saved))
    return NodeCost(sympy.sympify(flops), bytes_out, saved_bytes, kind, saved)
