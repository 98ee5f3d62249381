"""``plan.lowering.inductor``: the final program run through Inductor (CPU backend here) gives the
eager program's outputs and gradients, at the captured sizes and at a new sequence length, and
trains to the same losses."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import moec
from moec.runtime.block_graphs import program_blocks
from moec.runtime.lowering import InductorGraphs
from tests.models import tiny_llama, tokens

PLAN = {"moe": {"num_experts": 4, "top_k": 2, "dense_first": 1, "capacity_factor": None}}
INDUCTOR = {**PLAN, "lowering": {"inductor": True}}


def _pair(plan: dict, lowered_plan: dict, seed: int = 0):
    torch.manual_seed(seed)
    model = tiny_llama(2)
    x = tokens()
    eager = moec.compile(copy.deepcopy(model), plan, (x,), verify=False)
    lowered = moec.compile(model, lowered_plan, (x,), verify=False)
    for compiled in (eager, lowered):  # bf16 gradients, as moec.optim.AdamW takes them
        if compiled.working_weights is not None:
            compiled.working_weights.keep_gradients(compiled.parameters())
    return eager, lowered


def _step(model, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.float().square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["auto", "fa4"])
def test_inductor_program_equals_eager_forward_and_backward(attention):
    """bf16 compute over fp32 masters (the training setting; fp32 is tests/test_ops_compile.py's
    torch.compile check), at the captured length and a new one. ``fa4``: the lowered program's
    attention is ``moec::flash_attention`` (its reference here), an opaque call to Inductor
    with symbolic sequence lengths, against the eager program's SDPA."""
    precision, tol = {"precision": {"compute_dtype": "bf16"}}, 2e-2
    lowering = {"lowering": {"inductor": True, "attention": attention}}
    eager, lowered = _pair({**PLAN, **precision}, {**PLAN, **precision, **lowering})
    for seq in (16, 24):  # the captured length, then a new one (one recompile, then symbolic)
        x = tokens(seq=seq)
        want, want_grads = _step(eager, x)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got, got_grads = _step(lowered, x)
        ran = {e.name for e in prof.events()}
        assert ("moec::flash_attention_backward" in ran) == (attention == "fa4")
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, atol=tol, rtol=tol)


def test_the_lowered_program_is_compiled_once_per_graph():
    _, lowered = _pair(PLAN, PLAN)
    graphs = InductorGraphs(lowered.plan)
    graph = lowered.program.graph
    assert graphs.compiled(graph) is graphs.compiled(graph)
    other = copy.deepcopy(graph)
    assert graphs.compiled(other) is not graphs.compiled(graph)


def test_auto_lowers_to_inductor_on_cuda_only_where_the_plan_allows():
    auto = moec.Plan.from_dict(PLAN)
    assert auto.lowering.inductor == "auto"  # the default
    assert auto.lowers_to_inductor("cuda") and not auto.lowers_to_inductor("cpu")
    sharded = moec.Plan.from_dict({**PLAN, "parallel": {"dp": 2, "dp_shard": 2}})
    assert not sharded.lowers_to_inductor("cuda")
    # pipelined stages are lowered only when asked (not measured lowered on a GPU)
    for schedule, v in [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2)]:
        parallel = {"pp": 2, "virtual_stages": v, "pp_schedule": schedule, "microbatches": 4}
        pipelined = moec.Plan.from_dict({**PLAN, "parallel": parallel})
        assert not pipelined.lowers_to_inductor("cuda"), schedule
        assert not pipelined.lowers_to_inductor("cpu")
        forced_pipeline = moec.Plan.from_dict({**INDUCTOR, "parallel": parallel})
        assert forced_pipeline.lowers_to_inductor("cuda"), schedule
    block = moec.Plan.from_dict({**PLAN, "recompute": {"policy": "block"}})
    assert block.lowers_to_inductor("cuda")
    selective = moec.Plan.from_dict({**PLAN, "recompute": {"policy": "selective"}})
    assert not selective.lowers_to_inductor("cuda")
    forced_recompute = moec.Plan.from_dict({**INDUCTOR, "recompute": {"policy": "selective"}})
    assert forced_recompute.lowers_to_inductor("cuda")
    forced = moec.Plan.from_dict(INDUCTOR)
    assert forced.lowers_to_inductor("cpu") and forced.lowers_to_inductor("cuda")
    off = moec.Plan.from_dict({**PLAN, "lowering": {"inductor": False}})
    assert not off.lowers_to_inductor("cuda")


def test_auto_runs_the_graph_itself_on_the_cpu():
    _, model = _pair(PLAN, PLAN)
    graph = model.program.graph
    assert InductorGraphs(model.plan)(graph, [tokens()]) is graph
    assert InductorGraphs(moec.Plan.from_dict(INDUCTOR))(graph, [tokens()]) is not graph


def _backward_keeping_backend(backwards: list[torch.fx.GraphModule]):
    """An AOTAutograd backend that runs the graphs as traced and keeps each backward graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep_backward(gm: torch.fx.GraphModule, example_inputs):
        backwards.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=_forward_only, bw_compiler=keep_backward)


def _assert_gradients_uncast(backwards: list[torch.fx.GraphModule], lowered) -> None:
    """No backward graph returns a float32 cast, and the working copies' masters hold bf16
    gradients (their ``grad_dtype``)."""
    cast_ops = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
    for backward in backwards:
        (outputs,) = [n.args[0] for n in backward.graph.nodes if n.op == "output"]
        casts = [
            n
            for n in outputs
            if isinstance(n, torch.fx.Node)
            and n.target in cast_ops
            and n.meta["val"].dtype == torch.float32
        ]
        assert not casts, f"the compiled backward casts gradients to float32: {casts}"
    copied = [p for p in lowered.parameters() if lowered.working_weights.copy_of(p) is not None]
    assert copied and all(p.grad.dtype == torch.bfloat16 for p in copied)


@pytest.mark.parametrize("per_block", [False, True], ids=["whole", "per-block"])
@pytest.mark.parametrize("recompute", ["none", "block"])
def test_working_copies_gradients_leave_the_compiled_backward_uncast(recompute, per_block):
    """The bf16 gradients of working copies reach their float32 parameters as computed: the
    compiled backward returns no float32 cast of one (traced inside the graph, each copy's
    gradient was cast to float32 there and back to the parameter's bf16 ``grad_dtype`` by the
    engine), and they equal the eager program's; compiled whole (one backward) or per block
    (a dense and an MoE block: two)."""
    backwards: list[torch.fx.GraphModule] = []
    sections = {"precision": {"compute_dtype": "bf16"}, "recompute": {"policy": recompute}}
    eager, lowered = _pair({**PLAN, **sections}, {**INDUCTOR, **sections})
    blocks = (lambda: program_blocks(lowered.program)) if per_block else None
    backend = _backward_keeping_backend(backwards)
    lowered._lowering = InductorGraphs(lowered.plan, backend=backend, blocks=blocks)
    x = tokens()
    want, want_grads = _step(eager, x)
    got, got_grads = _step(lowered, x)
    assert len(backwards) == (2 if per_block else 1)
    _assert_gradients_uncast(backwards, lowered)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("attention", ["auto", "fa4"])
def test_a_users_torch_compile_leaves_the_working_copies_outside_too(attention):
    """``torch.compile(compiled_model)``, the user's own, over an eager program (lowering off):
    the working copies are made outside the traced graph as under ``lowering.inductor``, so
    its backward returns bf16 gradients to the masters uncast, equal to the eager program's.
    With ``fa4`` the traced graph holds the attention kernels chosen for the device too."""
    backwards: list[torch.fx.GraphModule] = []
    precision = {"precision": {"compute_dtype": "bf16"}}
    lowering = {"lowering": {"attention": attention}}
    eager, users = _pair({**PLAN, **precision}, {**PLAN, **precision, **lowering})
    assert not users.plan.lowers_to_inductor("cpu")
    compiled = torch.compile(users, backend=_backward_keeping_backend(backwards))
    x = tokens()
    want, want_grads = _step(eager, x)
    users.zero_grad(set_to_none=True)
    got = compiled(x)
    got.float().square().mean().backward()
    assert backwards
    _assert_gradients_uncast(backwards, users)
    swapped = any("moec.flash_attention" in str(n.target) for g in backwards for n in g.graph.nodes)
    assert swapped == (attention == "fa4")
    torch.testing.assert_close(got.detach(), want, atol=2e-2, rtol=2e-2)
    for p, w in zip(users.parameters(), want_grads, strict=True):
        torch.testing.assert_close(p.grad, w, atol=2e-2, rtol=2e-2)


def _no_compile(gm: torch.fx.GraphModule, example_inputs) -> None:
    raise RuntimeError("this backend compiles nothing")


def _forward_only(gm: torch.fx.GraphModule, example_inputs):
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm.forward)


def _graph_and_inputs():
    graph = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
    return graph, [torch.randn(4, 8, requires_grad=True)]


def _plan(inductor, monkeypatch) -> moec.Plan:
    plan = moec.Plan.from_dict({"lowering": {"inductor": inductor}})
    monkeypatch.setattr(plan, "lowers_to_inductor", lambda device_type: True)  # CPU as CUDA
    return plan


@pytest.mark.parametrize("fails", ["forward", "backward"])
def test_auto_runs_a_graph_eagerly_where_it_fails_to_compile(monkeypatch, fails):
    """Under ``auto`` a compile failure warns and the graph runs eagerly, now and later; a
    backward that fails to compile fails in the forward call, before a compiled forward ran."""
    from torch._dynamo.backends.common import aot_autograd

    backend = _no_compile
    if fails == "backward":
        backend = aot_autograd(fw_compiler=_forward_only, bw_compiler=_no_compile)
    graph, inputs = _graph_and_inputs()
    graphs = InductorGraphs(_plan("auto", monkeypatch), backend=backend)
    with pytest.warns(UserWarning, match="runs eagerly"):
        out = graphs(graph, inputs)(*inputs)
    torch.testing.assert_close(out, graph(*inputs))
    out.sum().backward()
    assert inputs[0].grad is not None
    assert graphs(graph, inputs) is graph


def test_forced_inductor_raises_the_compile_failure(monkeypatch):
    from torch._dynamo.exc import BackendCompilerFailed

    graph, inputs = _graph_and_inputs()
    graphs = InductorGraphs(_plan(True, monkeypatch), backend=_no_compile)
    with pytest.raises(BackendCompilerFailed, match="compiles nothing"):
        graphs(graph, inputs)(*inputs)
