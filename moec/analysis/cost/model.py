"""The graph's cost model: per-node costs summed per graph and per residual block.

:func:`graph_cost` applies :func:`~moec.analysis.cost.rules.node_cost` to every node and sums
per graph and per residual block (an FFN's parent module: the dense FFN regions
:func:`~moec.analysis.structure.find_structure` finds and the MoE layers the ``moe`` pass
recorded). Activation bytes are counted once per stored tensor (views resolved to their base),
which is what a recompute budget needs. Training FLOPs are 3x the forward matmul FLOPs (forward
+ two backward GEMMs), the report's useful-model FLOPs that exclude recompute. Parameters count
once; active parameters count an expert's top_k / num_experts of its size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import sympy
import torch.fx as fx

from moec.analysis.cost.report import CostReport
from moec.analysis.cost.rules import NodeCost, node_cost
from moec.analysis.cost.sizes import friendly_dims, tokens
from moec.analysis.structure import find_structure, module_path
from moec.fx import called_graph, evaluate, example_sizes, owning_path, under
from moec.program import MoELayer, ParamRole, Program

Expr = sympy.Expr


@dataclasses.dataclass
class CostTotals:
    """Sums over a set of nodes; ``saved_bytes`` counts each stored tensor once."""

    flops: Expr
    matmul_flops: Expr
    bytes_out: Expr
    saved_bytes: Expr

    @classmethod
    def of(cls, costs: dict[fx.Node, NodeCost], nodes: Iterable[fx.Node]) -> CostTotals:
        nodes = list(nodes)
        saved = dict.fromkeys(ref for n in nodes for ref in costs[n].saved)
        return cls(
            sympy.Add(*(costs[n].flops for n in nodes)),
            sympy.Add(*(costs[n].matmul_flops for n in nodes)),
            sympy.Add(*(costs[n].bytes_out for n in nodes)),
            sympy.Add(*(ref.nbytes() for ref in saved)),
        )

    @property
    def train_flops(self) -> Expr:
        """Useful training FLOPs: forward + backward matmuls, recompute excluded."""
        return 3 * self.matmul_flops


PRICED_KINDS = ("matmul", "attention", "experts")
"""Node kinds the time model prices by FLOPs; every other node by the bytes it writes."""


def work_by_kind(costs: Iterable[NodeCost]) -> tuple[dict[str, Expr], Expr]:
    """Forward FLOPs of each of :data:`PRICED_KINDS` (a region's, e.g. a recomputed block, as
    ``matmul``) and the bytes the other nodes write."""
    flops: dict[str, Expr] = {kind: sympy.Integer(0) for kind in PRICED_KINDS}
    other = sympy.Integer(0)
    for c in costs:
        if c.kind in PRICED_KINDS:
            flops[c.kind] += c.flops
        elif c.kind == "region":
            flops["matmul"] += c.flops
            other += c.bytes_out
        else:
            other += c.bytes_out
    return flops, other


@dataclasses.dataclass
class FFNInfo:
    path: str
    """Module path of the FFN (``layers.3.ffn``)."""
    activation: str
    dim: int
    hidden: int
    """Hidden width of the dense FFN, or of one routed expert."""
    num_experts: int = 0
    """Routed experts; 0 for a dense FFN."""
    top_k: int = 0
    shared_expert: bool = False

    def describe(self) -> str:
        shape = f"{self.activation} {self.dim}->{self.hidden}->{self.dim}"
        if not self.num_experts:
            return f"dense {shape}"
        shared = " +shared" if self.shared_expert else ""
        return f"moe {self.num_experts}x {shape} top-{self.top_k}{shared}"


@dataclasses.dataclass
class BlockCost:
    index: int
    path: str
    """Module path of the residual block (the FFN's parent module)."""
    ffn: FFNInfo
    cost: CostTotals
    ffn_cost: CostTotals
    params: int
    active_params: int

    def report(self, values: dict[sympy.Symbol, int]) -> dict[str, Any]:
        """This block's row of a :class:`CostReport` at the symbol ``values``."""
        return {
            "index": self.index,
            "path": self.path,
            "ffn": self.ffn.describe(),
            "ffn_path": self.ffn.path,
            "flops": evaluate(self.cost.flops, values),
            "ffn_flops": evaluate(self.ffn_cost.flops, values),
            "saved_bytes": evaluate(self.cost.saved_bytes, values),
            "params": self.params,
            "active_params": self.active_params,
        }


@dataclasses.dataclass
class GraphCost:
    nodes: dict[fx.Node, NodeCost]
    total: CostTotals
    blocks: list[BlockCost]
    tokens: Expr
    """Tokens per step: numel of the first integer input (or all-but-last dims of the first)."""
    params: int
    active_params: int
    """Parameters one token uses: expert parameters count top_k / num_experts of their size."""
    dims: dict[str, sympy.Symbol]
    """Friendly names of the input size symbols (``batch``, ``seq``) besides their own names."""
    example: dict[sympy.Symbol, int]
    """The example value of every size symbol (the ShapeEnv's ``var_to_val``)."""

    def sizes(self, **sizes: int) -> dict[sympy.Symbol, int]:
        """Symbol values: the example's, overridden by ``sizes`` (friendly or symbol names)."""
        by_name = {**{str(s): s for s in self.example}, **self.dims}
        values = dict(self.example)
        for name, value in sizes.items():
            if name not in by_name:
                raise KeyError(f"unknown size {name!r}; known: {sorted(by_name)}")
            values[by_name[name]] = value
        return values

    def value(self, expr: Expr, **sizes: int) -> int:
        return evaluate(expr, self.sizes(**sizes))

    def evaluate(self, **sizes: int) -> CostReport:
        values = self.sizes(**sizes)
        names = {s: n for n, s in self.dims.items()}
        return CostReport(
            sizes={names.get(s, str(s)): int(v) for s, v in values.items()},
            tokens=evaluate(self.tokens, values),
            flops=evaluate(self.total.flops, values),
            matmul_flops=evaluate(self.total.matmul_flops, values),
            train_flops=evaluate(self.total.train_flops, values),
            bytes_out=evaluate(self.total.bytes_out, values),
            saved_bytes=evaluate(self.total.saved_bytes, values),
            params=self.params,
            active_params=self.active_params,
            blocks=[b.report(values) for b in self.blocks],
        )


def graph_cost(program: Program | fx.GraphModule) -> GraphCost:
    """Per-node costs and their totals per graph and per residual block (see module). A bare
    graph has no MoE layers: its FFNs are the dense ones the structure analysis finds."""
    if isinstance(program, fx.GraphModule):
        gm, layers, roles = program, [], {}
    else:
        gm, layers, roles = program.graph, program.moe_layers, program.param_roles
    costs = {n: node_cost(n) for n in gm.graph.nodes}
    param_sizes = {name: p.numel() for name, p in gm.named_parameters()}
    active = _active_param_sizes(layers, roles, param_sizes)
    return GraphCost(
        nodes=costs,
        total=CostTotals.of(costs, gm.graph.nodes),
        blocks=_blocks(gm, layers, costs, param_sizes, active),
        tokens=tokens(gm),
        params=sum(param_sizes.values()),
        active_params=round(sum(active.values())),
        dims=friendly_dims(gm),
        example=example_sizes(gm),
    )


def _active_param_sizes(
    layers: list[MoELayer], roles: dict[str, ParamRole], sizes: dict[str, int]
) -> dict[str, float]:
    """Each parameter's size times the share of tokens that use it (top_k / N for experts)."""
    active = {}
    for name, size in sizes.items():
        layer = next((m for m in layers if under(name, m.path)), None)
        share = layer.top_k / layer.num_experts if layer and roles.get(name) == "expert" else 1.0
        active[name] = size * share
    return active


def _ffns(gm: fx.GraphModule, layers: list[MoELayer]) -> list[FFNInfo]:
    """Dense FFN regions still in the graph and the MoE layers the ``moe`` pass made."""
    moe = {
        m.path.removesuffix(".moe"): FFNInfo(
            m.path.removesuffix(".moe"),
            m.activation,
            m.dim,
            m.expert_width,
            m.num_experts,
            m.top_k,
            m.shared_expert,
        )
        for m in layers
    }
    dense = [
        FFNInfo(b.ffn.module_path, b.ffn.activation, b.ffn.dim, b.ffn.hidden)
        for b in find_structure(gm).blocks
        if b.ffn.module_path not in moe
    ]
    return dense + list(moe.values())


def _blocks(
    gm: fx.GraphModule,
    layers: list[MoELayer],
    costs: dict[fx.Node, NodeCost],
    param_sizes: dict[str, int],
    active: dict[str, float],
) -> list[BlockCost]:
    ffns = {f.path.rpartition(".")[0] or f.path: f for f in _ffns(gm, layers) if f.path}
    members: dict[str, list[fx.Node]] = {path: [] for path in ffns}
    for node in gm.graph.nodes:
        path = owning_path(module_path(node), members)
        if path is not None:
            members[path].append(node)
    paths = in_graph_order(gm, [p for p in members if members[p]])
    blocks = []
    for index, path in enumerate(paths):
        ffn = ffns[path]
        ffn_nodes = [n for n in members[path] if owning_path(module_path(n), {ffn.path})]
        names = [n for n in param_sizes if owning_path(n, {path})]
        blocks.append(
            BlockCost(
                index=index,
                path=path,
                ffn=ffn,
                cost=CostTotals.of(costs, members[path]),
                ffn_cost=CostTotals.of(costs, ffn_nodes),
                params=sum(param_sizes[n] for n in names),
                active_params=round(sum(active[n] for n in names)),
            )
        )
    return blocks


def in_graph_order(gm: fx.GraphModule, paths: Iterable[str]) -> list[str]:
    """Module ``paths`` ordered by the first node that runs under each (those none runs under
    are dropped)."""
    paths, first = set(paths), {}
    for i, node in enumerate(gm.graph.nodes):
        path = module_path(node)
        for p in paths:
            if under(path, p):
                first.setdefault(p, i)
    return sorted(first, key=first.__getitem__)


def block_paths(gm: fx.GraphModule, cost: GraphCost) -> list[str]:
    """The residual blocks of ``gm`` in graph order, by module path: the cost model's (each
    FFN's parent module: the dense FFN regions :func:`~moec.analysis.structure.find_structure`
    finds and the MoE layers the ``moe`` pass recorded) and the blocks the ``recompute`` pass
    moved into regions (whose FFNs the structure finder can no longer see). The one home of
    "which blocks a program has": the pipeline units, FSDP groups, the plan search's profile
    and the profiler's block ranges all read it."""
    paths = {b.path for b in cost.blocks}
    paths |= {module_path(n) for n in gm.graph.nodes if called_graph(n) is not None}
    return in_graph_order(gm, (p for p in paths if p))
