"""Pass ``pipeline``: split the graph into ``pp x v`` stage graphs at block or half-block cuts.

Runs last, when ``plan.parallel.pp > 1``. Matches the residual blocks the cost model finds
(:func:`moec.analysis.cost.graph_cost`: dense FFN regions and the MoE layers of the ``moe``
pass, and the regions of the ``recompute`` pass). A block ends at its **boundary**: the last
node of the block's module (the residual add after the FFN or the ``moec.combine`` output);
with ``parallel.pp_units: sublayer`` (the default) a block is also cut before its FFN, after
the attention's residual add, e.g. for Llama with x: f32[B, S, D]::

    add_2 = add(x, linear_3)              # layers.0 (pre-FFN) ends
    add_3 = add(add_2, linear_6)          # layers.0 (FFN) ends: boundary 0
    ...
    add_7 = add(add_6, combine_default)   # layers.1 (MoE) ends: boundary 1

Emits ``S = pp * v`` stage programs, recorded as the program's ``pipeline``
(:class:`moec.program.Pipeline`); the full graph itself is returned unchanged (it still runs as
one program, e.g. for evaluation, until the pipeline runtime frees the parameters of the stages
other ranks hold: :attr:`~moec.program.Pipeline.freed`)::

    stage 0:   forward(tokens)          -> (add_3, aux...)        # embed, blocks [0, b1)
    stage s:   forward(add_k)           -> (add_m, aux...)        # blocks [bs, bs+1)
    stage S-1: forward(add_n)           -> (logits, aux...)       # last blocks, norm, lm_head

By subject:

- :mod:`~moec.passes.pipeline.legality`: whether the plan can split the model;
- :mod:`~moec.passes.pipeline.units`: the units (blocks or their halves), their forward work
  and activation bytes;
- :mod:`moec.analysis.pipeline_schedule`: stage placement and the microbatches each stage holds
  in flight under the schedule (simulated from torch's own schedule planner);
- :mod:`~moec.passes.pipeline.balance`: units to stages, by dynamic programming over their
  forward seconds as :func:`moec.analysis.cost.time.forward_time` prices them (an H200's
  ceilings and the default efficiencies: only the ratios matter), unless ``parallel.pp_layout``
  gives the units per stage (``moec plan auto`` writes the split it priced on its GPU);
- :mod:`~moec.passes.pipeline.stages`: the stage graphs;
- :mod:`~moec.passes.pipeline.stage_table`: its stage cost table;
- :mod:`~moec.passes.pipeline.errors`: its error.

Activation memory per stage: ``in_flight`` microbatches of its saved bytes at its peak, plus the
largest transient of recomputing one block in backward (sizes are the captured example's: one
microbatch). Tensors a selective recompute region caches are not counted.

Zero-bubble release (zbv, dualpipev): torch's input backward (``stage_backward_input``) runs
``autograd.grad(retain_graph=True)`` and the weight backward re-runs only the nodes between the
weights and the parameter groups' intermediates, so a node on the input-gradient path alone
(activation, softmax, elementwise) keeps its saved tensors after both have run, until its
autograd graph is destroyed. torch drops its own references at W (the stage outputs and loss are
detached, the backward state popped), so the prediction holds only while the runtime keeps no
tensor attached to a finished microbatch's graph: the stage modules keep their aux outputs
detached (attached, they would keep the previous microbatch's saved tensors alive through the
next forward).

Preconditions: the plan is splittable, else :class:`~moec.plan.PlanError` naming the field
(``parallel.pp`` when ``pp * v`` exceeds the units, ``parallel.pp_layout`` when its counts do
not add up to the units, ``parallel.virtual_stages`` for V-shaped or
interleaved schedules without 2+ stages per rank, ``parallel.microbatches`` when fewer than the
schedule needs); a parameter read by two stages (tied embeddings) is an error naming it; a graph
whose stages' parameters a pipeline runtime already freed cannot be split again.

Options: ``plan.parallel`` (pp, virtual_stages, pp_schedule, microbatches, pp_units, pp_layout),
``plan.recompute``;
``PipelinePass(verify_stages=False)`` skips the per-stage verifier (re-splits of a verified graph).
Statistics: ``stages``, ``schedule``, ``units_per_stage``, ``minus_last_stage`` (mean units per
stage minus the last stage's), ``imbalance`` (max / mean stage predicted forward time),
``stage_table`` (per stage: units, flops, predicted forward ms, saved bytes per microbatch,
in-flight microbatches, predicted peak activation bytes, params, rank),
``params_removed``/``params_added`` 0. Invariants: those of :mod:`moec.passes.rewrite` on the
full graph and on every stage (each is verified); the stages' parameters partition the graph's.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from moec.analysis.cost import graph_cost
from moec.analysis.cost.time import forward_time
from moec.analysis.gpus import gpu_spec
from moec.analysis.pipeline_schedule import check_schedule_runs, inflight_microbatches
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.pipeline.balance import balance
from moec.passes.pipeline.errors import PipelinePassError
from moec.passes.pipeline.legality import check_splittable
from moec.passes.pipeline.stage_table import format_stage_table, stage_row
from moec.passes.pipeline.stages import build_split
from moec.passes.pipeline.units import pipeline_units, unit_saved_bytes, unit_work
from moec.plan import ParallelPlan, Plan, PlanError
from moec.program import Pipeline

BALANCE_GPU = "h200"
"""The GPU whose ceilings weigh units against each other when no ``pp_layout`` is given."""

__all__ = [
    "BALANCE_GPU",
    "PipelinePass",
    "PipelinePassError",
    "balance",
    "check_splittable",
    "pipeline_units",
    "format_stage_table",
]


@register_pass
class PipelinePass(Pass):
    name = "pipeline"
    after: tuple[str, ...] = (  # the last
        "recompute",
        "fsdp",
        "combine_experts",
    )

    @staticmethod
    def applies(plan: Plan) -> bool:
        """parallel.pp > 1"""
        return plan.parallel.pp > 1

    @staticmethod
    def options(plan: Plan) -> str:
        p = plan.parallel
        return f"pp={p.pp},v={p.virtual_stages},schedule={p.pp_schedule}"

    def __init__(self, verify_stages: bool = True):
        # the verifier's fake propagation of every stage is most of the pass's time
        self.verify_stages = verify_stages

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        program = ctx.require_program(self.name)
        old = program.pipeline
        if old is not None and old.freed:
            name, stage = next(iter(old.freed.items()))
            raise PipelinePassError(
                f"cannot split again: this rank freed the parameters of the stages it does not "
                f"run (e.g. {name!r} of stage {stage}) when its pipeline runtime was built; "
                "compile the model again for another split"
            )
        parallel = ctx.plan.parallel
        cost = ctx.analysis(graph_cost, program)
        names, units = pipeline_units(gm, cost, sublayers=parallel.pp_units == "sublayer")
        check_splittable(parallel, len(units))
        check_schedule_runs(parallel)
        gpu = gpu_spec(BALANCE_GPU)
        work = unit_work(gm, cost, units, program.moe_layers, parallel.ep)
        seconds = [forward_time(w, gpu) for w in work]
        in_flight = inflight_microbatches(parallel)
        if parallel.pp_layout is None:
            values = cost.sizes()
            saved = [unit_saved_bytes(cost, u, values) for u in units]
            starts = balance(seconds, saved, parallel.pp * parallel.virtual_stages, in_flight)
        else:
            starts = _layout_starts(parallel, names)
        split = build_split(
            program, cost, units, names, seconds, starts, ctx.plan, in_flight, self.verify_stages
        )
        program.pipeline = split
        return PassResult(gm, True, _stats(split))


def _layout_starts(parallel: ParallelPlan, names: list[str]) -> list[int]:
    """The first unit of every stage of ``parallel.pp_layout``."""
    layout = parallel.pp_layout or []
    if sum(layout) != len(names):
        raise PlanError(
            "parallel.pp_layout",
            layout,
            f"unit counts adding up to the {len(names)} units of this program ({', '.join(names)})",
        )
    starts = [0]
    for count in layout[:-1]:
        starts.append(starts[-1] + count)
    return starts


def _stats(split: Pipeline) -> dict[str, Any]:
    info = split.info
    times = [s.forward_s for s in info]
    units = [len(s.blocks) for s in info]
    return {
        "stages": len(info),
        "schedule": split.schedule,
        "units_per_stage": units,
        "minus_last_stage": round(sum(units) / len(units) - units[-1], 3),
        "imbalance": round(max(times) / (sum(times) / len(times)), 4),
        "stage_table": [stage_row(s) for s in info],
        "params_added": 0,
        "params_removed": 0,
    }
