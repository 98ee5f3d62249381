"""Compiling what repeats once (:mod:`moec.runtime.block_graphs`): the lowered program cut at
its residual blocks, each distinct block graph compiled once, equal to the program compiled
whole and to the eager one; where it cannot be cut, compiled whole, and ``moec debug`` says
which."""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

import moec
from moec.cli import main
from moec.runtime.block_graphs import Partition, Whole, partition, program_blocks, stage_blocks
from moec.runtime.lowering import InductorGraphs, stage_lowering
from moec.runtime.pipeline import build_pipeline_mesh, runtime_for
from tests.distributed import spawn
from tests.models import assert_same_grads, loss_and_grads, tiny_llama, tokens
from tests.pipeline_steps import check_stage_grads, unsplit_step

MOE = {"num_experts": 4, "top_k": 2, "capacity_factor": None}
ROUTE = torch.ops.moec.route.default
aten = torch.ops.aten


def _compiled(layers: int, dense_first: int, recompute: str = "none", lowered: bool | str = True):
    """A tiny Llama compiled with routed experts from block ``dense_first`` on, lowered to
    Inductor as ``lowering.inductor: lowered`` says (True: also on the CPU); the same seed,
    the same weights."""
    torch.manual_seed(0)
    plan = {
        "moe": {**MOE, "dense_first": dense_first},
        "recompute": {"policy": recompute},
        "lowering": {"inductor": lowered},
    }
    return moec.compile(tiny_llama(layers), plan, (tokens(),), verify=False)


class Counting:
    """A ``torch.compile`` backend that keeps every graph Dynamo hands it and compiles it with
    ``backend``."""

    def __init__(self, backend: str = "aot_eager"):
        self.backend = lookup_backend(backend)
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return self.backend(gm, example_inputs)

    def routes(self) -> list[int]:
        """The ``moec::route`` calls (one per MoE block) of each graph compiled, in the
        sub-graphs it calls (a checkpointed region's) too."""
        return [
            sum(
                n.target in (ROUTE, ROUTE.overloadpacket)
                for m in g.modules()
                if isinstance(m, torch.fx.GraphModule)
                for n in m.graph.nodes
            )
            for g in self.graphs
        ]


def _lower(model: moec.CompiledModel, backend, per_block: bool = True) -> None:
    """Run ``model``'s graphs through ``backend``, per block or whole."""
    blocks = (lambda: program_blocks(model.program)) if per_block else None
    model._lowering = InductorGraphs(model.plan, backend=backend, blocks=blocks)


@pytest.mark.parametrize("per_block", [True, False], ids=["per-block", "whole"])
def test_identical_blocks_compile_once_where_the_whole_graph_compiled_them_all(per_block):
    """Four MoE blocks of the same shapes: per block, Dynamo hands the backend one graph of
    one block, which every block then runs; whole, one graph of all four."""
    model, backend = _compiled(4, dense_first=0), Counting()
    _lower(model, backend, per_block)
    ids = tokens()
    for _ in range(2):
        model(ids).float().square().mean().backward()
    assert backend.routes() == ([1] if per_block else [4])
    cut = model._lowering.partition(model.program.graph)
    assert isinstance(cut, Partition) == per_block
    if per_block:
        (group,) = [g for g in cut.groups().values() if g[0].block]
        assert [s.name for s in group] == [f"layers.{i}" for i in range(4)]


@pytest.mark.parametrize("recompute", ["none", "block"])
def test_dense_and_moe_blocks_make_two_graphs_equal_to_eager(recompute):
    """A dense block then three MoE blocks (recompute regions or not): two block graphs, each
    compiled once; the loss and every gradient equal the eager program's, at the captured
    length and at a new one (one recompile of each block graph, with symbolic sizes)."""
    eager = _compiled(4, dense_first=1, recompute=recompute, lowered=False)
    model, backend = _compiled(4, dense_first=1, recompute=recompute), Counting()
    _lower(model, backend)
    for seq in (16, 24):
        ids = tokens(seq=seq)
        eager.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        want, want_grads = loss_and_grads(eager, ids)
        got, got_grads = loss_and_grads(model, ids)
        torch.testing.assert_close(got, want)
        assert_same_grads(got_grads, want_grads, atol=1e-5, rtol=1e-5)
        compiled = sorted(backend.routes())
        assert compiled == ([0, 1] if seq == 16 else [0, 0, 1, 1]), compiled


@pytest.mark.slow
def test_inductor_per_block_equals_whole_and_eager(tmp_path, monkeypatch):
    """Under Inductor (its own cache folder), a dense block, two MoE blocks and block
    recompute: per block, two block graphs are compiled (a forward and a backward each), where
    the whole program was one graph; losses and gradients equal the whole graph's and the eager
    program's within fp32 tolerance."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    eager = _compiled(3, dense_first=1, recompute="block", lowered=False)
    whole = _compiled(3, dense_first=1, recompute="block")
    per_block = _compiled(3, dense_first=1, recompute="block")
    _lower(whole, "inductor", per_block=False)
    assert isinstance(per_block._lowering.partition(per_block.program.graph), Partition)
    ids = tokens()
    want, want_grads = loss_and_grads(eager, ids)
    results = {}
    for name, model in (("whole", whole), ("per_block", per_block)):
        counters.clear()
        results[name] = loss_and_grads(model, ids)
        inductor = counters["inductor"]
        results[name + "_graphs"] = inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_hit"]
    assert results["whole_graphs"] == 2 and results["per_block_graphs"] == 4
    for name in ("whole", "per_block"):
        got, got_grads = results[name]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert_same_grads(got_grads, want_grads, atol=1e-4, rtol=1e-4)


def test_a_block_whose_recompute_level_or_implementation_differs_gets_its_own_graph():
    """Structural keys see the recompute level and the bound implementation: three identical
    MoE blocks share one key until one block's level or one op's ``impl`` differs."""
    model = _compiled(3, dense_first=0, recompute="block", lowered=False)
    graph, blocks = model.program.graph, program_blocks(model.program)

    def block_graphs(gm: torch.fx.GraphModule) -> int:
        cut = partition(gm, blocks)
        assert isinstance(cut, Partition)
        return sum(g[0].block for g in cut.groups().values())

    assert block_graphs(graph) == 1
    releveled = copy.deepcopy(graph)
    region = next(n for n in releveled.graph.nodes if "recompute_region" in str(n.target))
    region.args = (region.args[0], "selective", *region.args[2:])
    assert block_graphs(releveled) == 2
    rebound = copy.deepcopy(graph)
    last_block = getattr(rebound, "recompute_" + blocks[-1].replace(".", "_"))
    op = next(n for n in last_block.graph.nodes if n.target is ROUTE)
    op.args = (*op.args[:-1], "another")
    assert block_graphs(rebound) == 2


def test_where_the_program_is_compiled_whole_it_says_why():
    """One block: nothing repeats; an unpickled graph: no module paths; two blocks whose nodes
    interleave: no cut between them."""
    one = _compiled(1, dense_first=0, lowered=False)
    assert "1 residual block" in partition(one.program.graph, program_blocks(one.program)).reason
    model = _compiled(2, dense_first=0, lowered=False)
    blocks = program_blocks(model.program)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert "module path" in partition(loaded.program.graph, blocks).reason
    assert "module path" in loaded.lowering_layout()
    mixed = copy.deepcopy(model.program.graph)
    nodes = [n for n in mixed.graph.nodes if n.op == "call_function"]
    first = [n for n in nodes if n.meta.get("nn_module_stack") and "layers.0" in str(n.meta)]
    second = next(n for n in nodes if "layers.1" in str(n.meta.get("nn_module_stack")))
    first[len(first) // 2].meta["nn_module_stack"] = second.meta["nn_module_stack"]
    cut = partition(mixed, blocks)
    assert isinstance(cut, Whole) and "interleave" in cut.reason


def test_debug_says_which_blocks_share_a_graph(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    moec.Plan.from_dict({"moe": {**MOE, "dense_first": 1}}).save(plan)
    out = tmp_path / "dump"
    assert main(["debug", "llama", "--plan", str(plan), "--out", str(out)]) == 0
    text = (out / "lowering.txt").read_text()
    assert "off on cpu" in text and "4 blocks, 2 distinct block graphs" in text
    assert "model.layers.1, model.layers.2, model.layers.3" in text
    assert text in capsys.readouterr().out


def test_debug_says_how_each_pipeline_stage_is_cut(tmp_path, capsys):
    """PP = 2 over a dense block and three MoE blocks: one line per stage, stage 0's two
    blocks two graphs, stage 1's two MoE blocks one graph, of the digest of stage 0's MoE
    block (the same computation, compiled on each rank)."""
    plan = tmp_path / "plan.yaml"
    parallel = {"pp": 2, "microbatches": 2, "pp_units": "block", "pp_layout": [2, 2]}
    moec.Plan.from_dict({"moe": {**MOE, "dense_first": 1}, "parallel": parallel}).save(plan)
    out = tmp_path / "dump"
    assert main(["debug", "llama", "--plan", str(plan), "--out", str(out)]) == 0
    text = (out / "lowering.txt").read_text()
    assert "off on cpu" in text and "pipeline stages, each cut on its own" in text
    stage0, stage1 = text.split("stage 0 (pipeline rank 0): ")[1].split(
        "stage 1 (pipeline rank 1): "
    )
    assert "2 blocks, 2 distinct block graphs" in stage0
    assert "2 blocks, 1 distinct block graphs" in stage1
    moe_graph = stage1.splitlines()[1].split()[2]
    assert f"block graph {moe_graph} (" in stage0 and "model.layers.2, model.layers.3" in stage1
    assert text in capsys.readouterr().out


def test_a_pipeline_rank_of_one_block_compiles_its_stage_whole():
    """What stays whole under PP says why, stage by stage: where a pipeline rank holds one
    block, nothing repeats, and the rank's lowering compiles its stage whole."""
    plan = _pp_plan("1f1b", 1, True, layout=[1, 1])
    torch.manual_seed(0)
    model = moec.compile(tiny_llama(2), plan, (tokens(),), verify=False)
    text = model.lowering_layout()
    for stage in (0, 1):
        line = next(x for x in text.splitlines() if x.startswith(f"stage {stage} "))
        assert "compiles the program whole: the program has 1 residual block(s)" in line
    pipeline = model.program.pipeline
    graphs = stage_lowering(plan, pipeline, 0)
    assert isinstance(graphs.partition(pipeline.stages[0].graph), Whole)


def test_a_profile_windows_instrumented_graph_is_cut_too():
    """The profiler's block markers (nodes of no block, between blocks) run in the eager glue:
    the instrumented graph is cut at the same blocks, its block ranges recorded, its values the
    plain graph's."""
    from moec.runtime.profiling import instrument

    model, backend = _compiled(3, dense_first=1), Counting()
    _lower(model, backend)
    ids = tokens()
    plain = model(ids)
    blocks = program_blocks(model.program)
    model.set_instrument(functools.partial(instrument, blocks=blocks, nvtx=False))
    cut = model._lowering.partition(model._graph())
    assert isinstance(cut, Partition) and [s.name for s in cut.segments if s.block] == blocks
    with torch.profiler.profile() as prof:
        marked = model(ids)
    torch.testing.assert_close(marked, plain)
    ranges = {e.name for e in prof.events()}
    assert {f"block {path}" for path in blocks} <= ranges
    assert sorted(backend.routes()) == [0, 0, 1, 1]  # two graphs each, plain and instrumented


def test_what_a_block_reads_of_sizes_and_tables_runs_before_it_but_range_markers_stay():
    """A pipeline stage recomputes the sizes and RoPE table slices it reads where its first
    block first reads them: the cut runs them in the glue before the block, which then reads
    them as its inputs, as the next block does. A node nothing reads (an NVTX range marker
    around a ``moec::`` op) stays in its block with its op."""
    from moec.runtime.profiling import instrument, nvtx_push

    model = _pp_compiled(_pp_plan("1f1b", 1, False), None, tokens())
    pipeline = model.program.pipeline
    stage = pipeline.stages[0].graph
    blocks = stage_blocks(pipeline, [0])
    cut = partition(stage, blocks)
    assert isinstance(cut, Partition)
    glue, first, second = cut.segments[:3]
    assert (glue.name, first.name, second.name) == ("prologue", *blocks)
    recomputed = [
        n for n in glue.graph.graph.nodes if n.target in (aten.sym_size.int, aten.slice.Tensor)
    ]
    assert recomputed and first.key == second.key
    assert not any(n.op == "get_attr" and "rope" in str(n.target) for n in first.inputs)
    marked = instrument(model.program.graph, blocks=program_blocks(model.program), nvtx=True)
    cut = partition(marked, program_blocks(model.program))
    for segment in cut.segments:
        nodes = segment.graph.graph.nodes
        ops = [
            n
            for n in nodes
            if str(getattr(n.target, "_qualified_op_name", "")).startswith("moec::")
        ]
        assert sum(n.target is nvtx_push for n in nodes) == len(ops), segment.name
        assert ops or not segment.block


def test_under_auto_a_block_that_fails_to_compile_runs_the_program_eagerly(monkeypatch):
    eager = _compiled(3, dense_first=1, lowered=False)
    model = _compiled(3, dense_first=1, lowered="auto")
    monkeypatch.setattr(model.plan, "lowers_to_inductor", lambda device_type: True)

    def fails(gm: torch.fx.GraphModule, example_inputs):
        raise RuntimeError("this backend compiles nothing")

    _lower(model, fails)
    ids = tokens()
    with pytest.warns(UserWarning, match="runs eagerly"):
        got = model(ids)
    torch.testing.assert_close(got, eager(ids))
    assert model._lowering(model.program.graph, [ids]) is model.program.graph


# --- pipeline stages ---------------------------------------------------------------------------

PP_LAYOUTS = {1: [2, 2], 2: [1, 1, 1, 1]}
"""Blocks per stage of a 4-block model at 1 and 2 stages per rank: each rank holds two."""


def _pp_plan(schedule: str, v: int, lowered: bool, layout: list[int] | None = None) -> moec.Plan:
    """PP = 2 over MoE blocks of the same shapes (four, unless ``layout`` says), cut between
    blocks; two microbatches of two sequences (four for ``dualpipev``, which needs 2 pp)."""
    parallel = {
        "pp": 2,
        "virtual_stages": v,
        "pp_schedule": schedule,
        "microbatches": _microbatches(schedule),
        "pp_units": "block",
        "pp_layout": layout or PP_LAYOUTS[v],
    }
    moe = {**MOE, "dense_first": 0, "init": "random"}
    return moec.Plan.from_dict(
        {"moe": moe, "parallel": parallel, "lowering": {"inductor": lowered}}
    )


def _microbatches(schedule: str) -> int:
    return 4 if schedule == "dualpipev" else 2


def _pp_compiled(plan: moec.Plan, mesh, x: torch.Tensor) -> moec.CompiledModel:
    torch.manual_seed(0)
    return moec.compile(tiny_llama(4), plan, (x[:2],), mesh=mesh, verify=False)


class Runs:
    """An AOTAutograd backend running the graphs it compiles as they are, counting how often
    their forwards and backwards run."""

    def __init__(self):
        self.forward = self.backward = 0
        self.backend = aot_autograd(
            fw_compiler=self._counted("forward"), bw_compiler=self._counted("backward")
        )

    def _counted(self, kind: str):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            run = boxed_nop(gm, example_inputs)

            def counted(args):
                setattr(self, kind, getattr(self, kind) + 1)
                return run(args)

            counted._boxed_call = True
            return counted

        return compile_graph


def _pipelined_worker(rank: int, world: int, schedule: str, v: int, inductor: bool) -> None:
    """One step of the stages lowered per block (through Inductor, or through a backend that
    counts) against the eager stages and the PP = 1 program: the same loss and gradients, and
    one compiled graph for this rank's two blocks (all blocks are the same computation), within
    a stage or across the rank's stages."""
    g = torch.Generator().manual_seed(7)
    micro = _microbatches(schedule)
    seq = torch.randint(0, 256, (2 * micro, 17), generator=g)
    x, y = seq[:, :-1], seq[:, 1:]
    mesh = build_pipeline_mesh(_pp_plan(schedule, v, False))
    eager = _pp_compiled(_pp_plan(schedule, v, False), mesh, x)
    ref_loss, ref_grads = unsplit_step(eager, x, y, micro)
    eager_runtime = runtime_for(eager)
    eager_loss = eager_runtime.forward_backward(x, y)
    eager_grads = {
        n: p.grad for m in eager_runtime.modules for n, p in m.graph_module.named_parameters()
    }
    runtime = runtime_for(_pp_compiled(_pp_plan(schedule, v, True), mesh, x))
    runs, counting = Runs(), None
    if not inductor:
        runtime.lowering.backend = counting = Counting(runs.backend)
    counters.clear()
    loss = runtime.forward_backward(x, y)
    for expected, where in ((ref_grads, "PP = 1"), (eager_grads, "the eager stages")):
        check_stage_grads(runtime, expected, f"{schedule} vs {where}", atol=1e-5, rtol=1e-5)
    if runtime.is_last:
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loss, eager_loss, atol=1e-5, rtol=1e-5)
    cuts = [runtime.lowering.partition(m.graph_module) for m in runtime.modules]
    assert all(isinstance(cut, Partition) for cut in cuts), cuts
    blocks = [s for cut in cuts for s in cut.segments if s.block]
    assert len(blocks) == 2 and len({s.key for s in blocks}) == 1, [s.name for s in blocks]
    if inductor:
        compiled = counters["inductor"]
        assert compiled["fxgraph_cache_miss"] + compiled["fxgraph_cache_hit"] == 2  # fw + bw
        return
    assert counting.routes() == [1], counting.routes()
    runs.forward = runs.backward = 0
    runtime.forward_backward(x, y)  # a step after the first (which also infers shapes)
    assert runs.forward == 2 * micro, (runs.forward, runs.backward)  # two blocks per microbatch
    # a zero-bubble schedule's weight pass runs a compiled block's backward once more (why
    # lowering.inductor: auto leaves its stages eager)
    split = schedule in ("zbv", "dualpipev")
    assert (runs.backward > runs.forward) if split else (runs.backward == runs.forward)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_a_pipeline_ranks_stages_share_one_graph_per_distinct_block(schedule, v):
    """In one process, the stages run in order, each through its rank's lowering: each rank
    compiles one graph for its two MoE blocks (two in one stage, or one in each of two), and
    the stages' output and gradients equal the unsplit graph's run eagerly."""
    plan = _pp_plan(schedule, v, True)
    model = _pp_compiled(plan, None, tokens())
    pipeline, ids = model.program.pipeline, tokens()
    lowerings = {info.rank: stage_lowering(plan, pipeline, info.rank) for info in pipeline.info}
    counting = {rank: Counting() for rank in lowerings}
    for rank, lowering in lowerings.items():
        lowering.backend = counting[rank]
    values = [ids]
    for stage, info in zip(pipeline.stages, pipeline.info, strict=True):
        outputs = lowerings[info.rank](stage.graph, values)(*values)
        values = list(outputs[: stage.signature.num_user_outputs])
    (logits,) = values
    logits.float().square().mean().backward()
    params = dict(model.graph_module.named_parameters())
    got = {n: p.grad for n, p in params.items()}
    model.zero_grad(set_to_none=True)
    want = model.graph_module(ids)[0]
    want.float().square().mean().backward()
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    assert_same_grads(got, {n: p.grad for n, p in params.items()}, atol=1e-5, rtol=1e-5)
    assert {rank: c.routes() for rank, c in counting.items()} == {0: [1], 1: [1]}


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,v", [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2)]
)
def test_pipeline_stages_compile_each_distinct_block_once(schedule, v):
    """PP = 2 (gloo): per block, each rank compiles one graph for its two MoE blocks (two
    blocks of one stage; under interleaved and V-shaped schedules, one block in each of its
    two stages), and the step equals the eager stages' and the PP = 1 program's."""
    spawn(_pipelined_worker, 2, schedule, v, False)


@pytest.mark.slow
def test_inductor_pipeline_stages_per_block_equal_eager_and_pp1(tmp_path, monkeypatch):
    """The same under Inductor (its own cache folder): each rank compiles one forward and one
    backward graph."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    spawn(_pipelined_worker, 2, "1f1b", 1, True)
