"""Compiled programs kept across compiles (:mod:`moec.program_cache`): a second compile of the
same captured program, plan and target loads the program the first built, equal to it node for
node and in training, and any change to what the passes read builds anew.

(conftest gives each test a program folder of its own.)"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import moec
from moec import program_cache
from moec.compiler import meta_program
from moec.kernels.target import Target
from moec.runtime.materialize import FreshInit
from tests.models import hf_model, tiny_llama, tokens
from tests.programs import assert_same_program

MOE = {"num_experts": 4, "top_k": 2, "init": "random", "seed": 7}
MODELS = {
    "hf-llama": lambda: hf_model("llama"),
    "hf-gpt2": lambda: hf_model("gpt2"),
    "llama": tiny_llama,
}
"""(transformers' GPT-2 reads its embedding as its LM head: a parameter of two names)"""


def _meta(name: str) -> nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        return MODELS[name]()


def _plan(dtype: str, **moe) -> dict:
    return {"moe": {**MOE, **moe}, "precision": {"compute_dtype": dtype}}


def _compile(name: str, plan: dict) -> moec.CompiledModel:
    return moec.compile(_meta(name), plan, (tokens(),), init_from=FreshInit(seed=3))


def _loss_and_grads(compiled: moec.CompiledModel, ids: torch.Tensor) -> tuple:
    out = compiled(ids)
    logits = out.logits if hasattr(out, "logits") else out
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in compiled.named_parameters()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_second_compile_loads_the_program_the_first_built_and_trains_alike(name, dtype):
    built = _compile(name, _plan(dtype))
    ids = tokens()
    want_loss, want_grads = _loss_and_grads(built, ids)
    assert program_cache.counters["stored"] >= 1
    hits = program_cache.counters["hits"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = _compile(name, _plan(dtype))
    assert program_cache.counters["hits"] == hits + 1
    assert not [
        w
        for w in caught
        if "cached program" in str(w.message) or issubclass(w.category, FutureWarning)
    ], caught  # a load says nothing new
    got_loss, got_grads = _loss_and_grads(loaded, ids)
    a, b = built.program, loaded.program
    assert_same_program(a, b)
    assert {k: (r.modified, r.stats) for k, r in a.pass_results.items()} == {
        k: (r.modified, r.stats) for k, r in b.pass_results.items()
    }
    assert set(a.graph.state_dict()) == set(b.graph.state_dict())
    assert torch.equal(got_loss, want_loss)
    assert want_grads.keys() == got_grads.keys()
    for n, grad in want_grads.items():
        assert torch.equal(grad, got_grads[n]), n
    for compiled in (built, loaded):  # the optimizer users write, one step each
        torch.optim.AdamW(compiled.parameters(), lr=1e-3).step()
    want_params = dict(built.named_parameters())
    for n, p in loaded.named_parameters():
        assert torch.equal(p, want_params[n]), n


def _key(model: nn.Module, plan: dict, target: Target | None = None, **how) -> str:
    program = meta_program(model, moec.Plan.from_dict(plan), (tokens(),), {}, names=[])
    target = target or Target.detect("cpu")
    program.target = target
    args = dict(plan=moec.Plan.from_dict(plan), names=["moe"], target=target, ep_group=None)
    return program_cache.key(program, **{**args, "verify": True, **how})


def test_the_key_changes_with_everything_the_passes_read():
    plan = _plan("fp32")
    same = _key(_meta("llama"), plan)
    assert same is not None and same == _key(_meta("llama"), plan)
    cpu = Target.detect("cpu")
    changed = {
        "plan": _key(_meta("llama"), _plan("fp32", top_k=1)),
        "model": _key(_meta("hf-llama"), plan),
        "target": _key(_meta("llama"), plan, dataclasses.replace(cpu, triton=not cpu.triton)),
        "passes": _key(_meta("llama"), plan, names=["moe", "casts"]),
    }
    for what, key in changed.items():
        assert key is not None and key != same, what
    assert _key(_meta("llama"), plan, verify=False) is None  # unverified: not cached
    # a model whose code differs but captures the same graph: only its source lines differ
    model = _meta("llama")
    program = meta_program(model, moec.Plan.from_dict(plan), (tokens(),), {}, names=[])
    node = next(n for n in program.graph.graph.nodes if "stack_trace" in n.meta)
    node.meta["stack_trace"] += "\n  (edited)"
    program.target = cpu
    how = dict(plan=moec.Plan.from_dict(plan), names=["moe"], target=cpu, ep_group=None)
    assert program_cache.key(program, **how, verify=True) != same


def test_a_file_that_does_not_load_is_a_miss_and_is_replaced():
    _compile("llama", _plan("fp32"))
    [path] = list(program_cache.active_folder().glob("*.pkl"))
    path.write_bytes(b"not a program")
    with pytest.warns(UserWarning, match="ignoring the cached program"):
        _compile("llama", _plan("fp32"))
    hits = program_cache.counters["hits"]
    _compile("llama", _plan("fp32"))  # the rebuilt program replaced the file
    assert program_cache.counters["hits"] == hits + 1


def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_compile(monkeypatch, tmp_path):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setattr(program_cache, "active_folder", lambda: blocked / "programs")
    with pytest.warns(UserWarning, match="could not cache the program"):
        compiled = _compile("llama", _plan("fp32"))
    assert bool(compiled(tokens()).isfinite().all())
    assert "could not be written" in program_cache.last_reason


def test_what_is_not_cached_is_built_and_says_why():
    stored = program_cache.counters["stored"]
    recompute = {**_plan("fp32"), "recompute": {"policy": "block"}}
    _compile("llama", recompute)
    assert program_cache.counters["stored"] == stored
    assert "sub-graphs" in program_cache.last_reason
    real = tiny_llama()  # a model holding its tensors is captured with them
    moec.compile(real, _plan("fp32"), (tokens(),))
    assert "tensor data" in program_cache.last_reason


def test_a_loaded_program_issues_the_warnings_its_passes_issued(monkeypatch):
    from moec.passes.moe import MoEPass

    run = MoEPass.run

    def warning_run(self, gm, ctx):
        warnings.warn("moe pass: a note for the user", UserWarning, stacklevel=1)
        return run(self, gm, ctx)

    monkeypatch.setattr(MoEPass, "run", warning_run)
    for _ in range(2):
        with pytest.warns(UserWarning, match="a note for the user"):
            _compile("llama", _plan("fp32"))
    assert program_cache.counters["hits"] >= 1
