"""Pipeline schedules, simulated: stage placement and in-flight microbatches per stage.

For a plan's ``parallel`` section (pp ranks, v stages per rank, a ``pp_schedule``):

- :func:`stage_rank`: the rank holding a stage: loop placement (stage % pp), or V-shaped for
  ``zbv``/``dualpipev`` (0..pp-1, then pp-1..0);
- :func:`inflight_microbatches`: per stage, the most microbatches whose saved activations it
  holds at once: GPipe all of them, 1F1B ``pp - rank``; multi-stage schedules replay each
  rank's action order as torch's schedule class computes it (F adds one; a full backward B, or
  the weight backward W of zero-bubble schedules, after which the retained graph is freed,
  removes one);
- :func:`schedule_class`: the ``torch.distributed.pipelining`` class that runs the schedule;
- :func:`split_backward_runs`: whether this torch can run the schedules that split the backward
  into input and weight passes (:data:`SPLIT_BACKWARD`) through moec's ops;
- :func:`check_schedule_runs`: **the one gate** on ``parallel.pp_schedule``: a PlanError where
  the schedule cannot run (the ``pipeline`` pass calls it before it splits; the planner offers
  only what :func:`schedule_runs` accepts).

Nothing here needs a process group: the action order comes from the schedule class's own planner
run on a stand-in.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from moec.plan import ParallelPlan, PlanError

V_SHAPED = ("zbv", "dualpipev")
"""Schedules placing stage s and 2*pp-1-s on one rank."""
MULTI_STAGE = ("interleaved_1f1b", *V_SHAPED)
"""Schedules holding several stages per rank."""
SPLIT_BACKWARD = V_SHAPED
"""Schedules that run each backward as an input pass and a later weight pass (zero bubble)."""
SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""The ``torch.distributed.pipelining.schedules`` class name of each ``pp_schedule``."""


def stage_rank(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank holding ``stage``: loop placement, or V-shaped (0..pp-1, pp-1..0)."""
    if schedule in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def inflight_microbatches(p: ParallelPlan) -> list[int]:
    """Per stage, the most microbatches whose saved activations it holds at once (see module)."""
    if p.pp_schedule == "gpipe":
        return [p.microbatches] * p.pp
    if p.pp_schedule == "1f1b":  # warmup of pp - rank forwards, then one backward per forward
        return [min(p.microbatches, p.pp - rank) for rank in range(p.pp)]
    try:
        order = _pipeline_order(p)
    except AttributeError:  # another torch's planner needs other state: all in flight (bound)
        return [p.microbatches] * (p.pp * p.virtual_stages)
    peak = [0] * (p.pp * p.virtual_stages)
    for actions in order.values():
        live = [0] * len(peak)
        for action in _flatten(actions):
            kind = action.computation_type.name
            if kind == "FORWARD":
                live[action.stage_index] += 1
            elif kind in ("FULL_BACKWARD", "BACKWARD_WEIGHT"):
                live[action.stage_index] -= 1
            peak[action.stage_index] = max(peak[action.stage_index], live[action.stage_index])
    return peak


def _flatten(actions: list) -> list:
    flat = []
    for action in actions:
        if action is None:
            continue
        subs = getattr(action, "sub_actions", None)
        flat += list(subs) if subs else [action]
    return flat


def schedule_class(name: str) -> type:
    """The ``torch.distributed.pipelining`` schedule class for a plan's ``pp_schedule``."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, SCHEDULE_CLASSES[name], None)
    if cls is None:
        raise PlanError(
            "parallel.pp_schedule",
            name,
            f"a schedule this torch {torch.__version__} provides "
            f"({SCHEDULE_CLASSES[name]} is missing)",
        )
    return cls


@functools.cache
def split_backward_runs() -> bool:
    """Whether this torch runs :data:`SPLIT_BACKWARD` schedules through moec's custom ops.

    The weight pass differentiates from the autograd nodes where a parameter's path meets the
    input's, kept after the input pass has freed the graph above them. For a moec op that node
    is a Python ``autograd.Function`` node, which torch 2.11 keeps only weakly: once the nodes
    that consumed it are freed, reading its ``_input_metadata`` (``autograd.grad`` does) fails
    (newer releases keep it). Probed once on a stand-in function whose consumer is freed."""

    class _Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad

    out = _Probe.apply(torch.zeros(1, requires_grad=True))
    node = out.grad_fn
    del out  # the graph above the node is freed, as after a zero-bubble input pass
    try:
        node._input_metadata  # noqa: B018 (the access is the probe)
    except (RuntimeError, AttributeError):
        return False
    return True


def runnable_schedules(dp_shard: int = 1, split_backward: bool | None = None) -> list[str]:
    """The ``pp_schedule`` values :func:`check_schedule_runs` accepts beside ``dp_shard``, where
    the torch that runs the plan splits the backward or not (``split_backward``; None: this
    torch, :func:`split_backward_runs`)."""
    return [s for s in SCHEDULE_CLASSES if _refusal(s, dp_shard, split_backward) is None]


def schedule_runs(schedule: str, dp_shard: int = 1, split_backward: bool | None = None) -> bool:
    """Whether :func:`check_schedule_runs` accepts ``schedule`` (the planner's filter)."""
    return _refusal(schedule, dp_shard, split_backward) is None


def check_schedule_runs(p: ParallelPlan, split_backward: bool | None = None) -> None:
    """Raise :class:`PlanError` naming ``parallel.pp_schedule``, the installed torch and the
    schedules accepted where ``p``'s schedule cannot run: its ``torch.distributed.pipelining``
    class is missing; it splits the backward (:data:`SPLIT_BACKWARD`) on a torch that cannot
    (``split_backward``: whether the torch that runs the plan can; None: this torch,
    :func:`split_backward_runs`); or it splits the backward under FSDP (``dp_shard > 1``), whose
    gather/release views refuse the in-place detach of the stage outputs."""
    reason = _refusal(p.pp_schedule, p.dp_shard, split_backward)
    if reason is not None:
        accepted = ", ".join(runnable_schedules(p.dp_shard, split_backward))
        raise PlanError(
            "parallel.pp_schedule",
            p.pp_schedule,
            f"a schedule that runs on torch {torch.__version__} with this plan: {reason}; "
            f"accepted: {accepted}",
        )


def _refusal(schedule: str, dp_shard: int, split_backward: bool | None) -> str | None:
    """Why ``schedule`` cannot run (see :func:`check_schedule_runs`), or None."""
    if _class_missing(schedule):
        return f"torch.distributed.pipelining has no {SCHEDULE_CLASSES[schedule]}"
    if schedule not in SPLIT_BACKWARD:
        return None
    if not (split_backward_runs() if split_backward is None else split_backward):
        return (
            f"{schedule!r} splits each backward into input and weight passes, and this torch "
            "frees a moec op's autograd node (a Python node) with the graph above it, where "
            "the weight pass starts (torch 2.13 and newer keep it)"
        )
    if dp_shard > 1:
        return (
            f"{schedule!r} with parallel.dp_shard = {dp_shard}: its split backward detaches "
            "the stage outputs in place, which FSDP's gather/release views refuse (or use "
            "dp_shard = 1)"
        )
    return None


def _class_missing(name: str) -> bool:
    """Whether this torch lacks the schedule class of ``pp_schedule`` ``name``."""
    from torch.distributed.pipelining import schedules

    return getattr(schedules, SCHEDULE_CLASSES[name], None) is None


def _pipeline_order(p: ParallelPlan) -> dict[int, list]:
    """Every rank's action list, computed by the schedule class's own planner on a stand-in
    (no process group needed)."""
    cls = schedule_class(p.pp_schedule)
    stages = p.pp * p.virtual_stages
    microbatches_per_round = p.pp
    me = types.SimpleNamespace(
        pp_group_size=p.pp,
        _n_microbatches=p.microbatches,
        _num_stages=stages,
        num_stages=stages,
        n_local_stages=p.virtual_stages,
        microbatches_per_round=microbatches_per_round,
        number_of_rounds=max(1, p.microbatches // microbatches_per_round),
    )
    order = {}
    for rank in range(p.pp):
        me.rank = rank
        order[rank] = cls._calculate_single_rank_operations(me, rank)
    return order
