"""The pass pipeline as data: order from the declarations, the pipeline string and its round trip,
selection (--passes / --disable / --print-after), the checks, and the manager's bookkeeping."""

import pytest
import torch
import torch.fx as fx

import moec
from moec.cli import main
from moec.frontend import capture
from moec.fx import fake_mode, symbolic_input_dims
from moec.passes.base import Pass, PassContext, PassPipelineError, PassResult
from moec.passes.manager import (
    PassManager,
    default_pipeline,
    parse_pipeline,
    pipeline_string,
    registered,
    select,
)
from moec.passes.verify import VerificationError
from moec.plan import Plan
from moec.program import SignatureError

BF16 = {
    "moe": {"num_experts": 4, "top_k": 2},
    "precision": {"compute_dtype": "bf16", "gemm": "mxfp8"},
    "parallel": {"ep": 2, "dp": 2, "pp": 2, "microbatches": 2},
    "recompute": {"policy": "block"},
}


def test_every_pass_runs_after_what_it_declares():
    passes = registered()
    order = list(passes)
    for name, cls in passes.items():
        for before in (*cls.after, *cls.requires):
            assert order.index(before) < order.index(name), (before, name)


@pytest.mark.parametrize(
    "plan, expected",
    [
        ({}, ["moe", "fused_loss", "fuse_rope", "fuse_glu", "bind"]),
        (
            BF16,
            [
                "moe",
                "expert_parallel",
                "precision",
                "fused_loss",  # in the last pipeline stage
                "shared_casts",
                "fuse_rope",
                "fuse_glu",
                "working_weights",
                "recompute",
                "pipeline",
                "bind",  # always, the last
            ],
        ),
    ],
)
def test_default_pipeline_is_the_passes_that_apply(plan, expected):
    assert default_pipeline(Plan.from_dict(plan)) == expected


@pytest.mark.parametrize("plan", [{}, BF16])
def test_the_pipeline_string_round_trips(plan):
    plan = Plan.from_dict(plan)
    text = pipeline_string(plan)
    assert parse_pipeline(text, plan) == default_pipeline(plan)
    assert "expert_parallel{ep=2,path=auto}" in pipeline_string(Plan.from_dict(BF16))


def test_selection_and_its_errors_name_the_pass():
    plan = Plan.from_dict(BF16)
    assert select(plan, "moe, expert_parallel") == ["moe", "expert_parallel"]
    assert "working_weights" not in select(plan, disable=["working_weights"])
    with pytest.raises(PassPipelineError, match="unknown pass 'mo'.*moe, expert_parallel"):
        select(plan, "mo")
    with pytest.raises(PassPipelineError, match=r"pass moe must run before \['fuse_glu'\]"):
        select(plan, "fuse_glu,moe")
    with pytest.raises(PassPipelineError, match=r"expert_parallel requires \['moe'\]"):
        select(plan, "expert_parallel")
    with pytest.raises(PassPipelineError, match=r"working_weights requires \['shared_casts'\]"):
        select(plan, disable=["shared_casts"])
    with pytest.raises(PassPipelineError, match="does not apply to this plan.*parallel.ep > 1"):
        select(Plan(), "moe,expert_parallel")
    with pytest.raises(PassPipelineError, match="options come from the plan"):
        select(plan, "moe{experts=8}")
    with pytest.raises(PassPipelineError, match="appears twice"):
        select(plan, "moe,moe")


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)


class _Counting(Pass):
    """Reads an analysis twice per run; changes the graph when told to (and says so or not)."""

    name = "counting"
    calls = 0

    def __init__(self, change: bool, report: bool):
        self.change, self.report = change, report

    @staticmethod
    def count(gm: fx.GraphModule) -> int:
        _Counting.calls += 1
        return len(gm.graph.nodes)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        ctx.analysis(self.count, gm)
        ctx.analysis(self.count, gm)
        if self.change:
            (linear,) = gm.graph.find_nodes(
                op="call_function", target=torch.ops.aten.linear.default
            )
            with gm.graph.inserting_after(linear):
                relu = gm.graph.call_function(torch.ops.aten.relu.default, (linear,))
            linear.replace_all_uses_with(relu, delete_user_cb=lambda user: user is not relu)
            relu.meta["val"] = linear.meta["val"]
            gm.recompile()
        return PassResult(gm, self.report, {})


def _manager(*passes: Pass) -> PassManager:
    manager = PassManager([])
    manager.passes = list(passes)
    return manager


def test_analyses_are_cached_until_a_pass_modifies_the_graph():
    program = capture(_Linear(), (torch.randn(2, 3, 8),))
    ctx = PassContext(Plan(), program)
    _Counting.calls = 0
    _manager(_Counting(False, False), _Counting(False, False)).run(program, ctx)
    assert _Counting.calls == 1
    _manager(_Counting(True, True), _Counting(False, False)).run(program, ctx)
    assert _Counting.calls == 2  # the second pass saw the cached count of the modified graph


def test_a_pass_that_changes_the_graph_must_say_so():
    program = capture(_Linear(), (torch.randn(2, 3, 8),))
    with pytest.raises(VerificationError, match="reported modified=False but changed"):
        _manager(_Counting(True, False)).run(program, PassContext(Plan(), program))


class _Specializing(Pass):
    """Gives the input a concrete example size, as a pass that read a symbolic size as an int
    would leave it."""

    name = "specializing"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        (x,) = gm.graph.find_nodes(op="placeholder")
        val = x.meta["val"]
        with fake_mode(gm):
            x.meta["val"] = torch.empty([int(d) for d in val.shape], dtype=val.dtype)
        return PassResult(gm, True, {})


def test_a_pass_that_specializes_an_input_size_is_named():
    """The program would run (and be priced) at the example's sizes only: the manager warns,
    naming the pass and the sizes, and records them in its statistics."""
    program = capture(_Linear(), (torch.randn(2, 3, 8),))
    ctx = PassContext(Plan(), program)
    assert symbolic_input_dims(program.graph)["x"] == (0, 1)
    _manager(_Counting(False, False)).run(program, ctx)
    assert "specialized_inputs" not in ctx.results["counting"].stats
    with pytest.warns(UserWarning, match=r"pass specializing specialized input sizes \(x.size"):
        _manager(_Specializing()).run(program, ctx)
    assert ctx.results["specializing"].stats["specialized_inputs"] == [
        "x.size(0) = 2",
        "x.size(1) = 3",
    ]
    by_pass = [f for f in program.signature.fixed_sizes if f.reason == "pass specializing"]
    assert [(f.name, f.dim, f.size) for f in by_pass] == [("x", 0, 2), ("x", 1, 3)]
    with pytest.raises(SignatureError, match=r"size 4 in dim 0.*x\.size\(0\) = 2"):
        program.signature.flatten_inputs((torch.randn(4, 3, 8),), {})


def test_compile_runs_the_selected_passes_and_records_their_string():
    ids = torch.randint(0, 256, (2, 16))
    plan = Plan.from_dict({"moe": {"num_experts": 4, "top_k": 2}})
    compiled = moec.compile(moec.models.Llama(), plan, (ids,), passes="moe", print_after=["moe"])
    assert list(compiled.pass_results) == ["moe"]
    assert compiled.program.pass_pipeline == pipeline_string(plan, ["moe"])


def test_debug_runs_the_given_passes_and_prints_what_ran(tmp_path, capsys):
    out = tmp_path / "dump"
    argv = ["debug", "llama", "--passes", "moe,fuse_glu", "--print-after", "fuse_glu"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = Plan()
    assert f"passes: {pipeline_string(plan, ['moe', 'fuse_glu'])}" in printed
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["00_fuse_glu"]
    assert main(["debug", "llama", "--passes", "fuse_glu,moe", "--out", str(out)]) == 2
    assert "moec: error: pass moe must run before ['fuse_glu']" in capsys.readouterr().err
