"""The FP8 rowwise expert MLP (``moec.kernels.fp8_experts``, sm90) against the references.

The fused activation quantizer equals quantizing the float32 activation; the op on CUDA (the
kernels) equals the op's own reference (the same FP8 GEMMs, torch activation and quantizer) in
forward and backward, and the unquantized float64 expert MLP within FP8's error. Cases: empty
experts, one expert taking every row, rows past ``offsets[-1]`` poisoned with NaN; the op runs
without a host sync. The FP8 linear (``torch._scaled_mm``) against the same references.
"""

from __future__ import annotations

import pytest
import torch

from moec.kernels import fp8_rowwise
from moec.ops.activations import activate, kernel_activation
from moec.ops.quantized import (
    rowwise_fake_quantize,
    rowwise_quantize_reference,
)
from moec.runtime.metrics import run_without_host_sync

CUDA = torch.device("cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not fp8_rowwise.scaled_grouped_mm_available(CUDA),
        reason="needs the FP8 grouped GEMM (sm90)",
    ),
]


def _mlp(x, w_up, w_down, offsets, activation, recipe, impl):
    return torch.ops.moec.expert_mlp(
        x, w_up, w_down, offsets, None, None, activation, recipe, None, None, impl
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12)).item()


@pytest.mark.parametrize("width", [256, 9000, 70000])  # one pass; wider than one pass (chunks)
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu", "relu"])
def test_activation_quantizer_equals_quantized_activation(activation, width):
    h = torch.randn(300, 2 * width, device=CUDA, dtype=torch.bfloat16) * 3
    codes, scales = fp8_rowwise.rowwise_quantize(h, kernel_activation(activation))
    want_codes, want_scales = rowwise_quantize_reference(activate(h.float(), activation))
    torch.testing.assert_close(scales, want_scales[:, 0], rtol=1e-5, atol=0)
    _assert_codes_close(codes, want_codes)  # float32 activation math may differ in last bits


@pytest.mark.parametrize("width", [1536, 49152, 70000])
def test_row_quantizer_equals_reference(width):
    """Rows as the FP8 linears quantize them: the d = 1536 of a projection's input, and a dense
    FFN's gated gradient (49152 wide, one pass), with a strided view of it; and a row wider
    than one pass (quantized in chunks)."""
    x = torch.randn(70, width + 64, device=CUDA, dtype=torch.bfloat16)[:, :width] * 5
    x[3] = 0  # an all-zero row keeps scale 1
    codes, scales = fp8_rowwise.rowwise_quantize(x)
    want_codes, want_scales = rowwise_quantize_reference(x.float())
    torch.testing.assert_close(scales, want_scales[:, 0], rtol=1e-6, atol=0)
    assert scales[3] == 1
    _assert_codes_close(codes, want_codes)


def _assert_codes_close(codes: torch.Tensor, want: torch.Tensor) -> None:
    """Codes equal, or rarely one e4m3 step apart (reciprocal multiply vs division)."""
    diff = (codes.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2**-3 + 2**-9).all()
    assert (diff > 0).float().mean() < 1e-2


# experts with many column blocks (one program each), few (K split), a dense weight (K split)
@pytest.mark.parametrize("shape", [(8, 128, 4096), (5, 200, 136), (1, 3000, 100)])
@pytest.mark.parametrize("layout", ["N contiguous", "K contiguous"])
def test_weight_quantizer_per_output_channel(layout, shape):
    """``quantize_weight`` reads (G, K, N) in either layout in place and equals the reference
    quantized along K, in the column-major layout the FP8 GEMMs take, whether the quantizer
    runs one program per column block or splits K over programs."""
    groups, k, n = shape
    w = torch.randn(*shape, device=CUDA, dtype=torch.bfloat16) * 2
    w[0, :, 7] = 0  # an all-zero column keeps scale 1
    if layout == "K contiguous":
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    codes, scales = fp8_rowwise.quantize_weight(w)
    want_codes, want_scales = rowwise_quantize_reference(w.float(), dim=-2)
    assert scales[0, 7] == 1
    assert codes.shape == w.shape and codes.stride() == (k * n, 1, k)
    torch.testing.assert_close(scales, want_scales[:, 0, :], rtol=1e-6, atol=0)
    _assert_codes_close(codes, want_codes)


def _offsets(case: str, experts: int, rows: int) -> torch.Tensor:
    if case == "empty_experts":
        counts = torch.zeros(experts, dtype=torch.long)
        counts[1::3] = rows // len(counts[1::3])
    elif case == "one_expert":
        counts = torch.zeros(experts, dtype=torch.long)
        counts[experts // 2] = rows
    else:
        counts = torch.multinomial(torch.ones(experts), rows, replacement=True).bincount(
            minlength=experts
        )
    return counts.cumsum(0).to(torch.int32).to(CUDA)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("case", ["random", "empty_experts", "one_expert"])
def test_fp8_expert_mlp_equals_reference(case, activation):
    experts, dim, hidden, used, tail = 8, 256, 384, 900, 124
    width = 2 * hidden if activation == "swiglu" else hidden
    offsets = _offsets(case, experts, used)
    x = torch.randn(used + tail, dim, device=CUDA, dtype=torch.bfloat16)
    x[used:] = float("nan")  # rows past offsets[-1] must not reach any valid result
    w_up = torch.randn(experts, dim, width, device=CUDA) / dim**0.5  # float32 masters
    w_down = torch.randn(experts, hidden, dim, device=CUDA) / hidden**0.5
    d_y = torch.randn(used + tail, dim, device=CUDA, dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (x, w_up, w_down)]

    def step():
        y, _ = _mlp(*leaves, offsets, activation, "fp8_rowwise", "native")
        return y, torch.autograd.grad(y, leaves, d_y)

    step()  # compiles the kernels
    ((y, grads),) = run_without_host_sync(step, 1)

    args = (x, w_up, w_down, offsets)
    ref_y, ref_h = _mlp(*args, activation, "fp8_rowwise", "reference")
    ref_d_x, ref_d_w_up, ref_d_w_down, _, _ = torch.ops.moec.expert_mlp_backward(
        *args, ref_h, d_y, activation, False, "fp8_rowwise", None, None, "reference"
    )
    exact = [t.double() for t in (x[:used], w_up, w_down)]
    leaves64 = [t.clone().requires_grad_() for t in exact]
    y64, _ = _mlp(*leaves64, offsets, activation, "bf16", "reference")
    grads64 = torch.autograd.grad(y64, leaves64, d_y[:used].double())

    got = [y[:used], grads[0][:used], grads[1], grads[2]]
    ref = [ref_y[:used], ref_d_x[:used], ref_d_w_up, ref_d_w_down]
    for name, a, b, c in zip(["y", "d_x", "d_w_up", "d_w_down"], got, ref, [y64, *grads64]):
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) < 2e-2, (name, _rel(a, b))  # same FP8 GEMMs; activation rounding
        assert _rel(a, c) < 8e-2, (name, _rel(a, c))  # FP8 against unquantized float64
    assert grads[1].dtype == grads[2].dtype == torch.float32  # the masters' dtype


def test_fp8_linear_through_scaled_mm():
    """``moec::quantized_linear`` (``torch._scaled_mm`` on sm90) against the fake-quantized
    product in float32 and the unquantized float64 linear, forward and backward."""
    x = torch.randn(4, 96, 256, device=CUDA, dtype=torch.bfloat16)
    weight = torch.randn(384, 256, device=CUDA) / 16  # a float32 master
    bias = torch.randn(384, device=CUDA)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    y = torch.ops.moec.quantized_linear(*leaves, "fp8_rowwise")
    d_y = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, d_y)
    fake = rowwise_fake_quantize(x.float()) @ rowwise_fake_quantize(weight.t(), dim=-2) + bias
    assert y.dtype == torch.bfloat16 and _rel(y, fake) < 1e-2
    leaves64 = [t.double().requires_grad_() for t in (x, weight, bias)]
    y64 = torch.nn.functional.linear(*leaves64)
    grads64 = torch.autograd.grad(y64, leaves64, d_y.double())
    assert _rel(y, y64) < 8e-2
    for name, a, b in zip(["d_x", "d_weight", "d_bias"], grads, grads64, strict=True):
        assert _rel(a, b) < 8e-2, (name, _rel(a, b))
    assert grads[1].dtype == torch.float32 and grads[2].dtype == torch.float32


def test_fp8_dense_ffns_train_under_block_recompute(tmp_path):
    """``precision.scope: [dense_ffn]`` with block recompute through Inductor: the FP8 dense
    block is still a block (every block recomputed), steps run without a host sync, and the
    loss tracks the bf16 program's."""
    from benchmarks import e2e
    from moec.train import TrainConfig, Trainer

    shape = dict(e2e.SMALL, dim=512, dense_width=2048, seq=512, micro=2)
    losses = {}
    for name, precision in (("bf16", {}), ("fp8", {"gemm": "fp8_rowwise", "scope": ["dense_ffn"]})):
        torch.manual_seed(0)
        plan = e2e.moe_plan(shape)
        plan.recompute.policy = "block"
        for field, value in precision.items():
            setattr(plan.precision, field, value)
        config = TrainConfig(
            lr=1e-3, steps=12, batch_size=shape["micro"], seq_len=shape["seq"], device="cuda",
            synthetic=True, out=str(tmp_path / name), plots=False,
        )  # fmt: skip
        trainer = Trainer(e2e.dense_model(shape), plan, config)
        results = trainer.compiled.pass_results
        assert results["recompute"].stats["blocks_recomputed"] == shape["layers"]
        if precision:
            assert results["precision"].stats["dense_ffn_linears_quantized"] == 3
        losses[name] = [float(trainer.train_step()) for _ in range(10)]
        run_without_host_sync(trainer.train_step, 2)
    bf16, fp8 = losses["bf16"][-1], losses["fp8"][-1]
    assert abs(fp8 - bf16) / bf16 < 0.05, (bf16, fp8)
