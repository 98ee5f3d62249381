"""Pass ``working_weights`` + ``WorkingWeights`` + ``moec.optim.AdamW`` on the CPU.

The program reads persistent bf16 copies instead of casting parameters every step: the step's
loss and gradients equal the program without the pass bit for bit, the copies follow every
change of their parameters, and moec's AdamW equals torch's (its Triton path is compared under
the interpreter in ``test_kernels_cpu`` and on the GPU in ``tests/gpu``).
"""

from __future__ import annotations

import copy

import pytest
import torch

import moec
from moec.analysis.structure import find_structure
from moec.ops.working_weights import working_copy
from moec.optim import AdamW
from moec.train import LanguageModelWithLoss
from tests.models import compile_without, tiny_llama, tokens

PLAN = {
    "moe": {"num_experts": 4, "top_k": 2, "dense_first": 1, "shared_expert": True},
    "precision": {"compute_dtype": "bf16"},
}


def _pair():
    """(with the pass, without it) on one model and batch."""
    ids = tokens(2, 17)
    args = (ids[:, :-1], ids[:, 1:])
    torch.manual_seed(0)
    model = LanguageModelWithLoss(tiny_llama(2))
    with_copies = moec.compile(copy.deepcopy(model), PLAN, args)
    with_copies.working_weights.keep_gradients(with_copies.parameters())  # as moec's AdamW does
    without = compile_without(model, args, PLAN, "working_weights")
    return with_copies, without, args


def _grads(compiled) -> list[torch.Tensor]:
    return [p.grad for p in compiled.parameters()]


def test_copies_replace_every_cast_parameter_and_keep_the_step():
    ours, plain, args = _pair()
    gm = ours.graph_module
    copies = ours.program.working_weights
    names = {n for group in copies.values() for n in group}
    # expert weights (cast inside expert_mlp before), the fused head, the fused GLU's pair
    assert any(n.endswith("moe.w_up") for n in names) and any("lm_head" in n for n in names)
    assert any(len(group) == 2 for group in copies.values())
    assert not any("norm" in n or "embed" in n for n in names)  # read in float32 as well
    assert not any(
        n.target == torch.ops.aten._to_copy.default and n.args[0].op == "get_attr"
        for n in gm.graph.nodes
    )
    assert sum(n.target is working_copy for n in gm.graph.nodes) == len(copies)
    # the analyses see the parameters through their copies (recompute and pipeline use them)
    found = [find_structure(c.graph_module) for c in (ours, plain)]
    assert [len(f.blocks) for f in found] == [2, 2]
    assert [s.weight for s in found[0].linears] == [s.weight for s in found[1].linears]
    losses = []
    for compiled in (ours, plain):
        loss = compiled(*args)
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    by_name = dict(plain.named_parameters())
    for name, param in ours.named_parameters():
        cast = name.removeprefix("graph_module.") in names
        assert param.grad.dtype == (torch.bfloat16 if cast else torch.float32), name
        assert torch.equal(param.grad.float(), by_name[name].grad), name


@pytest.mark.slow
def test_copies_follow_their_parameters_and_accumulate_in_float32():
    ours, plain, args = _pair()
    for compiled in (ours, plain):  # any optimizer: torch's own writes the parameters in place
        compiled(*args).backward()
        torch.optim.SGD(compiled.parameters(), lr=0.5).step()
    assert ours.working_weights.refresh() == len(ours.working_weights)  # all stale after a step
    with torch.no_grad():  # a parameter without a copy changes: no copy is rewritten
        ours.graph_module.get_parameter("model.embed.weight").mul_(1.0)
    assert ours.working_weights.refresh() == 0
    ours.working_weights.invalidate()  # e.g. after writes through .data
    assert ours.working_weights.refresh() == len(ours.working_weights)
    for layer in (ours, plain):
        with torch.no_grad():
            layer.graph_module.get_parameter("model.lm_head.weight").mul_(0.5)
    assert torch.equal(ours(*args), plain(*args))

    plan = {**PLAN, "parallel": {"microbatches": 2}}
    accumulating = moec.compile(LanguageModelWithLoss(tiny_llama(2)), plan, args)
    accumulating(*args).backward()
    dtypes = {p.grad.dtype for p in accumulating.parameters()}
    assert dtypes == {torch.float32}


def test_float32_plans_have_no_copies():
    ids = tokens(2, 9)
    plan = {**PLAN, "precision": {"compute_dtype": "fp32"}}
    compiled = moec.compile(LanguageModelWithLoss(tiny_llama(2)), plan, (ids[:, :-1], ids[:, 1:]))
    assert "working_weights" not in compiled.pass_results and compiled.working_weights is None


def test_working_copy_checks_shapes():
    with pytest.raises(ValueError, match="row concatenation"):
        working_copy(torch.zeros(3, 4, dtype=torch.bfloat16), [torch.zeros(2, 4)])


@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_adamw_equals_torch_on_the_cpu(with_scale, grad_dtype):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(2)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p in params:
        p.grad_dtype = grad_dtype  # bf16: a working weight's gradient
    kwargs = {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1}
    ours, theirs = AdamW(params, **kwargs), torch.optim.AdamW(twins, foreach=False, **kwargs)
    for _ in range(3):
        scale = torch.tensor(2.5)
        for p, t in zip(params, twins, strict=True):
            g = torch.randn(5, 3).to(grad_dtype)
            p.grad, t.grad = g, g.float() / scale if with_scale else g.float()
        if with_scale:
            ours.grad_scale = scale  # what clip_gradients_ hands over
        ours.step()
        theirs.step()
        assert ours.grad_scale is None
    for p, t in zip(params, twins, strict=True):
        assert torch.equal(p, t)
    assert ours.state_dict()["state"][0].keys() == theirs.state_dict()["state"][0].keys()


def test_adamw_torch_only_options_need_gradients_in_the_parameter_dtype():
    param = torch.nn.Parameter(torch.randn(4))
    param.grad_dtype = torch.bfloat16
    param.grad = torch.randn(4).bfloat16()
    optimizer = AdamW([{"params": [param], "amsgrad": True}])
    with pytest.raises(ValueError, match="amsgrad, maximize"):
        optimizer.step()
