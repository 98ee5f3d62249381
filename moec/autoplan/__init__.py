"""Automatic plans: search parallelism, recompute, microbatching and precision for a model.

``moec plan auto --model M --world N --gpu GPU [--global-batch TOKENS]`` and its Python call::

    from moec.autoplan import auto_plan
    result = auto_plan("llama", world=8, gpu="h200", global_batch=2**20, seq=4096)
    result.best[0].plan(result.base)          # the chosen Plan

The model is captured once on the meta device (:mod:`~moec.autoplan.profile`), every
layout is evaluated analytically (:mod:`~moec.autoplan.search`, with the time model
:mod:`moec.analysis.cost.time` and the GPU specs :mod:`moec.analysis.gpus`), and the memory of
each layout is estimated with :mod:`moec.analysis.rank_memory`'s rules on the profile
(:mod:`~moec.autoplan.memory`); no candidate is a plan a pass turns down, and the plans
reported are priced as ``moec plan show`` prices them (:func:`~moec.autoplan.memory.plan_memory`,
the program built on the meta device). :mod:`~moec.autoplan.cli` runs the
subcommand (``cmd_plan_auto``; :mod:`moec.cli` builds its parser).
"""

from moec.autoplan.cli import AutoPlanResult, auto_plan, capture
from moec.autoplan.profile import ModelProfile, profile_program
from moec.autoplan.search import NoPlanFitsError, Prediction, Request, Search, search

__all__ = [
    "AutoPlanResult",
    "ModelProfile",
    "NoPlanFitsError",
    "Prediction",
    "Request",
    "Search",
    "auto_plan",
    "capture",
    "profile_program",
    "search",
]
