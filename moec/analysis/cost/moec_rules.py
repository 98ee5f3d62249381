"""Cost rules of the ``moec::`` ops, one per op, registered in :data:`~.rules.RULES`.

The ops (:mod:`moec.ops`) import no analysis; their rules live here, each keyed by its op
overload. Over R = T*K routed rows of T tokens, top-K:

- ``moec.expert_mlp`` (any recipe): 2*R*(D*U + H*D) (an EP receive buffer counts this rank's
  T*K routes, not its padding); saves its input rows and the pre-activation h; with the combine
  inside, over R = T*K rows of its route table plus the combine's 2*R*D, saving the tokens, the
  table, the route weights and h (not the experts' output);
- ``moec.route``: 4 FLOPs per logit, saving the logits and the chosen expert ids;
  ``moec.router_losses``: 6 per logit, saving its inputs;
- ``moec.dispatch``: data movement, saving the row indices; ``moec.combine``: its weighted sum,
  2*T*K*D, saving its inputs; ``moec.ep_combine``: movement, saving what its backward reads
  (the picked rows home, or on ``rowwise`` the route weights and the expert output ``y`` on the
  experts' side);
- ``moec.quantized_linear``: as ``aten.linear`` (the recipe changes the rate, not the work);
- ``moec.linear_cross_entropy``: the head's 2*N*D*V, saving the gradients it computed in the
  forward (held until the backward scales them);
- ``moec.flash_attention``: as ``scaled_dot_product_attention`` (pass ``bind`` swaps one for
  the other), saving q, k, v, its output and the softmax statistics;
- ``moec.rope``: 3 FLOPs per element, saving nothing but its (buffer) tables; ``moec.glu``:
  2 FLOPs per output element, saving its input.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.analysis.cost.memory import (
    SavedRef,
    activation_refs,
    expert_mlp_routes,
    stored_ref,
    value_of,
)
from moec.analysis.cost.rules import RuleResult, cost_rule, matmul_rule
from moec.fx import argument, numel, sym

ops = torch.ops.moec

ROUTE_FLOPS_PER_LOGIT = 4
LOSSES_FLOPS_PER_LOGIT = 6
ROPE_FLOPS = 3  # two products and a sum per element
GLU_FLOPS = 2  # as the unfused act and product count (one FLOP per element each)


def _expert_rows(buffer: fx.Node) -> sympy.Expr:
    """Useful rows of an expert buffer: every row of a local one (T*K), but only this rank's
    T*K routes for an EP receive buffer, whose padding to the per-source capacity is not work
    a balanced router asks for."""
    if buffer.op == "call_function" and getattr(buffer.target, "name", lambda: "")() in (
        "moec::ep_dispatch",
        "moec::ep_dispatch_wait",  # pass overlap's split exchange: args[1] is slots too
    ):
        return numel(value_of(buffer.args[1]))  # slots: (T, K) routes of this rank
    return sym(value_of(buffer).shape[0])


@cost_rule(ops.expert_mlp.default)
def _expert_mlp(node: fx.Node) -> RuleResult:
    x, w_up, w_down = (value_of(a) for a in node.args[:3])
    dim, up, hidden = sym(x.shape[-1]), sym(w_up.shape[-1]), sym(w_down.shape[1])
    routes = expert_mlp_routes(node)
    if routes is None:
        flops = 2 * _expert_rows(node.args[0]) * (dim * up + hidden * dim)
        return flops, "experts", [stored_ref(node.args[0]), SavedRef(node, 1)]
    flops = 2 * numel(routes) * (dim * up + hidden * dim + dim)  # and the combine
    tokens, rows, weights = node.args[0], node.args[8], node.args[9]
    return flops, "experts", [*(stored_ref(a) for a in (tokens, rows, weights)), SavedRef(node, 1)]


@cost_rule(ops.flash_attention.default)
def _flash_attention(node: fx.Node) -> RuleResult:
    q, k, v = (value_of(a) for a in node.args[:3])
    rows = numel(q) / sym(q.shape[-1])  # B * H * Sq
    flops = 2 * rows * sym(k.shape[-2]) * (sym(q.shape[-1]) + sym(v.shape[-1]))
    saved = [*activation_refs(node.args[:3]), SavedRef(node, 0), SavedRef(node, 1)]
    return flops / 2 if node.args[3] else flops, "attention", saved


# x[*, K] times weight[N, K] as aten.linear, whatever the recipe's operand precision
cost_rule(ops.quantized_linear.default)(matmul_rule)


@cost_rule(ops.route.default)
def _route(node: fx.Node) -> RuleResult:
    flops = ROUTE_FLOPS_PER_LOGIT * numel(value_of(node.args[0]))
    return flops, "routing", [stored_ref(node.args[0]), SavedRef(node, 0)]


@cost_rule(ops.router_losses.default)
def _router_losses(node: fx.Node) -> RuleResult:
    flops = LOSSES_FLOPS_PER_LOGIT * numel(value_of(node.args[0]))
    return flops, "routing", activation_refs(node.args[:2], floating=False)


@cost_rule(ops.dispatch.default)
def _dispatch(node: fx.Node) -> RuleResult:
    return sympy.Integer(0), "movement", [stored_ref(node.args[1])]


@cost_rule(ops.combine.default)
def _combine(node: fx.Node) -> RuleResult:
    y, _, rows = (value_of(a) for a in node.args)
    flops = 2 * numel(rows) * sym(y.shape[-1])
    return flops, "movement", activation_refs(node.args, floating=False)


@cost_rule(ops.ep_combine.default)
def _ep_combine(node: fx.Node) -> RuleResult:
    # ep_combine(y, weights, slots, recv_rows, sent, counts, group, ep_size, path) -> (out, saved)
    saved = [SavedRef(node, 1)]  # picked rows home, or rowwise's route weights on the experts
    if argument(node, "path") == "rowwise":  # whose backward reads the expert output there too
        saved.append(stored_ref(node.args[0]))
    return sympy.Integer(0), "movement", saved


@cost_rule(ops.linear_cross_entropy.default)
def _linear_cross_entropy(node: fx.Node) -> RuleResult:
    # the head GEMM (the backward's two run in the forward: useful FLOPs stay 3x this)
    flops = 2 * numel(value_of(node.args[0])) * sym(value_of(node.args[1]).shape[0])
    return flops, "matmul", [SavedRef(node, 1), SavedRef(node, 2), SavedRef(node, 3)]


@cost_rule(ops.rope.default)
def _rope(node: fx.Node) -> RuleResult:
    return ROPE_FLOPS * numel(value_of(node)), "elementwise", []  # saves only the tables


@cost_rule(ops.glu.default)
def _glu(node: fx.Node) -> RuleResult:
    return GLU_FLOPS * numel(value_of(node)), "elementwise", activation_refs(node.args[:1])
