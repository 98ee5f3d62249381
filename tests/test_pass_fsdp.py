"""Pass ``fsdp``: which parameters it shards, the block groups it inserts, and that the graph
computes what it computed before (the groups are identities without FSDP)."""

from __future__ import annotations

import copy

import pytest
import torch

from moec.compiler import build_program
from moec.ops.param_groups import ParamGroup, ReleaseParams
from moec.plan import Plan
from tests.models import tiny_llama, tokens

MOE = {"num_experts": 4, "top_k": 2, "init": "random", "capacity_factor": None}


def _program(model, dtype: str, dp_shard: int, recompute: str = "none"):
    plan = Plan.from_dict(
        {
            "moe": MOE,
            "parallel": {"dp": 2, "dp_shard": dp_shard},
            "precision": {"compute_dtype": dtype},
            "recompute": {"policy": recompute},
            # one expert layout whatever the sharding (auto keeps FSDP-sharded experts n-major):
            # the programs are compared bit for bit, and a layout changes the summation order
            "lowering": {"expert_weights": "n_major"},
        }
    )
    return build_program(model, plan, (tokens(),), {})


@pytest.mark.parametrize("dtype,recompute", [("fp32", "none"), ("bf16", "none"), ("bf16", "block")])
def test_blocks_become_groups_gathered_before_their_first_read(dtype, recompute):
    model = tiny_llama(2)
    program = _program(copy.deepcopy(model), dtype, 2, recompute)
    layout, gm = program.data_parallel, program.graph
    assert layout.groups == ("layers.0", "layers.1") and layout.shard == 2
    experts = {n for n in program.param_roles if program.role(n) == "expert"}
    assert experts and not experts & set(layout.params)
    norms = {n for n, _ in gm.named_parameters() if "norm" in n}
    if dtype == "bf16":  # read in float32: left whole, as under DDP
        assert not norms & set(layout.params) and "layers.0.attn.q_proj.weight" in layout.params
    else:
        assert norms <= set(layout.params)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for path in layout.groups:
        group = gm.get_submodule(path)
        assert isinstance(group, ParamGroup) and isinstance(group.release_params, ReleaseParams)
        (call,) = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == path]
        (release,) = [n for n in gm.graph.nodes if n.target == f"{path}.release_params"]
        reads = [
            n
            for n in gm.graph.nodes
            if n.op == "get_attr" and n.target in layout.params and n.target.startswith(path)
        ]
        assert reads and all(order[call] < order[r] for r in reads)
        last_read = max(order[u] for r in reads for u in r.users)
        assert order[release] > last_read


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_graph_computes_what_it_did(dtype):
    model = tiny_llama(2)
    with torch.no_grad():  # the same random experts in both programs (seeded by the plan)
        sharded = _program(copy.deepcopy(model), dtype, 2).graph
        replicated = _program(copy.deepcopy(model), dtype, 1).graph
        x = tokens()
        got, want = sharded(x), replicated(x)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_gathered_casts_are_not_activations():
    """The cost model takes ``to.dtype`` of a gathered parameter for the parameter itself (it
    returns the bf16 tensor FSDP gathered), never for a saved activation."""
    from moec.analysis.cost.memory import is_activation, stored_ref

    gm = _program(tiny_llama(2), "bf16", 2).graph
    casts = [n for n in gm.graph.nodes if n.target == torch.ops.aten.to.dtype]
    assert casts and all(c.args[0].op == "get_attr" for c in casts)
    for cast in casts:
        assert stored_ref(cast).node is cast.args[0] and not is_activation(cast)
