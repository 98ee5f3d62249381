"""Profiling a window of training steps: the trace names blocks and moec ops, the summary is
written, the instrumented graph computes what the plain one does, bad windows are refused."""

import json

import pytest
import torch

import moec
from moec.runtime.profiling import (
    ProfileError,
    ProfileWindow,
    StepProfiler,
    block_paths,
    instrument,
)
from moec.train.objective import LanguageModelWithLoss
from tests.models import tiny_llama, tokens

PLAN = {"moe": {"num_experts": 4, "top_k": 2, "dense_first": 1}}


def _compiled(plan=PLAN):
    torch.manual_seed(0)
    ids = tokens()
    return moec.compile(LanguageModelWithLoss(tiny_llama(2)), plan, (ids, ids)), ids


def _train(compiled, ids, profiler, steps):
    optimizer = torch.optim.SGD(compiled.parameters(), lr=1e-2)
    for step in range(steps):
        with profiler.step(step):
            (compiled(ids, ids) + compiled.aux_loss()).backward()
            optimizer.step()
            optimizer.zero_grad()


def _trace_names(path):
    events = json.loads(path.read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("ph") == "X"}


def test_profiled_window_writes_trace_with_block_and_op_ranges_and_summary(tmp_path):
    compiled, ids = _compiled()
    said = []
    profiler = StepProfiler(ProfileWindow(1, 2), compiled, tmp_path / "profile", say=said.append)
    _train(compiled, ids, profiler, 4)
    trace = tmp_path / "profile" / "trace_rank0.json"
    summary = tmp_path / "profile" / "summary_rank0.txt"
    ops = tmp_path / "profile" / "ops_rank0.json"
    assert profiler.written == [trace, summary, ops]
    names = _trace_names(trace)
    blocks = ["model.layers.0", "model.layers.1"]
    assert block_paths(compiled.program) == blocks
    for path in blocks:
        assert f"block {path}" in names and f"block {path} (backward)" in names
    for op in ["moec::route", "moec::dispatch", "moec::expert_mlp", "moec::combine"]:
        assert op in names, op
    steps = {n for n in names if n.startswith("step ")}
    assert steps == {"step 1", "step 2"}  # the window's steps only
    text = summary.read_text()
    assert said == [text]
    assert "ops by self cpu time total" in text and "aten::" in text
    totals = text.split("per-block totals")[1]
    for path in blocks:  # 2 steps: 2 calls of each range
        for name in (f"block {path} ", f"block {path} (backward) "):
            row = next(line for line in totals.splitlines() if line.startswith(name))
            assert row.split()[-2] == "2", row
    assert compiled.instrument is None  # closed: the plain graph runs again


@pytest.mark.parametrize("recompute", ["none", "block"])
def test_instrumented_graph_gives_the_same_loss_and_gradients(recompute):
    compiled, ids = _compiled({**PLAN, "recompute": {"policy": recompute}})
    blocks = block_paths(compiled.program)
    assert len(blocks) == 2
    plain = compiled.program.graph
    marked = instrument(plain, blocks, nvtx=False)
    begins = [n for n in marked.graph.nodes if getattr(n.target, "__name__", "") == "block_begin"]
    assert [n.args[0] for n in begins] == [f"block {p}" for p in blocks]

    def run(graph):
        compiled.zero_grad(set_to_none=True)
        loss, *aux = graph(*compiled.program.signature.flatten_inputs((ids, ids), {}))
        compiled.aux_outputs = dict(zip(compiled.program.signature.aux_outputs, aux))
        (loss + compiled.aux_loss()).backward()
        return loss.detach(), {n: p.grad.clone() for n, p in compiled.named_parameters()}

    loss, grads = run(plain)
    with torch.profiler.profile() as prof:
        loss_marked, grads_marked = run(marked)
    assert torch.equal(loss, loss_marked)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_marked[name]), name
    names = {e.name for e in prof.events()}
    assert {f"block {p} (backward)" for p in blocks} <= names


def test_nvtx_ranges_pair_up_in_forward_and_backward(monkeypatch):
    """The CUDA path's NVTX calls, recorded on the CPU: every moec op pushed and popped, every
    block range (forward and backward) started and ended once."""
    calls = []
    ids = iter(range(1000))

    def start(name):
        calls.append(("start", name, n := next(ids)))
        return n

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_start", start)
    monkeypatch.setattr(torch.cuda.nvtx, "range_end", lambda n: calls.append(("end", n)))
    compiled, ids_ = _compiled()
    graph = instrument(compiled.program.graph, block_paths(compiled.program), nvtx=True)
    loss, *aux = graph(ids_, ids_)
    compiled.aux_outputs = dict(zip(compiled.program.signature.aux_outputs, aux))
    (loss + compiled.aux_loss()).backward()
    depth, pushed = 0, []
    for call in calls:
        if call[0] in ("push", "pop"):
            depth += 1 if call[0] == "push" else -1
            assert depth in (0, 1), calls  # each op's range closes before the next opens
            pushed += call[1:]
    assert depth == 0
    assert {"moec::route", "moec::dispatch", "moec::expert_mlp", "moec::combine"} <= set(pushed)
    started = {c[2]: c[1] for c in calls if c[0] == "start"}
    ended = [c[1] for c in calls if c[0] == "end"]
    assert sorted(ended) == sorted(started)
    blocks = ["model.layers.0", "model.layers.1"]
    assert sorted(started.values()) == sorted(
        [f"block {b}" for b in blocks] + [f"block {b} (backward)" for b in blocks]
    )


def test_a_step_that_raises_inside_the_window_closes_it_and_writes_the_trace(tmp_path):
    compiled, ids = _compiled()
    profiler = StepProfiler(ProfileWindow(0, 3), compiled, tmp_path, say=None)
    with pytest.raises(RuntimeError, match="boom"):
        with profiler.step(0):
            compiled(ids, ids).backward()
            raise RuntimeError("boom")
    assert not profiler.active and compiled.instrument is None
    assert "block model.layers.1" in _trace_names(tmp_path / "trace_rank0.json")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("3", "expected START:STEPS"),
        ("a:2", "expected START:STEPS"),
        ("1:2:3", "expected START:STEPS"),
        ("", "expected START:STEPS"),
        ("-1:2", "START = -1 must be >= 0"),
        ("4:0", "STEPS = 0 must be >= 1"),
    ],
)
def test_malformed_windows_are_refused(spec, message):
    with pytest.raises(ProfileError, match=message):
        ProfileWindow.parse(spec)


def test_windows_outside_the_run_are_refused():
    window = ProfileWindow.parse("8:3")
    assert (window.start, window.stop) == (8, 11)
    window.check(11)
    with pytest.raises(ProfileError, match="past the run's last step 9 \\(--steps 10\\)"):
        window.check(10)
    with pytest.raises(ProfileError, match="this run resumes at step 9"):
        window.check(20, first_step=9)


@pytest.mark.slow
def test_moec_train_profile_writes_the_window_into_the_run(tmp_path):
    """``moec train --profile 1:2`` end to end: the trace of steps 1-2 and the summary land in
    the run's profile folder; a window past the run is a one-line error before any step."""
    from moec.cli import main

    out = tmp_path / "run"
    args = ["train", "--steps", "4", "--synthetic", "--batch-size", "2", "--seq-len", "16"]
    assert main([*args, "--out", str(out), "--profile", "1:2", "--log-every", "2"]) == 0
    names = _trace_names(out / "profile" / "trace_rank0.json")
    assert {"step 1", "step 2"} <= names and "step 0" not in names and "step 3" not in names
    assert any(name.startswith("block ") for name in names)
    assert (out / "profile" / "summary_rank0.txt").read_text()
    assert main([*args, "--out", str(tmp_path / "late"), "--profile", "3:5"]) == 2


def test_profiled_cpu_run_calibrates_the_time_model(tmp_path):
    """The window's ops_rank0.json names each op's kind, shapes and time, says the step's
    shape, and calibrates the time model: GEMM, attention and (priced with the model's
    profile) memory factors are refitted from it."""
    from moec.analysis.cost.time import Efficiency
    from moec.analysis.gpus import gpu_spec
    from moec.autoplan.calibration import fit, load_measurement
    from moec.autoplan.profile import profile_program

    compiled, ids = _compiled()
    profiler = StepProfiler(ProfileWindow(1, 2), compiled, tmp_path / "profile", say=None)
    _train(compiled, ids, profiler, 3)
    data = json.loads((tmp_path / "profile" / "ops_rank0.json").read_text())
    assert data["steps"] == 2 and data["world"] == 1 and data["device_time"] is False
    assert data["microbatch"] == list(ids.shape) and data["forward_calls"] == 2
    kinds = {(o["name"], o["kind"]) for o in data["ops"]}
    assert {("moec::expert_mlp", "gemm"), ("moec::expert_mlp_backward", "gemm")} <= kinds
    assert ("aten::scaled_dot_product_attention", "attention") in kinds
    expert = next(o for o in data["ops"] if o["name"] == "moec::expert_mlp")
    assert expert["shapes"][1] == [4, 32, 128] and expert["seconds"] > 0
    measured = load_measurement(tmp_path)  # the run directory's profile folder
    assert measured.forward_calls == 2 and measured.other_s > 0
    result = fit(measured, gpu_spec("h200"), profile=profile_program(compiled.program))
    prior = Efficiency()
    assert result.eff.gemm != prior.gemm and result.eff.attention != prior.attention
    assert result.eff.memory != prior.memory and result.eff.memory > 0
    assert any(note.startswith("memory: ") and "GB" in note for note in result.notes)
