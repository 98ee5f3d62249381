"""The FA4 swap of pass ``bind`` (``plan.lowering.attention``) on the CPU, where
``moec::flash_attention`` runs its reference: the compiled program's attention runs as the op
(and only the attention FA4 takes), its outputs and gradients equal the default plan's, and the
swap is a node of the final program (recomputed blocks' sub-graphs included)."""

import copy
import dataclasses
import warnings

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import moec
from moec.frontend import capture
from moec.kernels.target import Target
from moec.models.llama import Llama, LlamaConfig
from moec.passes.base import PassContext
from moec.passes.bind import SDPA, BindPass, wants_fa4
from moec.plan import Plan, PlanError
from tests.models import assert_same_grads, loss_and_grads, tokens

PLAN = {
    "moe": {"num_experts": 4, "top_k": 2, "dense_first": 1, "capacity_factor": None},
    "precision": {"compute_dtype": "bf16"},
}
HOPPER = Target(device="cuda", arch="sm90", triton=True, quack=True, fa4=True)


def _ops(step) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return {e.name for e in prof.events() if "attention" in e.name}


def _graphs(compiled) -> list[torch.fx.Graph]:
    return [
        m.graph for m in compiled.program.graph.modules() if isinstance(m, torch.fx.GraphModule)
    ]


@pytest.mark.parametrize("recompute", ["none", "selective"])  # attention in recomputed blocks
def test_fa4_plan_runs_the_op_and_equals_sdpa(recompute):
    model = Llama(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128))
    x = tokens(batch=2, seq=32)
    plan = {**PLAN, "recompute": {"policy": recompute}}
    default = moec.compile(copy.deepcopy(model), plan, (x,))
    fa4 = moec.compile(model, {**plan, "lowering": {"attention": "fa4"}}, (x,))
    ran = _ops(lambda: loss_and_grads(fa4, x))
    assert "moec::flash_attention" in ran and "moec::flash_attention_backward" in ran, ran
    assert not any("scaled_dot_product" in name for name in ran), ran
    assert "moec::flash_attention" not in _ops(lambda: loss_and_grads(default, x))
    fa4.zero_grad(set_to_none=True)
    default.zero_grad(set_to_none=True)
    want, want_grads = loss_and_grads(default, x)
    got, got_grads = loss_and_grads(fa4, x)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-2)
    assert_same_grads(got_grads, want_grads, atol=2e-3, rtol=5e-2)
    nodes = [n for g in _graphs(fa4) for n in g.nodes]
    assert not any(n.target is SDPA for n in nodes)
    swapped = [n for n in nodes if n.target == torch.ops.moec.flash_attention.default]
    assert len(swapped) == 2 and {n.kwargs["impl"] for n in swapped} == {"reference"}
    if recompute != "none":  # the attention runs inside the recomputed blocks' sub-graphs
        assert not any(n in _graphs(fa4)[0].nodes for n in swapped)
    assert fa4.pass_results["bind"].stats["attention_swapped"] == 2
    assert any(n.target is SDPA for g in _graphs(default) for n in g.nodes)


class _Masked(torch.nn.Module):
    """One attention FA4 takes and one it does not (an explicit mask)."""

    def forward(self, q, k, v):
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        masked = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return plain + masked


def _bind(inputs: tuple, plan: dict, target: Target):
    program = capture(_Masked(), inputs)
    program.target = target
    result = BindPass().run(program.graph, PassContext(Plan.from_dict(plan), program))
    return result, [n.target for n in result.gm.graph.nodes if n.op == "call_function"]


def test_only_attention_fa4_takes_is_swapped():
    q, k, v = (torch.randn(2, 2, 16, 32, dtype=torch.bfloat16) for _ in range(3))
    fa4 = {"lowering": {"attention": "fa4"}}
    result, targets = _bind((q, k, v), fa4, Target())
    assert result.stats["attention_swapped"] == 1 and result.stats["attention_kept"] == 1
    assert torch.ops.moec.flash_attention.default in targets
    assert SDPA in targets  # the masked one stays SDPA
    (out,) = result.gm(q, k, v)
    torch.testing.assert_close(out, _Masked()(q, k, v), atol=2e-2, rtol=2e-2)
    fp32 = tuple(t.float() for t in (q, k, v))
    with pytest.warns(UserWarning, match=r"none of the program's 2 attention calls fits"):
        result, _ = _bind(fp32, fa4, Target())
    assert result.stats["attention_swapped"] == 0


@pytest.mark.parametrize(
    "target, want",
    [(HOPPER, True), (dataclasses.replace(HOPPER, arch="sm100"), False),
     (dataclasses.replace(HOPPER, fa4=False), False), (Target(), False)],
)  # fmt: skip
def test_auto_runs_fa4_on_hopper_where_it_is_installed(target, want):
    assert wants_fa4(Plan.from_dict({}), target) is want  # auto, the default
    assert not wants_fa4(Plan.from_dict({"lowering": {"attention": "sdpa"}}), target)


def test_fa4_asked_of_a_cuda_target_without_it_is_refused_and_of_the_cpu_runs_the_reference():
    fa4 = Plan.from_dict({"lowering": {"attention": "fa4"}})
    with pytest.raises(PlanError, match="lowering.attention"):
        wants_fa4(fa4, dataclasses.replace(HOPPER, fa4=False))
    assert wants_fa4(fa4, Target()) and Target().implementation("flash_attention") == "reference"
    assert HOPPER.implementation("flash_attention") == "fa4"


def test_auto_leaves_unfit_attention_on_sdpa_without_a_warning():
    fp32 = tuple(torch.randn(2, 2, 16, 32) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result, targets = _bind(fp32, {}, HOPPER)
    assert result.stats["attention_swapped"] == 0 and targets.count(SDPA) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fa4_plan_on_a_gpu_without_fa4_is_refused():  # pragma: no cover - GPU machines only
    plan = Plan.from_dict({"lowering": {"attention": "fa4"}})
    target = Target.detect("cuda")
    if target.fa4:
        assert wants_fa4(plan, target)
    else:
        with pytest.raises(PlanError, match="lowering.attention"):
            wants_fa4(plan, target)
