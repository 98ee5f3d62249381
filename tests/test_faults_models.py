"""Ordinary dense models that once stopped moec with an internal error compile and train, or are
refused with a ``MoecError`` naming the input size and the model code that fixed it.

- masked-LM heads whose decoder bias is tied to the head's ``bias`` (BERT, RoBERTa), in bf16;
- a parameter the forward never reads;
- an MLP-Mixer: its token-mixing MLPs (run on a transposed tensor, over positions) stay dense,
  its channel-mixing MLPs become experts;
- a depthwise ``conv1d`` with a bias reading a linear's output, in bf16 (RecurrentGemma's);
- a model that loops over its sequence in Python (RecurrentGemma's scan): the capture fixes
  the sequence length, says so and where, and a call at another length is a ``SignatureError``.

Each compiles under ``init: upcycle`` with normalized route weights and no capacity limit, where
the MoE equals the dense model at init: a float32 program's output equals the dense model's, a
bf16 program's loss is the dense loss up to bf16 rounding; then one SGD step trains.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

import moec
from moec.program import SignatureError
from moec.train import LanguageModelWithLoss, language_model_loss
from tests.models import tokens, train_one_step

MOE = {"num_experts": 4, "top_k": 2, "capacity_factor": None, "init": "upcycle"}
PLANS = {"fp32": {"moe": MOE}, "bf16": {"moe": MOE, "precision": {"compute_dtype": "bf16"}}}
BF16_LOSS_TOLERANCE = 0.02
"""|bf16 program loss - dense float32 loss| at init, on a loss of ~ln(256) = 5.5."""


def _check_lm(model: nn.Module, precision: str, ids: torch.Tensor) -> moec.CompiledModel:
    """The model with its next-token loss compiled under ``PLANS[precision]`` (what ``moec
    train`` compiles): its loss at init is the dense model's (exactly in float32), and it
    trains a step."""
    inputs, targets = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        dense = language_model_loss(model(inputs), targets)
    compiled = moec.compile(LanguageModelWithLoss(model), PLANS[precision], (inputs, targets))
    loss = compiled(inputs, targets)
    if precision == "fp32":
        torch.testing.assert_close(loss, dense, rtol=1e-5, atol=1e-5)
    else:
        assert abs(float(loss.detach()) - float(dense)) < BF16_LOSS_TOLERANCE
    train_one_step(compiled, lambda: compiled(inputs, targets))
    return compiled


# --- tied masked-LM bias -----------------------------------------------------------------------


def _masked_lm(family: str) -> nn.Module:
    config = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    if family == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(**config))
    return tf.RobertaForMaskedLM(tf.RobertaConfig(**config, pad_token_id=1))


@pytest.mark.parametrize(
    ("family", "precision"),
    [
        ("bert", "bf16"),
        pytest.param("bert", "fp32", marks=pytest.mark.slow),
        pytest.param("roberta", "bf16", marks=pytest.mark.slow),
        pytest.param("roberta", "fp32", marks=pytest.mark.slow),
    ],
)
def test_a_masked_lm_head_with_a_tied_bias_trains(family, precision):
    """The head's decoder bias is the head's ``bias`` parameter under a second name: the
    program reads it by one name (its working copy's too), and it trains."""
    model = _masked_lm(family)
    head = model.cls.predictions if family == "bert" else model.lm_head
    assert head.decoder.bias is head.bias
    compiled = _check_lm(model, precision, tokens(2, 17))
    params = dict(compiled.named_parameters())
    for masters in compiled.program.working_weights.values():
        assert set(masters) <= params.keys()
    bias = next(name for name, p in params.items() if p is head.bias)
    assert not bias.endswith("decoder.bias")  # the first name, not the alias
    assert params[bias].grad is not None


# --- a parameter no node reads -----------------------------------------------------------------


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(256, 32), nn.Linear(32, 256)
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        self.unused = nn.Linear(32, 32)  # built, never called

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + self.down(F.gelu(self.up(h))))


def test_a_parameter_no_node_reads_stays_a_parameter_without_a_gradient():
    model, ids = _WithUnused(), tokens(2, 16)
    compiled = moec.compile(model, PLANS["fp32"], (ids,))
    assert compiled.pass_results["moe"].stats["ffns_replaced"] == 1
    torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-6)
    targets = tokens(2, 16)
    train_one_step(
        compiled, lambda: F.cross_entropy(compiled(ids).flatten(0, 1), targets.flatten())
    )
    params = dict(compiled.named_parameters())
    assert params["unused.weight"] is model.unused.weight and params["unused.weight"].grad is None


# --- MLP-Mixer ---------------------------------------------------------------------------------


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class _MixerLayer(nn.Module):
    def __init__(self, patches: int, dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token_mix, self.channel_mix = _Mlp(patches, 2 * patches), _Mlp(dim, 4 * dim)

    def forward(self, x):  # x: [batch, patches, dim]
        x = x + self.token_mix(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mix(self.norm2(x))


class _Mixer(nn.Module):
    """An MLP-Mixer on 16x16 images in 4x4 patches: token-mixing MLPs over the 16 patches."""

    def __init__(self, dim: int = 32, layers: int = 2):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, 4)
        self.layers = nn.ModuleList(_MixerLayer(16, dim) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    def forward(self, images):
        x = self.stem(images).flatten(2).transpose(1, 2)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).mean(1))


def test_an_mlp_mixer_keeps_its_token_mixing_mlps_dense():
    """The token-mixing MLPs' features are the patches (a size that follows the image's): they
    stay dense, named in a warning; the channel-mixing MLPs become experts, and the program
    equals the dense model, gradients included."""
    model, images = _Mixer(), torch.randn(2, 3, 16, 16)
    with pytest.warns(UserWarning, match=r"FFNs kept dense: layers\.0\.token_mix, layers\.1"):
        compiled = moec.compile(model, PLANS["fp32"], (images,))
    stats = compiled.pass_results["moe"].stats
    assert stats["ffns_over_positions"] == 2 and stats["ffns_replaced"] == 2
    assert [layer.path for layer in compiled.moe_layers] == [
        "layers.0.channel_mix.moe",
        "layers.1.channel_mix.moe",
    ]
    out, dense = compiled(images), model(images)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-6)
    out.square().mean().backward()
    dense.square().mean().backward()
    for name, param in compiled.named_parameters():
        if name.startswith(("stem.", "layers.0.token_mix.", "layers.1.token_mix.")):
            want = model.get_parameter(name).grad
            torch.testing.assert_close(param.grad, want, rtol=1e-4, atol=1e-6, msg=name)
    train_one_step(compiled, lambda: compiled(images).square().mean())


# --- a convolution with a bias in bf16 ---------------------------------------------------------


class _ConvBlock(nn.Module):
    """RecurrentGemma's temporal block in small: a linear, then a causal depthwise conv1d with
    a bias over the sequence, then an FFN."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.embed, self.head = nn.Embedding(256, dim), nn.Linear(dim, 256)
        self.proj = nn.Linear(dim, dim)
        self.conv = nn.Conv1d(dim, dim, kernel_size=4, groups=dim, padding=3)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.conv(self.proj(h).transpose(1, 2))[..., : ids.shape[1]].transpose(1, 2)
        return self.head(h + self.down(F.gelu(self.up(h))))


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp32", marks=pytest.mark.slow)])
def test_a_conv_with_a_bias_reading_a_linear_trains(precision):
    """Under bf16 autocast the conv reads the linear's bf16 output and casts its weight and
    bias: the program casts them explicitly, as it does a linear's."""
    compiled = _check_lm(_ConvBlock(), precision, tokens(2, 17))
    if precision == "bf16":
        copies = {m for masters in compiled.program.working_weights.values() for m in masters}
        assert {"model.conv.weight", "model.conv.bias"} <= copies


# --- a size the model's code fixes -------------------------------------------------------------


class _Scan(nn.Module):
    """A linear recurrence written as a Python loop over the sequence, then an FFN."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.embed, self.head = nn.Embedding(256, dim), nn.Linear(dim, 256)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, ids):
        h = self.embed(ids)
        state, states = torch.zeros_like(h[:, 0]), []
        for t in range(h.shape[1]):
            state = 0.5 * state + h[:, t]
            states.append(state)
        h = torch.stack(states, 1)
        return self.head(h + self.down(F.gelu(self.up(h))))


def test_a_sequence_length_the_model_fixes_is_named_and_other_lengths_are_refused():
    model, ids = _Scan(), tokens(3, 8)
    with pytest.warns(UserWarning, match=r"ids\.size\(1\) = 8 \(.*test_faults_models\.py:\d+"):
        compiled = moec.compile(model, PLANS["fp32"], (ids,))
    (fixed,) = compiled.program.signature.fixed_sizes
    assert (fixed.name, fixed.dim, fixed.size) == ("ids", 1, 8) and "in forward" in fixed.reason
    other_batch = tokens(5, 8)  # the batch stays symbolic
    torch.testing.assert_close(compiled(other_batch), model(other_batch), rtol=1e-5, atol=1e-6)
    with pytest.raises(SignatureError, match=r"size 12 in dim 1.*ids\.size\(1\) = 8"):
        compiled(tokens(3, 12))


def _recurrent_gemma() -> nn.Module:
    config = tf.RecurrentGemmaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,  # two recurrent blocks, one attention block
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        lru_width=64,
        attention_window_size=16,
        use_cache=False,
    )
    return tf.RecurrentGemmaForCausalLM(config)


@pytest.mark.slow  # a three-block RecurrentGemma captured with its scan unrolled
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recurrent_gemma_trains_at_the_length_its_scan_fixes(precision):
    """Its conv1d biases are cast in bf16; its scan loops over the sequence in Python, which
    fixes the length: named at capture, and another length is a SignatureError."""
    model = _recurrent_gemma()
    with pytest.warns(UserWarning, match=r"inputs\.size\(1\) = 16 \(.*in _rnn_scan"):
        compiled = _check_lm(model, precision, tokens(2, 17))
    ids = tokens(2, 25)
    with pytest.raises(SignatureError, match=r"inputs\.size\(1\) = 16 .*_rnn_scan"):
        compiled(ids[:, :-1], ids[:, 1:])
