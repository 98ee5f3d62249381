"""When a plan can pipeline a model: the checks the ``pipeline`` pass runs before splitting.

:func:`check_splittable` raises :class:`~moec.plan.PlanError` naming the plan field: at most one
stage per unit (residual block, or half block: ``parallel.pp``), 2 stages per rank for the
V-shaped schedules and 2+ for interleaved 1F1B, 1 for GPipe and 1F1B
(``parallel.virtual_stages``), and as many microbatches as the schedule needs
(``parallel.microbatches``).
"""

from __future__ import annotations

from moec.analysis.pipeline_schedule import V_SHAPED
from moec.plan import ParallelPlan, PlanError


def check_splittable(p: ParallelPlan, num_units: int) -> None:
    """Raise :class:`PlanError` naming the field when ``p`` cannot split ``num_units`` units."""
    stages = p.pp * p.virtual_stages
    if stages > num_units:
        raise PlanError(
            "parallel.pp",
            p.pp,
            f"pp * virtual_stages = {stages} stages but the model has {num_units} units "
            f"(parallel.pp_units={p.pp_units!r}); use at most one stage per unit",
        )
    if p.pp_schedule in V_SHAPED and p.virtual_stages != 2:
        raise PlanError(
            "parallel.virtual_stages",
            p.virtual_stages,
            f"2 for the V-shaped schedule {p.pp_schedule!r}",
        )
    if p.pp_schedule == "interleaved_1f1b" and p.virtual_stages < 2:
        raise PlanError(
            "parallel.virtual_stages", p.virtual_stages, "2 or more for interleaved_1f1b"
        )
    if p.pp_schedule in ("gpipe", "1f1b") and p.virtual_stages != 1:
        raise PlanError("parallel.virtual_stages", p.virtual_stages, f"1 for {p.pp_schedule!r}")
    need = 2 * p.pp if p.pp_schedule == "dualpipev" else p.pp
    if p.microbatches < need:
        raise PlanError(
            "parallel.microbatches",
            p.microbatches,
            f"at least {need} for {p.pp_schedule!r} with pp={p.pp}",
        )
