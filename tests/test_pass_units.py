"""Each pass on a minimal graph (a few ops): one it must rewrite and one it must leave alone.

The whole-model tests (``test_pass_moe.py``, ``test_recompute.py``, ``test_pipeline.py``...)
check numerics on real models; these pin down each pass's match on the smallest graph that
shows it, through the pass's public ``run``.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from moec.frontend import capture
from moec.kernels.target import Target
from moec.ops.recompute import recompute_region
from moec.passes.base import PassContext, PassResult
from moec.passes.bind import BindPass
from moec.passes.casts import SharedCastsPass
from moec.passes.combine_experts import CombineExpertsPass
from moec.passes.expert_parallel import ExpertParallelError, ExpertParallelPass
from moec.passes.loss import FusedLossPass
from moec.passes.moe import MoEPass
from moec.passes.pipeline import PipelinePass, PipelinePassError
from moec.passes.precision import PrecisionPass
from moec.passes.recompute import RecomputePass
from moec.passes.rewrite import GraphEditor
from moec.passes.rope import FuseRopePass
from moec.passes.verify import verify_graph
from moec.passes.working_weights import WorkingWeightsPass
from moec.plan import Plan, PlanError
from moec.program import EPGroup, Program

aten = torch.ops.aten
moec_ops = torch.ops.moec
DIM, HIDDEN = 16, 32
MOE = {"num_experts": 4, "top_k": 2}


class FFN(nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN, bias), nn.Linear(HIDDEN, DIM, bias)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class Block(nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.ffn = FFN(bias)

    def forward(self, x):
        return x + self.ffn(x)


class Blocks(nn.Module):
    """``n`` residual FFN blocks: the smallest graph with blocks (x: [B, S, DIM])."""

    def __init__(self, n: int, bias: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(Block(bias) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class OneLinear(nn.Module):
    """A graph with no FFN: nothing for the block-level passes to find."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.proj(x)


def _x() -> torch.Tensor:
    return torch.randn(2, 5, DIM)


PROGRAMS: dict[fx.GraphModule, Program] = {}
"""The program of every graph these tests capture or a pass returns (passes record into it)."""


def _trace(module: torch.nn.Module, args: tuple) -> fx.GraphModule:
    program = capture(module, args)
    PROGRAMS[program.graph] = program
    return program.graph


def _run(p, gm: fx.GraphModule, plan: dict, ep_group: EPGroup | None = None) -> PassResult:
    program = PROGRAMS[gm]
    result = p.run(gm, PassContext(Plan.from_dict(plan), program, ep_group=ep_group))
    program.graph = result.gm
    PROGRAMS[result.gm] = program
    verify_graph(result.gm, p.name, program.signature)
    return result


def _count(gm: fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.target == target)


# --- moe ---------------------------------------------------------------------------------------


def test_moe_replaces_the_ffn_past_dense_first_and_keeps_the_first():
    gm = _trace(Blocks(2), (_x(),))
    result = _run(MoEPass(), gm, {"moe": {**MOE, "dense_first": 1}})
    assert result.stats["ffns_replaced"] == 1 and result.stats["ffns_kept_dense"] == 1
    assert _count(result.gm, moec_ops.expert_mlp.default) == 1
    assert _count(result.gm, aten.linear.default) == 2 + 1  # the dense FFN's two, the router


# --- expert_parallel ---------------------------------------------------------------------------


def _moe_graph(n: int = 1, bias: bool = True) -> fx.GraphModule:
    gm = _trace(Blocks(n, bias), (_x(),))
    return _run(MoEPass(), gm, {"moe": MOE}).gm


def test_expert_parallel_rewrites_the_moe_block_to_ep_ops_with_this_ranks_experts():
    gm = _moe_graph()
    plan = {"moe": MOE, "parallel": {"ep": 2, "dp": 2, "ep_path": "a2a_capacity"}}
    result = _run(ExpertParallelPass(), gm, plan, EPGroup(rank=1, size=2, group="g"))
    assert result.stats["blocks_rewritten"] == 1 and result.stats["experts_per_rank"] == 2
    assert _count(result.gm, moec_ops.dispatch.default) == 0
    assert _count(result.gm, moec_ops.ep_dispatch.default) == 1
    (mlp,) = result.gm.graph.find_nodes(op="call_function", target=moec_ops.expert_mlp.default)
    assert mlp.args[1].meta["val"].shape[0] == 2  # w_up: [L = N / ep, D, U]


@pytest.mark.parametrize("device, path", [("cuda", "rowwise"), ("cpu", "a2a_capacity")])
def test_expert_parallel_resolves_auto_for_the_programs_target(device, path):
    """``ep_path: auto`` resolves for the program's target (``Target.ep_path``), whatever the
    group's device; bind records the path of each exchange."""
    gm = _moe_graph()
    PROGRAMS[gm].target = Target(device=device)
    plan = {"moe": MOE, "parallel": {"ep": 2, "dp": 2}}
    result = _run(ExpertParallelPass(), gm, plan, EPGroup(rank=0, size=2, group="g"))
    assert result.stats["path"] == path
    bound = _run(BindPass(), result.gm, plan)
    exchanges = {k: v for k, v in PROGRAMS[bound.gm].bindings.items() if k.startswith("ep_")}
    assert len(exchanges) == 3 and all(f": {path} (" in v for v in exchanges.values())


def test_expert_parallel_refuses_a_dense_graph_and_leaves_it_unchanged():
    gm = _trace(OneLinear(), (_x(),))
    before = [n.target for n in gm.graph.nodes]
    plan = {"moe": MOE, "parallel": {"ep": 2, "dp": 2, "ep_path": "a2a_capacity"}}
    with pytest.raises(ExpertParallelError, match="run moe first"):
        _run(ExpertParallelPass(), gm, plan, EPGroup(rank=0, size=2, group="g"))
    assert [n.target for n in gm.graph.nodes] == before


# --- precision ---------------------------------------------------------------------------------


def test_precision_quantizes_the_routed_experts_in_scope():
    gm = _moe_graph()
    plan = {"moe": MOE, "precision": {"gemm": "fp8_rowwise", "scope": ["routed_experts"]}}
    result = _run(PrecisionPass(), gm, plan)
    assert result.stats["experts_quantized"] == 1
    (mlp,) = result.gm.graph.find_nodes(op="call_function", target=moec_ops.expert_mlp.default)
    assert mlp.args[7] == "fp8_rowwise"  # the recipe


def test_precision_leaves_linears_outside_its_scope():
    gm = _trace(OneLinear(), (_x(),))  # no attention: attn_out finds no linear
    plan = {"precision": {"gemm": "fp8_rowwise", "scope": ["attn_out"]}}
    result = _run(PrecisionPass(), gm, plan)
    assert result.stats["out_linears_quantized"] == 0
    assert _count(result.gm, aten.linear.default) == 1


# --- fused_loss --------------------------------------------------------------------------------


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(DIM, 10)

    def forward(self, h, targets):
        return F.cross_entropy(self.head(h), targets)


@pytest.mark.filterwarnings("error:Raw SymInt")  # a symbolic width is read from h, not baked in
def test_fused_loss_fuses_a_head_and_its_cross_entropy():
    h, targets = torch.randn(6, DIM), torch.randint(0, 10, (6,))
    gm = _trace(Head(), (h, targets))
    want = gm(h, targets)[0]
    result = _run(FusedLossPass(), gm, {})
    assert result.stats["fused"] == 1
    assert _count(result.gm, aten.linear.default) == 0
    torch.testing.assert_close(result.gm(h, targets)[0], want)
    h, targets = torch.randn(9, DIM), torch.randint(0, 10, (9,))  # another row count
    torch.testing.assert_close(result.gm(h, targets)[0], gm(h, targets)[0])


# --- shared_casts and working_weights ----------------------------------------------------------

BF16 = {"precision": {"compute_dtype": "bf16"}}


class TwoReaders(nn.Module):
    """x read by two linears: under bf16 autocast each casts x itself."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        return self.a(x) + self.b(x)


def _casts_of(gm: fx.GraphModule, name: str) -> list[fx.Node]:
    (source,) = (n for n in gm.graph.nodes if n.name == name)
    return [u for u in source.users if u.target is aten._to_copy.default]


def test_shared_casts_casts_a_source_once_for_all_its_readers():
    gm = _trace(TwoReaders(), (_x(),))
    x = next(iter(gm.graph.find_nodes(op="placeholder"))).name
    result = _run(SharedCastsPass(), gm, BF16)
    (cast,) = _casts_of(result.gm, x)
    assert len(cast.users) == 2 and cast.meta["val"].dtype == torch.bfloat16
    assert result.stats["sources_cast"] == 3  # x and the two weights


def test_shared_casts_leaves_a_graph_without_autocast_ops():
    class Elementwise(nn.Module):
        def forward(self, x):
            return x * 2 + 1

    gm = _trace(Elementwise(), (_x(),))
    result = _run(SharedCastsPass(), gm, BF16)
    assert not result.modified and result.stats["sources_cast"] == 0
    assert _count(result.gm, aten._to_copy.default) == 0


def test_working_weights_turn_a_parameters_cast_into_a_persistent_copy():
    gm = _trace(TwoReaders(), (_x(),))
    gm = _run(SharedCastsPass(), gm, BF16).gm
    result = _run(WorkingWeightsPass(), gm, BF16)
    assert result.stats["copies"] == 2
    copies = PROGRAMS[result.gm].working_weights
    assert sorted(p for ps in copies.values() for p in ps) == ["a.weight", "b.weight"]
    assert all(result.gm.get_buffer(b).dtype == torch.bfloat16 for b in copies)


def test_working_weights_leave_parameters_read_without_a_cast():
    gm = _trace(TwoReaders(), (_x(),))  # no shared_casts: the linears read f32 weights
    result = _run(WorkingWeightsPass(), gm, BF16)
    assert not result.modified and result.stats["copies"] == 0


# --- fuse_rope ---------------------------------------------------------------------------------


class BufferTables(nn.Module):
    """The Llama rotary expression with cos/sin tables held in buffers."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cos", torch.randn(DIM))
        self.register_buffer("sin", torch.randn(DIM))

    def forward(self, x):
        lo, hi = x.chunk(2, dim=-1)
        return x * self.cos + torch.cat((-hi, lo), dim=-1) * self.sin


def test_fuse_rope_replaces_the_rotary_expression_with_buffer_tables():
    x = _x()
    gm = _trace(BufferTables(), (x,))
    want = gm(x)[0]
    result = _run(FuseRopePass(), gm, {})
    assert result.stats["fused"] == 1
    assert _count(result.gm, moec_ops.rope.default) == 1
    assert _count(result.gm, aten.cat.default) == 0
    torch.testing.assert_close(result.gm(x)[0], want)


# --- recompute ---------------------------------------------------------------------------------


def test_recompute_wraps_every_block_in_a_region():
    x = _x()
    gm = _trace(Blocks(2), (x,))
    want = gm(x)[0]
    result = _run(RecomputePass(), gm, {"recompute": {"policy": "block"}})
    assert result.stats["blocks_recomputed"] == 2
    assert _count(result.gm, recompute_region) == 2
    assert _count(result.gm, aten.linear.default) == 0  # moved into the regions
    torch.testing.assert_close(result.gm(x)[0], want)


def test_recompute_leaves_a_graph_without_blocks():
    gm = _trace(OneLinear(), (_x(),))
    result = _run(RecomputePass(), gm, {"recompute": {"policy": "block"}})
    assert not result.modified and result.stats["blocks_recomputed"] == 0
    assert _count(result.gm, aten.linear.default) == 1


# --- combine_experts ---------------------------------------------------------------------------

COMBINE = {"moe": MOE, "lowering": {"combine_in_experts": True}}


def test_combine_experts_folds_the_dispatch_and_combine_into_the_expert_mlp():
    x = _x()
    gm = _moe_graph(bias=False)
    want = gm(x)[0]
    (mlp,) = gm.graph.find_nodes(op="call_function", target=moec_ops.expert_mlp.default)
    stack = mlp.meta["nn_module_stack"]
    result = _run(CombineExpertsPass(), gm, COMBINE)
    assert result.stats["fused"] == 1 and result.stats["left_alone"] == {}
    assert _count(result.gm, moec_ops.dispatch.default) == 0
    assert _count(result.gm, moec_ops.combine.default) == 0
    (new,) = result.gm.graph.find_nodes(op="call_function", target=moec_ops.expert_mlp.default)
    assert new.args[7] == "bf16" and new.args[8] is not None and new.args[9] is not None
    assert new.meta["nn_module_stack"] == stack and new.meta["from_pass"] == "combine_experts"
    torch.testing.assert_close(result.gm(x)[0], want)


def test_combine_experts_leaves_an_expert_mlp_with_biases():
    gm = _moe_graph()
    result = _run(CombineExpertsPass(), gm, COMBINE)
    assert not result.modified and result.stats["fused"] == 0
    assert list(result.stats["left_alone"].values()) == ["it has biases"]
    assert _count(result.gm, moec_ops.dispatch.default) == 1
    assert _count(result.gm, moec_ops.combine.default) == 1


def test_combine_experts_leaves_a_dispatch_with_another_reader():
    gm = _moe_graph(bias=False)
    (buffer,) = gm.graph.find_nodes(op="call_function", target=moec_ops.dispatch.default)
    with gm.graph.inserting_after(buffer):
        GraphEditor(gm, "test").call(aten.clone.default, (buffer,), buffer)
    gm.recompile()
    result = _run(CombineExpertsPass(), gm, COMBINE)
    assert not result.modified and result.stats["fused"] == 0
    assert "other readers" in next(iter(result.stats["left_alone"].values()))
    assert _count(result.gm, moec_ops.dispatch.default) == 1


def test_combine_experts_folds_inside_a_recompute_region():
    x = _x()
    gm = _moe_graph(bias=False)
    want = gm(x)[0]
    gm = _run(RecomputePass(), gm, {"moe": MOE, "recompute": {"policy": "block"}}).gm
    result = _run(CombineExpertsPass(), gm, {**COMBINE, "recompute": {"policy": "block"}})
    assert result.stats["fused"] == 1 and result.stats["in_regions"] == 1
    (region,) = (
        m
        for _, m in result.gm.named_modules()
        if isinstance(m, fx.GraphModule) and m is not result.gm
    )
    assert _count(region, moec_ops.dispatch.default) == 0
    assert _count(region, moec_ops.combine.default) == 0
    torch.testing.assert_close(result.gm(x)[0], want)


# --- bind --------------------------------------------------------------------------------------

HOPPER = Target(device="cuda", arch="sm90", triton=True, quack=True, fa4=True)


def _bound(gm: fx.GraphModule, target: Target, plan: dict) -> PassResult:
    PROGRAMS[gm].target = target
    return _run(BindPass(), gm, plan)


def _impls(gm: fx.GraphModule) -> dict[str, str]:
    return {
        n.target._schema.name: n.kwargs["impl"]
        for n in gm.graph.nodes
        if n.op == "call_function" and "impl" in n.kwargs
    }


def test_bind_binds_every_moec_node_for_the_target_and_records_it():
    x = _x()
    gm = _moe_graph()
    want = gm(x)[0]
    result = _bound(gm, HOPPER, {"moe": MOE})
    assert _impls(result.gm) == {
        "moec::route": "triton",
        "moec::dispatch": "triton",
        "moec::expert_mlp": "kernels:rules+quack",
        "moec::combine": "triton",
    }
    program = PROGRAMS[result.gm]
    assert program.target == HOPPER and result.stats["bound"] == 4
    (mlp,) = result.gm.graph.find_nodes(op="call_function", target=moec_ops.expert_mlp.default)
    assert program.bindings[mlp.name].startswith("expert_mlp: kernels:rules+quack")
    # its kernels take no CPU tensor: every implementation runs the reference here
    torch.testing.assert_close(result.gm(x)[0], want)


def test_bind_binds_the_reference_on_a_cpu_target():
    result = _bound(_moe_graph(), Target(), {"moe": MOE})
    assert set(_impls(result.gm).values()) == {"reference"}


def test_bind_leaves_a_graph_without_moec_ops():
    gm = _trace(OneLinear(), (_x(),))
    result = _bound(gm, HOPPER, {})
    assert not result.modified and result.stats["bound"] == 0
    assert PROGRAMS[result.gm].bindings == {}


class Attention(nn.Module):
    """One causal SDPA over 2 heads of 16 (x: [B, S, 32])."""

    def forward(self, x):
        q = x.unflatten(-1, (2, 16)).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return out.transpose(1, 2).flatten(-2)


BF16 = {"precision": {"compute_dtype": "bf16"}}


@pytest.mark.parametrize(
    "target,attention,swapped",
    [(HOPPER, "auto", True), (Target(device="cuda", arch="sm100", fa4=True), "auto", False),
     (Target(), "auto", False), (Target(), "fa4", True), (HOPPER, "sdpa", False)],
)  # fmt: skip
def test_bind_swaps_sdpa_for_fa4_where_the_target_runs_it(target, attention, swapped):
    """``auto``: FA4 on Hopper with FA4 installed; ``fa4`` asks for it (the reference on a CPU
    target: tests); ``sdpa`` keeps torch's. The swap is a visible node with its impl."""
    x = torch.randn(2, 8, 32)
    gm = _trace(Attention(), (x,))
    want = gm(x)
    result = _bound(gm, target, {**BF16, "lowering": {"attention": attention}})
    assert result.stats["attention_swapped"] == int(swapped)
    assert _count(result.gm, aten.scaled_dot_product_attention.default) == int(not swapped)
    if swapped:
        impl = "fa4" if target.fa4 else "reference"
        assert _impls(result.gm) == {"moec::flash_attention": impl}
        (node,) = PROGRAMS[result.gm].bindings
        assert "SDPA swapped" in PROGRAMS[result.gm].bindings[node]
    if target.device == "cpu":
        torch.testing.assert_close(result.gm(x), want, atol=1e-5, rtol=1e-5)


def test_bind_refuses_fa4_on_a_cuda_target_without_it():
    gm = _trace(Attention(), (torch.randn(2, 8, 32),))
    without = Target(device="cuda", arch="sm90", triton=True)
    with pytest.raises(PlanError, match="lowering.attention"):
        _bound(gm, without, {**BF16, "lowering": {"attention": "fa4"}})


# --- pipeline ----------------------------------------------------------------------------------

PP2 = {"parallel": {"pp": 2, "microbatches": 2, "pp_schedule": "1f1b"}}


def test_pipeline_splits_two_blocks_into_two_stages_that_compose_to_the_graph():
    x = _x()
    gm = _trace(Blocks(2), (x,))
    want = gm(x)[0]
    result = _run(PipelinePass(), gm, PP2)
    split = PROGRAMS[result.gm].pipeline
    assert result.stats["units_per_stage"] == [1, 1]
    (boundary,) = split.stages[0].graph(x)
    torch.testing.assert_close(split.stages[1].graph(boundary)[0], want)
    names = [{n for n, _ in s.graph.named_parameters()} for s in split.stages]
    assert names[0] == {f"layers.0.ffn.{m}.{p}" for m in ("up", "down") for p in ("weight", "bias")}
    assert not names[0] & names[1]


def test_pipeline_refuses_a_graph_without_blocks_and_leaves_it_unchanged():
    gm = _trace(OneLinear(), (_x(),))
    before = [n.target for n in gm.graph.nodes]
    with pytest.raises(PipelinePassError, match="no residual blocks"):
        _run(PipelinePass(), gm, PP2)
    assert [n.target for n in gm.graph.nodes] == before and PROGRAMS[gm].pipeline is None
