import pytest
import torch

import moec
from moec.analysis.structure import find_structure
from tests.models import hf_model, tiny_gpt2, tiny_llama, tokens


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
