import math

import pytest
import torch

import moec
from moec.analysis.structure import find_structure
from moec.ops.activations import ActivationError, activate, known_activations
from tests.models import HalvedProjection, hf_model, tiny_gpt2, tiny_llama, tokens


@pytest.mark.parametrize(
    "make, activation, blocks",
    [
        (tiny_llama, "swiglu", 3),
        (tiny_gpt2, "gelu_tanh", 3),
        (lambda: hf_model("llama"), "swiglu", 2),
        (lambda: hf_model("qwen2"), "swiglu", 2),
        (lambda: hf_model("gpt2"), "gelu_tanh", 2),  # Conv1D (addmm) + gelu_new decomposed
    ],
)
def test_ffn_regions_found_structurally(make, activation, blocks):
    gm = moec.trace(make(), (tokens(),))
    found = find_structure(gm).blocks
    assert len(found) == blocks
    for i, block in enumerate(found):
        ffn = block.ffn
        assert block.index == i and ffn.activation == activation
        assert ffn.dim == 32 and ffn.hidden in (64, 128)
        assert block.residual is not None
        assert ffn.input.meta["val"].shape == ffn.output.meta["val"].shape


class GatedOrderSwapped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (
            torch.nn.Linear(8, 16),
            torch.nn.Linear(8, 16),
            torch.nn.Linear(16, 8),
        )

    def forward(self, x):
        return x + self.c(self.a(x) * torch.relu(self.b(x)))


class NotAnFFN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.c = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(h) + h.sum(-1, keepdim=True)  # h escapes the region


def test_gate_and_up_identified_by_value_not_position():
    gm = moec.trace(GatedOrderSwapped(), (torch.randn(2, 4, 8),))
    (block,) = find_structure(gm).blocks
    assert block.ffn.activation == "reglu"
    assert block.ffn.ups[0].weight == "b.weight"


def test_escaping_values_are_rejected_with_a_reason():
    structure = find_structure(moec.trace(NotAnFFN(), (torch.randn(2, 4, 8),)))
    assert structure.blocks == []
    assert any("also used by" in r for r in structure.rejected)


class LearnedSlope(torch.nn.Module):
    """A parametrised activation (a learned slope, as Apertus's xIELU has its alphas)."""

    def __init__(self):
        super().__init__()
        self.alpha = torch.nn.Parameter(torch.rand(()))

    def forward(self, x):
        return torch.where(x > 0, x, torch.nn.functional.softplus(self.alpha) * x)


def test_a_learned_activation_is_rejected_naming_its_parameters():
    structure = find_structure(moec.trace(PlainFFN(LearnedSlope()), (torch.randn(2, 4, 8),)))
    assert structure.blocks == []
    assert any("reads act.alpha" in r and "parameter-free" in r for r in structure.rejected), (
        structure.rejected
    )


class SubNormFFN(torch.nn.Module):
    """An FFN that normalizes its hidden activation before the down projection (BitNet's
    ``ffn_sub_norm``; NormFormer's FFN layer norm)."""

    def __init__(self, norm: str):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.norm = torch.nn.LayerNorm(16) if norm == "layer_norm" else torch.nn.RMSNorm(16)
        self.decompose = norm == "decomposed"

    def forward(self, x):
        h = torch.relu(self.up(x))
        if self.decompose:  # as transformers writes RMSNorm
            h = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        else:
            h = self.norm(h)
        return x + self.down(h)


@pytest.mark.parametrize(
    "norm, op",
    [("layer_norm", "aten.layer_norm"), ("rms_norm", "aten.rms_norm"), ("decomposed", "mean")],
)
def test_a_norm_inside_an_ffn_is_rejected_naming_it(norm, op):
    structure = find_structure(moec.trace(SubNormFFN(norm), (torch.randn(2, 4, 8),)))
    assert structure.blocks == []
    (reason,) = structure.rejected
    assert reason.startswith("down: ") and op in reason and "between its up and down" in reason


class SharedExpertMoE(torch.nn.Module):
    """A block that routes tokens already: a softmax router's top-2 of 4 expert matrices, and an
    FFN beside it on the same input (the block's shared expert)."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(8, 4, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(4, 8, 8) * 0.1)
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        weights, chosen = self.router(x).float().softmax(-1).topk(2, dim=-1)
        routed = torch.einsum("btk,btkde,btd->bte", weights, self.experts[chosen], x)
        return x + routed + self.down(torch.relu(self.up(x)))


class DenseThenRouted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense, self.moe = PlainFFN(torch.nn.GELU()), SharedExpertMoE()

    def forward(self, x):
        return self.moe(self.dense(x))


def test_an_ffn_beside_a_router_records_it():
    gm = moec.trace(DenseThenRouted(), (torch.randn(2, 4, 8),))
    dense, shared = find_structure(gm).blocks
    assert dense.ffn.router is None and dense.ffn.module_path == "dense"
    assert shared.ffn.router.target == torch.ops.aten.topk.default
    assert shared.ffn.module_path == "moe"


@pytest.fixture
def fresh_activations(monkeypatch):
    """Activations registered by the test are forgotten after it."""
    from moec.ops import activations

    monkeypatch.setattr(activations, "_unary", dict(activations._unary))
    monkeypatch.setattr(activations, "_gated", dict(activations._gated))


class PlainFFN(torch.nn.Module):
    def __init__(self, act, gated: bool = False):
        super().__init__()
        self.act = act
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.gate = torch.nn.Linear(8, 16) if gated else None

    def forward(self, x):
        h = self.act(self.up(x) if self.gate is None else self.gate(x))
        return x + self.down(h if self.gate is None else h * self.up(x))


def _gelu_tanh_formula(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3))))


@pytest.mark.parametrize(
    "act, gated, name",
    [
        (lambda x: x * torch.sigmoid(1.702 * x), False, "quick_gelu"),  # QuickGELU (CLIP)
        (_gelu_tanh_formula, False, "gelu_tanh"),
        (
            lambda x: x * torch.sigmoid(1.5957691216057308 * (x + 0.044715 * x**3)),
            False,
            "gelu_tanh",
        ),
        (lambda x: torch.relu(x) ** 2, False, "relu2"),
        (lambda x: torch.square(torch.relu(x)), True, "relu2_glu"),
        (lambda x: x * torch.sigmoid(1.702 * x), True, "quick_gelu_glu"),
    ],
)
def test_written_out_activations_are_recognised_by_value(act, gated, name):
    gm = moec.trace(PlainFFN(act, gated), (torch.randn(2, 4, 8),))
    (block,) = find_structure(gm).blocks
    assert block.ffn.activation == name


class PointwiseConvFFN(torch.nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.up, self.down = conv(8, 16, 1), conv(16, 8, 1)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.parametrize(
    "conv, shape", [(torch.nn.Conv1d, (2, 8, 5)), (torch.nn.Conv2d, (2, 8, 3, 3))]
)
def test_pointwise_convolutions_are_linears_over_the_channel_dim(conv, shape):
    model = PointwiseConvFFN(conv)
    gm = moec.trace(model, (torch.randn(shape),))
    (block,) = find_structure(gm).blocks
    ffn = block.ffn
    assert ffn.activation == "gelu" and ffn.channel_dim == 1 and (ffn.dim, ffn.hidden) == (8, 16)
    expected = model.up.weight.detach().flatten(1).t()
    torch.testing.assert_close(ffn.ups[0].weight_in_out(gm), expected)


def test_a_conv_with_a_wider_kernel_is_not_a_linear():
    model = PointwiseConvFFN(torch.nn.Conv1d)
    model.up = torch.nn.Conv1d(8, 16, 3, padding=1)
    structure = find_structure(moec.trace(model, (torch.randn(2, 8, 5),)))
    assert structure.blocks == [] and len(structure.linears) == 1


def _mish(x):
    return x * torch.tanh(torch.nn.functional.softplus(x))


def test_registered_activation_is_recognised_by_value(fresh_activations):
    gm = moec.trace(PlainFFN(_mish, gated=True), (torch.randn(2, 4, 8),))
    structure = find_structure(gm)
    assert structure.blocks == [] and "activation not recognised" in structure.rejected[0]
    moec.register_activation("mish", lambda x: x * torch.tanh(torch.log1p(torch.exp(x))))
    (block,) = find_structure(gm).blocks
    assert block.ffn.activation == "mish_glu" and block.ffn.ups[0].weight == "gate.weight"
    h = torch.randn(3, 4)
    torch.testing.assert_close(activate(h, "mish"), _mish(h))


@pytest.mark.parametrize(
    "name, fn, message",
    [
        ("silu", torch.sigmoid, "taken by a built-in"),
        ("swiglu", torch.sigmoid, "taken by a built-in"),
        ("not a name", torch.sigmoid, "identifier"),
        ("rowsoftmax", lambda x: torch.softmax(x, -1), "not elementwise"),
        ("halfwidth", lambda x: x[..., ::2], "input's shape"),
        ("detached", lambda x: x.detach().sign(), "differentiable"),
        ("broken", lambda x: x.no_such_method(), "failed on a float64 tensor"),
    ],
)
def test_register_activation_refuses_what_it_cannot_use(fresh_activations, name, fn, message):
    before = known_activations()
    with pytest.raises(ActivationError, match=message):
        moec.register_activation(name, fn)
    assert known_activations() == before


@pytest.mark.parametrize("split", ["chunk", "split", "slice"])
@pytest.mark.parametrize("up_first", [False, True])
def test_a_projection_split_in_halves_is_the_gate_and_the_up(split, up_first):
    model = HalvedProjection(split, up_first)
    gm = moec.trace(model, (torch.randn(2, 4, 8),))
    (block,) = find_structure(gm).blocks
    gate, up = block.ffn.ups
    assert block.ffn.activation == "swiglu" and block.ffn.hidden == 16
    assert gate.node is up.node  # one matmul, each site a half of it
    assert (gate.out_span, up.out_span) == (
        ((16, 32), (0, 16)) if up_first else ((0, 16), (16, 32))
    )
    assert gate.out_features == up.out_features == 16
    w = model.gate_up.weight.detach().t()
    torch.testing.assert_close(gate.weight_in_out(gm), w[:, slice(*gate.out_span)])
    torch.testing.assert_close(up.weight_in_out(gm), w[:, slice(*up.out_span)])


class PartOfAProjection(torch.nn.Module):
    """A projection of which the FFN reads two of three pieces."""

    def __init__(self):
        super().__init__()
        self.proj, self.down = torch.nn.Linear(8, 48), torch.nn.Linear(16, 8)

    def forward(self, x):
        gate, up, rest = self.proj(x).chunk(3, dim=-1)
        return x + self.down(torch.nn.functional.silu(gate) * up) + rest.sum(-1, keepdim=True)


def test_a_region_reading_part_of_a_projection_is_rejected_with_a_reason():
    structure = find_structure(moec.trace(PartOfAProjection(), (torch.randn(2, 4, 8),)))
    assert not structure.blocks
    assert any("reads part of" in reason for reason in structure.rejected), structure.rejected
