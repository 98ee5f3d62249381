"""Pass ``precision``: the scoped GEMMs -> fused quantize + MXFP8 / FP8 GEMM ops.

Options: ``plan.precision.gemm`` (``mxfp8`` | ``fp8_rowwise``; ``bf16`` leaves the graph alone)
and ``plan.precision.scope``, a subset of:

- ``routed_experts``: every ``moec.expert_mlp`` node (emitted by pass ``moe``)::

      y, h = moec.expert_mlp(buf: bf16[R, D], w_up: f32[N, D, U], w_down: f32[N, H, D], offs, ...)
    becomes
      y, h = moec.expert_mlp(buf, w_up, w_down, offs, b_up, b_down, act, "mxfp8")  # recipe

- ``shared_expert``: the ``aten.linear`` nodes of a shared expert, found structurally: the
  linears on the paths from the tensor the block's ``moec.dispatch`` reads to the dense branch
  of ``add(shared_out, moec.combine(...))`` (none where that add is the residual one);
- ``attn_qkv``: the linears whose outputs reach ``scaled_dot_product_attention``'s q/k/v through
  views, RoPE and other non-linear ops (the search stops at the first linear on each path);
- ``attn_out``: the linear that reads the attention output through views;
- ``dense_ffn``: the linears of every FFN region the ``moe`` pass left dense (``moe.dense_first``
  blocks, or every FFN when no ``moe`` pass runs), found by :func:`find_structure`; a shared
  expert's linears are the ``shared_expert`` scope's, never this one's. ``fuse_glu`` then joins
  a gated pair's two quantized linears into one, as it does unquantized ones::

      out: f32[B, S, E] = aten.linear(x: f32[B, S, K], w: f32[E, K], b?)
    becomes
      out = moec.quantized_linear(x, w, b, "mxfp8")

Preconditions: ``routed_experts`` and ``shared_expert`` need the ``moe`` pass to have run
(an empty match is reported in the statistics, not an error). Invariants: those of
:mod:`moec.passes.rewrite`; parameters are untouched (master weights stay in their dtype: the
ops quantize them on every call), so the parameter count does not change; every replaced node
has the same ``meta["val"]``. Statistics: ``experts_quantized``, ``shared_linears_quantized``,
``qkv_linears_quantized``, ``out_linears_quantized``, ``dense_ffn_linears_quantized``,
``recipe``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import moec.ops.quantized  # noqa: F401  (registers moec::quantized_*)
from moec.analysis.structure import CASTS, TRANSPOSE_OPS, VIEW_OPS, find_structure, linear_site
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.rewrite import GraphEditor
from moec.plan import Plan

aten = torch.ops.aten
moec_ops = torch.ops.moec

SDPA_OPS = {
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}
_PASS_THROUGH = set(VIEW_OPS) | set(TRANSPOSE_OPS) | {aten.contiguous.default, aten.clone.default}
_SEARCH_LIMIT = 64
"""Nodes visited per backward search before it gives up (keeps a search inside one block)."""


def _is_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target == aten.linear.default


def _first_linears_behind(start: fx.Node) -> list[fx.Node]:
    """The first ``aten.linear`` node on each backward path from ``start``."""
    found, seen, todo = [], set(), [start]
    while todo and len(seen) < _SEARCH_LIMIT:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if _is_linear(node):
            found.append(node)
        elif node.op == "call_function":
            todo.extend(node.all_input_nodes)
    return found


def routed_expert_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target == moec_ops.expert_mlp.default]


def shared_expert_linears(gm: fx.GraphModule) -> list[fx.Node]:
    """Linears of the dense branch added to each ``moec.combine`` output that read the block's
    MoE input (the tensor dispatch reads, and what it is a view or cast of): the shared
    expert's. Without a shared expert that add is the residual add, whose other operand does
    not descend from the MoE input: no linears."""
    linears: list[fx.Node] = []
    for combine in (n for n in gm.graph.nodes if n.target == moec_ops.combine.default):
        expert_in = _dispatch_input(combine)
        for add in combine.users:
            if add.target != aten.add.Tensor or expert_in is None:
                continue
            (dense,) = [a for a in add.args if isinstance(a, fx.Node) and a is not combine]
            linears += _linears_between(_views_of(expert_in), dense)
    return linears


def _linears_between(sources: set[fx.Node], end: fx.Node) -> list[fx.Node]:
    """The ``aten.linear`` nodes on paths from ``sources`` to ``end`` (a backward walk from
    ``end`` of at most ``_SEARCH_LIMIT`` nodes, then forward from ``sources`` inside it)."""
    behind, todo = {end}, [end]
    while todo and len(behind) < _SEARCH_LIMIT:
        node = todo.pop()
        if node in sources or node.op != "call_function":
            continue
        for arg in node.all_input_nodes:
            if arg not in behind:
                behind.add(arg)
                todo.append(arg)
    reached, todo = set(), [s for s in sources if s in behind]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in behind and user not in reached:
                reached.add(user)
                todo.append(user)
    return [n for n in end.graph.nodes if n in reached and _is_linear(n)]


def _views_of(node: fx.Node) -> set[fx.Node]:
    """``node`` and the nodes it is a view or cast of: the shared expert may read the norm's
    output directly while dispatch reads it reshaped."""
    chain = {node}
    while node.target in _PASS_THROUGH | CASTS and isinstance(node.args[0], fx.Node):
        node = node.args[0]
        chain.add(node)
    return chain


def _dispatch_input(combine: fx.Node) -> fx.Node | None:
    """The tensor the block's ``moec.dispatch`` reads (the MoE input X)."""
    rows = combine.args[2]
    for user in rows.users:
        if user.target == moec_ops.dispatch.default:
            return user.args[0]
    return None


def attention_qkv_linears(gm: fx.GraphModule) -> list[fx.Node]:
    linears: list[fx.Node] = []
    for sdpa in (n for n in gm.graph.nodes if n.target in SDPA_OPS):
        for operand in sdpa.args[:3]:
            linears += _first_linears_behind(operand)
    return linears


def attention_out_linears(gm: fx.GraphModule) -> list[fx.Node]:
    """The linear reading each attention output through views (and the output getitem)."""
    linears: list[fx.Node] = []
    for sdpa in (n for n in gm.graph.nodes if n.target in SDPA_OPS):
        todo = list(sdpa.users)
        while todo:
            node = todo.pop()
            if _is_linear(node) and linear_site(node) is not None:
                linears.append(node)
            elif node.target in _PASS_THROUGH or (
                node.target is operator.getitem and node.args[1] == 0
            ):
                todo.extend(node.users)
    return linears


def dense_ffn_linears(gm: fx.GraphModule) -> list[fx.Node]:
    """The ``aten.linear`` nodes of the FFN regions still dense, shared experts excepted."""
    shared = set(shared_expert_linears(gm))
    sites = [site for b in find_structure(gm).blocks for site in (*b.ffn.ups, b.ffn.down)]
    nodes = dict.fromkeys(s.node for s in sites)  # a fused gate/up pair is one node
    return [n for n in nodes if _is_linear(n) and n not in shared]


@register_pass
class PrecisionPass(Pass):
    name = "precision"
    after: tuple[str, ...] = ("moe", "expert_parallel")

    @staticmethod
    def applies(plan: Plan) -> bool:
        """precision.gemm is not bf16"""
        return plan.precision.gemm != "bf16"

    @staticmethod
    def options(plan: Plan) -> str:
        return f"{plan.precision.gemm},{'+'.join(plan.precision.scope)}"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        precision = ctx.plan.precision
        recipe = precision.gemm
        stats: dict[str, object] = {"recipe": recipe}
        if recipe == "bf16":
            return PassResult(gm, False, stats)
        editor = GraphEditor(gm, self.name)
        scope = set(precision.scope)
        experts = routed_expert_nodes(gm) if "routed_experts" in scope else []
        for node in experts:
            self._replace(editor, node, moec_ops.expert_mlp.default, (*node.args[:7], recipe))
        stats["experts_quantized"] = len(experts)
        finders = {
            "shared_expert": ("shared_linears_quantized", shared_expert_linears),
            "attn_qkv": ("qkv_linears_quantized", attention_qkv_linears),
            "attn_out": ("out_linears_quantized", attention_out_linears),
            "dense_ffn": ("dense_ffn_linears_quantized", dense_ffn_linears),
        }
        done: set[fx.Node] = set()
        for key, (stat, finder) in finders.items():
            found = (
                [
                    n
                    for n in dict.fromkeys(finder(gm))
                    if n not in done and linear_site(n) is not None
                ]
                if key in scope
                else []
            )
            for node in found:
                self._replace(
                    editor, node, moec_ops.quantized_linear.default, _linear_args(node, recipe)
                )
            done.update(found)
            stats[stat] = len(found)
        gm.graph.lint()
        gm.recompile()
        modified = bool(experts or done)
        return PassResult(gm, modified, stats)

    def _replace(self, editor: GraphEditor, node: fx.Node, target, args: tuple) -> None:
        with editor.graph.inserting_after(node):
            new = editor.call(target, args, like=node)
        node.replace_all_uses_with(new)
        editor.graph.erase_node(node)


def _linear_args(node: fx.Node, recipe: str) -> tuple:
    x, weight, *rest = node.args
    bias = rest[0] if rest else node.kwargs.get("bias")
    return (x, weight, bias, recipe)
