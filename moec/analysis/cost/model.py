"""The shared symbolic cost model: FLOPs, bytes written and activation bytes saved, per node.

Every quantity is a sympy expression in the graph's symbolic sizes (the batch and sequence
symbols of ``meta["val"]`` shapes), so one analysis answers for every batch and sequence length;
``GraphCost.evaluate()`` substitutes the example sizes recorded by the ShapeEnv, or others::

    cost = graph_cost(gm)
    cost.evaluate().flops_per_token          # at the example shapes
    cost.evaluate(batch=8, seq=4096).flops   # anywhere else
    node_cost(node).flops                    # one node, e.g. 2*s0*s1*128*512
    node_cost(node).saved                    # the tensors its backward keeps (SavedRef)

Rules (forward pass; a FLOP is a multiply or an add):

- matmuls (``linear``, ``addmm``, ``mm``, ``matmul``, ``bmm``, ``baddbmm``): 2*M*N*K, i.e.
  2 * numel(out) * K; saved: the operands that are activations (not parameters);
- ``scaled_dot_product_attention``: 2*B*H*Sq*Sk*(Dqk + Dv) (= 4*B*H*Sq*Sk*Dh), halved when
  ``is_causal``; saved: q, k, v and the output;
- ``moec.expert_mlp`` over R = T*K routed rows: 2*R*(D*U + H*D); saved: its input rows and the
  pre-activation h; ``moec.route`` and ``moec.router_losses``: a few FLOPs per logit;
  ``moec.dispatch``/``moec.combine``: data movement (combine's weighted sum is 2*T*K*D);
  ``moec.linear_cross_entropy``: the head's 2*N*D*V, saving the gradients it computed;
  ``moec.rope``: 3 FLOPs per element, saving nothing but its (buffer) tables; ``moec.glu``:
  2 FLOPs per output element, saving its input;
- pointwise ops: numel(out), saving their floating-point inputs unless the op is linear (add,
  sub, neg, copies); norms: a few FLOPs per element, saving the input; reductions: numel(in);
- views, getitem and shape ops: nothing.

``bytes_out`` is what a node writes (every output tensor, views write nothing). Activation
bytes are counted per node and, for totals, once per stored tensor (views resolved to their
base), which is what a recompute budget needs. Training FLOPs are 3x the forward matmul FLOPs
(forward + two backward GEMMs), the report's useful-model FLOPs that exclude recompute.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Container, Iterable
from typing import Any

import sympy
import torch
import torch.fx as fx

from moec.analysis.structure import (
    MATMUL_OPS,
    TRANSPOSE_OPS,
    VIEW_OPS,
    find_structure,
    module_path,
)
from moec.ops.working_weights import working_copy
from moec.passes.rewrite import fake_mode

aten = torch.ops.aten
Expr = sympy.Expr
ZERO = sympy.Integer(0)

MATMUL_KINDS = frozenset({"matmul", "attention", "experts"})
"""Node kinds whose FLOPs are tensor-core GEMM work (the report's model FLOPs)."""

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
ROUTE_FLOPS_PER_LOGIT = 4
LOSSES_FLOPS_PER_LOGIT = 6
ROPE_FLOPS = 3  # two products and a sum per element
GLU_FLOPS = 2  # as the unfused act and product count (one FLOP per element each)


@dataclasses.dataclass(frozen=True)
class SavedRef:
    """One tensor kept for backward: output ``index`` of ``node`` (None for a single output)."""

    node: fx.Node
    index: int | None = None

    def nbytes(self) -> Expr:
        val = self.node.meta.get("val")
        return nbytes(val if self.index is None else val[self.index])


@dataclasses.dataclass(frozen=True)
class NodeCost:
    flops: Expr
    bytes_out: Expr
    saved_bytes: Expr
    kind: str
    """``matmul``, ``attention``, ``experts``, ``routing``, ``movement``, ``elementwise``,
    ``norm``, ``reduction``, ``view`` or ``other``."""
    saved: tuple[SavedRef, ...] = ()
    """The activations this node's backward keeps (parameters excluded), views resolved."""
    region_matmul_flops: Expr = ZERO
    """For a ``region`` (a sub-graph call, e.g. a recomputed block): its matmul FLOPs."""

    @property
    def matmul_flops(self) -> Expr:
        if self.kind == "region":
            return self.region_matmul_flops
        return self.flops if self.kind in MATMUL_KINDS else ZERO


# --- sizes -------------------------------------------------------------------------------------


def sym(x: Any) -> Expr:
    """A size (int or SymInt) as a sympy expression."""
    if isinstance(x, torch.SymInt):
        return x.node.expr
    return sympy.Integer(int(x))


def numel(val: Any) -> Expr:
    return sympy.Mul(*(sym(s) for s in val.shape)) if val.dim() else sympy.Integer(1)


def nbytes(val: Any) -> Expr:
    """Bytes of a tensor, or of every tensor in a tuple/list of them."""
    if isinstance(val, torch.Tensor):
        return numel(val) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sympy.Add(*(nbytes(v) for v in val))
    return ZERO


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


def _ref(node: fx.Node) -> SavedRef:
    """The stored tensor ``node`` is (a view of): views and split pieces resolve to their base."""
    while node.op == "call_function":
        if node.target is operator.getitem:
            producer, index = node.args
            if producer.target not in VIEW_LIKE:
                return SavedRef(producer, index)
            node = producer.args[0]
        elif node.target in VIEW_LIKE:
            node = node.args[0]
        else:
            break
    return SavedRef(node)


def _is_activation(arg: Any, floating: bool = True) -> bool:
    """A tensor node computed from the inputs (not a parameter or buffer read)."""
    val = _val(arg)
    if not isinstance(val, torch.Tensor) or _ref(arg).node.op == "get_attr":
        return False
    return val.is_floating_point() or not floating


def _refs(args: Iterable[Any], floating: bool = True) -> list[SavedRef]:
    return [_ref(a) for a in args if _is_activation(a, floating)]


# --- per-node rules ----------------------------------------------------------------------------

Rule = Callable[[fx.Node], tuple[Expr, str, list[SavedRef]]]


def _matmul(node: fx.Node) -> tuple[Expr, str, list[SavedRef]]:
    operands = (
        node.args[1:3]
        if node.target in (aten.addmm.default, aten.baddbmm.default)
        else (node.args[:2])
    )
    k = sym(_val(operands[0]).shape[-1])
    return 2 * numel(_val(node)) * k, "matmul", _refs(operands)


def _attention(node: fx.Node) -> tuple[Expr, str, list[SavedRef]]:
    q, k, v = (_val(a) for a in node.args[:3])
    causal = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
    rows = numel(q) / sym(q.shape[-1])  # B * H * Sq
    flops = 2 * rows * sym(k.shape[-2]) * (sym(q.shape[-1]) + sym(v.shape[-1]))
    return flops / 2 if causal else flops, "attention", _refs([*node.args[:3], node])


def _expert_rows(buffer: fx.Node) -> Expr:
    """Useful rows of an expert buffer: every row of a local one (T*K), but only this rank's
    T*K routes for an EP receive buffer, whose padding to the per-source capacity is not work
    a balanced router asks for."""
    if buffer.op == "call_function" and getattr(buffer.target, "name", lambda: "")() == (
        "moec::ep_dispatch"
    ):
        return numel(_val(buffer.args[1]))  # slots: (T, K) routes of this rank
    return sym(_val(buffer).shape[0])


def _expert_mlp(node: fx.Node) -> tuple[Expr, str, list[SavedRef]]:
    x, w_up, w_down = (_val(a) for a in node.args[:3])
    rows, dim, up = _expert_rows(node.args[0]), sym(x.shape[1]), sym(w_up.shape[-1])
    hidden = sym(w_down.shape[1])
    return 2 * rows * (dim * up + hidden * dim), "experts", [_ref(node.args[0]), SavedRef(node, 1)]


def _route(node: fx.Node) -> tuple[Expr, str, list[SavedRef]]:
    flops = ROUTE_FLOPS_PER_LOGIT * numel(_val(node.args[0]))
    return flops, "routing", [_ref(node.args[0]), SavedRef(node, 0)]


def _router_losses(node: fx.Node) -> tuple[Expr, str, list[SavedRef]]:
    flops = LOSSES_FLOPS_PER_LOGIT * numel(_val(node.args[0]))
    return flops, "routing", _refs(node.args[:2], floating=False)


def _dispatch(node: fx.Node) -> tuple[Expr, str, list[SavedRef]]:
    return ZERO, "movement", [_ref(node.args[1])]


def _combine(node: fx.Node) -> tuple[Expr, str, list[SavedRef]]:
    y, _, rows = (_val(a) for a in node.args)
    flops = 2 * numel(rows) * sym(y.shape[-1])
    return flops, "movement", _refs(node.args, floating=False)


def _linear_cross_entropy(node: fx.Node) -> tuple[Expr, str, list[SavedRef]]:
    # the head GEMM (the backward's two run in the forward: useful FLOPs stay 3x this);
    # saved: the gradients it computed, held until the backward scales them
    flops = 2 * numel(_val(node.args[0])) * sym(_val(node.args[1]).shape[0])
    return flops, "matmul", [SavedRef(node, 1), SavedRef(node, 2), SavedRef(node, 3)]


def _rope(node: fx.Node) -> tuple[Expr, str, list[SavedRef]]:
    return ROPE_FLOPS * numel(_val(node)), "elementwise", []  # saves only the (buffer) tables


def _glu(node: fx.Node) -> tuple[Expr, str, list[SavedRef]]:
    return GLU_FLOPS * numel(_val(node)), "elementwise", _refs(node.args[:1])


def _embedding(node: fx.Node) -> tuple[Expr, str, list[SavedRef]]:
    return ZERO, "movement", _refs(node.args[1:2], floating=False)


def _softmax(node: fx.Node) -> tuple[Expr, str, list[SavedRef]]:
    return SOFTMAX_FLOPS * numel(_val(node)), "elementwise", [SavedRef(node)]


def _norm(node: fx.Node) -> tuple[Expr, str, list[SavedRef]]:
    return NORM_FLOPS[node.target] * numel(_val(node.args[0])), "norm", _refs(node.args[:1])


def _moec_rules() -> dict[Any, Rule]:
    import moec.ops  # noqa: F401  (registers torch.ops.moec)

    ops = torch.ops.moec
    return {
        ops.expert_mlp.default: _expert_mlp,
        ops.route.default: _route,
        ops.router_losses.default: _router_losses,
        ops.dispatch.default: _dispatch,
        ops.combine.default: _combine,
        ops.linear_cross_entropy.default: _linear_cross_entropy,
        ops.rope.default: _rope,
        ops.glu.default: _glu,
    }


RULES: dict[Any, Rule] = {
    **dict.fromkeys(MATMUL_OPS, _matmul),
    aten.scaled_dot_product_attention.default: _attention,
    aten.embedding.default: _embedding,
    aten._softmax.default: _softmax,
    aten.softmax.int: _softmax,
    **{op: _norm for op in NORM_FLOPS},
    **_moec_rules(),
}
"""Cost rules by op; ops not listed fall back to the pointwise / reduction / other rules."""


def _fallback(node: fx.Node) -> tuple[Expr, str, list[SavedRef]]:
    target = node.target
    tags = getattr(target, "tags", ())
    if torch.Tag.pointwise in tags:
        saved = [] if target in LINEAR_POINTWISE else _refs(node.args)
        return numel(_val(node)), "elementwise", saved
    if torch.Tag.reduction in tags and isinstance(_val(node.args[0]), torch.Tensor):
        return numel(_val(node.args[0])), "reduction", []
    return ZERO, "other", []


def _rule_result(node: fx.Node) -> tuple[Expr, str, list[SavedRef]]:
    if node.target in VIEW_LIKE:
        return ZERO, "view", []
    return RULES.get(node.target, _fallback)(node)


def _sub_graph(node: fx.Node) -> fx.GraphModule | None:
    """The GraphModule a node calls as its first argument (a recompute region), if any."""
    first = node.args[0] if node.args else None
    if not (isinstance(first, fx.Node) and first.op == "get_attr"):
        return None
    sub = node.graph.owning_module
    for part in str(first.target).split("."):
        sub = getattr(sub, part, None)
    return sub if isinstance(sub, fx.GraphModule) else None


def _region_cost(node: fx.Node, region: fx.GraphModule) -> NodeCost:
    """A sub-graph call costs what its nodes cost; the call itself keeps its tensor inputs."""
    inner = [node_cost(n) for n in region.graph.nodes]
    saved = tuple(dict.fromkeys(_refs(node.args[2:])))
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
    region = _sub_graph(node)
    if region is not None:
        return _region_cost(node, region)
    flops, kind, saved = _rule_result(node)
    bytes_out = ZERO if kind == "view" else nbytes(node.meta.get("val"))
    saved = tuple(dict.fromkeys(saved))
    saved_bytes = sympy.Add(*(ref.nbytes() for ref in saved))
    return NodeCost(sympy.sympify(flops), bytes_out, saved_bytes, kind, saved)


def _grad_bytes(val: Any) -> Expr:
    """Bytes of the gradients of ``val``'s floating-point tensors (integers get none)."""
    if isinstance(val, (tuple, list)):
        return sympy.Add(*(_grad_bytes(v) for v in val))
    if isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
        return nbytes(val)
    return ZERO


def backward_workspace(node: fx.Node) -> Expr:
    """Bytes live together while ``node``'s backward runs, besides saved tensors: the gradients
    of its outputs and of its floating inputs (a parameter's arrives in the dtype the op read
    before it is accumulated), plus what the backward allocates inside: ``moec.expert_mlp``
    holds the pre-activation's gradient [R, U] and the recomputed activation [R, H] as well."""
    if node.op != "call_function" or node_cost(node).kind == "view":
        return ZERO
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):  # only the outputs something reads get a gradient
        read = {u.args[1] for u in node.users if u.target is operator.getitem}
        val = [v for i, v in enumerate(val) if i in read]
    grads = _grad_bytes(val) + sympy.Add(
        *(_grad_bytes(_val(a)) for a in dict.fromkeys(node.all_input_nodes))
    )
    if node.target is torch.ops.moec.expert_mlp.default:
        x, w_up, w_down = (_val(a) for a in node.args[:3])
        rows = sym(x.shape[0])
        grads += rows * (sym(w_up.shape[-1]) + sym(w_down.shape[1])) * x.element_size()
    return grads


# --- totals ------------------------------------------------------------------------------------


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


@dataclasses.dataclass
class CostReport:
    """A :class:`GraphCost` evaluated at concrete sizes (plain numbers, JSON-ready)."""

    sizes: dict[str, int]
    tokens: int
    flops: int
    matmul_flops: int
    train_flops: int
    bytes_out: int
    saved_bytes: int
    params: int
    active_params: int
    blocks: list[dict[str, Any]]

    @property
    def flops_per_token(self) -> float:
        return self.flops / max(self.tokens, 1)

    @property
    def train_flops_per_token(self) -> float:
        return self.train_flops / max(self.tokens, 1)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["flops_per_token"] = self.flops_per_token
        data["train_flops_per_token"] = self.train_flops_per_token
        return data


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
            blocks=[_block_report(b, values) for b in self.blocks],
        )


def evaluate(expr: Expr, values: dict[sympy.Symbol, int]) -> int:
    result = sympy.sympify(expr).xreplace({s: sympy.Integer(v) for s, v in values.items()})
    if result.free_symbols:
        missing = sorted(map(str, result.free_symbols))
        raise ValueError(f"cannot evaluate {expr}: no value for {missing}")
    return int(result)


def _block_report(block: BlockCost, values: dict[sympy.Symbol, int]) -> dict[str, Any]:
    return {
        "index": block.index,
        "path": block.path,
        "ffn": block.ffn.describe(),
        "ffn_path": block.ffn.path,
        "flops": evaluate(block.cost.flops, values),
        "ffn_flops": evaluate(block.ffn_cost.flops, values),
        "saved_bytes": evaluate(block.cost.saved_bytes, values),
        "params": block.params,
        "active_params": block.active_params,
    }


def graph_cost(gm: fx.GraphModule) -> GraphCost:
    """Per-node costs and their totals per graph and per residual block (see module)."""
    costs = {n: node_cost(n) for n in gm.graph.nodes}
    param_sizes = {name: p.numel() for name, p in gm.named_parameters()}
    active = _active_param_sizes(gm, param_sizes)
    blocks = _blocks(gm, costs, param_sizes, active)
    example = {s: int(v) for s, v in _example_sizes(gm).items()}
    return GraphCost(
        nodes=costs,
        total=CostTotals.of(costs, gm.graph.nodes),
        blocks=blocks,
        tokens=tokens(gm),
        params=sum(param_sizes.values()),
        active_params=round(sum(active.values())),
        dims=_friendly_dims(gm),
        example=example,
    )


def _example_sizes(gm: fx.GraphModule) -> dict[sympy.Symbol, Any]:
    """The ShapeEnv's values of the size symbols (the example inputs' sizes)."""
    shape_env = fake_mode(gm).shape_env
    if shape_env is None:
        return {}
    return getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val


def tokens(gm: fx.GraphModule) -> Expr:
    inputs = [
        v for v in map(_val, gm.graph.find_nodes(op="placeholder")) if isinstance(v, torch.Tensor)
    ]
    if not inputs:
        return sympy.Integer(1)
    integer = [v for v in inputs if not v.is_floating_point() and not v.is_complex()]
    if integer:
        return numel(integer[0])
    return numel(inputs[0]) / sym(inputs[0].shape[-1]) if inputs[0].dim() else sympy.Integer(1)


def _friendly_dims(gm: fx.GraphModule) -> dict[str, sympy.Symbol]:
    """``batch``/``seq``: the size symbols of dims 0/1 of the first input with symbolic sizes
    (integer inputs first: token ids)."""
    inputs = [
        v for v in map(_val, gm.graph.find_nodes(op="placeholder")) if isinstance(v, torch.Tensor)
    ]
    inputs.sort(key=lambda v: v.is_floating_point())
    for value in inputs:
        names = {}
        for name, size in zip(("batch", "seq"), value.shape, strict=False):
            free = getattr(sym(size), "free_symbols", set())
            if len(free) == 1:
                names[name] = next(iter(free))
        if names:
            return names
    return {}


def _active_param_sizes(gm: fx.GraphModule, sizes: dict[str, int]) -> dict[str, float]:
    roles = gm.meta.get("moec_param_roles", {})
    layers = gm.meta.get("moec_moe_layers", [])
    active = {}
    for name, size in sizes.items():
        layer = next((m for m in layers if name.startswith(m.path + ".")), None)
        share = layer.top_k / layer.num_experts if layer and roles.get(name) == "expert" else 1.0
        active[name] = size * share
    return active


def _ffns(gm: fx.GraphModule) -> list[FFNInfo]:
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
        for m in gm.meta.get("moec_moe_layers", [])
    }
    dense = [
        FFNInfo(b.ffn.module_path, b.ffn.activation, b.ffn.dim, b.ffn.hidden)
        for b in find_structure(gm).blocks
        if b.ffn.module_path not in moe
    ]
    return dense + list(moe.values())


def _owner(path: str, prefixes: Container[str]) -> str | None:
    """The member of ``prefixes`` that is ``path`` or a dotted prefix of it."""
    while path:
        if path in prefixes:
            return path
        path = path.rpartition(".")[0]
    return None


def _blocks(
    gm: fx.GraphModule,
    costs: dict[fx.Node, NodeCost],
    param_sizes: dict[str, int],
    active: dict[str, float],
) -> list[BlockCost]:
    ffns = {f.path.rpartition(".")[0] or f.path: f for f in _ffns(gm) if f.path}
    members: dict[str, list[fx.Node]] = {path: [] for path in ffns}
    for node in gm.graph.nodes:
        path = _owner(module_path(node), members)
        if path is not None:
            members[path].append(node)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    paths = sorted((p for p in members if members[p]), key=lambda p: order[members[p][0]])
    blocks = []
    for index, path in enumerate(paths):
        ffn = ffns[path]
        ffn_nodes = [n for n in members[path] if _owner(module_path(n), {ffn.path})]
        names = [n for n in param_sizes if _owner(n, {path})]
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


def format_count(value: float) -> str:
    """``1234567`` -> ``1.23M`` (for tables and summary lines)."""
    if value == 0:
        return "0"
    exponent = min(int(math.log10(abs(value)) // 3), 5)
    return f"{value / 1000**exponent:.3g}{['', 'K', 'M', 'G', 'T', 'P'][exponent]}"
