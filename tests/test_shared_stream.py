"""Pass ``shared_stream`` and its stream calls (:mod:`moec.ops.side_stream`) on the CPU.

The stream switch itself needs a GPU (tests/gpu/test_shared_stream_gpu.py); here: where the pass
puts the calls and the shared expert's nodes, that values and gradients do not change (the
calls return their inputs), which layers it leaves alone and why, and the plan's refusals."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import moec
from moec.fx import ancestors, node_order
from moec.ops.side_stream import side_stream_enter, side_stream_join, side_stream_leave
from moec.passes.shared_stream import shared_expert_nodes
from moec.plan import Plan, PlanError
from tests.models import (
    assert_same_grads,
    assert_same_work,
    loss_and_grads,
    rewrite_reference,
    tiny_llama,
    tokens,
)

CALLS = (side_stream_enter, side_stream_leave, side_stream_join)


def compile_shared(model, ids, on: bool, recompute: str = "none", dtype: str = "fp32"):
    """``model`` compiled with a shared expert per MoE layer, the pass on or off."""
    plan = {
        "moe": {"num_experts": 4, "top_k": 2, "dense_first": 1, "shared_expert": True},
        "precision": {"compute_dtype": dtype},
        "recompute": {"policy": recompute},
        "lowering": {"shared_expert_stream": on},
    }
    return moec.compile(copy.deepcopy(model), Plan.from_dict(plan), (ids,))


@pytest.fixture(scope="module")
def llama_case():
    return rewrite_reference(lambda model, ids: compile_shared(model, ids, False), "shared_stream")


def _graph_with_calls(compiled) -> fx.Graph:
    for _, sub in compiled.graph_module.named_modules():
        if isinstance(sub, fx.GraphModule) and sub.graph.find_nodes(
            op="call_function", target=side_stream_enter
        ):
            return sub.graph
    raise AssertionError("no graph holds a side_stream_enter")


@pytest.mark.parametrize("recompute", ["none", "block"])
def test_the_shared_expert_sits_between_enter_and_leave_and_values_stay(llama_case, recompute):
    model, ids, (want_loss, want) = llama_case
    streamed = compile_shared(model, ids, True, recompute)
    stats = streamed.pass_results["shared_stream"].stats
    assert stats["layers"] == 1 and stats["in_regions"] == (recompute != "none")
    assert stats["left_alone"] == {}

    graph = _graph_with_calls(streamed)
    (enter,) = graph.find_nodes(op="call_function", target=side_stream_enter)
    (leave,) = graph.find_nodes(op="call_function", target=side_stream_leave)
    (join,) = graph.find_nodes(op="call_function", target=side_stream_join)
    (total,) = [n for n in graph.nodes if n.meta.get("from_pass") == "moe" and n.op != "output"
                and n.target is torch.ops.aten.add.Tensor]  # fmt: skip
    order = node_order(graph)
    between = [n for n in graph.nodes if order[enter] < order[n] < order[leave]]
    shared_out, routed = leave.args[0], total.args[1]
    assert between and between[-1] is shared_out  # the stretch ends with the shared output
    shared, routed_side = ancestors(shared_out), ancestors(routed)
    assert all(n in shared and n not in routed_side for n in between)
    left_out = [
        n
        for n in shared - routed_side
        if n.op == "call_function" and n not in between and n.target not in CALLS
    ]
    assert left_out == []  # the whole shared expert moved
    assert order[leave] < order[routed] < order[join] < order[total]  # routed work in between
    assert total.args[0].args[0] is join

    assert_same_work(streamed, compile_shared(model, ids, False, recompute))
    got_loss, got = loss_and_grads(streamed, ids)
    torch.testing.assert_close(got_loss, want_loss, atol=0, rtol=0)
    assert_same_grads(got, want, atol=0, rtol=0)


def _sum_graph(extra_reader: bool) -> fx.Node:
    """x -> relu -> neg = y; x * 2 = routed; y + routed (marked as the moe pass marks it)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    hidden = graph.call_function(torch.relu, (x,))
    y = graph.call_function(torch.neg, (hidden,))
    routed = graph.call_function(torch.mul, (x, 2))
    total = graph.call_function(torch.ops.aten.add.Tensor, (y, routed))
    total.meta["from_pass"] = "moe"
    outputs = (total, graph.call_function(torch.exp, (hidden,))) if extra_reader else (total,)
    graph.output(outputs)
    return total


def test_a_shared_node_read_elsewhere_leaves_the_layer_alone():
    nodes, why = shared_expert_nodes(_sum_graph(extra_reader=False))
    assert [n.target for n in nodes] == [torch.relu, torch.neg] and why is None
    nodes, why = shared_expert_nodes(_sum_graph(extra_reader=True))
    assert nodes == [] and "relu" in why and "exp" in why


def test_the_calls_return_their_inputs_on_cpu_and_fake_tensors():
    x, y = torch.randn(3), torch.randn(2)
    for call in CALLS:
        out = call(x, y)
        assert out[0] is x and out[1] is y
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(4))
        assert side_stream_enter(fake)[0] is fake and side_stream_join(fake)[0] is fake


@pytest.mark.parametrize(
    "change, message",
    [
        ({"lowering": {"shared_expert_stream": True, "inductor": True}}, "lowering.inductor"),
        (
            {"lowering": {"shared_expert_stream": True}, "parallel": {"dp": 2, "dp_shard": 2}},
            "parallel.dp_shard",
        ),
    ],
)
def test_plans_it_cannot_run_name_the_fields(change, message):
    with pytest.raises(PlanError, match=f"lowering.shared_expert_stream.*{message}"):
        Plan.from_dict({"moe": {"shared_expert": True}, **change}).validate()


def test_pipeline_stages_keep_each_layer_s_calls_together():
    """The pipeline pass runs after this one: every stage holding a shared expert holds its
    enter, leave and join too (a stage cut never falls inside the stretch)."""
    torch.manual_seed(0)
    plan = Plan.from_dict(
        {
            "moe": {"num_experts": 4, "top_k": 2, "dense_first": 1, "shared_expert": True},
            "parallel": {"pp": 2, "microbatches": 2},
            "lowering": {"shared_expert_stream": True},
        }
    )
    compiled = moec.compile(tiny_llama(layers=4), plan, (tokens(),), verify=False)
    assert compiled.pass_results["shared_stream"].stats["layers"] == 3
    counts = []
    for stage in compiled.program.pipeline.stages:
        found = {call: 0 for call in CALLS}
        for node in stage.graph.graph.nodes:
            if node.target in found:
                found[node.target] += 1
        assert len(set(found.values())) == 1, found
        counts.append(found[side_stream_enter])
    assert sum(counts) == 3 and all(counts)
