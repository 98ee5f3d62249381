"""Pass ``recompute``: same gradients under every policy, predicted vs measured activation
memory, budgets met or refused."""

import copy
import dataclasses
import gc

import pytest
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import moec
from moec.analysis.cost import graph_cost
from moec.fx import parameter_count
from moec.passes.base import PassContext
from moec.passes.recompute import (
    RecomputePass,
    block_regions,
    outside_refs,
    policy_levels,
    predict,
)
from moec.passes.verify import verify_graph
from moec.plan import Plan, PlanError
from tests.models import tiny_llama, tokens

POLICIES = ["block", "selective", "budget"]
ROUTINGS = ["learned", "random"]
MOE = {"num_experts": 4, "top_k": 2, "dense_first": 1}


def _plan(policy: str, budget: int | None = None) -> Plan:
    return Plan.from_dict({"moe": MOE, "recompute": {"policy": policy, "budget_bytes": budget}})


def _route_randomly(compiled: moec.CompiledModel) -> moec.CompiledModel:
    """``compiled`` with each ``moec::route`` set to the op's ``random`` routing (a benchmark
    baseline no plan names): its choices come from the random stream, so a recompute that
    routed again would choose other experts."""
    gm = compiled.graph_module
    routes = gm.graph.find_nodes(op="call_function", target=torch.ops.moec.route.default)
    assert routes, "no moec::route to set"
    for node in routes:
        node.args = (*node.args[:5], "random", *node.args[6:])
    gm.recompile()
    return compiled


def _with_policy(
    base: moec.CompiledModel, policy: str, budget: int | None = None, verify: bool = False
) -> moec.CompiledModel:
    """``base`` (compiled without recompute) with the recompute pass run on a copy of its graph;
    the parameters are shared (capturing once keeps the test fast; the verifier runs on request
    and in ``moec.compile``)."""
    gm = base.graph_module
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    program = dataclasses.replace(base.program, graph=fx.GraphModule(gm, graph))
    plan = _plan(policy, budget)
    result = RecomputePass().run(program.graph, PassContext(plan, program))
    if verify:
        verify_graph(result.gm, "recompute", expected_params=parameter_count(gm))
    program.graph, program.pass_results = result.gm, {"recompute": result}
    return moec.CompiledModel(plan, program)


def _grads(compiled, ids, seed: int) -> dict[str, torch.Tensor]:
    compiled.graph_module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # random routing draws the same choices in both runs
    out = compiled(ids)
    (out.square().mean() + compiled.aux_loss()).backward()
    return {n: p.grad.clone() for n, p in compiled.graph_module.named_parameters()}


class _LiveStorages(TorchDispatchMode):
    """Keeps one reference to the storage of every tensor an op makes; afterwards a storage
    someone else also references (autograd, a checkpoint, a selective-checkpoint cache) is kept
    for backward."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, torch.UntypedStorage] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        return out


def _state_storages(compiled) -> set[int]:
    gm = compiled.graph_module
    return {t.untyped_storage().data_ptr() for t in [*gm.parameters(), *gm.buffers()]}


def measured_saved_bytes(compiled, ids) -> int:
    """Bytes of the storages made in forward that are still referenced once its outputs are
    dropped: what autograd keeps for backward."""
    mode = _LiveStorages()
    with mode:
        out = compiled(ids)
    loss = out.sum()  # sum keeps no activation for backward
    del out
    compiled.aux_outputs = {}
    gc.collect()
    state = _state_storages(compiled)
    kept = sum(
        s.nbytes()
        for ptr, s in mode.storages.items()
        if ptr not in state and torch._C._storage_Use_Count(s._cdata) > 1
    )
    del loss
    return kept


def hooked_saved_bytes(compiled, ids) -> int:
    """Unique storages autograd saves, counted by saved-tensor hooks (sees no checkpoint)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled(ids).sum()
    state = _state_storages(compiled)
    return sum(n for ptr, n in seen.items() if ptr not in state)


def _predicted_none(compiled) -> int:
    gm, cost = compiled.graph_module, graph_cost(compiled.program)
    regions = block_regions(gm, cost)
    levels = policy_levels("none", regions)
    return predict(regions, outside_refs(gm, regions), levels, cost).saved_bytes


@pytest.fixture(scope="module")
def ids():
    return tokens(batch=2, seq=16)


@pytest.fixture(scope="module")
def bases(ids) -> dict[str, moec.CompiledModel]:
    """The tiny Llama compiled without recompute, per routing policy."""
    torch.manual_seed(0)
    model = tiny_llama(layers=3)
    compiled = {r: moec.compile(copy.deepcopy(model), _plan("none"), (ids,)) for r in ROUTINGS}
    _route_randomly(compiled["random"])
    return compiled


@pytest.fixture(scope="module")
def base(bases):
    return bases["learned"]


@pytest.fixture(scope="module")
def floor(base) -> int:
    """The predicted peak with every block recomputed: the least ``budget`` accepts."""
    return _with_policy(base, "block").pass_results["recompute"].stats["predicted_peak_bytes"]


def _budget_between(base, floor) -> int:
    stats = _with_policy(base, "selective").pass_results["recompute"].stats
    return (floor + stats["predicted_peak_bytes_before"]) // 2


def test_compile_registers_the_pass_after_moe():
    compiled = moec.compile(tiny_llama(layers=2), _plan("block"), (tokens(),))
    passes = ["moe", "fused_loss", "fuse_rope", "fuse_glu", "recompute", "bind"]
    assert list(compiled.pass_results) == passes
    assert compiled.pass_results["recompute"].stats["blocks_recomputed"] == 2


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_identical_to_no_recompute(bases, ids, floor, policy, routing):
    base = bases[routing]
    budget = floor if policy == "budget" else None
    compiled = _with_policy(base, policy, budget)
    expected, got = _grads(base, ids, seed=7), _grads(compiled, ids, seed=7)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("policy", ["block", "selective"])
def test_every_block_is_wrapped_and_routing_stays_cached(base, ids, policy):
    compiled = _with_policy(base, policy, verify=True)
    stats = compiled.pass_results["recompute"].stats
    assert stats["blocks_recomputed"] == 3
    assert stats["block_policies"] == {f"layers.{i}": policy for i in range(3)}
    gm = compiled.graph_module
    outer = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.moec.route.default not in outer  # moved into the regions
    routes = [
        n
        for _, sub in gm.named_children()
        if isinstance(sub, fx.GraphModule)
        for n in sub.graph.nodes
        if n.target == torch.ops.moec.route.default
    ]
    assert len(routes) == 2 and all(n.meta["from_pass"] == "moe" for n in routes)
    assert [row["block"] for row in stats["memory_table"]] == ["layers.0", "layers.1", "layers.2"]
    assert stats["predicted_saved_bytes_after"] < stats["predicted_saved_bytes_before"]
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), base(ids), rtol=0, atol=0)


def test_measurement_agrees_with_saved_tensor_hooks(base, ids):
    assert measured_saved_bytes(base, ids) == pytest.approx(hooked_saved_bytes(base, ids), rel=0.02)


@pytest.mark.parametrize("policy", ["none", *POLICIES])
def test_predicted_activation_memory_within_10_percent(base, ids, floor, policy):
    if policy == "none":
        compiled, predicted = base, _predicted_none(base)
    else:
        budget = _budget_between(base, floor) if policy == "budget" else None
        compiled = _with_policy(base, policy, budget)
        predicted = compiled.pass_results["recompute"].stats["predicted_saved_bytes_after"]
    measured = measured_saved_bytes(compiled, ids)
    assert measured == pytest.approx(predicted, rel=0.10), (policy, measured, predicted)


def test_budget_is_met_with_some_blocks_left_alone(base, ids, floor):
    budget = _budget_between(base, floor)
    compiled = _with_policy(base, "budget", budget)
    stats = compiled.pass_results["recompute"].stats
    assert stats["predicted_peak_bytes"] <= budget
    assert measured_saved_bytes(compiled, ids) <= budget
    assert 0 < stats["blocks_recomputed"] <= 3
    assert set(stats["block_policies"].values()) != {"block"}  # cheaper than recomputing all


def test_budget_below_block_recompute_names_the_minimum(base, floor):
    with pytest.raises(PlanError, match="recompute.budget_bytes") as err:
        _with_policy(base, "budget", floor - 1)
    assert f"at least {floor} bytes" in str(err.value)


def test_budget_above_no_recompute_recomputes_nothing(base):
    compiled = _with_policy(base, "budget", 10**12)
    assert compiled.pass_results["recompute"].stats["blocks_recomputed"] == 0
    assert not any(n.name.startswith("recompute") for n in compiled.graph_module.graph.nodes)
