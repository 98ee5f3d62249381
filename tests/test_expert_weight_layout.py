"""``lowering.expert_weights``: the routed experts' weights n-major or k-major.

The layout changes strides only: a k-major program computes the n-major program's loss and
gradients (up to the GEMMs' summation order), its working copies, gradients and optimizer
state keep the parameters' strides, and a step of moec's AdamW moves both alike. Plans that
cannot hold k-major weights say so (or ``auto`` avoids it)."""

from __future__ import annotations

import copy

import pytest
import torch

import moec
from moec.optim import AdamW
from moec.plan import Plan, PlanError
from moec.train import LanguageModelWithLoss
from tests.models import tiny_llama, tokens

MOE = {"num_experts": 4, "top_k": 2, "dense_first": 1, "shared_expert": True}


def _plan(layout: str, dtype: str = "bf16", **sections) -> dict:
    return {
        "moe": MOE,
        "precision": {"compute_dtype": dtype},
        "lowering": {"expert_weights": layout},
        **sections,
    }


def _k_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.transpose(1, 2).is_contiguous()


def test_auto_takes_k_major_unless_fsdp_shards_the_experts_or_they_run_in_fp8():
    assert Plan.from_dict(_plan("auto")).expert_weights_k_major()
    assert not Plan.from_dict(_plan("n_major")).expert_weights_k_major()
    sharded = {"dp": 4, "dp_shard": 4, "ep": 2}
    assert not Plan.from_dict(_plan("auto", parallel=sharded)).expert_weights_k_major()
    fp8 = {"gemm": "fp8_rowwise", "scope": ["routed_experts"], "compute_dtype": "bf16"}
    assert not Plan.from_dict({**_plan("auto"), "precision": fp8}).expert_weights_k_major()
    shared_only = {**fp8, "scope": ["shared_expert"]}
    assert Plan.from_dict({**_plan("auto"), "precision": shared_only}).expert_weights_k_major()
    with pytest.raises(PlanError, match=r"lowering\.expert_weights.*shards split dim 1"):
        Plan.from_dict(_plan("k_major", parallel=sharded))
    with pytest.raises(PlanError, match=r"lowering\.expert_weights"):
        Plan.from_dict(_plan("column_major"))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_k_major_program_trains_as_the_n_major_one(dtype):
    ids = tokens(2, 17)
    args = (ids[:, :-1], ids[:, 1:])
    torch.manual_seed(0)
    model = LanguageModelWithLoss(tiny_llama(2))
    programs = {
        layout: moec.compile(copy.deepcopy(model), _plan(layout, dtype), args)
        for layout in ("n_major", "k_major")
    }
    stats = {k: p.pass_results["moe"].stats["expert_weights"] for k, p in programs.items()}
    assert stats == {"n_major": "n_major", "k_major": "k_major"}
    tol = {"bf16": dict(rtol=2e-2, atol=2e-3), "fp32": dict(rtol=1e-5, atol=1e-6)}[dtype]
    # eps above the gradients' rounding noise: with a tiny eps AdamW's first update is
    # lr * sign(g), which a last-bit difference in a near-zero gradient flips
    optimizers = {k: AdamW(p.parameters(), lr=1e-2, eps=1e-3, working_weights=p.working_weights)
                  for k, p in programs.items()}  # fmt: skip
    losses = {k: [] for k in programs}
    grads = {}
    for step in range(2):  # the second step reads the parameters (and copies) AdamW wrote
        for layout, program in programs.items():
            loss = program(*args)
            loss.backward()
            losses[layout].append(loss.detach())
            if step == 0:
                grads[layout] = {n: p.grad.float() for n, p in program.named_parameters()}
            optimizers[layout].step()
            if step == 0:
                _check_layouts(program, optimizers[layout], k_major=layout == "k_major")
            optimizers[layout].zero_grad()
    torch.testing.assert_close(losses["k_major"], losses["n_major"], **tol)
    for name, grad in grads["k_major"].items():
        torch.testing.assert_close(grad, grads["n_major"][name], **tol, msg=name)
    want = dict(programs["n_major"].named_parameters())
    for name, param in programs["k_major"].named_parameters():
        torch.testing.assert_close(param, want[name], **tol, msg=name)


def _check_layouts(program, optimizer: AdamW, k_major: bool) -> None:
    """Expert weights, their gradients, moments and working copies all in one layout."""
    gm = program.graph_module
    experts = {n: p for n, p in gm.named_parameters() if n.endswith(("moe.w_up", "moe.w_down"))}
    assert len(experts) == 2
    copies = program.working_weights
    for name, param in experts.items():
        assert _k_major(param) == k_major and (k_major or param.is_contiguous()), name
        assert param.grad.stride() == param.stride(), name
        if copies is not None:
            assert copies.copy_of(param).stride() == param.stride(), name
        for moment in ("exp_avg", "exp_avg_sq"):
            assert optimizer.state[param][moment].stride() == param.stride(), name
