"""The pass manager: runs the passes a plan enables, verifies after each, calls dump hooks.

A pass is an object with a ``name``, a docstring (what it matches, what it emits, which
invariants it keeps) and ``run(gm, ctx) -> PassResult``. Passes are pure functions of the graph
and the plan: everything they learn goes into their result's ``stats``, nothing into globals.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch.fx as fx

from moec.plan import Plan


@dataclasses.dataclass
class PassResult:
    gm: fx.GraphModule
    modified: bool
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Counters tests assert on (``ffns_replaced``) and ``params_added``/``params_removed``."""


@dataclasses.dataclass
class PassContext:
    plan: Plan
    results: dict[str, PassResult] = dataclasses.field(default_factory=dict)
    """Results of the passes that already ran, by name."""


class Pass(Protocol):
    name: str

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult: ...


DumpHook = Callable[[str, fx.GraphModule, dict[str, Any]], None]
"""``hook(stage_name, gm, stats)``: called once for the captured graph and after every pass."""


class PassManager:
    def __init__(self, passes: list[Pass], *, verify: bool = True, dump: DumpHook | None = None):
        self.passes, self.verify, self.dump = passes, verify, dump

    def run(self, gm: fx.GraphModule, plan: Plan) -> tuple[fx.GraphModule, PassContext]:
        from moec.passes.verify import parameter_count, verify_graph

        ctx = PassContext(plan)
        if self.verify:
            verify_graph(gm, "capture")
        if self.dump:
            self.dump("capture", gm, {})
        for p in self.passes:
            before = parameter_count(gm)
            start = time.perf_counter()
            result = p.run(gm, ctx)
            result.stats["seconds"] = round(time.perf_counter() - start, 3)
            gm = result.gm
            if self.verify:
                expected = (
                    before
                    + result.stats.get("params_added", 0)
                    - result.stats.get("params_removed", 0)
                )
                verify_graph(gm, p.name, expected_params=expected)
            ctx.results[p.name] = result
            if self.dump:
                self.dump(p.name, gm, result.stats)
        return gm, ctx


def default_passes(plan: Plan, mesh: Any = None) -> list[Pass]:
    """The passes ``plan`` enables, in pipeline order; ``mesh`` (a
    :class:`moec.runtime.distributed.MoEMesh`) places this rank when ``parallel.ep > 1``."""
    from moec.passes.casts import SharedCastsPass
    from moec.passes.expert_parallel import ExpertParallelPass
    from moec.passes.glu import FuseGluPass
    from moec.passes.loss import FusedLossPass
    from moec.passes.moe import MoEPass
    from moec.passes.precision import PrecisionPass
    from moec.passes.recompute import RecomputePass
    from moec.passes.rope import FuseRopePass
    from moec.passes.working_weights import WorkingWeightsPass

    passes: list[Pass] = [MoEPass()]
    if plan.parallel.ep > 1:
        passes.append(ExpertParallelPass.for_mesh(plan, mesh))
    if plan.precision.gemm != "bf16":
        passes.append(PrecisionPass())
    if plan.loss.fused and plan.parallel.pp == 1:
        # pipelined programs compute the loss outside the graph, in the last stage's loss_fn
        passes.append(FusedLossPass())
    if plan.precision.compute_dtype == "bf16":
        passes.append(SharedCastsPass())
    passes.append(FuseRopePass())  # after shared_casts: it folds their cast before attention
    passes.append(FuseGluPass())  # after shared_casts: it concatenates the weights' bf16 casts
    if plan.precision.compute_dtype == "bf16":
        passes.append(WorkingWeightsPass())  # after fuse_glu: it keeps the concatenation too
    if plan.recompute.policy != "none":
        passes.append(RecomputePass())
    if plan.parallel.pp > 1:
        from moec.passes.pipeline import PipelinePass

        passes.append(PipelinePass())
    return passes
