"""``moec::expert_mlp_combined`` on the CUDA kernels equals the float64 reference, fwd + bwd.

Under the default policy and with every piece forced onto the CuTe DSL (``"cute_glu"``: the down
dgrad then reads the output gradient's token rows through ``A_idx``, scales them by the route
weights and reduces the weights' gradient in its epilogue, which the test checks ran), with
n-major and k-major expert weights; routings with dropped routes and one expert taking every
row. Also: a layer step with the op raises no host sync.
"""

from __future__ import annotations

import pytest
import torch

from moec.kernels import cute_gemm, gemm_backend
from moec.ops.cuda import register_kernels
from tests.gpu.test_gathered_experts_gpu import (
    SHAPES,
    TOP_K,
    _forced,
    _rel,
    _routing,
    assert_layer_step_sync_free,
)
from tests.gpu.test_kernels_ops import layer_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_quack = pytest.mark.skipif(
    not gemm_backend.have_quack(), reason="quack-kernels (moec[cutlass]) is not installed"
)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert register_kernels()


def _k_major(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("backend", ["policy", pytest.param("cute_glu", marks=needs_quack)])
@pytest.mark.parametrize("layout", ["n_major", "k_major"])
@pytest.mark.parametrize("case", ["drops", "one_expert"])
@pytest.mark.parametrize("shape", SHAPES)
def test_combined_expert_mlp_equals_reference(monkeypatch, backend, layout, case, shape):
    experts, num_rows, dim, hidden = shape
    top_k = TOP_K[num_rows]
    tokens = num_rows // top_k
    rows, offsets = _routing(case, experts, tokens, top_k)
    masters = dict(device="cuda", dtype=torch.float32)
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
    weights = torch.rand(tokens, top_k, **masters).softmax(-1).requires_grad_()
    w_up = torch.randn(experts, dim, 2 * hidden, **masters) / dim**0.5
    w_down = torch.randn(experts, hidden, dim, **masters) / hidden**0.5
    if layout == "k_major":
        w_up, w_down = _k_major(w_up), _k_major(w_down)
    w_up, w_down = w_up.requires_grad_(), w_down.requires_grad_()
    fused = []
    original = cute_gemm.gmm_act_backward_combined

    def counted(*args, **kwargs):
        fused.append(True)
        return original(*args, **kwargs)

    monkeypatch.setattr(cute_gemm, "gmm_act_backward_combined", counted)
    leaves = (x, weights, w_up, w_down)
    with _forced(backend):
        out, _ = torch.ops.moec.expert_mlp_combined(
            x, rows, weights, w_up, w_down, offsets, "swiglu"
        )
        d_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, d_out)
    if backend == "cute_glu":  # forced: the weights went through the dgrad's epilogue
        assert fused == [True]

    ref = [t.detach().double().cpu().requires_grad_() for t in leaves]
    out_ref, _ = torch.ops.moec.expert_mlp_combined(
        ref[0], rows.cpu(), ref[1], ref[2], ref[3], offsets.cpu(), "swiglu"
    )
    ref_grads = torch.autograd.grad(out_ref, ref, d_out.double().cpu())
    tol = 2e-2
    assert _rel(out.cpu(), out_ref) < tol
    for name, g, r in zip(["x", "weights", "w_up", "w_down"], grads, ref_grads, strict=True):
        assert torch.isfinite(g).all(), name
        assert _rel(g.cpu(), r) < tol, name
    assert grads[2].stride() == w_up.stride() and grads[3].stride() == w_down.stride()
    assert (grads[1][rows < 0] == 0).all()  # dropped routes: no weight gradient


def _layer(x, router, w_up, w_down):
    ops = torch.ops.moec
    _, weights, rows, offsets, _ = ops.route(x @ router, 8, 1.25, "softmax", True, "learned")
    return ops.expert_mlp_combined(x, rows, weights, w_up, w_down, offsets, "swiglu")[0]


@pytest.mark.parametrize("backend", ["policy", pytest.param("cute_glu", marks=needs_quack)])
def test_combined_layer_step_is_sync_free(backend):
    """One forward + backward of a layer on the combined op (k-major weights, the compiler's
    default) under ``torch.cuda.set_sync_debug_mode("error")``."""
    assert_layer_step_sync_free(_layer, layer_inputs(k_major=True), backend)
