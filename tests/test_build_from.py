"""One capture, several plans (:func:`moec.compiler.build_from`): a plan built on a copy of a
capture is the program its own capture builds, and the capture stays as it was; the planner
captures a model once for its profile and every plan it prices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moec import compiler, program_cache
from moec.analysis.rank_memory import rank_memory
from moec.autoplan import cli as autoplan
from moec.autoplan.memory import CapturedModel, plan_memory
from moec.compiler import build_from, build_program, captured_program, default_target
from moec.debug import with_next_token_loss
from moec.plan import Plan
from tests.models import hf_model, tiny_llama, tokens
from tests.programs import assert_same_program, nodes, state

MODELS = {"hf-llama": lambda: hf_model("llama"), "llama": tiny_llama}
PLANS = (
    {"moe": {"num_experts": 4, "top_k": 2, "init": "random", "seed": 7}},
    {
        "moe": {"num_experts": 8, "top_k": 2, "init": "upcycle", "dense_first": 1},
        "precision": {"compute_dtype": "bf16"},
        "recompute": {"policy": "block"},
    },
)


def _meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return MODELS[name]()


def _results(program) -> dict:
    """Each pass's result but its time."""
    return {
        name: (r.modified, {k: v for k, v in r.stats.items() if k != "seconds"})
        for name, r in program.pass_results.items()
    }


@pytest.mark.parametrize("name", list(MODELS))
def test_plans_built_on_one_capture_are_their_own_builds_and_leave_it_as_it_was(name, monkeypatch):
    monkeypatch.setattr(program_cache, "active_folder", lambda: None)  # every program built
    ids = tokens().to("meta")
    captured = captured_program(_meta(name), (ids,), {}, training=True)
    before = (captured.graph.code, nodes(captured), state(captured), repr(captured.signature))
    target = default_target((ids,), {})
    for data in PLANS:
        plan = Plan.from_dict(data)
        shared = build_from(captured, plan, target=target)
        own = build_program(_meta(name), plan, (ids,), {}, target=target)
        assert_same_program(shared, own)
        assert _results(shared) == _results(own)
    after = (captured.graph.code, nodes(captured), state(captured), repr(captured.signature))
    assert after == before


def test_the_planner_captures_once_for_its_profile_and_every_plan_it_prices(monkeypatch):
    captures = []
    capture = compiler.capture

    def counted(*args, **kwargs):
        captures.append(args[0])
        return capture(*args, **kwargs)

    monkeypatch.setattr(compiler, "capture", counted)

    def load():
        return tiny_llama(layers=2), (tokens().to("meta"),), {}

    model = CapturedModel(load, "tiny")
    profile = autoplan.profile_of(model, Plan())
    plans = [Plan.from_dict({"moe": {"num_experts": n, "top_k": 2}}) for n in (4, 8)]
    priced = [plan_memory(model, plan, 2, 16)[0] for plan in plans]
    assert len(captures) == 1 and profile.num_blocks == 2
    with torch.device("meta"):  # each price is the one a capture of its own gives
        fresh, args, kwargs = load()
    fresh, args = with_next_token_loss(fresh, args, kwargs, "tiny")
    for plan, memory in zip(plans, priced, strict=True):
        program = build_program(fresh, plan, args, {}, verify=False)
        assert memory == rank_memory(program, plan.parallel.microbatches, 2, 16, 0)
