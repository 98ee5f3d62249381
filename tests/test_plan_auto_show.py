"""``moec plan auto`` and ``moec plan show`` agree (issue 51): the YAML the planner writes holds
every choice it made (``parallel.microbatch_size`` included), ``plan show`` on it predicts the
memory the planner printed, and no pass turns the plan down."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from moec.analysis.gpus import GPUS
from moec.analysis.rank_memory import GIB, RankMemory
from moec.autoplan import NoPlanFitsError, Request, Search, capture
from moec.autoplan.cli import auto_plan, plan_yaml
from moec.autoplan.search import refusal
from moec.cli import main
from moec.plan import Plan

LLAMA8B = "examples/llama3_8b.py:llama3_8b"


@pytest.fixture(scope="module")
def llama_profile():
    return capture("llama", Plan())


def _show(path: Path, model: str, seq: int, capsys) -> tuple[float, list[str]]:
    """(total GiB ``moec plan show`` prints, the warnings it raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["plan", "show", str(path), "--model", model, "--seq", str(seq)]) == 0
    out = capsys.readouterr().out
    total = re.search(r"^total\s+([0-9.]+) GiB", out, re.MULTILINE)
    assert total is not None, out
    return float(total.group(1)), [str(w.message) for w in caught if "moec:" in str(w.message)]


def _agree(tmp_path, capsys, monkeypatch, model, profile, world, global_batch, seq, pp=None):
    import moec.autoplan.cli as cli

    if profile is not None:
        monkeypatch.setattr(cli, "profile_of", lambda model, plan: profile)
    result = auto_plan(model, world, "h200", global_batch, seq, top=1, min_micro_seqs=2, pp=pp)
    best = result.best[0]
    path = tmp_path / "plan.yaml"
    path.write_text(plan_yaml(result, model))
    written = Plan.load(path)
    assert written == best.plan(result.base)
    assert written.parallel.microbatch_size == best.layout.micro_seqs
    units = profile.num_blocks if best.layout.whole_blocks else profile.num_units
    assert refusal(written, units) is None
    shown, declined = _show(path, model, seq, capsys)
    assert not [w for w in declined if "left the program unchanged" in w], declined
    assert shown == pytest.approx(best.memory.total / GIB, abs=1e-3)
    return best


@pytest.mark.parametrize(
    "world, global_batch, pp",
    [(4, 32 * 128, None), (8, 64 * 128, 2), (16, 128 * 128, None)],
)
def test_plan_show_on_what_plan_auto_wrote_predicts_its_memory(
    tmp_path, capsys, monkeypatch, llama_profile, world, global_batch, pp
):
    _agree(tmp_path, capsys, monkeypatch, "llama", llama_profile, world, global_batch, 128, pp)


@pytest.mark.slow
def test_the_issues_8b_on_16_h200s_agrees_with_plan_show(tmp_path, capsys, monkeypatch):
    """The issue's case: Llama-3-8B on 16 H200s at seq 4096, a 1M-token global batch."""
    profile = capture(LLAMA8B, Plan())
    best = _agree(tmp_path, capsys, monkeypatch, LLAMA8B, profile, 16, 2**20, 4096)
    assert best.memory.total <= GPUS["h200"].memory_bytes * 0.92


def test_the_search_offers_no_overlap_the_overlap_pass_turns_down(llama_profile):
    """Pass ``overlap`` declines rowwise EP with a binding capacity (``capacity_factor`` below
    N/K) and an odd batch: the search never proposes either, and offers rowwise overlap once
    the plan is dropless."""
    request = Request(8, GPUS["h200"], 24 * 128, 128, min_micro_seqs=1)
    binding = Search(llama_profile, request, Plan())
    every = list(binding.candidates(prune=False))
    overlapped = [p.layout for p in every if p.layout.overlap == "two_batch"]
    assert overlapped and all(lay.ep_path == "a2a_capacity" for lay in overlapped)
    assert all(lay.micro_seqs % 2 == 0 for lay in overlapped)
    assert any(p.layout.micro_seqs % 2 for p in every)  # odd batches exist, without overlap
    assert any(reason.startswith("pass overlap declines") for reason in binding.refused)
    dropless = Plan.from_dict({"moe": {"capacity_factor": None}})
    lays = [p.layout for p in Search(llama_profile, request, dropless).candidates(prune=False)]
    assert any(lay.overlap == "two_batch" and lay.ep_path == "rowwise" for lay in lays)


def test_plan_show_prices_the_plans_microbatch_size_and_the_fullest_pipeline_rank(tmp_path, capsys):
    """Without ``--batch``, ``plan show`` predicts at ``parallel.microbatch_size``; a
    pipelined plan reports its fullest rank."""
    path = tmp_path / "plan.yaml"
    parallel = {"pp": 2, "microbatches": 2, "microbatch_size": 3}
    path.write_text(Plan.from_dict({"parallel": parallel}).to_yaml())
    assert main(["plan", "show", str(path), "--model", "llama", "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"pipeline rank [01] of 2, the fullest; 3 x 64 tokens per microbatch", out)
    assert main(["plan", "show", str(path), "--model", "llama", "--seq", "64", "--batch", "8"]) == 0
    assert "4 x 64 tokens per microbatch" in capsys.readouterr().out


def test_the_overlap_pass_declines_from_the_plan_what_its_run_declines():
    """``OverlapPass.declines`` runs the checks ``run`` applies to the graph, on the plan."""
    from moec.passes.overlap import OverlapPass

    def plan(**parallel) -> Plan:
        return Plan.from_dict({"parallel": {"dp": 2, "ep": 2, "overlap": "two_batch", **parallel}})

    assert "ep_path=rowwise" in OverlapPass.declines(plan(ep_path="rowwise"))
    assert "ep_path=rowwise" in OverlapPass.declines(plan())  # auto may resolve to rowwise
    odd = OverlapPass.declines(plan(ep_path="a2a_capacity", microbatch_size=3))
    assert "parallel.microbatch_size is 3" in odd and "even batch >= 2" in odd
    assert OverlapPass.declines(plan(ep_path="a2a_capacity", microbatch_size=4)) is None
    parallel = plan(ep_path="rowwise").to_dict()["parallel"]
    dropless = Plan.from_dict({"moe": {"capacity_factor": None}, "parallel": parallel})
    assert OverlapPass.declines(dropless) is None


def test_priced_returns_only_plans_that_fit_as_priced_in_the_searchs_order(llama_profile):
    """``Search.priced`` replaces each estimate by the pricer's memory, drops a plan that does
    not fit as priced, and refuses when none does."""
    search = Search(llama_profile, Request(4, GPUS["h200"], 32 * 128, 128))
    ranked = search.ranked()
    too_big = RankMemory(0, 0, 0, 0, 0, round(search.capacity) + 1)
    priced: list[Plan] = []

    def price(plan: Plan, micro_seqs: int) -> RankMemory:
        priced.append(plan)
        first = plan == ranked[0].plan(search.base)
        return too_big if first else RankMemory(1, 2, 3, 4, 5, micro_seqs)

    best = search.priced(2, price)
    # the first plan held (capacity + 1) / its estimate: the next priced are those whose
    # estimate, scaled so, fits
    scale = too_big.total / ranked[0].memory.total
    fitting = [p.layout for p in ranked[1:] if p.memory.total * scale <= search.capacity]
    assert len(fitting) >= 2 and [p.layout for p in best] == fitting[:2]
    assert [p.memory.activations for p in best] == [p.layout.micro_seqs for p in best]
    assert len(priced) == 3
    with pytest.raises(NoPlanFitsError, match="as built"):
        search.priced(1, lambda plan, micro_seqs: too_big)
