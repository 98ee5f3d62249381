"""``CompiledModel`` keeps the nn.Module contract: train()/eval() (dropout follows the mode),
names a user recognises, state_dict round trip, .to(), pickling, torch.compile."""

import io

import pytest
import torch
import transformers as tf
from torch import nn

import moec
from moec.runtime.variants import ModeError
from moec.train import LanguageModelWithLoss
from tests.models import hf_model, tiny_llama, tokens

PLAN = {"moe": {"num_experts": 4, "top_k": 2, "dense_first": 1}}


class LogitDropout(nn.Module):
    """The bundled Llama with dropout on its logits (the Llama itself has none)."""

    def __init__(self, model: nn.Module, p: float):
        super().__init__()
        self.model, self.dropout = model, nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.model(x))


def qwen2_with_attention_dropout(p: float) -> nn.Module:
    """HF Qwen2, whose attention passes ``dropout_p = p if self.training else 0`` to SDPA."""
    common = dict(vocab_size=256, num_hidden_layers=2, num_attention_heads=4, use_cache=False)
    config = tf.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_key_value_heads=2, attention_dropout=p, **common
    )
    return tf.Qwen2ForCausalLM(config)


def logits(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


MODELS = {
    "llama": lambda: tiny_llama(2),
    "llama-dropout": lambda: LogitDropout(tiny_llama(2), 0.5),
    "hf-qwen2-dropout": lambda: qwen2_with_attention_dropout(0.5),
    "hf-gpt2": lambda: hf_model("gpt2"),
}


BF16_RECOMPUTE = {**PLAN, "precision": {"compute_dtype": "bf16"}, "recompute": {"policy": "block"}}


def compiled(name: str, plan: dict = PLAN, *, eval_source: bool = False) -> moec.CompiledModel:
    """``name`` compiled (not verified: the passes are tested elsewhere) from a source model in
    train mode, or in eval mode as ``from_pretrained`` gives it."""
    model = MODELS[name]().train(not eval_source)
    return moec.compile(model, plan, (tokens(),), verify=False)


@pytest.mark.parametrize(
    "name, plan, eval_source",
    [
        ("llama-dropout", PLAN, False),
        # the attention's dropout inside recompute regions, from an eval-mode source model
        ("hf-qwen2-dropout", {**PLAN, "recompute": {"policy": "block"}}, True),
    ],
    ids=["llama-dropout", "hf-qwen2-dropout-eval-source-recompute"],
)
def test_dropout_follows_the_mode(name, plan, eval_source):
    model = compiled(name, plan, eval_source=eval_source)
    assert model.training is not eval_source  # starts in the source model's mode
    x = tokens()
    with torch.no_grad():
        model.train()
        first, second = logits(model(x)), logits(model(x))
        assert not torch.equal(first, second), "train mode: dropout draws new masks"
        assert model.eval() is model and not model.training
        first, second = logits(model(x)), logits(model(x))
        assert torch.equal(first, second), "eval mode: no dropout"
        model.train()
        assert not torch.equal(logits(model(x)), first), "back in train mode"


def test_train_and_eval_agree_without_dropout():
    model = compiled("llama")
    x = tokens()
    trained = model.train()(x)
    assert torch.equal(model.eval()(x), trained)


def test_batch_norm_cannot_switch_mode():
    net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.BatchNorm1d(8))
    model = moec.compile(net.eval(), None, (torch.randn(4, 8),), verify=False)
    stats = net[3].running_mean.clone()
    model(torch.randn(4, 8))
    assert torch.equal(net[3].running_mean, stats)  # captured in its own mode: eval
    with pytest.raises(ModeError, match=r"cannot run in train mode.*batch_norm"):
        model.train()
    assert not model.training


@pytest.mark.parametrize(
    "name, dense_ffn, attention",
    [
        ("llama", "layers.0.ffn.gate_proj.weight", "layers.1.attn.q_proj.weight"),
        ("hf-gpt2", "transformer.h.0.mlp.c_fc.weight", "transformer.h.1.attn.c_attn.weight"),
    ],
)
def test_parameter_names_are_the_source_models(name, dense_ffn, attention):
    source = MODELS[name]()
    model = moec.compile(source, PLAN, (tokens(),), verify=False)
    names = {n for n, _ in model.named_parameters()}
    assert {dense_ffn, attention} <= names  # dense parameters keep their names
    assert names - {n for n, _ in source.named_parameters()}  # and the experts are new
    assert names <= set(model.state_dict())
    assert model.get_parameter(attention) is source.get_parameter(attention)


@pytest.mark.parametrize("name", ["llama", "hf-gpt2"])
def test_state_dict_round_trip(name):
    model, fresh = compiled(name).eval(), compiled(name).eval()
    x = tokens()
    assert not torch.equal(logits(fresh(x)), logits(model(x)))
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(logits(fresh(x)), logits(model(x)))


def test_to_dtype_and_device():
    model = compiled("llama").eval()
    x = tokens()
    expected = model(x)
    assert model.to(torch.float64) is model
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all(p.dtype == torch.float64 for p in model.graph_module.parameters())
    out = model(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.float(), expected, rtol=1e-4, atol=1e-4)
    model.to("cpu", torch.float32)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "model, plan, inputs",
    [
        (lambda: LogitDropout(tiny_llama(2), 0.5), PLAN, lambda: (tokens(),)),
        (lambda: hf_model("gpt2"), PLAN, lambda: (tokens(),)),
        # working-weight copies (working_copy calls) and recompute regions (sub-GraphModules)
        (
            lambda: LanguageModelWithLoss(tiny_llama(2)),
            BF16_RECOMPUTE,
            lambda: (tokens(), tokens()),
        ),
    ],
    ids=["llama-dropout", "hf-gpt2", "llama-loss-bf16-recompute"],
)
def test_torch_save_and_load(model, plan, inputs):
    model = moec.compile(model(), plan, inputs(), verify=False)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert [n for n, _ in loaded.named_parameters()] == [n for n, _ in model.named_parameters()]
    x = inputs()
    model.eval(), loaded.eval()
    assert torch.equal(logits(loaded(*x)), logits(model(*x)))
    loaded.train()
    logits(loaded(*x)).float().square().mean().backward()
    assert all(p.grad is not None for p in loaded.parameters())


def test_torch_compile_runs_forward_and_backward():
    """aot_eager traces the backward too (the expert GEMMs' on fake tensors), as inductor does."""
    model = compiled("llama")
    x = tokens()
    expected = model(x)
    expected.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = torch.compile(model, backend="aot_eager")(x)
    torch.testing.assert_close(out, expected)
    out.square().mean().backward()
    for p, grad in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, grad)
