"""Pass ``fuse_glu``: a dense gated FFN's two projections and activation -> GEMM + ``moec::glu``.

Matches  ``mul(act(linear(x, w_gate[, b_gate])), linear(x, w_up[, b_up]))`` (either operand
         order), act one of ``silu``, ``gelu`` (exact or tanh), ``relu``; both linears read the
         same x, their weights have one shape, both or neither has a bias, and the
         intermediates are read by nothing else. This is what stays dense after the ``moe``
         pass: the dense blocks' FFNs and the shared experts. The two linears are both
         ``aten.linear`` or both ``moec.quantized_linear`` of one recipe (the ``precision``
         pass's); a mixed pair is left alone.
Emits    ``h = linear(x, cat([w_gate, w_up]), cat([b_gate, b_up]))`` (or the quantized linear
         with the pair's recipe: its scales are per row of x and per output channel, so the
         joined GEMM quantizes every operand as the two did) and
         ``moec.glu(h, "swiglu" | "geglu" | "geglu_tanh" | "reglu")``.
Also     ``mul(act(h[..., :H]), h[..., H:])`` of one projection ``h`` of width 2H split in
         halves (``chunk``/``split``/``slice``: Phi-3's and GLM's ``gate_up_proj``), gate
         first, the halves read by nothing else -> ``moec.glu(h, ...)``; h stays as it is.
Keeps    values up to the GEMM's summation order (each output element is the same dot product;
         float32 results agree to rounding), every parameter and its gradient (the concatenation
         is of the weights as read, e.g. their bf16 casts: its backward hands each weight its
         half).

Why: unfused, the activation and the product are one elementwise kernel each forward and three
backward over [T, H] tensors (at the e2e model's dense width 24576, ~17 GB of memory traffic per
block and step); the op reads h once and writes a once, its backward reads h and d_a and writes
d_h, and it saves h instead of gate, act(gate) and up.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.fx as fx

import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.analysis.structure import output_slice
from moec.ops.activations import gated_from_unary
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.rewrite import GraphEditor

aten = torch.ops.aten


def _unary(node: fx.Node) -> str | None:
    """The activation name of ``node`` if it is a supported unary activation of one tensor."""
    if node.target == aten.silu.default:
        return "silu"
    if node.target == aten.relu.default:
        return "relu"
    if node.target == aten.gelu.default:
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    return None


class _Linear(NamedTuple):
    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    recipe: str | None
    """The ``moec.quantized_linear`` recipe, None for ``aten.linear``."""


def _linear_parts(node: fx.Node) -> _Linear | None:
    """The operands of an ``aten.linear`` or ``moec.quantized_linear`` node."""
    if node.kwargs:
        return None
    if node.target == aten.linear.default:
        x, weight, *rest = node.args
        return _Linear(x, weight, rest[0] if rest else None, None)
    if node.target == torch.ops.moec.quantized_linear.default:
        return _Linear(*node.args)
    return None


class _Match(NamedTuple):
    act: fx.Node
    gate: fx.Node
    up: fx.Node
    gate_parts: _Linear
    up_parts: _Linear
    activation: str
    """The gated activation's name."""


def _gated_products(mul: fx.Node) -> Iterator[tuple[fx.Node, fx.Node, fx.Node, str]]:
    """(act, gate, up, unary activation) for each operand order in which ``mul`` is
    ``mul(act(gate), up)``, ``act`` a supported unary activation."""
    if mul.target != aten.mul.Tensor or mul.kwargs or len(mul.args) != 2:
        return
    if not all(isinstance(a, fx.Node) for a in mul.args):
        return
    for act, up in (mul.args, mul.args[::-1]):
        unary = _unary(act)
        gate = act.args[0] if unary else None
        if isinstance(gate, fx.Node) and gate is not up:
            yield act, gate, up, unary


def _match(mul: fx.Node) -> _Match | None:
    """The nodes and operands of a gated FFN product."""
    for act, gate, up, unary in _gated_products(mul):
        g, u = _linear_parts(gate), _linear_parts(up)
        if g is None or u is None or g.x is not u.x or g.recipe != u.recipe:
            continue
        if g.weight.meta["val"].shape != u.weight.meta["val"].shape or (
            (g.bias is None) != (u.bias is None)
        ):
            continue
        if any(len(n.users) != 1 for n in (act, gate, up)):
            continue
        return _Match(act, gate, up, g, u, gated_from_unary(unary))
    return None


class _Halves(NamedTuple):
    act: fx.Node
    gate: fx.Node
    up: fx.Node
    split: fx.Node | None
    """The ``chunk``/``split`` node the halves are pieces of (None for slices)."""
    h: fx.Node
    activation: str


def _match_halves(mul: fx.Node) -> _Halves | None:
    """``mul(act(h[..., :H]), h[..., H:])`` of one projection h of width 2H (either operand
    order; the gate must be the first half, as ``moec.glu`` reads it)."""
    for act, gate, up, unary in _gated_products(mul):
        g, u = output_slice(gate), output_slice(up)
        if g is None or u is None or g[:2] != u[:2] or _linear_parts(g[0]) is None:
            continue
        h, split, g_start, g_stop = g
        width = h.meta["val"].shape[-1]
        if (g_start, g_stop, u[2], u[3]) != (0, width // 2, width // 2, width) or width % 2:
            continue
        pieces_only = split is None or set(split.users) == {gate, up}
        if not pieces_only or any(len(n.users) != 1 for n in (act, gate, up)):
            continue
        if len(h.users) != (1 if split is not None else 2):
            continue
        return _Halves(act, gate, up, split, h, gated_from_unary(unary))
    return None


@register_pass
class FuseGluPass(Pass):
    name = "fuse_glu"
    after: tuple[str, ...] = ("moe", "shared_casts")

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        edit = GraphEditor(gm, self.name)
        fused: dict[str, int] = {}
        for mul in list(gm.graph.nodes):
            halves = _match_halves(mul)
            if halves is not None:
                act, gate, up, split, h, activation = halves
                with gm.graph.inserting_before(mul):
                    out = edit.call(torch.ops.moec.glu.default, (h, activation), mul)
                mul.replace_all_uses_with(out)
                for node in (mul, act, gate, up, split):
                    if node is not None:
                        gm.graph.erase_node(node)
                fused[activation] = fused.get(activation, 0) + 1
                continue
            match = _match(mul)
            if match is None:
                continue
            act, gate, up, g, u, activation = match
            with gm.graph.inserting_before(mul):
                weight = edit.call(aten.cat.default, ([g.weight, u.weight], 0), gate)
                bias = None
                if g.bias is not None:
                    bias = edit.call(aten.cat.default, ([g.bias, u.bias], 0), gate)
                if g.recipe is None:
                    args = (g.x, weight) if bias is None else (g.x, weight, bias)
                    h = edit.call(aten.linear.default, args, gate)
                else:
                    quantized = torch.ops.moec.quantized_linear.default
                    h = edit.call(quantized, (g.x, weight, bias, g.recipe), gate)
                out = edit.call(torch.ops.moec.glu.default, (h, activation), mul)
            mul.replace_all_uses_with(out)
            for node in (mul, act, gate, up):
                gm.graph.erase_node(node)
            fused[activation] = fused.get(activation, 0) + 1
        gm.recompile()
        return PassResult(gm, bool(fused), {"fused": sum(fused.values()), "activations": fused})
