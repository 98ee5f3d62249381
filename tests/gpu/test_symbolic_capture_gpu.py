"""GPU: a program compiled on a CUDA machine keeps symbolic batch and sequence sizes.

On the CPU no pass sees CUDA's dispatch rules; on a CUDA machine the bf16 dtype analysis of
``shared_casts`` runs autocast on fake CUDA tensors, whose attention picks its backend by shape.
Torch 2.11 on an H200 specialized the e2e capture's input sizes there (RESULTS.md, session 11):
the plan search then priced every microbatch size as the example's."""

import pytest
import torch

from moec.analysis.cost import graph_cost
from moec.autoplan.cli import _one_rank
from moec.compiler import build_program
from moec.debug import with_next_token_loss
from moec.fx import symbolic_input_dims
from moec.models.zoo import load_model
from moec.plan import Plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("device", ["meta", "cuda"])
def test_bf16_compile_keeps_the_input_sizes_symbolic(device):
    plan = Plan.from_dict(
        {"moe": {"num_experts": 4, "top_k": 2}, "precision": {"compute_dtype": "bf16"}}
    )
    with torch.device(device):
        model, inputs, kwargs = load_model("llama")
    model, inputs = with_next_token_loss(model, inputs, kwargs, "llama")
    program = build_program(model, _one_rank(plan), inputs, {}, verify=False)
    assert all(symbolic_input_dims(program.graph).values()), symbolic_input_dims(program.graph)
    cost = graph_cost(program)
    assert not cost.tokens.is_number
    batch = cost.example[cost.dims["batch"]]
    twice = cost.evaluate(batch=2 * batch).train_flops
    assert twice > 1.5 * cost.evaluate().train_flops
