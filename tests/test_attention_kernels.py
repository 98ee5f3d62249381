"""``plan.lowering.attention: fa4`` (:mod:`moec.runtime.attention_kernels`) on the CPU, where
``moec::flash_attention`` runs its reference: the compiled program's attention runs as the op
(and only the attention FA4 takes), its outputs and gradients equal the default plan's, and the
passes still see SDPA."""

import copy
import warnings

import pytest
import torch
from torch._subclasses import FakeTensorMode
from torch.profiler import ProfilerActivity, profile

import moec
from moec.models.llama import Llama, LlamaConfig
from moec.plan import Plan, PlanError
from moec.runtime import attention_kernels
from tests.models import assert_same_grads, loss_and_grads, tokens

PLAN = {
    "moe": {"num_experts": 4, "top_k": 2, "dense_first": 1, "capacity_factor": None},
    "precision": {"compute_dtype": "bf16"},
}


def _ops(step) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return {e.name for e in prof.events() if "attention" in e.name}


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
    graphs = [m.graph for m in fa4.program.graph.modules() if isinstance(m, torch.fx.GraphModule)]
    assert any(n.target is attention_kernels.SDPA for g in graphs for n in g.nodes)  # passes'
    if recompute != "none":  # the attention ran inside the recomputed blocks' sub-graphs
        assert not any(n.target is attention_kernels.SDPA for n in graphs[0].nodes)


class _Masked(torch.nn.Module):
    """One attention FA4 takes and one it does not (an explicit mask)."""

    def forward(self, q, k, v):
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        masked = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return plain + masked


def test_only_attention_fa4_takes_is_swapped():
    q, k, v = (torch.randn(1, 2, 16, 32, dtype=torch.bfloat16) for _ in range(3))
    exported = torch.export.export(_Masked(), (q, k, v)).module()
    swapped, count = attention_kernels.with_fa4(exported, compute_half=True)
    assert count == 1
    targets = [n.target for n in swapped.graph.nodes if n.op == "call_function"]
    assert torch.ops.moec.flash_attention.default in targets
    assert attention_kernels.SDPA in targets  # the masked one stays SDPA
    torch.testing.assert_close(swapped(q, k, v), _Masked()(q, k, v), atol=2e-2, rtol=2e-2)
    assert attention_kernels.with_fa4(exported, compute_half=False)[1] == 1  # bf16 inputs
    fp32 = torch.export.export(_Masked(), tuple(t.float() for t in (q, k, v))).module()
    with pytest.warns(UserWarning, match=r"none of the program's 2 attention calls fits"):
        assert attention_kernels.with_fa4(fp32, compute_half=False) == (fp32, 0)


@pytest.mark.parametrize(
    "major, fa4_runs, want", [(9, True, True), (10, True, False), (9, False, False)]
)
def test_auto_runs_fa4_on_hopper_where_it_is_installed(monkeypatch, major, fa4_runs, want):
    with FakeTensorMode():  # a CUDA tensor's device, on a machine without one
        x = torch.empty(2, 4, dtype=torch.long, device="cuda")
    why = None if fa4_runs else "flash-attn-4 (flash_attn.cute) is not installed"
    monkeypatch.setattr(attention_kernels.fa4, "device_why_not", lambda device: why)
    monkeypatch.setattr(attention_kernels, "chip", lambda inputs: major)
    assert attention_kernels.wants_fa4(Plan.from_dict({}), [x]) is want  # auto, the default
    sdpa = Plan.from_dict({"lowering": {"attention": "sdpa"}})
    assert not attention_kernels.wants_fa4(sdpa, [x])
    # on the CPU auto keeps SDPA (fa4 runs the op's reference there: tests ask for it)
    assert not attention_kernels.wants_fa4(Plan.from_dict({}), [torch.zeros(2, 4)])


def test_auto_leaves_unfit_attention_on_sdpa_without_a_warning():
    q, k, v = (torch.randn(1, 2, 16, 32) for _ in range(3))
    fp32 = torch.export.export(_Masked(), (q, k, v)).module()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert attention_kernels.with_fa4(fp32, compute_half=False, asked=False) == (fp32, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fa4_plan_on_a_gpu_without_fa4_is_refused():  # pragma: no cover - GPU machines only
    x = torch.zeros(2, 4, dtype=torch.long, device="cuda")
    plan = Plan.from_dict({"lowering": {"attention": "fa4"}})
    probe = torch.empty(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    if attention_kernels.fa4.takes(probe, probe, probe, causal=True):
        assert attention_kernels.wants_fa4(plan, [x])
    else:
        with pytest.raises(PlanError, match="lowering.attention"):
            attention_kernels.wants_fa4(plan, [x])
