"""The shared symbolic cost model: FLOPs, bytes written and activation bytes saved, per node.

Every quantity is a sympy expression in the graph's symbolic sizes (the batch and sequence
symbols of ``meta["val"]`` shapes), so one analysis answers for every batch and sequence length;
``GraphCost.evaluate()`` substitutes the example sizes recorded by the ShapeEnv, or others::

    cost = graph_cost(gm)
    cost.evaluate().flops_per_token          # at the example shapes
    cost.evaluate(batch=8, seq=4096).flops   # anywhere else
    node_cost(node).flops                    # one node, e.g. 2*s0*s1*128*512
    node_cost(node).saved                    # the tensors its backward keeps (SavedRef)

By subject:

- :mod:`~moec.analysis.cost.sizes`: what the size symbols mean (tokens, ``batch``, ``seq``);
- :mod:`~moec.analysis.cost.rules`: the per-op rules, a registry keyed by op, with the ``aten``
  rules; :mod:`~moec.analysis.cost.moec_rules`: the rules of the ``moec::`` ops;
- :mod:`~moec.analysis.cost.memory`: saved tensors (views resolved to their base) and the
  backward workspace of a node;
- :mod:`~moec.analysis.cost.model`: totals per graph and per residual block;
- :mod:`~moec.analysis.cost.report`: a cost evaluated at concrete sizes, and its text.

Size helpers shared with the passes (``nbytes``, ``evaluate``) are :mod:`moec.fx`'s.
"""

from moec.analysis.cost import moec_rules  # noqa: F401  (registers the moec:: ops' rules)
from moec.analysis.cost.memory import VIEW_LIKE, SavedRef, backward_workspace
from moec.analysis.cost.model import (
    PRICED_KINDS,
    BlockCost,
    CostTotals,
    FFNInfo,
    GraphCost,
    graph_cost,
    work_by_kind,
)
from moec.analysis.cost.report import CostReport, format_count
from moec.analysis.cost.rules import RULES, NodeCost, cost_rule, node_cost

__all__ = [
    "PRICED_KINDS",
    "RULES",
    "VIEW_LIKE",
    "BlockCost",
    "CostReport",
    "CostTotals",
    "FFNInfo",
    "GraphCost",
    "NodeCost",
    "SavedRef",
    "backward_workspace",
    "cost_rule",
    "format_count",
    "graph_cost",
    "work_by_kind",
    "node_cost",
]
