import copy

import pytest
import torch

import moec
from moec.frontend import CaptureError, capture
from moec.passes.verify import verify_graph
from moec.program import SignatureError
from moec.train import LanguageModelWithLoss
from tests.models import hf_model, tiny_gpt2, tiny_llama, tokens


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
def test_trace_is_flat_aten_and_trains(make):
    model = make()
    ids = tokens()
    gm = moec.trace(model, (ids,))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert all("val" in n.meta for n in calls)
    assert any("nn_module_stack" in n.meta for n in calls)
    assert {n.op for n in gm.graph.nodes if n.op == "get_attr"} == {"get_attr"}
    other = tokens(3, 11)  # other batch and sequence sizes run without recapture
    (out,) = gm(other)
    torch.testing.assert_close(out, model(other))
    out.backward(torch.randn_like(out))
    assert (
        gm.get_parameter("lm_head.weight" if make is tiny_llama else "wte.weight").grad is not None
    )


def test_symbolic_trace_route_gives_the_same_graph_kind():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 3, 8)
    gm = moec.trace(model, (x,), method="symbolic_trace")
    torch.testing.assert_close(gm(x)[0], model(x))


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_transformers_models_capture_with_kwargs(name):
    model = hf_model(name)
    ids = tokens()
    program = capture(model, (), {"input_ids": ids, "labels": ids})
    gm, sig = program.graph, program.signature
    out = sig.unflatten_outputs(gm(*sig.flatten_inputs((), {"input_ids": ids, "labels": ids})))
    torch.testing.assert_close(out.loss, model(input_ids=ids, labels=ids).loss)


def test_capture_errors_say_what_to_try():
    class DataDependent(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    with pytest.raises(CaptureError, match="torch.where"):
        moec.trace(DataDependent(), (torch.randn(2, 3),))
    with pytest.raises(CaptureError, match="batch >= 2"):
        moec.trace(tiny_llama(), (tokens(1, 8),))
    with pytest.raises(CaptureError, match="nn.Module"):
        moec.trace(lambda x: x, (torch.randn(2, 2),))


def test_wrong_input_structure_is_a_clear_error():
    compiled = moec.compile(tiny_llama(), None, (tokens(),))
    with pytest.raises(SignatureError, match="structure"):
        compiled(tokens(), tokens())


def test_capture_on_first_call_then_other_sizes_reuse_the_graph():
    model = tiny_llama()
    compiled = moec.compile(model, {"moe": {"num_experts": 4, "top_k": 2, "capacity_factor": None}})
    assert compiled.graph_module is None
    first = compiled(tokens(2, 16))
    graph = compiled.graph_module
    other = tokens(5, 9)
    out = compiled(other)
    assert (
        compiled.graph_module is graph and out.shape == (5, 9, 256) and first.shape == (2, 16, 256)
    )
    torch.testing.assert_close(out, model(other), rtol=1e-4, atol=1e-5)  # upcycled: equals dense


class _Regions(torch.nn.Module):
    """A no_grad region reading a parameter, a bf16 autocast region and a disabled one."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            frozen = self.proj(x) * 2
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = self.proj(x).softmax(-1) + x
        with torch.autocast("cpu", enabled=False):
            plain = self.proj(x.float()) + 1
        return self.proj(x) + low + plain + frozen


def test_grad_and_autocast_regions_are_inlined_with_their_semantics():
    model, x = _Regions(), torch.randn(2, 3, 8)
    exported = torch.export.export(model, (x,), strict=False).graph_module
    regions = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert {"wrap_with_set_grad_enabled", "wrap_with_autocast"} <= regions  # export makes them
    gm = moec.trace(model, (x,))
    verify_graph(gm, "capture")
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert not [n for n in calls if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert any(n.kwargs.get("dtype") == torch.bfloat16 for n in calls)  # autocast made explicit
    other = torch.randn(3, 5, 8, requires_grad=True)
    (out,) = gm(other)
    torch.testing.assert_close(out, model(other))
    weight = model.proj.weight
    grads = torch.autograd.grad(out.sum(), [other, weight])
    expected = torch.autograd.grad(model(other).sum(), [other, weight])
    for got, want in zip(grads, expected, strict=True):  # nothing flows out of the no_grad block
        torch.testing.assert_close(got, want)


def test_a_region_capture_cannot_inline_is_a_clear_error():
    class Branch(torch.nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,))

    with pytest.raises(CaptureError, match="cond region .* wrap_with_set_grad_enabled"):
        moec.trace(Branch(), (torch.randn(2, 3),))


def test_one_example_tensor_passed_twice_stays_two_inputs():
    """``model(ids, ids)`` as the example: the program still reads its second argument (as
    captured, torch.export would make both arguments one input and compute the loss of the
    inputs against themselves on every later call)."""
    torch.manual_seed(0)
    model = LanguageModelWithLoss(tiny_llama(2))
    ids = tokens(2, 16)
    compiled = moec.compile(
        copy.deepcopy(model), {"moe": {"init": "upcycle", "num_experts": 2}}, (ids, ids)
    )
    inputs, targets = tokens(3, 16), tokens(3, 16)
    with torch.no_grad():
        want = model(inputs, targets)
        got = compiled(inputs, targets)
    assert len(compiled.program.signature.flatten_inputs((inputs, targets), {})) == 2
    torch.testing.assert_close(got, want)
