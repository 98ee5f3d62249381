"""moec::expert_mlp against a per-row loop; its implementations (the reference's grouped GEMMs
and the masked loop, named by ``impl``); its recipes; gradients (float64 gradcheck); fakes and
argument errors. The combine inside is tests/test_combined_experts.py's."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd import gradcheck
from torch.utils._python_dispatch import TorchDispatchMode

import moec.ops  # noqa: F401
from moec.ops import experts, grouped
from moec.ops.activations import ACTIVATIONS, activate, is_gated
from moec.ops.quantized import mx_fake_quantize, rowwise_fake_quantize

expert_mlp = torch.ops.moec.expert_mlp


def _problem(act, n=4, d=8, h=12, rows=20, dtype=torch.float32, bias=True):
    u = 2 * h if is_gated(act) else h
    counts = torch.randint(0, 6, (n,))
    counts[1] = 0  # an empty expert
    offsets = counts.cumsum(0).clamp(max=rows).to(torch.int32)
    x = torch.randn(rows, d, dtype=dtype)
    w_up, w_down = (
        torch.randn(n, d, u, dtype=dtype) / d**0.5,
        torch.randn(n, h, d, dtype=dtype) / h**0.5,
    )
    b_up = torch.randn(n, u, dtype=dtype) if bias else None
    b_down = torch.randn(n, d, dtype=dtype) if bias else None
    return x, w_up, w_down, offsets, b_up, b_down


def _loop(x, w_up, w_down, offsets, b_up, b_down, act):
    out = torch.zeros_like(x)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        h = x[start:end] @ w_up[e] + (0 if b_up is None else b_up[e])
        out[start:end] = activate(h, act) @ w_down[e] + (0 if b_down is None else b_down[e])
        start = end
    return out


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("impl", ["auto", "reference", "loop"])
def test_expert_mlp_matches_loop(act, impl):
    args = _problem(act)
    y, h = expert_mlp(*args, act, "bf16", None, None, impl)
    valid = int(args[3][-1])
    torch.testing.assert_close(y[:valid], _loop(*args, act)[:valid], rtol=1e-5, atol=1e-5)


def test_an_unknown_impl_is_refused_naming_the_known_ones():
    args = _problem("gelu")
    with pytest.raises(ValueError, match=r"moec::expert_mlp: impl 'fast'; known: 'auto'"):
        expert_mlp(*args, "gelu", "bf16", None, None, "fast")
    with pytest.raises(ValueError, match=r"moec::expert_mlp: recipe 'fp4'"):
        expert_mlp(*args, "gelu", "fp4")


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_rowwise"])
def test_a_recipe_quantizes_each_gemm_as_the_loop_over_fake_quantized_operands(recipe):
    """The forward of a low-precision recipe: each GEMM's operands quantized along the
    contraction (rows of x and of act(h); the weights' input dim) then multiplied exactly."""
    x, w_up, w_down, offsets, b_up, b_down = _problem("swiglu", d=32, h=32, rows=24)
    quantize = mx_fake_quantize if recipe == "mxfp8" else rowwise_fake_quantize
    y, h = expert_mlp(x, w_up, w_down, offsets, b_up, b_down, "swiglu", recipe, None, None,
                      "reference")  # fmt: skip
    valid = int(offsets[-1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        want = quantize(x[start:end]) @ quantize(w_up[e], 0) + b_up[e]
        torch.testing.assert_close(h[start:end], want, rtol=1e-5, atol=1e-5)
        a = activate(h[start:end], "swiglu")
        want_y = quantize(a) @ quantize(w_down[e], 0) + b_down[e]
        torch.testing.assert_close(y[start:end], want_y, rtol=1e-5, atol=1e-5)
        start = end
    assert not torch.equal(
        y[:valid], _loop(x, w_up, w_down, offsets, b_up, b_down, "swiglu")[:valid]
    )


@pytest.mark.parametrize("act", ["swiglu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_expert_mlp_gradcheck(act, bias):
    x, w_up, w_down, offsets, b_up, b_down = _problem(
        act, n=3, d=4, h=3, rows=9, dtype=torch.float64, bias=bias
    )
    offsets = torch.tensor([3, 3, 9], dtype=torch.int32)  # every row valid, one empty expert
    tensors = [t.requires_grad_() for t in (x, w_up, w_down) + ((b_up, b_down) if bias else ())]

    def fn(x, w_up, w_down, *biases):
        b = biases if bias else (None, None)
        return expert_mlp(x, w_up, w_down, offsets, b[0], b[1], act)[0]

    assert gradcheck(fn, tensors)


def test_fp32_master_weights_with_bf16_rows_give_fp32_grads():
    x, w_up, w_down, offsets, b_up, b_down = _problem("swiglu", d=16, h=16)
    w_up.requires_grad_()
    w_down.requires_grad_()
    y, _ = expert_mlp(x.bfloat16(), w_up, w_down, offsets, None, None, "swiglu")
    assert y.dtype == torch.bfloat16
    y.backward(torch.randn_like(y))
    assert w_up.grad.dtype == torch.float32 and w_down.grad.dtype == torch.float32


def test_poisoned_tail_rows_do_not_reach_gradients():
    x, w_up, w_down, offsets, b_up, b_down = _problem("swiglu", d=16, h=16)
    valid = int(offsets[-1])
    x[valid:] = float("nan")
    params = [t.requires_grad_() for t in (w_up, w_down, b_up, b_down)]
    y, _ = expert_mlp(x, w_up, w_down, offsets, b_up, b_down, "swiglu")
    grad = torch.randn_like(y)
    grad[valid:] = 0  # what combine's backward sends to rows no route reads
    y.backward(grad)
    assert all(torch.isfinite(p.grad).all() for p in params)


def test_grouped_loop_and_grouped_mm_agree():
    x, w_up, _, offsets, _, _ = _problem("gelu", d=16, h=16)
    valid = int(offsets[-1])
    fast = grouped.gmm(x, w_up, offsets)[:valid]
    slow = grouped.gmm(x, w_up, offsets, loop=True)[:valid]
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(F.gelu(fast), F.gelu(slow), rtol=1e-5, atol=1e-5)


class _ZeroFills(TorchDispatchMode):
    """Records the shapes of the zero-filled tensors the dispatcher makes."""

    FILLS = {torch.ops.aten.zeros_like.default, torch.ops.aten.zero_.default,
             torch.ops.aten.zeros.default, torch.ops.aten.new_zeros.default}  # fmt: skip

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        filled = func in self.FILLS or (func is torch.ops.aten.fill_.Scalar and args[1] == 0)
        if filled and isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


def test_backward_fills_no_zero_gradient_for_the_saved_pre_activation():
    x, w_up, w_down, offsets, _, _ = _problem("swiglu", d=16, h=24, rows=40)
    params = [t.requires_grad_() for t in (x, w_up, w_down)]
    y, h = expert_mlp(*params, offsets, None, None, "swiglu")
    assert not h.requires_grad  # h is saved for the backward, not a differentiable output
    with _ZeroFills() as fills:
        y.backward(torch.randn_like(y))
    assert tuple(h.shape) not in fills.shapes
    assert all(torch.isfinite(p.grad).all() for p in params[1:])


def test_fake_shapes_of_the_op_and_its_backward():
    x, w_up, w_down, offsets, b_up, b_down = _problem("swiglu", d=16, h=12, rows=20)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx_, up, down, offs = (mode.from_tensor(t) for t in (x.bfloat16(), w_up, w_down, offsets))
        y, h = expert_mlp(fx_, up, down, offs, None, None, "swiglu", "mxfp8")
        grads = torch.ops.moec.expert_mlp_backward(fx_, up, down, offs, h, y, "swiglu", False)
    assert y.shape == (20, 16) and h.shape == (20, 24) and y.dtype == h.dtype == torch.bfloat16
    shapes = [tuple(g.shape) for g in grads]
    assert shapes == [(20, 16), tuple(w_up.shape), tuple(w_down.shape), (20, 24), (0,)]
    assert grads[1].dtype == grads[2].dtype == torch.float32


@pytest.mark.parametrize(
    "change,message",
    [
        ({"x": torch.randn(20, 9)}, "shapes do not fit: x"),
        ({"w_down": torch.randn(4, 13, 8)}, r"expected w_down \(4, 12, 8\)"),
        ({"offsets": torch.zeros(5, dtype=torch.int32)}, r"offsets \(5,\)"),
        ({"w_up": torch.randn(4, 8)}, "expected w_up \\[N, D, U\\]"),
    ],
)
def test_bad_arguments_raise_naming_them(change, message):
    x, w_up, w_down, offsets, _, _ = _problem("gelu", d=8, h=12)
    args = {"x": x, "w_up": w_up, "w_down": w_down, "offsets": offsets}
    args.update(change)
    with pytest.raises(ValueError, match=f"moec::expert_mlp: .*{message}"):
        expert_mlp(*args.values(), None, None, "gelu")


def test_the_kernels_impl_runs_the_reference_gemms_where_its_kernels_do_not_take_the_operands():
    """``kernels:<policy>`` on the CPU without the interpreter (or float64): its kernels take
    nothing, so every GEMM runs the reference's, with the same values."""
    args = _problem("swiglu", dtype=torch.float64)
    valid = int(args[3][-1])
    y, _ = expert_mlp(*args, "swiglu", "bf16", None, None, "kernels:rules")
    want, _ = expert_mlp(*args, "swiglu", "bf16", None, None, "reference")
    torch.testing.assert_close(y[:valid], want[:valid])
    assert experts.movement_impl("kernels:rules") == "triton"
    assert experts.movement_impl("loop") == "reference"
