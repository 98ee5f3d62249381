"""Pass ``working_weights``: per-step bf16 casts of parameters become persistent bf16 copies.

Matches  a float32 parameter whose only reader is ``aten._to_copy(P, dtype=bfloat16)`` (what
         ``shared_casts`` leaves: one cast per source), and ``aten.cat([cast(P1), cast(P2),
         ...], 0)`` of such casts when the cat is each cast's only reader (``fuse_glu``'s
         concatenated gate/up weights).
Emits    a non-persistent bf16 buffer ``working_bf16_<i>`` on the root module holding the cast
         (or the concatenation) and ``working_copy(buffer, [P1, ...])`` in place of the cast or
         the cat; the program's ``working_weights`` gains ``{buffer: [parameter targets]}`` (in
         row order) for the runtime (:class:`moec.runtime.working_weights.WorkingWeights`), which
         refreshes a copy whenever its parameter changed and lets ``moec.optim.AdamW`` write
         it in its update pass.
Keeps    forward values bit for bit (the buffer holds the same round-to-nearest casts);
         gradients reach the same parameters with the same values (``working_copy`` hands each
         its rows; they stay in bf16, the dtype they were computed in, unless the runtime asks
         the engine to accumulate them in float32); parameters unchanged (buffers are not
         parameters); a parameter read any other way is left alone.
Under FSDP (``parallel.dp_shard > 1``) only expert parameters get copies: the others are
sharded, and a whole bf16 copy of each would undo that (pass ``fsdp`` handles their casts);
none do when the experts are sharded too (``dp > ep``: each expert slice is held by several
expert-data-parallel ranks).
Runs only when ``precision.compute_dtype`` is bf16; before ``pipeline``, which hands each stage
the copies its nodes read (as non-persistent buffers, in the stage's program).

Why: a cast reads 4 and writes 2 bytes per parameter every forward and its backward casts the
gradient back (2 + 4 bytes); at the e2e model's ~2e9 parameters that was ~24 GB of traffic,
~7% of a step on an H200.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from moec.ops.working_weights import joined_copy, working_copy
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.casts import is_bf16_cast
from moec.passes.rewrite import GraphEditor
from moec.plan import Plan

aten = torch.ops.aten


def _cast_param(gm: fx.GraphModule, node: object) -> fx.Node | None:
    """The get_attr of the float32 parameter ``node`` casts to bf16, if the cast is its only use."""
    if not isinstance(node, fx.Node) or not is_bf16_cast(node):
        return None
    source = node.args[0]
    if not isinstance(source, fx.Node) or source.op != "get_attr" or len(source.users) != 1:
        return None
    try:
        param = gm.get_parameter(str(source.target))
    except AttributeError:  # a buffer or constant
        return None
    return source if param.dtype == torch.float32 and param.dim() > 0 else None


def _cat_of_casts(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node] | None:
    """The casts a dim-0 ``cat`` joins, if every piece is a parameter cast read only there."""
    if node.target != aten.cat.default or node.kwargs:
        return None
    pieces, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    if dim != 0 or not pieces:
        return None
    ok = all(_cast_param(gm, p) is not None and len(p.users) == 1 for p in pieces)
    return list(pieces) if ok else None


@register_pass
class WorkingWeightsPass(Pass):
    name = "working_weights"
    after: tuple[str, ...] = ("fuse_glu",)
    requires: tuple[str, ...] = ("shared_casts",)

    @staticmethod
    def applies(plan: Plan) -> bool:
        """precision.compute_dtype is bf16"""
        return plan.precision.compute_dtype == "bf16"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        edit = GraphEditor(gm, self.name)
        replaced: list[tuple[fx.Node, list[fx.Node]]] = []  # (the cat or cast, its casts)
        for node in gm.graph.nodes:
            pieces = _cat_of_casts(gm, node)
            if pieces is not None:
                replaced.append((node, pieces))
        joined = {cast for _, casts in replaced for cast in casts}
        replaced += [
            (node, [node])
            for node in gm.graph.nodes
            if node not in joined and _cast_param(gm, node) is not None
        ]
        p = ctx.plan.parallel
        if p.shards_experts:  # experts sharded too: no copies (see the docstring)
            replaced = []
        elif p.dp_shard > 1 and ctx.program is not None:
            replaced = [
                (old, casts)
                for old, casts in replaced
                if all(ctx.program.role(str(_cast_param(gm, c).target)) == "expert" for c in casts)
            ]
        copies: dict[str, list[str]] = {}
        for old, casts in replaced:
            params = [_cast_param(gm, cast) for cast in casts]
            masters = [gm.get_parameter(str(p.target)).detach() for p in params]
            name = f"working_bf16_{len(copies)}"
            with gm.graph.inserting_before(old):
                buffer = edit.buffer(name, joined_copy(masters, torch.bfloat16), old)
                new = edit.call(working_copy, (buffer, params), old)
            old.replace_all_uses_with(new)
            for node in dict.fromkeys([old, *casts]):
                gm.graph.erase_node(node)
            copies[name] = [str(p.target) for p in params]
        if ctx.program is not None:
            ctx.program.working_weights.update(copies)
        gm.recompile()
        parameters = sum(len(v) for v in copies.values())
        return PassResult(gm, bool(copies), {"copies": len(copies), "parameters": parameters})
