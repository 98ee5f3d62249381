"""GPU: ``plan.lowering.attention = "fa4"`` (FlashAttention 4's kernels, where flash-attn-4 is
installed) and ``"auto"`` (FA4 on Hopper where it is installed, else torch's order) give torch's
SDPA's outputs and gradients (bf16 tolerance), run the kernels they name, and their steps never
sync the host."""

import copy

import pytest
import torch

import moec
from moec.kernels import flash_attention as fa4
from moec.kernels.target import Target
from moec.models.llama import Llama, LlamaConfig
from moec.passes.bind import AUTO_ARCHS
from moec.runtime.metrics import run_without_host_sync
from tests.models import tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PLAN = {
    "moe": {"num_experts": 4, "top_k": 2, "dense_first": 1, "capacity_factor": None},
    "precision": {"compute_dtype": "bf16"},
}


def _step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.float().square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _attention_ops(step) -> set[str]:
    """The aten attention ops one ``step()`` dispatched to (profiler op names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return {e.name for e in prof.events() if "attention" in e.name}


def _auto_runs_fa4() -> bool:
    """Whether ``auto`` runs FA4 on this GPU: an arch of AUTO_ARCHS where FA4 runs."""
    target = Target.detect("cuda")
    return target.arch in AUTO_ARCHS and target.fa4


@pytest.mark.parametrize(
    "backend, kernel",
    [
        pytest.param(
            "fa4",
            "moec::flash_attention_backward",
            marks=pytest.mark.skipif(not fa4.installed(), reason="needs flash-attn-4"),
        ),
        ("auto", None),
    ],
)
def test_attention_backend_equals_the_default(backend, kernel):
    torch.manual_seed(0)
    config = LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=512)
    model = Llama(config).cuda()  # head dim 64: in every backend's range
    x = tokens(batch=4, seq=256).cuda()
    sdpa = {**PLAN, "lowering": {"attention": "sdpa"}}
    default = moec.compile(copy.deepcopy(model), sdpa, (x,), verify=False)
    plan = {**PLAN, "lowering": {"attention": backend}}
    chosen = moec.compile(model, plan, (x,), verify=False)
    want, want_grads = _step(default, x)
    got, got_grads = _step(chosen, x)
    ran = _attention_ops(lambda: _step(chosen, x))
    if kernel is None:  # auto
        assert any("moec::flash_attention" in name for name in ran) == _auto_runs_fa4(), ran
    else:
        assert any(kernel in name for name in ran), ran
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=3e-2, rtol=5e-2)
    run_without_host_sync(lambda: _step(chosen, x)[0], 1)
