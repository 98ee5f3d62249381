"""``moec::flash_attention`` (reference, CPU): SDPA's outputs and gradients, the softmax
statistics, grouped key heads, the (B, S, H, D)-backed layout, autocast, and a clear error for
shapes that do not fit."""

import random
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.kernels import flash_attention as fa4


def _qkv(batch, heads, kv_heads, seq, dim, dtype=torch.float32, grad=False):
    def make(h: int) -> torch.Tensor:
        t = torch.randn(batch, seq, h, dim, dtype=dtype).transpose(1, 2)
        return t.requires_grad_() if grad else t

    return make(heads), make(kv_heads), make(kv_heads)


@pytest.mark.parametrize("causal", [True, False])
def test_outputs_statistics_and_gradients_equal_sdpa(causal):
    kv_heads = random.randint(1, 3)
    heads = kv_heads * random.randint(1, 3)
    seq, dim = random.randint(5, 40), random.choice([8, 16, 24])
    q, k, v = _qkv(2, heads, kv_heads, seq, dim, dtype=torch.float64, grad=True)
    scale = random.uniform(0.1, 0.5)
    out, lse = torch.ops.moec.flash_attention(q, k, v, causal, scale)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    torch.testing.assert_close(out, want.to(out.dtype), atol=1e-5, rtol=1e-5)
    group = heads // kv_heads
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), -torch.inf)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).float(), atol=1e-5, rtol=1e-5)
    assert not lse.requires_grad
    d_out = torch.randn_like(want)
    got = torch.autograd.grad(out, (q, k, v), d_out)
    expected = torch.autograd.grad(want, (q, k, v), d_out)
    for name, g, w in zip("qkv", got, expected, strict=True):
        torch.testing.assert_close(g, w.to(g.dtype), atol=1e-5, rtol=1e-5, msg=f"d_{name}")


def test_outputs_are_tokens_major_and_autocast_runs_bf16():
    q, k, v = _qkv(2, 4, 2, 12, 16)
    out, _ = torch.ops.moec.flash_attention(q, k, v, True, 0.25)
    assert out.transpose(1, 2).is_contiguous()  # a model's transpose back is a view
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, lse = torch.ops.moec.flash_attention(q, k, v, True, 0.25)
    assert low.dtype == torch.bfloat16 and lse.dtype == torch.float32


@pytest.mark.parametrize("kv_heads", [1, 2])  # one key head: a size-1 dim's stride too
def test_gradients_are_stored_tokens_major_as_fa4_writes_them(kv_heads):
    """(opcheck runs on both ops in tests/test_ops_compile.py.)"""
    q, k, v = _qkv(2, 4, kv_heads, 9, 8)
    out, lse = torch.ops.moec.flash_attention(q, k, v, True, 0.3)
    args = (q, k, v, out, lse, torch.randn_like(out), True, 0.3)
    for got, t in zip(torch.ops.moec.flash_attention_backward(*args), (q, k, v), strict=True):
        b, h, s, d = t.shape
        assert got.stride() == t.new_empty(b, s, h, d).transpose(1, 2).stride()  # FA4's layout


def test_fa4_backward_writes_tokens_major_gradients_for_heads_major_inputs(monkeypatch):
    """FA4 allocates each gradient like its input unless handed one; the wrapper hands it
    (B, S, H, D) buffers, the strides the op's fake promises, also for contiguous (B, H, S, D)
    inputs (keys repeated for grouped heads). FA4 itself is stood in for: this runs on the CPU."""

    def fa4_backward(q, k, v, out, d_out, lse, scale, causal, dq=None, dk=None, dv=None):
        dq, dk, dv = (  # as FA4 does where none is handed: like the input, its strides too
            torch.empty_like(t) if given is None else given
            for t, given in ((q, dq), (k, dk), (v, dv))
        )
        for grad in (dq, dk, dv):
            grad.normal_()
        return dq, dk, dv

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_bwd = fa4_backward
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    q, k, v = (torch.randn(2, h, 9, 8, dtype=torch.bfloat16) for h in (4, 4, 4))  # (B, H, S, D)
    out, lse = torch.ops.moec.flash_attention(q, k, v, True, 0.3)
    d_out = torch.randn_like(out)
    reference = torch.ops.moec.flash_attention_backward(q, k, v, out, lse, d_out, True, 0.3)
    grads = fa4.backward(fa4.AttentionSaved(q, k, v, out, lse), d_out, True, 0.3)
    for got, want in zip(grads, reference, strict=True):  # the fake's strides
        assert got.shape == want.shape and got.stride() == want.stride()


def test_shapes_that_do_not_fit_are_named():
    q, k, v = _qkv(1, 3, 2, 8, 8)
    with pytest.raises(ValueError, match=r"moec::flash_attention: q \(1, 3, 8, 8\).*multiple"):
        torch.ops.moec.flash_attention(q, k, v, True, 0.3)


def test_fa4_says_why_it_does_not_run_on_cpu_tensors():
    q, k, v = _qkv(1, 2, 2, 8, 8)
    reason = fa4.why_not(q, k, v, True)
    assert reason is not None and not fa4.takes(q, k, v, True)
    assert "not installed" in reason or "CUDA" in reason


def test_fa4_shape_rules_name_what_they_refuse():
    q, kv = (2, 8, 64, 128), (2, 2, 64, 128)
    assert fa4.shapes_why_not(q, kv, kv, causal=True, major=None) is None
    four = (2, 4, 64, 128)
    assert "not a multiple" in fa4.shapes_why_not((2, 6, 64, 128), four, four, True, 9)
    assert "causal" in fa4.shapes_why_not(q, (2, 2, 32, 128), (2, 2, 32, 128), True, 9)
    wide, wide_kv = (2, 8, 64, 160), (2, 2, 64, 160)  # Hopper's FA4 takes head dim 160
    assert fa4.shapes_why_not(wide, wide_kv, wide_kv, True, major=9) is None
    for major in (10, None):  # Blackwell's does not, so neither does "either chip"
        assert "head dims" in fa4.shapes_why_not(wide, wide_kv, wide_kv, True, major)
    odd, odd_kv = (2, 8, 64, 100), (2, 2, 64, 100)  # not a multiple of 8
    assert "head dims" in fa4.shapes_why_not(odd, odd_kv, odd_kv, False, 9)
