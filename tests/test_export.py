"""``moec export``: a trained run -> a transformers MoE model whose logits equal the program's.

Dense tiny HF models are upcycled (8 experts, top-2, a capacity that cannot bind: capacity
factor N/K makes every expert's buffer hold all tokens), trained a few steps with the trainer,
exported, and loaded with ``AutoModelForCausalLM.from_pretrained``; its float32 logits on fresh
inputs equal those of the moec program holding the trained parameters. Plans no HF
architecture expresses are refused by name.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import transformers as tf

import moec
from moec.errors import MoecError
from moec.export import ExportError, add_export_parser, export_hf
from moec.export.hf import Layout, choose_target, layout_of
from moec.plan import MoEPlan
from moec.train import TrainConfig, train
from tests.models import hf_family, tokens

NON_BINDING = 4.0
"""num_experts / top_k: every expert's capacity is the whole batch, so nothing is dropped."""


def _moe(**overrides) -> dict:
    base = {"num_experts": 8, "top_k": 2, "capacity_factor": NON_BINDING, "init": "random"}
    return {"moe": {**base, "expert_width": 32, **overrides}}


def _train(family: str, plan: dict, out) -> tuple[torch.nn.Module, dict, moec.CompiledModel]:
    torch.manual_seed(0)
    model = hf_family(family)
    cfg = TrainConfig(
        steps=3, batch_size=2, seq_len=16, warmup_steps=1, log_every=3, out=str(out),
        synthetic=True, plots=False, device="cpu", lr=1e-2,
    )  # fmt: skip
    result = train(model, plan, cfg)
    return model, plan, result.compiled


def _program_logits(model, plan: dict, trained: moec.CompiledModel, ids: torch.Tensor):
    """The logits of ``model`` compiled with ``plan`` holding ``trained``'s parameters (the
    trainer's program computes the loss, not the logits)."""
    compiled = moec.compile(model, plan, (), {"input_ids": tokens(2, 16)})
    values = {k.removeprefix("model."): v for k, v in trained.named_parameters()}
    with torch.no_grad():
        for name, param in compiled.named_parameters():
            param.copy_(values[name])
        return compiled(input_ids=ids).logits


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moec")
    add_export_parser(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama_run")
    return out, *_train("llama", _moe(), out)


def test_llama_run_exports_to_mixtral_with_equal_logits(llama_run, tmp_path):
    run, model, plan, trained = llama_run
    model.config.save_pretrained(tmp_path / "dense")  # the --init-from folder's config
    args = _parser().parse_args(
        ["export", str(run), "--to", str(tmp_path / "hf"), "--config", str(tmp_path / "dense")]
    )
    assert args.func(args) == 0
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == "MixtralForCausalLM"
    assert hf.config.num_local_experts == 8 and hf.config.num_experts_per_tok == 2
    ids = tokens(3, 11)
    with torch.no_grad():
        exported = hf(input_ids=ids).logits
    torch.testing.assert_close(exported, _program_logits(model, plan, trained, ids), atol=1e-4,
                               rtol=0)  # fmt: skip
    notes = json.loads((tmp_path / "hf" / "moec_export.json").read_text())["notes"]
    assert any(note.startswith("capacity:") for note in notes)


@pytest.mark.parametrize(
    ("family", "moe", "architecture"),
    [
        ("qwen2", {"shared_expert": True, "dense_first": 1}, "Qwen2MoeForCausalLM"),
        pytest.param(
            "llama", {"dense_first": 1}, "Qwen2MoeForCausalLM", marks=pytest.mark.slow
        ),  # Llama attention on Qwen2-MoE, a shared expert of width 0
        pytest.param("olmo2", {}, "FlexOlmoForCausalLM", marks=pytest.mark.slow),
    ],
)
def test_shared_expert_and_dense_blocks_export_with_equal_logits(
    family, moe, architecture, tmp_path
):
    model, plan, trained = _train(family, _moe(**moe), tmp_path / "run")
    step = tmp_path / "run" / "checkpoints" / "step_3"
    result = export_hf(step, tmp_path / "hf", model=model)  # a checkpoint folder
    assert result.architecture == architecture
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == architecture
    ids = tokens(3, 11)
    with torch.no_grad():
        exported = hf(input_ids=ids).logits
    torch.testing.assert_close(exported, _program_logits(model, plan, trained, ids), atol=1e-4,
                               rtol=0)  # fmt: skip


def test_plan_no_hf_architecture_expresses_is_refused(llama_run, tmp_path):
    run, model, _, _ = llama_run
    sigmoid = tmp_path / "sigmoid.yaml"
    moec.Plan.from_dict(_moe(gating="sigmoid")).save(sigmoid)
    args = _parser().parse_args(
        ["export", str(run), "--to", str(tmp_path / "hf"), "--plan", str(sigmoid),
         "--model", "hf-qwen2"]
    )  # fmt: skip
    with pytest.raises(ExportError, match="(?s)run in .* trained"):  # another model
        args.func(args)
    with pytest.raises(MoecError, match="sigmoid gating"):
        export_hf(run, tmp_path / "hf", model=model, plan=sigmoid)
    assert not (tmp_path / "hf" / "config.json").exists()


@pytest.mark.parametrize(
    ("family", "moe", "message"),
    [
        ("qwen3", {"shared_expert": True}, "Qwen3MoeForCausalLM has no shared expert"),
        ("olmo2", {"dense_first": 1}, "FlexOlmoForCausalLM has no dense first blocks"),
        ("gpt2", {}, "no HF MoE architecture for a 'gpt2' source"),
    ],
)
def test_inexpressible_plans_name_what_is_missing(family, moe, message):
    config = getattr(tf, {"qwen3": "Qwen3Config", "olmo2": "Olmo2Config", "llama": "LlamaConfig",
                          "gpt2": "GPT2Config"}[family])()  # fmt: skip
    plan = MoEPlan(**{**_moe()["moe"], **moe})
    layout = Layout(2, [plan.dense_first, 1], 8, 32, 64, plan.shared_expert)
    with pytest.raises(ExportError, match=message):
        choose_target(config, plan, layout)


def test_a_non_zero_selection_bias_is_refused_by_name():
    """``moe.balance: aux_free`` routers choose by scores + bias, which no HF target does; a
    zero bias (step 0) chooses as plain top-k and exports."""
    n, dim, width = 4, 8, 16
    tensors = {
        "model.layers.0.mlp.moe.router_weight": torch.randn(n, dim),
        "model.layers.0.mlp.moe.w_up": torch.randn(n, dim, 2 * width),
        "model.layers.0.mlp.moe.w_down": torch.randn(n, width, dim),
        "model.layers.0.mlp.moe.expert_bias": torch.zeros(n),
    }
    config = tf.LlamaConfig(num_hidden_layers=1)
    plan = MoEPlan(num_experts=n, balance="aux_free")
    assert layout_of(tensors, config, plan).moe_layers == [0]
    tensors["model.layers.0.mlp.moe.expert_bias"][2] = 1e-3
    with pytest.raises(ExportError, match=r"selection bias \(model\.layers\.0\.mlp\.moe\.expert_b"):
        layout_of(tensors, config, plan)
