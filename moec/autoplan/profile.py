"""The model as the plan search sees it: per pipeline unit, costs as functions of the microbatch.

:func:`profile_program` reads a program built once on one rank (``ep = pp = dp = 1``, no
recompute) and, optionally, the same model built with FSDP (``dp = dp_shard = 2``) to learn
which parameters FSDP shards and its groups; it keeps, per unit of the ``pipeline`` pass
(:mod:`moec.passes.pipeline.units` at ``sublayer`` granularity: each residual block's pre-FFN
and FFN halves, or a whole block where it has nothing before its FFN; the prologue joined to the
first and the epilogue to the last):

- forward FLOPs by kind (dense matmuls, and of them the dense FFNs' that the ``precision``
  scope ``dense_ffn`` quantizes; attention; routed experts), bytes the other nodes write,
  and activation bytes kept for backward without recompute and under block recompute (the
  recompute region keeps its tensor inputs, the cost model's rule; the prologue and
  epilogue are not recomputed) and the transient of recomputing it, each a function of
  (batch, seq) per microbatch (the cost model's sympy expressions, compiled once);
- its MoE layers (experts, top-k, width, capacity factor) and its parameters (shape, dtype,
  role, working copy, FSDP group), from which :mod:`~moec.autoplan.memory` sizes
  every layout analytically, with :mod:`moec.analysis.rank_memory`'s accounting.

Optionally a third program, the same model with ``lowering.combine_in_experts`` (each MoE
layer's dispatch and combine folded into its expert MLP), is profiled as
:attr:`ModelProfile.folded`: the same units with what that lowering keeps for backward,
which the search offers as a memory lever at EP = 1.

:meth:`ModelProfile.repeat_block` grows a captured model to its full depth (a model captured
with a few identical blocks stands for one with many, e.g. the report's 63-layer Ultra).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

import sympy
import torch
import torch.fx as fx

from moec.analysis.cost import graph_cost, node_cost, work_by_kind
from moec.analysis.cost.memory import is_activation, stored_ref
from moec.analysis.cost.model import block_paths
from moec.fx import module_path, under
from moec.passes.pipeline.units import (
    CE_FLOPS_PER_LOGIT,
    FFN,
    loss_flops,
    moe_layers_in,
    pipeline_units,
)
from moec.passes.precision import dense_ffn_linears
from moec.program import MoELayer, Program

CostFn = Callable[[int, int], float]
"""A cost of one microbatch as a function of (sequences, sequence length)."""


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    itemsize: int
    trainable: bool
    expert: bool
    """An expert slice: dim 0 is the experts, split by EP."""
    master: bool
    """Read through a persistent bf16 working copy (pass ``working_weights``) without FSDP."""
    fsdp: bool
    """Sharded by FSDP when ``dp_shard > 1`` (its ``group``: "" is the root unit)."""
    group: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass
class UnitProfile:
    """One pipeline unit (see module)."""

    name: str
    """The pipeline pass's name of the unit (``layers.3 (FFN)``)."""
    block: int
    """Index of the residual block the unit belongs to (a block's halves share it)."""
    paths: list[str]
    matmul_flops: CostFn
    dense_ffn_flops: CostFn
    """The dense FFN linears' part of ``matmul_flops`` (``precision.scope: [dense_ffn]``)."""
    attention_flops: CostFn
    expert_flops: CostFn
    other_bytes: CostFn
    saved: CostFn
    """Bytes kept per microbatch without recompute."""
    saved_block: CostFn
    """Bytes kept per microbatch under block recompute."""
    transient_block: CostFn
    """Bytes live while the block is recomputed in backward."""
    recompute_flops: CostFn
    """Forward FLOPs block recompute repeats (the blocks, not prologue / epilogue)."""
    moe: list[MoELayer]
    params: list[ParamInfo]


@dataclasses.dataclass
class ModelProfile:
    units: list[UnitProfile]
    hidden: int
    """Width of the residual stream (what pipeline stages send)."""
    act_itemsize: int
    """Bytes per element of activations (2 in a bf16 program)."""
    useful_flops_per_token: CostFn
    """Training FLOPs per token (3x forward matmuls, recompute excluded): Table 51's useful
    FLOPs, a function of (1, seq)."""
    folded: ModelProfile | None = None
    """The same model with the MoE layers' dispatch and combine folded into the expert MLPs
    (``lowering.combine_in_experts``, EP = 1 only), unit for unit; None: not
    profiled."""

    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def params(self) -> int:
        return sum(p.numel for u in self.units for p in u.params)

    @property
    def num_blocks(self) -> int:
        return self.units[-1].block + 1 if self.units else 0

    def block_units(self, block: int) -> list[UnitProfile]:
        return [u for u in self.units if u.block == block]

    def repeat_block(self, index: int, total_blocks: int) -> ModelProfile:
        """This model with block ``index`` (its units) repeated until it has ``total_blocks``
        blocks (its parameters renamed ``<name>#k`` so FSDP groups stay per block)."""
        extra = total_blocks - self.num_blocks
        if extra < 0:
            raise ValueError(f"the profile has {self.num_blocks} blocks, more than {total_blocks}")
        units = self.block_units(index)
        copies = []
        for k in range(extra):
            for unit in units:
                params = [
                    dataclasses.replace(p, name=f"{p.name}#{k}", group=p.group and f"{p.group}#{k}")
                    for p in unit.params
                ]
                copies.append(
                    dataclasses.replace(
                        unit,
                        name=f"{unit.name}#{k}",
                        block=index + 1 + k,
                        params=params,
                        paths=[f"{p}#{k}" for p in unit.paths],
                    )
                )
        last = self.units.index(units[-1])
        after = [dataclasses.replace(u, block=u.block + extra) for u in self.units[last + 1 :]]
        base = self.useful_flops_per_token

        def per_token(batch: int, seq: int) -> float:  # the copies' 3x forward FLOPs too
            forward = sum(
                f(batch, seq)
                for u in units
                for f in (u.matmul_flops, u.attention_flops, u.expert_flops)
            )
            return base(batch, seq) + extra * 3 * forward / (batch * seq)

        grown = self.units[: last + 1] + copies + after
        folded = self.folded.repeat_block(index, total_blocks) if self.folded else None
        return dataclasses.replace(
            self, units=grown, useful_flops_per_token=per_token, folded=folded
        )


def _compile(expr: sympy.Expr, symbols: dict[sympy.Symbol, str]) -> CostFn:
    """``expr`` in the batch/seq symbols as a fast (batch, seq) -> float function."""
    expr = sympy.sympify(expr)
    b, s = sympy.symbols("b s")
    expr = expr.xreplace({sym: (b if role == "batch" else s) for sym, role in symbols.items()})
    if expr.free_symbols - {b, s}:
        raise ValueError(f"cost {expr} depends on sizes other than batch and sequence")
    fn = sympy.lambdify((b, s), expr, "math")
    return lambda batch, seq: float(fn(batch, seq))


def size_roles(program: Program) -> dict[sympy.Symbol, str]:
    """Every size symbol of the capture as ``batch`` or ``seq``, by its example value (the
    tokens and the shifted targets have symbols of their own): the example must have distinct
    batch and sequence sizes."""
    cost = graph_cost(program)
    example = cost.sizes()
    batch, seq = example[cost.dims["batch"]], example[cost.dims["seq"]]
    if batch == seq:
        raise ValueError(f"capture with distinct batch and sequence sizes (both {batch})")
    roles = {}
    for symbol, value in example.items():
        if value not in (batch, seq):
            raise ValueError(f"size {symbol} = {value} is neither the batch nor the sequence")
        roles[symbol] = "batch" if value == batch else "seq"
    return roles


def profile_program(
    program: Program, fsdp_program: Program | None = None, folded_program: Program | None = None
) -> ModelProfile:
    """The :class:`ModelProfile` of ``program`` (one rank, no recompute, no pipeline), with the
    FSDP layout of ``fsdp_program`` (the same model and plan at ``dp = dp_shard = 2``) and, from
    ``folded_program`` (the same with ``lowering.combine_in_experts``), its
    :attr:`~ModelProfile.folded` profile."""
    if program.pipeline is not None:
        raise ValueError("profile a program built without pipeline parallelism (pp = 1)")
    gm = program.graph
    cost = graph_cost(program)
    if sympy.sympify(cost.tokens).is_number:
        raise ValueError(
            f"the program's tokens per step are a number ({cost.tokens}), not an expression in "
            "the batch and sequence sizes: a pass specialized the input sizes (the compile "
            "warned which), so the profile cannot price other microbatch sizes"
        )
    roles = size_roles(program)
    names, units = pipeline_units(gm, cost, sublayers=True)
    paths = block_paths(gm, cost)
    unit_of = {n: i for i, u in enumerate(units) for n in u}
    dense_ffn = set(dense_ffn_linears(gm))
    masters = {name for names in program.working_weights.values() for name in names}
    layout = fsdp_program.data_parallel if fsdp_program is not None else None
    sharded = set(layout.params) | set(layout.expert_params) if layout else set()
    dense_groups = tuple(layout.groups) if layout else ()
    expert_groups = tuple(layout.expert_groups) if layout else ()
    param_unit = _param_units(gm, unit_of, len(units))
    params: list[list[ParamInfo]] = [[] for _ in units]
    for name, p in gm.named_parameters():
        role = program.param_roles.get(name)
        # an expert slice is gathered with its expert unit, not the block holding it
        groups = expert_groups if layout and name in layout.expert_params else dense_groups
        group = next((g for g in groups if under(name, g)), "")
        params[param_unit.get(name, 0)].append(
            ParamInfo(
                name,
                tuple(p.shape),
                p.element_size(),
                p.requires_grad,
                role == "expert",
                name in masters,
                name in sharded,
                group,
            )
        )
    whole: dict[str, set[fx.Node]] = {}  # each block's nodes, over both its halves
    for nodes in units:
        for n in nodes:
            key = _block_key(module_path(n), paths)
            if key:
                whole.setdefault(key, set()).add(n)
    result, block = [], -1
    for i, (name, nodes) in enumerate(zip(names, units, strict=True)):
        block += not name.endswith(FFN)  # a block's FFN half follows its pre-FFN half
        extra = loss_flops(gm) if i == len(units) - 1 else 0
        result.append(
            _unit(
                name, block, nodes, whole, paths, program.moe_layers, params[i], roles, extra,
                dense_ffn,
            )
        )  # fmt: skip
    act = next(
        (
            n.meta["val"].element_size()
            for n in gm.graph.nodes
            if n.op == "call_function"
            and isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].is_floating_point()
            and node_cost(n).kind == "matmul"
        ),
        4,
    )
    hidden = program.moe_layers[0].dim if program.moe_layers else _hidden(gm)
    per_token = _compile(cost.total.train_flops / cost.tokens, roles)
    folded = profile_program(folded_program) if folded_program is not None else None
    if folded is not None and [u.name for u in folded.units] != [u.name for u in result]:
        raise ValueError(
            "the folded program's pipeline units differ from the program's: "
            f"{[u.name for u in folded.units]} against {[u.name for u in result]}"
        )
    return ModelProfile(result, hidden, act, per_token, folded)


def _block_key(path: str, blocks: list[str]) -> str:
    """The residual block ``path`` runs in: a block the cost model found, or a sibling of one
    (``model.layers.0`` beside ``model.layers.1``: dense blocks it may not see); "" for none."""
    for b in blocks:
        container = b.rpartition(".")[0]
        if container and path.startswith(container + "."):
            rest = path[len(container) + 1 :]
            return f"{container}.{rest.split('.')[0]}"
    return ""


def _max_of(fns: list[CostFn]) -> CostFn:
    return lambda batch, seq: max((f(batch, seq) for f in fns), default=0.0)


def _hidden(gm: fx.GraphModule) -> int:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, torch.Tensor) and val.dim() == 3:
            return int(val.shape[-1])
    raise ValueError("no [batch, seq, hidden] activation found")


def _param_units(gm: fx.GraphModule, unit_of: dict[fx.Node, int], n: int) -> dict[str, int]:
    """The unit of the first compute node reading each parameter (through casts and views)."""
    found: dict[str, int] = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        frontier, seen = [node], set()
        while frontier:
            current = frontier.pop(0)
            if current in unit_of:
                found[str(node.target)] = unit_of[current]
                break
            for user in current.users:
                if user not in seen:
                    seen.add(user)
                    frontier.append(user)
        else:
            found[str(node.target)] = n - 1
    return found


def _unit(
    name: str,
    index: int,
    nodes: list[fx.Node],
    whole: dict[str, set[fx.Node]],
    paths: list[str],
    layers: list[MoELayer],
    params: list[ParamInfo],
    roles: dict[sympy.Symbol, str],
    loss: sympy.Expr | int,
    dense_ffn: set[fx.Node],
) -> UnitProfile:
    costs = {n: node_cost(n) for n in nodes}
    kinds, other = work_by_kind(costs.values())
    other += sympy.sympify(loss) * 4 / CE_FLOPS_PER_LOGIT  # the loss reads its fp32 logits

    def saved_of(members: Iterable[fx.Node]) -> sympy.Expr:
        refs = dict.fromkeys(r for n in members for r in (costs.get(n) or node_cost(n)).saved)
        return sympy.Add(*(r.nbytes() for r in refs))

    # each block is recomputed on its own (a block's halves are one region): it keeps its
    # tensor inputs; its own saved tensors live again while its backward runs (the largest of
    # the unit's blocks is the transient)
    by_block: dict[str, list[fx.Node]] = {}
    for n in nodes:
        key = _block_key(module_path(n), paths)
        if key:
            by_block.setdefault(key, []).append(n)
    block = [n for members in by_block.values() for n in members]
    in_block = set(block)
    kept_block = saved_of(n for n in nodes if n not in in_block)
    for key, members in by_block.items():
        inputs = dict.fromkeys(
            stored_ref(a)
            for n in members
            for a in n.all_input_nodes
            if a not in whole[key] and is_activation(a, floating=False)
        )
        kept_block += sympy.Add(*(r.nbytes() for r in inputs))
    transients = [saved_of(whole[key]) for key in by_block]
    unit_paths = [p for p in paths if any(under(module_path(n), p) for n in block)]
    moe = moe_layers_in(nodes, layers)
    return UnitProfile(
        name=name,
        block=index,
        paths=unit_paths,
        matmul_flops=_compile(kinds["matmul"], roles),
        dense_ffn_flops=_compile(
            sympy.Add(*(costs[n].flops for n in nodes if n in dense_ffn)), roles
        ),
        attention_flops=_compile(kinds["attention"], roles),
        expert_flops=_compile(kinds["experts"], roles),
        other_bytes=_compile(other, roles),
        saved=_compile(saved_of(nodes), roles),
        saved_block=_compile(kept_block, roles),
        transient_block=_max_of([_compile(t, roles) for t in transients]),
        recompute_flops=_compile(sympy.Add(*(costs[n].flops for n in block)), roles),
        moe=moe,
        params=params,
    )
