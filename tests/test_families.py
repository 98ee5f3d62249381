"""transformers families: each compiles to an MoE program in float32, bf16 and MXFP8 and trains.

Every family in ``tests.models.HF_FAMILIES`` (Llama, Qwen2, Qwen3, Mistral, OLMo-2, Phi,
GPT-NeoX, Gemma, and Phi-3 and GLM, whose FFNs split one gate/up projection in halves) at the
same tiny shape; ``MORE_FAMILIES`` (31 more) in float32 and bf16, in the slow set. Under ``init:
upcycle`` with normalized route weights and no capacity limit the MoE equals the dense model at
init, so the float32 program's logits equal the dense model's and the bf16 programs' loss is
the dense loss up to bf16 rounding. One training step: finite gradients on every parameter that
has one, non-zero ones on the experts, and a finite loss after an SGD update that changed the
parameters. The cases that test no mechanism another fast case does not are marked slow (see
the sets below).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import moec
from moec.train import LanguageModelWithLoss, language_model_loss
from tests.models import HF_FAMILIES, MORE_FAMILIES, hf_family, tokens, train_one_step

MOE = {"num_experts": 4, "top_k": 2, "capacity_factor": None, "init": "upcycle"}
PRECISIONS = {
    "bf16": {"compute_dtype": "bf16"},
    "mxfp8": {"compute_dtype": "bf16", "gemm": "mxfp8"},
}
LOSS_TOLERANCE = {"bf16": 0.02, "mxfp8": 0.05}
"""|program loss - dense float32 loss| at init, on a loss of ~ln(256) = 5.5."""
LLAMA_BLOCK = {"llama", "qwen2", "mistral"}
"""Llama's block (Qwen2 adds q/k/v biases, Mistral a sliding window): their float32 programs run
in the slow set (every run captures Llama and Qwen2 in ``tests/test_frontend.py``)."""
RETYPING = {"qwen3", "olmo2", "phi"}
"""Families whose bf16 programs change dtypes inside a block: q/k norms that upcast a bf16
projection (Qwen3), a norm after the FFN (OLMo-2), a dropout after it (Phi); the other bf16
programs run in the slow set."""
MXFP8 = ["llama", "phi"]
"""A gated bias-free FFN and a plain one with biases (the MXFP8 rewrite sees nothing else); slow."""


def _case(*values: str, fast: bool) -> object:
    return pytest.param(*values, marks=() if fast else pytest.mark.slow)


FLOAT32 = [_case(f, fast=f not in LLAMA_BLOCK) for f in HF_FAMILIES]
FLOAT32 += [_case(f, fast=False) for f in MORE_FAMILIES]
LOW_PRECISION = [_case("bf16", f, fast=f in RETYPING) for f in HF_FAMILIES]
LOW_PRECISION += [_case("bf16", f, fast=False) for f in MORE_FAMILIES]
LOW_PRECISION += [_case("mxfp8", f, fast=False) for f in MXFP8]


def _train_one_step(compiled: torch.nn.Module, loss_of: Callable[[], torch.Tensor]) -> None:
    assert len(train_one_step(compiled, loss_of)) == 4  # w_up and w_down of two MoE blocks


@pytest.mark.parametrize("family", FLOAT32)
def test_fp32_program_equals_the_dense_model_and_trains(family):
    model = hf_family(family)
    ids, other = tokens(2, 16), tokens(3, 11)
    with torch.no_grad():
        dense = model(input_ids=other).logits
    compiled = moec.compile(model, {"moe": MOE}, (), {"input_ids": ids})
    assert compiled.pass_results["moe"].stats["ffns_replaced"] == 2
    logits = compiled(input_ids=other).logits
    torch.testing.assert_close(logits, dense, rtol=1e-4, atol=1e-5)
    targets = tokens(2, 16)
    _train_one_step(
        compiled,
        lambda: F.cross_entropy(compiled(input_ids=ids).logits.flatten(0, 1), targets.flatten()),
    )


@pytest.mark.parametrize(("precision", "family"), LOW_PRECISION)
def test_low_precision_program_trains(precision, family):
    model = hf_family(family)
    ids = tokens(2, 17)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        dense = language_model_loss(model(inputs), targets)
    plan = {"moe": MOE, "precision": PRECISIONS[precision]}
    compiled = moec.compile(LanguageModelWithLoss(model), plan, (inputs, targets))
    assert "shared_casts" in compiled.pass_results
    loss = compiled(inputs, targets)
    assert abs(float(loss.detach()) - float(dense)) < LOSS_TOLERANCE[precision]
    _train_one_step(compiled, lambda: compiled(inputs, targets))
