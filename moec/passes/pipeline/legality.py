"""Whether a plan's pipeline fits a model: the check the ``pipeline`` pass runs before splitting.

:func:`check_splittable` raises :class:`~moec.plan.PlanError` naming the plan field: the
schedule's shape (stages per rank, microbatches), which :meth:`moec.plan.ParallelPlan.validate`
owns, and at most one stage per unit (residual block, or half block: ``parallel.pp``), which
needs the model.
"""

from __future__ import annotations

from moec.plan import ParallelPlan, PlanError


def check_splittable(p: ParallelPlan, num_units: int) -> None:
    """Raise :class:`PlanError` naming the field when ``p`` cannot split ``num_units`` units."""
    p.validate()
    stages = p.pp * p.virtual_stages
    if stages > num_units:
        raise PlanError(
            "parallel.pp",
            p.pp,
            f"pp * virtual_stages = {stages} stages but the model has {num_units} units "
            f"(parallel.pp_units={p.pp_units!r}); use at most one stage per unit",
        )
