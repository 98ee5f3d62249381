"""Fake propagation is incremental and the verifier keeps its checking power.

:func:`moec.fx.propagate_fake` runs again only the nodes a rewrite touched and those whose
inputs came out with other metadata; the result equals a full propagation's, and the verifier,
which checks the nodes propagation ran, still catches a pass that leaves a stale value.
Properties only (nodes run, values), never timings; ``benchmarks/capture_profile.py`` times it.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import moec.passes.verify
from moec.compiler import build_program
from moec.frontend import capture
from moec.fx import fake_mode, propagate_fake, symbolic_dispatch
from moec.passes.verify import VerificationError, verify_graph
from moec.plan import Plan
from tests.models import tiny_llama, tokens


class _Chain(torch.nn.Module):
    """x -> linear -> relu -> linear -> * 2: four call_function nodes in a row."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))) * 2


def _calls(nodes) -> list[fx.Node]:
    return [n for n in nodes if n.op == "call_function"]


def _metadata(gm: fx.GraphModule) -> dict[str, object]:
    """Every node's value as sizes, strides and dtype (strings of the symbolic sizes)."""

    def describe(val: object) -> object:
        if isinstance(val, torch.Tensor):
            return (str(tuple(val.shape)), str(val.stride()), val.dtype)
        if isinstance(val, (tuple, list)):
            return tuple(describe(v) for v in val)
        return str(val)

    return {n.name: describe(n.meta.get("val")) for n in gm.graph.nodes}


def _captured() -> fx.GraphModule:
    return capture(_Chain(), (torch.randn(2, 3, 8),)).graph


def _relu(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.target == torch.ops.aten.relu.default)


def _insert_after(gm: fx.GraphModule, node: fx.Node, target, **kwargs) -> fx.Node:
    """A new node ``target(node, **kwargs)`` read by ``node``'s users, with its fake value."""
    with gm.graph.inserting_after(node):
        new = gm.graph.call_function(target, (node,), kwargs)
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    with symbolic_dispatch(fake_mode(gm)):
        new.meta["val"] = target(node.meta["val"], **kwargs)
    return new


def test_a_second_propagation_runs_no_call_and_full_runs_them_all():
    gm = _captured()
    calls = _calls(gm.graph.nodes)
    assert _calls(propagate_fake(gm)) == calls  # the first: every node
    assert _calls(propagate_fake(gm)) == []  # nothing changed
    assert _calls(propagate_fake(gm, full=True)) == calls


def test_a_rewrite_reruns_its_nodes_and_only_the_readers_whose_inputs_changed():
    gm = _captured()
    propagate_fake(gm)
    relu = _relu(gm)
    same = _insert_after(gm, relu, torch.ops.aten.neg.default)  # same sizes and dtype
    assert _calls(propagate_fake(gm)) == [same, *same.users]  # its reader's args changed
    wider = _insert_after(gm, same, torch.ops.aten.unsqueeze.default, dim=0)
    calls = _calls(gm.graph.nodes)
    assert _calls(propagate_fake(gm)) == calls[calls.index(wider) :]  # the new rank flows on
    assert _metadata(gm) == _metadata_after_full(gm)


def _metadata_after_full(gm: fx.GraphModule) -> dict[str, object]:
    propagate_fake(gm, full=True)
    return _metadata(gm)


def test_a_value_a_pass_replaced_is_propagated_again():
    gm = _captured()
    propagate_fake(gm)
    relu = _relu(gm)
    relu.meta["val"] = relu.meta["val"][..., :3]
    assert _calls(propagate_fake(gm)) == [relu]
    assert relu.meta["val"].shape[-1] == 16


def test_incremental_propagation_equals_a_full_one_after_the_passes():
    """A bf16 program (casts re-type the nodes after them) built with verification, whose
    propagations after the capture's were incremental, holds the values a full one gives."""
    plan = Plan.from_dict(
        {"moe": {"num_experts": 4, "top_k": 2}, "precision": {"compute_dtype": "bf16"}}
    )
    program = build_program(tiny_llama(2), plan, (tokens(),), {})
    incremental = _metadata(program.graph)
    assert incremental == _metadata_after_full(program.graph)


def test_the_verifier_after_a_pass_runs_only_what_the_pass_touched(monkeypatch):
    """After the capture's full check, the moe pass's verification propagates only the nodes
    the pass made and their readers, not the rest of the model."""
    runs: list[list[fx.Node]] = []

    def counted(gm: fx.GraphModule, **how) -> list[fx.Node]:
        runs.append(_calls(propagate_fake(gm, **how)))
        return runs[-1]

    monkeypatch.setattr(moec.passes.verify, "propagate_fake", counted)
    program = build_program(tiny_llama(2), Plan(), (tokens(),), {}, names=["moe"])
    capture_run, moe_run = runs
    assert len(capture_run) > 3 * len(moe_run) > 0
    made = {n for n in program.graph.graph.nodes if n.meta.get("from_pass") == "moe"}
    readers = {u for n in made for u in n.users}
    assert set(moe_run) <= made | readers


def test_the_verifier_still_catches_a_stale_value_after_an_earlier_check():
    gm = _captured()
    verify_graph(gm, "capture")
    relu = _relu(gm)
    (double,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.mul.Tensor)
    double.args = (relu, *double.args[1:])  # reads 16 features now; its value still says 4
    with pytest.raises(VerificationError, match=r"mul.*disagrees"):
        verify_graph(gm, "rewiring")


def test_a_failed_propagation_fails_again_when_run_again():
    """The rewired relu reads 8 features and the linear after it takes 16: propagation fails
    there, and a second check, with nothing changed since, fails the same way."""
    gm = _captured()
    verify_graph(gm, "capture")
    _relu(gm).args = (gm.graph.find_nodes(op="placeholder")[0],)
    for _ in range(2):
        with pytest.raises(VerificationError, match="propagation failed"):
            verify_graph(gm, "rewiring")


def test_the_verifier_catches_a_reader_left_stale_by_a_changed_input():
    """The pass re-types the input and leaves the reader's value as it was: the reader runs
    again because its input's metadata changed, and disagrees."""
    program = capture(torch.nn.ReLU(), (torch.randn(2, 3, 8),))
    gm = program.graph
    verify_graph(gm, "capture")
    (x,) = gm.graph.find_nodes(op="placeholder")
    x.meta["val"] = x.meta["val"].to(torch.float64)
    with pytest.raises(VerificationError, match="disagrees"):
        verify_graph(gm, "retyping")


def test_the_capture_runs_fake_tensors_without_the_dispatch_cache():
    """Export and every later propagation in its fake mode run without FakeTensorMode's
    dispatch cache (slower than dispatching on graphs of symbolic views; see
    moec.frontend._without_fake_dispatch_cache); torch's own setting is left as it was."""
    before = torch._dynamo.config.fake_tensor_cache_enabled
    gm = _captured()
    assert fake_mode(gm).cache_enabled is False
    assert torch._dynamo.config.fake_tensor_cache_enabled == before
