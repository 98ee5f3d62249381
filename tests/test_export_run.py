"""``moec export RUN`` with nothing else: the model comes from the configuration ``run.json``
recorded (transformers models, and moec's bundled Llama as transformers' Llama), the output
goes to ``RUN/hf``; every refusal names its actual reason, before any tensor is read."""

import json

import pytest
import torch
import transformers as tf

import moec
from moec.cli import main
from moec.export import ExportError, export_hf
from moec.export.hf import BUNDLED_LLAMA, _bundled_llama_config, _source_of
from moec.models import Llama, LlamaConfig
from moec.runtime import run_identity
from moec.train import TrainConfig, train
from tests.models import hf_family, hf_model, tiny_gpt2, tokens

PLAN = {"moe": {"num_experts": 4, "top_k": 2, "init": "random", "capacity_factor": None}}


def _train(model: torch.nn.Module, out) -> moec.CompiledModel:
    cfg = TrainConfig(
        steps=2, batch_size=2, seq_len=16, warmup_steps=1, log_every=2, out=str(out),
        synthetic=True, plots=False, device="cpu", lr=1e-2,
    )  # fmt: skip
    return train(model, PLAN, cfg).compiled


def _logits(model: torch.nn.Module, trained: moec.CompiledModel, ids: torch.Tensor, **kw):
    """``model`` compiled with ``PLAN`` holding ``trained``'s parameters, run on ``ids``."""
    compiled = moec.compile(model, PLAN, (ids,))
    values = {k.removeprefix("model."): v for k, v in trained.named_parameters()}
    with torch.no_grad():
        for name, param in compiled.named_parameters():
            param.copy_(values[name])
        out = compiled(ids)
    return getattr(out, "logits", out)


def test_a_bundled_llama_run_exports_as_mixtral_with_nothing_else(tmp_path, capsys):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64))
    trained = _train(model, tmp_path)
    recorded = json.loads((tmp_path / "run.json").read_text())["model"]
    assert recorded["class"] == BUNDLED_LLAMA and recorded["config"]["ffn_hidden"] == 64
    assert main(["export", str(tmp_path)]) == 0
    assert f"to {tmp_path / 'hf'}" in capsys.readouterr().out
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == "MixtralForCausalLM"
    ids = tokens(3, 11)
    with torch.no_grad():
        exported = hf(input_ids=ids).logits
    torch.testing.assert_close(exported, _logits(model, trained, ids), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_an_hf_run_exports_from_its_recorded_config(tmp_path):
    torch.manual_seed(0)
    model = hf_family("llama")
    trained = _train(model, tmp_path)
    result = export_hf(tmp_path)  # nothing but the run
    assert result.out == tmp_path / "hf" and result.architecture == "MixtralForCausalLM"
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.config.hidden_size == model.config.hidden_size
    ids = tokens(3, 11)
    with torch.no_grad():
        exported = hf(input_ids=ids).logits
    torch.testing.assert_close(exported, _logits(model, trained, ids), atol=1e-4, rtol=0)


def test_the_bundled_gpt2_is_refused_for_what_it_is(tmp_path):
    torch.manual_seed(0)
    _train(tiny_gpt2(2), tmp_path)
    with pytest.raises(ExportError, match="moec's bundled GPT-2, and no HF MoE architecture"):
        export_hf(tmp_path)
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_an_hf_gpt2_is_refused_by_its_family_not_as_a_non_decoder(tmp_path):
    """GPT-2 is a transformers decoder; what it lacks is an HF MoE counterpart."""
    torch.manual_seed(0)
    _train(hf_model("gpt2"), tmp_path)
    with pytest.raises(ExportError, match="no HF MoE architecture for a 'gpt2' source") as caught:
        export_hf(tmp_path)
    assert "decoder" not in str(caught.value)


def test_refusals_name_what_the_record_lacks(tmp_path):
    with pytest.raises(ExportError, match="per-block FFN widths .*one intermediate_size"):
        _bundled_llama_config({"ffn_hidden": 64, "ffn_hidden_per_layer": [256, 64]})
    with pytest.raises(ExportError, match="no recorded configuration .* --config"):
        _source_of("transformers.models.llama.modeling_llama.LlamaForCausalLM", None, tmp_path)
    with pytest.raises(ExportError, match="neither a transformers model nor moec's bundled"):
        _source_of("my_models.Net", {"width": 3}, tmp_path)
    with pytest.raises(ExportError, match="not in a run directory .* give --to DIR"):
        export_hf(_checkpoint_without_run(tmp_path))


def _checkpoint_without_run(tmp_path):
    torch.manual_seed(0)
    _train(tiny_gpt2(2), tmp_path / "run")
    (tmp_path / "run" / "run.json").unlink()
    return tmp_path / "run" / "checkpoints" / "step_2"


def test_the_recorded_config_is_not_part_of_the_compared_identity():
    """A run recorded before configs were (or by another transformers version) resumes."""
    spec = run_identity.model_spec(Llama(LlamaConfig(dim=32, n_layers=1, n_heads=4)))
    assert spec["config"]["dim"] == 32
    older = {"model": run_identity.compared(spec), "seed": 0}
    assert run_identity.differences(older, {"model": spec, "seed": 0}) == []
    changed = {**spec, "parameters": 1}
    assert run_identity.differences({"model": changed, "seed": 0}, {"model": spec, "seed": 0})


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "no_such_family"},
        {"hidden_size": 8},  # no model_type
        ["not", "a", "mapping"],
        # a Hub config's pointer to remote code: read as data, never imported
        {"model_type": "llama", "auto_map": {"AutoConfig": "evil.Config"}, "vocab_size": "x"},
    ],
)
def test_a_hostile_recorded_config_is_refused_as_data(config, tmp_path):
    """``run.json``'s recorded configuration comes from a run folder: what transformers cannot
    read as a config is one ExportError naming the run, and nothing it names is imported."""
    qualified = "transformers.models.llama.modeling_llama.LlamaForCausalLM"
    try:
        source = _source_of(qualified, config, tmp_path)
    except ExportError as exc:
        assert str(tmp_path) in str(exc)
        return
    # transformers may take an odd value as given; then it is only data on the config
    assert type(source.config).__module__.startswith("transformers.")
