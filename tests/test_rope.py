"""``moec::rope`` equals the rotary expression, and ``fuse_rope`` finds it (Llama, HF Llama)."""

from __future__ import annotations

import pytest
import torch

import moec
from moec.ops.rope import rotate
from moec.passes.base import PassContext
from moec.passes.rope import FuseRopePass
from tests.models import compile_without, hf_model, tiny_llama, tokens


def _unfused(x, cos, sin):
    lo, hi = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-hi, lo), dim=-1) * sin


def test_op_equals_the_expression_on_a_transposed_view_and_its_gradient():
    x = torch.randn(2, 7, 3, 8).transpose(1, 2).requires_grad_()  # (B, H, S, D) view
    cos, sin = torch.randn(7, 8), torch.randn(1, 1, 7, 8)
    got = torch.ops.moec.rope(x, cos, sin, None)
    want = _unfused(x, cos, sin)
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(got, x, grad)[0],
                               torch.autograd.grad(want, x, grad)[0])  # fmt: skip
    half = torch.ops.moec.rope(x.detach(), cos, sin, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, want.detach().bfloat16())
    assert torch.allclose(rotate(x.detach(), cos, sin, backward=False), want)


def test_op_gradcheck_and_refuses_tables_that_need_a_gradient():
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True)
    cos, sin = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: torch.ops.moec.rope(x, cos, sin, None), (x,))
    with pytest.raises(ValueError, match="cos and sin must not require grad"):
        torch.ops.moec.rope(x, cos.requires_grad_(), sin, None)
    with pytest.raises(ValueError, match="even last dimension"):
        torch.ops.moec.rope(torch.randn(2, 5), torch.randn(5), torch.randn(5), None)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pass_fuses_llama_rope_and_keeps_the_step(dtype):
    torch.manual_seed(0)
    model, ids = tiny_llama(), tokens(2, 17)
    plan = {"moe": {"num_experts": 4, "top_k": 2, "dense_first": 1},
            "precision": {"compute_dtype": dtype}}  # fmt: skip
    fused, plain = (compile_without(model, (ids,), plan, s) for s in (None, "fuse_rope"))
    stats = fused.pass_results["fuse_rope"].stats
    assert stats["fused"] == 6  # q and k of 3 blocks
    assert stats["casts_folded"] == (3 if dtype == "bf16" else 0)  # q's cast before attention
    outs = [c(ids) for c in (fused, plain)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    grads = [torch.autograd.grad(o.float().square().mean(), list(c.parameters())) for o, c in
             zip(outs, (fused, plain))]  # fmt: skip
    scale = max(b.norm() for b in grads[1])
    for a, b in zip(*grads, strict=True):  # bf16: x's gradient rounded once instead of per branch
        assert (a - b).norm() <= (1e-6 if dtype == "fp32" else 2e-2) * (b.norm() + scale)


def test_pass_fuses_hf_llama_rope():
    model, ids = hf_model("llama"), tokens(2, 12)
    gm = moec.trace(model, (ids,))
    want = model(ids).logits
    result = FuseRopePass().run(gm, PassContext(moec.Plan()))
    assert result.stats["fused"] == 4  # q and k of 2 layers (slice halves, [B, 1, S, D] tables)
    torch.testing.assert_close(gm(ids)[0], want)


class _LearnedTables(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cos, self.sin = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        return _unfused(x, self.cos, self.sin)


def test_pass_leaves_rope_whose_tables_are_parameters():
    gm = moec.trace(_LearnedTables(), (torch.randn(2, 3, 8),))
    assert FuseRopePass().run(gm, PassContext(moec.Plan())).stats["fused"] == 0
