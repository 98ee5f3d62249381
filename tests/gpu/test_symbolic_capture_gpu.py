"""GPU: a program compiled on a CUDA machine keeps symbolic batch and sequence sizes.

Torch 2.11 on the GPU image specialized every capture's input sizes (RESULTS.md, sessions 11
and 12): its C++ ``matmul`` read the sizes of the router's 3-D ``linear`` as numbers when the moe
pass typed the new node outside the Python dispatcher. The plan search then priced every
microbatch size as the example's. The CPU wheel (2.13) never did, so this runs on the GPU image;
``cuda`` also covers CUDA's dispatch rules in the bf16 dtype analysis of ``shared_casts``."""

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
    if device == "meta":
        with torch.device(device):
            model, inputs, kwargs = load_model("llama")
    else:  # the zoo draws its example tokens from a CPU generator
        model, inputs, kwargs = load_model("llama")
        model, inputs = model.to(device), tuple(x.to(device) for x in inputs)
    model, inputs = with_next_token_loss(model, inputs, kwargs, "llama")
    program = build_program(model, _one_rank(plan), inputs, {}, verify=False)
    assert all(symbolic_input_dims(program.graph).values()), symbolic_input_dims(program.graph)
    cost = graph_cost(program)
    assert not cost.tokens.is_number
    batch = cost.example[cost.dims["batch"]]
    twice = cost.evaluate(batch=2 * batch).train_flops
    assert twice > 1.5 * cost.evaluate().train_flops
