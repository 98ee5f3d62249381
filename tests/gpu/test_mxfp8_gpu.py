"""MXFP8 / FP8 rowwise kernels on the GPU against the CPU reference (skipped without CUDA).

sm90 runs ``tl.dot_scaled`` emulated, sm100+ natively; nothing here calls a torch MXFP8 kernel
(``torch._scaled_grouped_mm`` with MX scales is SM100-only and kills the context on sm90).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from moec.ops.grouped import gmm  # noqa: E402
from moec.ops.quantized import (  # noqa: E402
    mx_fake_quantize,
    mx_quantize_reference,
    quantized_gmm_wgrad,
)
from tests.test_mxfp8 import adversarial_inputs  # noqa: E402

CUDA = torch.device("cuda")


@pytest.mark.parametrize("name", list(adversarial_inputs()))
@pytest.mark.parametrize("layout", ["rowwise", "columnwise", "bf16"])
def test_quantize_bit_exact(name, layout):
    from moec.kernels.mxfp8 import mx_quantize

    x = adversarial_inputs()[name]
    if layout == "bf16":
        x = x.bfloat16()
    if layout == "columnwise":
        if x.shape[0] % 32:
            pytest.skip("columnwise needs rows % 32 == 0")
        x = x.t()
    q = mx_quantize(x.to(CUDA))
    codes, scales = mx_quantize_reference(x)
    assert torch.equal(q.scales.cpu(), scales)
    assert torch.equal(q.codes.view(torch.uint8).cpu(), codes.view(torch.uint8))


def _reference_gmm(a, w, offsets):
    out = gmm(mx_fake_quantize(a), mx_fake_quantize(w, dim=-2), offsets)
    out[int(offsets[-1]) :] = 0
    return out


@pytest.mark.parametrize("shape", [(100, 96, 48, [30, 30, 90]), (1024, 256, 384, [64] * 16)])
@pytest.mark.parametrize("mode", ["fused", "prequantized", "fused_bf16"])
def test_gmm_matches_reference(shape, mode):
    from moec.kernels.mxfp8 import mx_gmm, mx_quantize, mx_quantize_weight

    m, k, n, sizes = shape
    offsets = torch.tensor(sizes, dtype=torch.int32).cumsum(0).int()
    a, w = torch.randn(m, k), torch.randn(len(sizes), k, n)
    if mode == "fused_bf16":
        a, w = a.bfloat16().float(), w.bfloat16().float()
    ref = _reference_gmm(a, w, offsets)
    da, dw, doff = a.to(CUDA), w.to(CUDA), offsets.to(CUDA)
    if mode == "prequantized":
        out = mx_gmm(mx_quantize(da), mx_quantize_weight(dw), doff, torch.float32)
    elif mode == "fused_bf16":
        out = mx_gmm(da.bfloat16(), dw.bfloat16(), doff, torch.float32)
    else:
        out = mx_gmm(da, dw, doff, torch.float32)
    err = (out.cpu() - ref).norm() / ref.norm()
    assert err < 1e-5, err


def test_wgrad_matches_reference():
    from moec.kernels.mxfp8 import mx_gmm_wgrad

    offsets = torch.tensor([30, 30, 100, 250], dtype=torch.int32)
    a, dy = torch.randn(256, 96), torch.randn(256, 160)
    want = quantized_gmm_wgrad(a, dy, offsets, "mxfp8", "reference")
    got = mx_gmm_wgrad(a.to(CUDA), dy.to(CUDA), offsets.to(CUDA), torch.float32).cpu()
    assert (got - want).norm() / want.norm() < 1e-5


def test_mxfp8_expert_mlp_cuda_equals_cpu():
    """The op with the mxfp8 recipe on the Triton MXFP8 kernels (what a CUDA target binds)
    equals its reference on the CPU."""
    n, d, hidden = 4, 128, 192
    offsets = torch.tensor([40, 40, 130, 200], dtype=torch.int32)
    x = torch.randn(224, d)
    w_up, w_down = torch.randn(n, d, 2 * hidden) / 10, torch.randn(n, hidden, d) / 10
    results = []
    for device in ("cpu", "cuda"):
        leaves = [t.to(device).requires_grad_() for t in (x, w_up, w_down)]
        impl = "kernels" if device == "cuda" else "reference"
        y, _ = torch.ops.moec.expert_mlp(*leaves, offsets.to(device), None, None, "swiglu",
                                         "mxfp8", None, None, impl)  # fmt: skip
        grads = torch.autograd.grad(y, leaves, torch.ones_like(y))
        results.append([t.detach().cpu() for t in (y, *grads)])
    for cpu, gpu in zip(*results, strict=True):
        assert (gpu - cpu).norm() / cpu.norm() < 1e-4


def test_fp8_rowwise_quantize_and_gemm():
    from moec.kernels import fp8_rowwise
    from moec.ops.quantized import rowwise_quantize_reference

    x = torch.randn(300, 256, device=CUDA, dtype=torch.bfloat16)
    codes, scales = fp8_rowwise.rowwise_quantize(x)
    ref_codes, ref_scales = rowwise_quantize_reference(x.cpu())
    assert torch.allclose(scales.cpu(), ref_scales[:, 0], rtol=1e-6)
    # The GPU scales with a reciprocal multiply, the reference divides: a value on a rounding
    # boundary may land one e4m3 step (3 mantissa bits) away, rarely; never further.
    diff = (codes.float().cpu() - ref_codes.float()).abs()
    assert (diff <= ref_codes.float().abs() * 2**-3 + 2**-9).all()
    assert (diff > 0).float().mean() < 1e-2  # 0.16% seen on an H200
    if not fp8_rowwise.scaled_grouped_mm_available(CUDA):
        pytest.skip("torch._scaled_grouped_mm rowwise is used on sm90 only")
    w = torch.randn(4, 256, 512, device=CUDA, dtype=torch.bfloat16) / 16
    offsets = torch.tensor([64, 128, 256, 288], device=CUDA, dtype=torch.int32)
    wq = fp8_rowwise.quantize_weight(w)
    ref = torch._grouped_mm(x, w, offs=offsets)[:288].float()
    exact = fp8_rowwise.rowwise_gmm((codes, scales), wq, offsets)[:288].float()
    fast = fp8_rowwise.rowwise_gmm((codes, scales), wq, offsets, fast_accum=True)[:288].float()
    assert (exact - ref).norm() / ref.norm() < 0.06
    # fast accumulation changes the sums, not the quantization: far closer to exact than to bf16
    assert (fast - exact).norm() / exact.norm() < 5e-3
