"""Pass ``fsdp``: the dense parameters become FSDP2 shards (``parallel.dp_shard > 1``).

Matches  every parameter that is not an expert slice (role ``dense`` or ``router``), and in a
         bf16 program the casts ``shared_casts`` put on them: ``aten._to_copy(P, dtype=bf16)``
         with P such a parameter's ``get_attr``.
Emits    ``aten.to.dtype(P, bf16)`` in place of each such cast: the runtime all-gathers these
         parameters in bf16 (FSDP2's ``MixedPrecisionPolicy``), so the cast is a no-op on what
         arrives (``to`` returns its input) where ``_to_copy`` would copy every unsharded weight
         each step; the program's ``data_parallel`` (:class:`moec.program.ShardedDataParallel`)
         names the sharded parameters, the replicate x shard layout and the gather dtype.
Keeps    values (the cast rounds the same float32 values to bf16, on the shard before the
         all-gather instead of on the whole tensor after it) and gradients (``to``'s backward
         casts back, as ``_to_copy``'s does; FSDP2 reduces them in float32); the parameters
         and their names.
Runs after ``working_weights``, which leaves the sharded parameters' casts alone (a persistent
bf16 copy of a whole parameter would undo the sharding), and before ``recompute`` and
``pipeline``, which copy the graph's nodes into regions and stages.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.casts import is_bf16_cast
from moec.plan import Plan
from moec.program import ShardedDataParallel

aten = torch.ops.aten


@register_pass
class FSDPPass(Pass):
    name = "fsdp"
    after: tuple[str, ...] = ("moe", "expert_parallel", "shared_casts", "working_weights")

    @staticmethod
    def applies(plan: Plan) -> bool:
        """parallel.dp_shard > 1"""
        return plan.parallel.dp_shard > 1

    @staticmethod
    def options(plan: Plan) -> str:
        p = plan.parallel
        return f"replicate={p.dp // p.dp_shard},shard={p.dp_shard}"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        program = ctx.require_program(self.name)
        sharded = tuple(name for name, _ in gm.named_parameters() if program.role(name) != "expert")
        names = set(sharded)
        bf16 = ctx.plan.precision.compute_dtype == "bf16"
        casts = [
            node
            for node in gm.graph.nodes
            if bf16
            and node.target == aten._to_copy.default
            and is_bf16_cast(node)
            and node.args[0].op == "get_attr"
            and node.args[0].target in names
        ]
        for node in casts:
            node.target, node.kwargs = aten.to.dtype, {}
            node.args = (node.args[0], torch.bfloat16)
        gm.recompile()
        p = ctx.plan.parallel
        program.data_parallel = ShardedDataParallel(
            replicate=p.dp // p.dp_shard,
            shard=p.dp_shard,
            params=sharded,
            gather_dtype="bfloat16" if bf16 else None,
        )
        return PassResult(gm, bool(casts), {"sharded": len(sharded), "casts_to_gather": len(casts)})
