"""moec::expert_mlp against a per-row loop; both grouped-GEMM implementations; gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck
from torch.utils._python_dispatch import TorchDispatchMode

import moec.ops  # noqa: F401
from moec.ops import grouped
from moec.ops.activations import ACTIVATIONS, activate, is_gated

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
@pytest.mark.parametrize("force_loop", [False, True])
def test_expert_mlp_matches_loop(act, force_loop, monkeypatch):
    monkeypatch.setattr(grouped, "_FORCE_LOOP", force_loop)
    args = _problem(act)
    y, h = expert_mlp(*args, act)
    valid = int(args[3][-1])
    torch.testing.assert_close(y[:valid], _loop(*args, act)[:valid], rtol=1e-5, atol=1e-5)


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


def test_grouped_loop_and_grouped_mm_agree(monkeypatch):
    x, w_up, _, offsets, _, _ = _problem("gelu", d=16, h=16)
    valid = int(offsets[-1])
    fast = grouped.gmm(x, w_up, offsets)[:valid]
    monkeypatch.setattr(grouped, "_FORCE_LOOP", True)
    slow = grouped.gmm(x, w_up, offsets)[:valid]
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
