"""``moec::expert_mlp_gathered`` on the CUDA kernels equals the float64 reference, fwd + bwd.

Under every piece forced onto the CuTe DSL (``"cute"``, ``"cute_glu"``: the up GEMM and its
wgrad read token rows through quack's ``A_idx``, which the test checks ran) and under the default
policy (which gathers the buffer below the CuTe DSL's row thresholds). Routings with dropped
routes, empty experts and one expert taking every row; rows past ``offsets[-1]`` get output
gradients of 1e4 that must not reach any result. Also: a layer step with the op raises no host sync.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from moec.kernels import cute_gemm, gemm_backend, grouped_gemm
from moec.ops.cuda import kernel_activation, register_kernels
from moec.ops.gathered_experts import row_sources
from moec.ops.routing import assign_rows
from moec.runtime.metrics import run_without_host_sync
from tests.gpu.test_kernels_ops import layer_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_quack = pytest.mark.skipif(
    not gemm_backend.have_quack(), reason="quack-kernels (moec[cutlass]) is not installed"
)
SHAPES = [(8, 1000, 128, 96), (32, 8192, 512, 384)]
"""(experts, buffer rows R = T*K, D, H), as tests/gpu/test_kernels_ops.py's CuTe DSL cases."""
TOP_K = {1000: 4, 8192: 8}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert register_kernels()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12)).item()


def _routing(case: str, experts: int, tokens: int, top_k: int) -> tuple[torch.Tensor, ...]:
    """(rows [T, K], offsets [N] int32) on the device: ``drops`` (capacity below the load),
    ``empty_experts`` (two of every three experts get nothing), ``one_expert`` (every route to
    expert N/2, no drops)."""
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


class _Calls:
    """Counts the gathered CuTe DSL calls (the token rows read through ``A_idx``)."""

    def __init__(self, monkeypatch):
        self.counts = {"up": 0, "wgrad": 0}
        for name, key, position in (
            ("gmm", "up", 3),
            ("gmm_act", "up", 4),
            ("gmm_wgrad", "wgrad", 4),
        ):
            original = getattr(cute_gemm, name)

            def counted(*args, _original=original, _key=key, _at=position, **kwargs):
                sources = args[_at] if len(args) > _at else kwargs.get("sources")
                self.counts[_key] += sources is not None
                return _original(*args, **kwargs)

            monkeypatch.setattr(cute_gemm, name, counted)


def _forced(backend: str):
    return contextlib.nullcontext() if backend == "policy" else gemm_backend.forced_backend(backend)


@pytest.mark.parametrize(
    "backend", ["policy", *(pytest.param(b, marks=needs_quack) for b in ("cute", "cute_glu"))]
)
@pytest.mark.parametrize("activation", ["swiglu", "silu", "gelu"])
@pytest.mark.parametrize("case", ["drops", "empty_experts", "one_expert"])
@pytest.mark.parametrize("shape", SHAPES)
def test_gathered_expert_mlp_equals_reference(monkeypatch, backend, activation, case, shape):
    _check_gathered(monkeypatch, backend, activation, case, shape, k_major=False)


@pytest.mark.parametrize("backend", ["policy", pytest.param("cute_glu", marks=needs_quack)])
@pytest.mark.parametrize("case", ["drops", "one_expert"])
@pytest.mark.parametrize("shape", SHAPES)
def test_gathered_expert_mlp_with_k_major_weights(monkeypatch, backend, case, shape):
    """The compiler's default layout (``lowering.expert_weights``): the gathered up projection
    reads w_up's ``[gate | up]`` dim as pairs, its gradients come back k-major."""
    _check_gathered(monkeypatch, backend, "swiglu", case, shape, k_major=True)


def _check_gathered(monkeypatch, backend, activation, case, shape, k_major):
    experts, num_rows, dim, hidden = shape
    top_k = TOP_K[num_rows]
    tokens = num_rows // top_k
    rows, offsets = _routing(case, experts, tokens, top_k)
    used = int(offsets[-1])
    gated = activation == "swiglu"
    width = 2 * hidden if gated else hidden
    masters = dict(device="cuda", dtype=torch.float32)
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w_up = torch.randn(experts, dim, width, **masters) / dim**0.5
    w_down = torch.randn(experts, hidden, dim, **masters) / hidden**0.5
    if k_major:
        w_up, w_down = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w_up, w_down))
    w_up, w_down = w_up.requires_grad_(), w_down.requires_grad_()
    calls = _Calls(monkeypatch)
    with _forced(backend):
        y, h = torch.ops.moec.expert_mlp_gathered(
            x, rows, w_up, w_down, offsets, None, None, activation
        )
        d_y = torch.randn_like(y)
        d_y[used:] = 1e4  # rows past the offsets: must reach no result
        grads = torch.autograd.grad(y, (x, w_up, w_down), d_y)
        sources = row_sources(rows)
        buffer = grouped_gemm.buffer_like(x, sources)  # the policy reads the buffer's shape
        chosen = grouped_gemm.up_backend(
            buffer, w_up.to(x.dtype), False, kernel_activation(activation)
        )
        wgrad = gemm_backend.backend("wgrad", buffer, h)
    # forced: the operands (bf16, 8-aligned dims) take the CuTe DSL; cute_glu only with a gated
    # activation quack's epilogue computes (else the policy passes to "pointer")
    if backend == "cute" or (backend == "cute_glu" and gated):
        assert chosen == backend
    on_cute = chosen in ("cute", "cute_glu")
    paired = k_major and chosen == "cute_glu"  # its wgrad reads pairs: on quack whatever the policy
    want_calls = {"up": int(on_cute), "wgrad": int(on_cute and (wgrad == "cute" or paired))}
    assert calls.counts == want_calls, (chosen, wgrad, calls.counts)

    # the reference op on the CPU in float64 (reference forward and the op's own backward)
    ref = [t.detach().double().cpu().requires_grad_() for t in (x, w_up, w_down)]
    y_ref, h_ref = torch.ops.moec.expert_mlp_gathered(
        ref[0], rows.cpu(), ref[1], ref[2], offsets.cpu(), None, None, activation
    )
    ref_grads = torch.autograd.grad(y_ref, ref, d_y.double().cpu())
    tol = 2e-2
    assert _rel(y[:used].cpu(), y_ref[:used]) < tol
    if chosen == "cute_glu":  # gate/up columns interleaved in pairs (see cute_gemm)
        h = cute_gemm.deinterleave(h[None], h.dtype)[0]
    assert _rel(h[:used].cpu(), h_ref[:used]) < tol
    for name, g, r in zip(["x", "w_up", "w_down"], grads, ref_grads, strict=True):
        assert torch.isfinite(g).all(), name
        assert _rel(g.cpu(), r) < tol, name
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    assert grads[1].stride() == w_up.stride() and grads[2].stride() == w_down.stride()


def _layer(x, router, w_up, w_down):
    ops = torch.ops.moec
    _, weights, rows, offsets, _ = ops.route(x @ router, 8, 1.25, "softmax", True, "learned")
    y, _ = ops.expert_mlp_gathered(x, rows, w_up, w_down, offsets, None, None, "swiglu")
    return ops.combine(y, weights, rows)


@pytest.mark.parametrize(
    "backend", ["policy", *(pytest.param(b, marks=needs_quack) for b in ("cute", "cute_glu"))]
)
def test_gathered_layer_step_is_sync_free(backend):
    """One forward + backward of a layer on the gathered op under
    ``torch.cuda.set_sync_debug_mode("error")`` (benchmarks/moe_layer.py's sizes)."""
    assert_layer_step_sync_free(_layer, layer_inputs(), backend)


def assert_layer_step_sync_free(layer, inputs: tuple[torch.Tensor, ...], backend: str) -> None:
    """``layer(x, router, w_up, w_down)`` forward + backward raises no host sync once warm, under
    ``backend`` (``"policy"``: the default policy), and every gradient is finite."""
    x, router, w_up, w_down = inputs

    def step():
        layer(x, router, w_up, w_down).float().square().mean().backward()

    with _forced(backend):
        for _ in range(3):  # warm-up: autotuning and compilation may sync
            step()
        run_without_host_sync(step, 1)
    torch.cuda.synchronize()
    assert all(torch.isfinite(t.grad).all() for t in (x, w_up, w_down))
