"""``moec::expert_mlp`` with the combine inside, on the CUDA kernels, equals the float64
reference, fwd + bwd.

Under the default policy and with every piece forced onto the CuTe DSL (``impl`` ``kernels:cute``
/ ``kernels:cute_glu``: the up projection reads the token rows through ``A_idx``; the down dgrad
reads the output gradient's token rows, scales them by the route weights and reduces the
weights' gradient in its epilogue, which the test checks ran), with n-major and k-major expert
weights; routings with dropped routes, empty experts and one expert taking every row. Also: a
layer step with the op raises no host sync.
"""

from __future__ import annotations

import pytest
import torch

from moec.kernels import cute_gemm
from moec.ops.routing import assign_rows
from moec.runtime.metrics import run_without_host_sync
from tests.gpu.test_kernels_ops import POLICY, TARGET, _rel, layer_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_quack = pytest.mark.skipif(
    not TARGET.quack, reason="quack-kernels (moec[cutlass]) is not installed"
)
SHAPES = [(8, 1000, 128, 96), (32, 8192, 512, 384)]
"""(experts, buffer rows R = T*K, D, H), as tests/gpu/test_kernels_ops.py's CuTe DSL cases."""
TOP_K = {1000: 4, 8192: 8}


def _impl(backend: str) -> str:
    """``policy``: what this GPU binds; else that backend forced for every piece."""
    return POLICY if backend == "policy" else f"kernels:{backend}"


def _routing(case: str, experts: int, tokens: int, top_k: int) -> tuple[torch.Tensor, ...]:
    """(rows [T, K], offsets [N] int32) on the device: ``drops`` (capacity below the load),
    ``empty_experts`` (two of every three experts get nothing; K is at most the experts left),
    ``one_expert`` (every route to expert N/2, no drops)."""
    if case == "one_expert":
        ids = torch.full((tokens, top_k), experts // 2)
        cap = tokens * top_k
    else:
        scores = torch.randn(tokens, experts)
        if case == "empty_experts":
            keep = torch.zeros(experts, dtype=torch.bool)
            keep[1::3] = True
            scores[:, ~keep] -= 100.0
            top_k = min(top_k, int(keep.sum()))
        ids = scores.topk(top_k, dim=-1).indices
        cap = max(1, int(0.8 * tokens * top_k / experts)) if case == "drops" else tokens * top_k
    rows, offsets, _ = assign_rows(ids, experts, cap)
    return rows.cuda(), offsets.cuda()


def _k_major(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize(
    "backend", ["policy", *(pytest.param(b, marks=needs_quack) for b in ("cute", "cute_glu"))]
)
@pytest.mark.parametrize("layout", ["n_major", "k_major"])
@pytest.mark.parametrize("case", ["drops", "empty_experts", "one_expert"])
@pytest.mark.parametrize("shape", SHAPES)
def test_combined_expert_mlp_equals_reference(monkeypatch, backend, layout, case, shape):
    experts, num_rows, dim, hidden = shape
    top_k = TOP_K[num_rows]
    tokens = num_rows // top_k
    rows, offsets = _routing(case, experts, tokens, top_k)
    masters = dict(device="cuda", dtype=torch.float32)
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
    # one weight per route: empty_experts routes to fewer experts than top_k where few are left
    weights = torch.rand(tokens, rows.shape[1], **masters).softmax(-1).requires_grad_()
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
    out, _ = _combined(x, rows, weights, w_up, w_down, offsets, _impl(backend))
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, d_out)
    if backend == "cute_glu":  # forced: the weights went through the dgrad's epilogue
        assert fused == [True]

    ref = [t.detach().double().cpu().requires_grad_() for t in leaves]
    out_ref, _ = _combined(ref[0], rows.cpu(), ref[1], ref[2], ref[3], offsets.cpu(), "reference")
    ref_grads = torch.autograd.grad(out_ref, ref, d_out.double().cpu())
    tol = 2e-2
    assert _rel(out.cpu(), out_ref) < tol
    for name, g, r in zip(["x", "weights", "w_up", "w_down"], grads, ref_grads, strict=True):
        assert torch.isfinite(g).all(), name
        assert _rel(g.cpu(), r) < tol, name
    assert grads[2].stride() == w_up.stride() and grads[3].stride() == w_down.stride()
    assert (grads[1][rows < 0] == 0).all()  # dropped routes: no weight gradient


def _combined(x, rows, weights, w_up, w_down, offsets, impl):
    return torch.ops.moec.expert_mlp(
        x, w_up, w_down, offsets, None, None, "swiglu", "bf16", rows, weights, impl
    )


@pytest.mark.parametrize("backend", ["policy", pytest.param("cute_glu", marks=needs_quack)])
def test_combined_layer_step_is_sync_free(backend):
    """One forward + backward of a layer on the op with the combine inside (k-major weights,
    the compiler's default) under ``torch.cuda.set_sync_debug_mode("error")``; every gradient
    finite."""
    x, router, w_up, w_down = layer_inputs(k_major=True)

    def step():
        ops = torch.ops.moec
        _, weights, rows, offsets, _ = ops.route(x @ router, 8, 1.25, "softmax", True, "learned")
        out = _combined(x, rows, weights, w_up, w_down, offsets, _impl(backend))[0]
        out.float().square().mean().backward()

    for _ in range(3):  # warm-up: autotuning and compilation may sync
        step()
    run_without_host_sync(step, 1)
    torch.cuda.synchronize()
    assert all(torch.isfinite(t.grad).all() for t in (x, w_up, w_down))
