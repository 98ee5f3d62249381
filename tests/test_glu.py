"""``moec::glu`` equals the gated activation, and ``fuse_glu`` finds dense gated FFNs (the bundled
Llama's dense blocks and shared experts, HF Llama) and leaves ungated ones (GPT-2) alone."""

from __future__ import annotations

import pytest
import torch

import moec
from moec.analysis.cost import graph_cost
from moec.ops.activations import activate
from moec.passes.base import PassContext
from moec.passes.glu import FuseGluPass
from tests.models import HalvedProjection, compile_without, hf_model, tiny_gpt2, tiny_llama, tokens

GATED = ["swiglu", "geglu", "geglu_tanh", "reglu"]


@pytest.mark.parametrize("activation", GATED)
def test_op_equals_the_activation_and_its_gradient(activation):
    h = torch.randn(2, 5, 12, requires_grad=True)
    got = torch.ops.moec.glu(h, activation)
    want = activate(h.reshape(-1, 12), activation).view(2, 5, 6)
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(got, h, grad)[0],
                               torch.autograd.grad(want, h, grad)[0])  # fmt: skip


def test_op_gradcheck_and_errors():
    h = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h: torch.ops.moec.glu(h, "swiglu"), (h,))
    with pytest.raises(ValueError, match="needs a gated activation"):
        torch.ops.moec.glu(h, "silu")
    with pytest.raises(ValueError, match="even last dimension"):
        torch.ops.moec.glu(torch.randn(3, 5), "swiglu")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pass_fuses_dense_blocks_and_shared_experts_and_keeps_the_step(dtype):
    torch.manual_seed(0)
    model, ids = tiny_llama(), tokens(2, 17)
    plan = {"moe": {"num_experts": 4, "top_k": 2, "dense_first": 1, "shared_expert": True},
            "precision": {"compute_dtype": dtype}}  # fmt: skip
    fused, plain = (compile_without(model, (ids,), plan, s) for s in (None, "fuse_glu"))
    assert fused.pass_results["fuse_glu"].stats["fused"] == 3  # 1 dense FFN + 2 shared experts
    assert sum(n.target == torch.ops.moec.glu.default for n in fused.graph_module.graph.nodes) == 3
    for compiled in (fused, plain):  # blocks still found: through the fused form and bf16 casts
        blocks = graph_cost(compiled.program).blocks
        assert [(b.path, b.ffn.activation) for b in blocks] == [
            ("layers.0", "swiglu"), ("layers.1", "swiglu"), ("layers.2", "swiglu")
        ]  # fmt: skip
    outs = [c(ids) for c in (fused, plain)]
    tol = 1e-5 if dtype == "fp32" else 2e-2
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)
    grads = [torch.autograd.grad(o.float().square().mean(), list(c.parameters())) for o, c in
             zip(outs, (fused, plain))]  # fmt: skip
    scale = max(b.norm() for b in grads[1])
    for a, b in zip(*grads, strict=True):
        assert (a - b).norm() <= (1e-5 if dtype == "fp32" else 2e-2) * (b.norm() + scale)


def test_pass_fuses_hf_llama_and_leaves_gpt2():
    model, ids = hf_model("llama"), tokens(2, 12)
    gm = moec.trace(model, (ids,))
    want = model(ids).logits
    stats = FuseGluPass().run(gm, PassContext(moec.Plan())).stats
    assert stats == {"fused": 2, "activations": {"swiglu": 2}}
    torch.testing.assert_close(gm(ids)[0], want, rtol=1e-5, atol=1e-5)
    gpt2 = moec.trace(tiny_gpt2(), (tokens(),))
    assert FuseGluPass().run(gpt2, PassContext(moec.Plan())).stats["fused"] == 0


class _BiasedGeGLU(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = (torch.nn.Linear(8, 16), torch.nn.Linear(8, 16),
                                         torch.nn.Linear(16, 8))  # fmt: skip

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.gate(x), approximate="tanh") * self.up(x))


def test_pass_concatenates_biases_and_keeps_gradients():
    model, x = _BiasedGeGLU(), torch.randn(3, 5, 8)
    gm = moec.trace(model, (x,))
    stats = FuseGluPass().run(gm, PassContext(moec.Plan())).stats
    assert stats == {"fused": 1, "activations": {"geglu_tanh": 1}}
    want = model(x)
    got = gm(x)[0]
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), list(gm.parameters()))
    reference = torch.autograd.grad(want.square().sum(), list(model.parameters()))
    expected = dict(zip([n for n, _ in model.named_parameters()], reference, strict=True))
    for (name, _), grad in zip(gm.named_parameters(), grads, strict=True):
        torch.testing.assert_close(grad, expected[name], msg=name)


@pytest.mark.parametrize("split", ["chunk", "split", "slice"])
@pytest.mark.parametrize("up_first", [False, True])
def test_pass_joins_a_projection_split_in_halves_with_the_gate_first(split, up_first):
    model, x = HalvedProjection(split, up_first), torch.randn(3, 5, 8)
    gm = moec.trace(model, (x,))
    stats = FuseGluPass().run(gm, PassContext(moec.Plan())).stats
    # moec.glu reads [gate | up]: a projection with the up half first stays as it is
    assert stats["fused"] == (0 if up_first else 1)
    glus = [n for n in gm.graph.nodes if n.target == torch.ops.moec.glu.default]
    assert len(glus) == stats["fused"]
    splits = {torch.ops.aten.chunk.default, torch.ops.aten.split_with_sizes.default}
    assert any(n.target in splits for n in gm.graph.nodes) == (up_first and split != "slice")
    want = model(x)
    got = gm(x)[0]
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), list(gm.parameters()))
    reference = torch.autograd.grad(want.square().sum(), list(model.parameters()))
    for grad, expected in zip(grads, reference, strict=True):
        torch.testing.assert_close(grad, expected)
