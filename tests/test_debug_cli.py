"""The ``moec`` CLI run in-process: debug dumps (with the loss moec train adds, and a runnable
repro.py), inspect, plan show, and the dump hook's safety."""

import json
import logging
import math
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import moec
from moec.cli import main
from moec.debug import DebugDump
from moec.frontend import capture
from moec.passes.manager import pipeline_string

ARTIFACTS = ("graph.py", "ops.txt", "graph.dot", "diff.patch", "stats.json")
PLAN = {"moe": {"num_experts": 4, "top_k": 2, "dense_first": 1}}


TWO_BLOCK_LLAMA = """
import torch
from moec.models import Llama, LlamaConfig

def make():
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)
    return Llama(cfg), (torch.randint(0, 256, (2, 16)),)
"""
"""Two blocks (a dense one, an MoE one under ``PLAN``'s dense_first 1), dim 32: the debug tests
whose property does not depend on the model's size use it instead of the bundled four-block,
dim-128 ``llama`` (passes and dumps take time with the graph)."""


@pytest.fixture
def two_blocks(tmp_path) -> str:
    """The model spec of :data:`TWO_BLOCK_LLAMA` written to a factory file."""
    factory = tmp_path / "two_blocks.py"
    factory.write_text(TWO_BLOCK_LLAMA)
    return f"{factory}:make"


@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "plan.yaml"
    moec.Plan.from_dict(PLAN).save(path)
    return path


def test_debug_prints_each_nodes_bound_implementation(tmp_path, capsys, two_blocks):
    """After pass bind, moec debug prints (and writes to bindings.txt) the target, the expert
    GEMMs' policy and every moec:: node's bound implementation: here (no GPU) the reference, a
    low-precision recipe emulated, the FA4 swap of each attention as its own node, and the
    fused loss's chunk bound in binary units (:func:`moec.kernels.target.count_text`)."""
    path = tmp_path / "plan.yaml"
    plan = {
        **PLAN,
        "precision": {"gemm": "fp8_rowwise", "compute_dtype": "bf16"},
        "lowering": {"attention": "fa4"},
    }
    moec.Plan.from_dict(plan).save(path)
    out = tmp_path / "dump"
    assert main(["debug", two_blocks, "--plan", str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    text = (out / "bindings.txt").read_text()
    assert text in printed
    assert text.startswith("target: cpu ") and "expert GEMMs: the ops' reference path" in text
    lines = text.splitlines()
    mlps = [line for line in lines if " expert_mlp: " in line]
    attention = [line for line in lines if " flash_attention: " in line]
    assert len(mlps) == 1 and all("reference (fp8_rowwise emulated)" in m for m in mlps)
    assert len(attention) == 2 and all("(SDPA swapped)" in a for a in attention)
    (loss,) = [line for line in lines if " linear_cross_entropy: reference" in line]
    # the chunk bound (Target.loss_chunk_elements, 2^30) in binary units, not 1073741824
    assert loss.endswith("chunks of at most 1 Gi logits)")
    graph = next(out.glob("*_bind")) / "graph.py"
    assert "impl = 'reference'" in graph.read_text()


@pytest.mark.parametrize("model, ffns", [("llama", 4), ("hf-gpt2", 2)])
def test_debug_writes_every_artifact_for_every_pass(tmp_path, plan_file, model, ffns):
    out = tmp_path / "dump"
    assert main(["debug", model, "--plan", str(plan_file), "--out", str(out)]) == 0
    stages = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert stages == [
        "00_capture", "01_moe", "02_fused_loss", "03_fuse_rope", "04_fuse_glu", "05_bind"
    ]  # fmt: skip
    for stage in stages:
        for name in ARTIFACTS:
            assert (out / stage / name).stat().st_size > 0, f"{stage}/{name} is empty"
    pipeline = pipeline_string(moec.Plan.from_dict(PLAN))
    assert (out / "pipeline.txt").read_text().startswith(pipeline)
    assert pipeline in (out / "01_moe" / "graph.py").read_text()
    assert "+" in (out / "01_moe" / "diff.patch").read_text()
    assert "moec.expert_mlp" in (out / "01_moe" / "diff.patch").read_text()
    assert (out / "01_moe" / "graph.dot").read_text().startswith('digraph "01_moe"')
    ops = (out / "01_moe" / "ops.txt").read_text()
    assert re.search(r"moec\.route\.default .* moe\s*$", ops, re.MULTILINE)
    stats = json.loads((out / "01_moe" / "stats.json").read_text())
    assert stats["pass_stats"]["ffns_replaced"] == ffns - 1
    assert stats["pass_stats"]["ffns_kept_dense"] == 1
    assert stats["active_params"] < stats["params"]
    assert stats["flops_per_token"] > 0
    summary = (out / "summary.txt").read_text().splitlines()
    expected = ["[capture]", "[moe]", "[fused_loss]", "[fuse_rope]", "[fuse_glu]", "[bind]"]
    assert [line.split()[0] for line in summary] == expected
    # captured with moec train's next-token loss, which the fused_loss pass fuses with the head
    fused = json.loads((out / "02_fused_loss" / "stats.json").read_text())
    assert fused["pass_stats"]["fused"] == 1
    assert "moec.linear_cross_entropy" in (out / "02_fused_loss" / "diff.patch").read_text()


def test_debug_no_loss_dumps_the_bare_model(tmp_path, plan_file, two_blocks):
    out = tmp_path / "dump"
    argv = ["debug", two_blocks, "--plan", str(plan_file), "--out", str(out), "--no-loss"]
    assert main(argv) == 0
    fused = json.loads((out / "02_fused_loss" / "stats.json").read_text())
    assert fused["pass_stats"]["fused"] == 0
    assert "targets" not in (out / "00_capture" / "graph.py").read_text()


MLP_FACTORY = """
import torch
from torch import nn

def make():
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)), (torch.randn(2, 3, 8),)
"""


def run_repro(out) -> float:
    """Run ``out/repro.py`` in a fresh interpreter from another directory; its loss."""
    done = subprocess.run(
        [sys.executable, str(out / "repro.py")],
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    loss = float(re.search(r"^loss (\S+)$", done.stdout, re.MULTILINE).group(1))
    assert math.isfinite(loss)
    parameters = re.search(r"^(\d+) of (\d+) parameters have gradients$", done.stdout, re.M)
    assert parameters.group(1) == parameters.group(2)
    return loss


@pytest.mark.slow
def test_repro_reruns_the_final_program(tmp_path, two_blocks):
    """bf16 working-weight copies, recompute regions (nested classes) and the fused loss."""
    plan = tmp_path / "plan.yaml"
    moec.Plan.from_dict(
        {**PLAN, "precision": {"compute_dtype": "bf16"}, "recompute": {"policy": "block"}}
    ).save(plan)
    out = tmp_path / "dump"
    assert main(["debug", two_blocks, "--plan", str(plan), "--out", str(out)]) == 0
    script = (out / "repro.py").read_text()
    assert "moec.linear_cross_entropy" in script and "recompute_region" in script
    assert "working_copy" in script
    assert 0 < run_repro(out) < 10  # near ln(256) = 5.5 for random weights


def test_debug_of_a_model_without_token_inputs_needs_no_loss(tmp_path, capsys):
    factory = tmp_path / "mlp.py"
    factory.write_text(MLP_FACTORY)
    out = tmp_path / "dump"
    assert main(["debug", f"{factory}:make", "--out", str(out)]) == 2
    assert "--no-loss" in capsys.readouterr().err
    assert main(["debug", f"{factory}:make", "--out", str(out), "--no-loss"]) == 0
    run_repro(out)


def test_print_after_all_prints_to_the_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    program = capture(
        nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), (torch.randn(2, 3, 8),)
    )
    dump = DebugDump(None, moec.Plan(), print_after_all=True)
    dump("capture", program, {})
    dump("moe", program, {"ffns_replaced": 1})
    out = capsys.readouterr().out
    assert "after 00_capture" in out and "after 01_moe" in out
    assert "aten.linear.default" in out and "[moe] nodes=" in out and "ffns_replaced=1" in out
    assert list(tmp_path.iterdir()) == []


def test_inspect_accepts_a_factory_file(tmp_path, capsys):
    factory = tmp_path / "tiny.py"
    factory.write_text(
        textwrap.dedent("""
        import torch
        from moec.models import Llama, LlamaConfig

        def make():
            cfg = LlamaConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=64)
            return Llama(cfg), (torch.randint(0, 256, (2, 16)),)
    """)
    )
    assert main(["inspect", f"{factory}:make", "--seq", "32"]) == 0
    out = capsys.readouterr().out
    assert "3 FFN regions" in out and "seq=32" in out


def test_inspect_builds_the_model_on_the_meta_device(tmp_path, capsys):
    """A model far larger than this machine (7.8G float32 parameters: 31 GB) is inspected
    without allocating it: the factory runs under the meta device. Built anywhere else, the
    factory refuses (so the old code fails here instead of exhausting the machine's memory)."""
    factory = tmp_path / "huge.py"
    factory.write_text(
        textwrap.dedent("""
        import torch
        from moec.models import Llama, LlamaConfig

        def make():
            if torch.empty(0).device.type != "meta":
                raise RuntimeError("built on a real device: it would allocate 31 GB")
            cfg = LlamaConfig(
                vocab_size=262144, dim=8192, n_layers=2, n_heads=64, n_kv_heads=8,
                ffn_hidden=65536,
            )
            model = Llama(cfg)
            assert all(p.is_meta for p in model.parameters())
            return model, (torch.randint(0, cfg.vocab_size, (2, 16)),)
    """)
    )
    assert main(["inspect", f"{factory}:make"]) == 0
    out = capsys.readouterr().out
    assert "2 FFN regions" in out and "params 7.82G" in out


def test_inspect_names_an_ffn_beside_a_router_and_a_rejected_one(tmp_path, capsys):
    factory = tmp_path / "routed.py"
    factory.write_text(
        textwrap.dedent("""
        import torch
        from tests.test_structure import DenseThenRouted, SubNormFFN

        def make():
            model = torch.nn.Sequential(SubNormFFN("layer_norm"), DenseThenRouted())
            return model, (torch.randn(2, 4, 8),)
    """)
    )
    assert main(["inspect", f"{factory}:make"]) == 0
    out = capsys.readouterr().out
    assert "kept by the moe pass: 1.moe, the shared expert" in out and "topk in 1.moe" in out
    assert "not an FFN: 0.down: aten.layer_norm.default (0.norm) runs between" in out


@pytest.mark.parametrize(
    "model, ffns",
    [("llama", 4), ("gpt2", 4), ("hf-llama", 2), ("hf-qwen2", 2), ("hf-gpt2", 2)],
)
def test_inspect_lists_every_ffn(capsys, model, ffns):
    assert main(["inspect", model]) == 0
    out = capsys.readouterr().out
    assert f"{ffns} FFN regions" in out
    assert "FLOPs/token" in out


def test_plan_show_prints_the_resolved_plan(capsys, plan_file):
    assert main(["plan", "show", str(plan_file)]) == 0
    out = capsys.readouterr().out
    assert "num_experts: 4" in out and "capacity_factor: 1.25" in out
    assert f"passes: {pipeline_string(moec.Plan.from_dict(PLAN))}" in out


def test_plan_show_bad_plan_exits_2_naming_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("moe:\n  num_experts: 4\n  top_k: 9\n")
    assert main(["plan", "show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "moe.top_k" in err and "9" in err


def test_unknown_model_exits_2(capsys):
    assert main(["inspect", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_dump_hook_never_raises(tmp_path, caplog):
    blocked = tmp_path / "not_a_dir"
    blocked.write_text("a file where the dump directory should go")
    program = capture(nn.Linear(8, 8), (torch.randn(2, 3, 8),))
    with caplog.at_level(logging.WARNING, logger="moec.debug"):
        dump = DebugDump(blocked, moec.Plan())
        dump("capture", program, {})
    assert dump.stages == ["00_capture"]
    assert "could not produce" in caplog.text


def test_debug_shows_an_ep_rank_graph_without_a_process_group(tmp_path, two_blocks):
    """The EP program's graph, and in its bindings each exchange's path: ``ep_path: auto``
    resolved for the (CPU) target."""
    plan = tmp_path / "ep.yaml"
    moec.Plan.from_dict({**PLAN, "parallel": {"dp": 2, "ep": 2}}).save(plan)
    out = tmp_path / "dump"
    argv = ["debug", two_blocks, "--plan", str(plan), "--out", str(out), "--ep-rank", "1"]
    assert main(argv) == 0
    stage = out / "02_expert_parallel"
    assert all((stage / name).exists() for name in ARTIFACTS)
    assert "moec.ep_dispatch" in (stage / "graph.py").read_text()
    lines = (out / "bindings.txt").read_text().splitlines()
    exchanges = [line for line in lines if " ep_" in line]
    ops = {line.split(": ")[0].split()[-1] for line in exchanges}
    assert ops == {"ep_layout", "ep_dispatch", "ep_combine"}
    assert all(": a2a_capacity (sync-free all_to_all" in line for line in exchanges), exchanges


@pytest.mark.slow
def test_debug_writes_the_lowered_program(tmp_path, two_blocks):
    """With ``lowering.inductor``, ``moec debug`` adds Inductor's trace of one step: generated
    code for the forward and the backward graph, the moec ops called in it as opaque ops. Two
    blocks (a dense one, an MoE one) instead of the bundled four: Inductor's time grows with
    the graph."""
    plan = tmp_path / "plan.yaml"
    moec.Plan.from_dict({**PLAN, "lowering": {"inductor": True}}).save(plan)
    out = tmp_path / "dump"
    assert main(["debug", two_blocks, "--plan", str(plan), "--out", str(out)]) == 0
    generated = sorted((out / "lowered").rglob("output_code.py"))
    names = {path.parent.name for path in generated}
    assert any("forward" in n for n in names) and any("backward" in n for n in names), names
    code = "\n".join(path.read_text() for path in generated)
    assert "torch.ops.moec.expert_mlp" in code and "torch.ops.moec.expert_mlp_backward" in code
