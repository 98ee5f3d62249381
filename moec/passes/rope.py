"""Pass ``fuse_rope``: the rotary-embedding expression -> ``moec::rope``.

Matches  ``add(mul(x, cos), mul(rotate_half(x), sin))`` (either operand order of the add and of
         each mul), where ``rotate_half(x) = cat([neg(hi), lo], -1)`` and lo / hi are the halves
         of x's last dimension taken by ``chunk(x, 2, -1)`` or by two ``slice``s (the Llama / HF
         formulations), cos and sin broadcast to x, and neither depends on a parameter (they are
         tables from buffers, so they need no gradient). The intermediates are read by nothing
         else.
Emits    ``moec.rope(x, cos, sin, out_dtype)``. When the add's only reader is a cast (e.g. the
         bf16 cast ``shared_casts`` put before attention), the cast is folded in as
         ``out_dtype``: the kernel computes in float32 and writes that dtype directly.
Keeps    values (float32 arithmetic, as the promoted unfused expression with float32 tables;
         rounding to the folded cast's dtype happens once, as before) and x's gradient.

Why: with float32 tables the unfused expression promotes q and k to float32 and runs five
elementwise kernels each way (profile in ``benchmarks/RESULTS.md``); the op reads x once.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.casts import CASTS
from moec.passes.rewrite import GraphEditor

aten = torch.ops.aten


def _last_dim(node: fx.Node, dim: object) -> bool:
    return isinstance(dim, int) and dim in (-1, node.meta["val"].dim() - 1)


def _half(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(x, 0 for the low half / 1 for the high half) if ``node`` is a half of x's last dim."""
    if node.target is operator.getitem and node.args[0].target == aten.chunk.default:
        chunk, index = node.args
        src, *rest = chunk.args
        dim = rest[1] if len(rest) > 1 else chunk.kwargs.get("dim", 0)
        if rest[0] == 2 and _last_dim(src, dim):
            return src, index
    if node.target == aten.slice.Tensor and len(node.args) >= 3:
        src, dim, start, *end = node.args
        width = src.meta["val"].shape[-1]
        stop = end[0] if end else None
        if _last_dim(src, dim) and (start, stop) in ((0, width // 2), (None, width // 2)):
            return src, 0
        if _last_dim(src, dim) and start == width // 2 and (stop is None or stop >= width):
            return src, 1
    return None


def _rotated(node: fx.Node) -> fx.Node | None:
    """x if ``node`` is ``cat([neg(hi(x)), lo(x)], -1)``."""
    if node.target != aten.cat.default or len(node.args[0]) != 2:
        return None
    negated, low = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if negated.target != aten.neg.default or not _last_dim(node, dim):
        return None
    hi, lo = _half(negated.args[0]), _half(low)
    if hi is None or lo is None or hi != (lo[0], 1) or lo[1] != 0:
        return None
    return lo[0]


def _products(node: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    if node.target != aten.mul.Tensor or not all(isinstance(a, fx.Node) for a in node.args):
        return []
    a, b = node.args
    return [(a, b), (b, a)]


def _match(add: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, list[fx.Node]] | None:
    """(x, cos, sin, the nodes the op replaces) for a rotary add, else None."""
    if add.target != aten.add.Tensor or add.kwargs:
        return None
    if len(add.args) != 2 or not all(isinstance(a, fx.Node) for a in add.args):
        return None
    for first, second in (add.args, add.args[::-1]):
        for x, cos in _products(first):
            for rotated, sin in _products(second):
                if _rotated(rotated) is x:
                    halves = [rotated.args[0][0].args[0], rotated.args[0][1]]
                    parts = [add, first, second, rotated, rotated.args[0][0], *halves]
                    parts += [h.args[0] for h in halves if h.target is operator.getitem]
                    return x, cos, sin, list(dict.fromkeys(parts))
    return None


def _depends_on_parameter(node: fx.Node, params: set[str]) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr" and str(n.target) in params:
            return True
        todo.extend(n.all_input_nodes)
    return False


def _broadcasts(x: fx.Node, *tables: fx.Node) -> bool:
    shapes = [t.meta["val"].shape for t in (x, *tables)]
    try:
        return torch.broadcast_shapes(*shapes) == shapes[0] and shapes[0][-1] % 2 == 0
    except RuntimeError:
        return False


@register_pass
class FuseRopePass(Pass):
    name = "fuse_rope"
    after: tuple[str, ...] = ("shared_casts",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        edit = GraphEditor(gm, self.name)
        params = {name for name, _ in gm.named_parameters()}
        fused = folded = 0
        for add in list(gm.graph.nodes):
            match = _match(add)
            if match is None:
                continue
            x, cos, sin, parts = match
            inner = set(parts)
            if any(u not in inner for p in parts[1:] for u in p.users) or not _broadcasts(
                x, cos, sin
            ):
                continue
            if _depends_on_parameter(cos, params) or _depends_on_parameter(sin, params):
                continue
            readers = list(add.users)
            cast = readers[0] if len(readers) == 1 else None
            dtype_only = cast is not None and len(cast.args) == 1 and set(cast.kwargs) == {"dtype"}
            out_dtype = cast.kwargs["dtype"] if dtype_only and cast.target in CASTS else None
            replaced = cast if out_dtype is not None else add
            with gm.graph.inserting_before(add):
                rope = edit.call(torch.ops.moec.rope.default, (x, cos, sin, out_dtype), add)
            replaced.replace_all_uses_with(rope)
            for node in ([replaced] if replaced is not add else []) + parts:
                gm.graph.erase_node(node)
            fused += 1
            folded += out_dtype is not None
        gm.recompile()
        return PassResult(gm, fused > 0, {"fused": fused, "casts_folded": folded})
