"""GPU: ``moec::flash_attention`` on FlashAttention 4 equals the op's reference (outputs, the
softmax statistics and the gradients at bf16 tolerance), with grouped key heads and ragged
lengths, in the layout the reference (and the op's fake) writes whatever the inputs' strides,
and a forward + backward never syncs the host."""

import pytest
import torch

import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.kernels import flash_attention as fa4
from moec.kernels.flash_attention import AttentionSaved
from moec.ops.attention import flash_attention_backward_reference, flash_attention_reference
from moec.runtime.metrics import run_without_host_sync

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not fa4.installed(), reason="needs flash-attn-4 (flash_attn.cute)"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _qkv(batch, heads, kv_heads, seq, dim, dtype=torch.bfloat16, heads_major=False):
    """q/k/v as a model makes them: (B, S, H, D) storage seen as (B, H, S, D); with
    ``heads_major``, contiguous (B, H, S, D) (e.g. keys repeated for grouped heads)."""

    def make(h: int) -> torch.Tensor:
        if heads_major:
            return torch.randn(batch, h, seq, dim, device="cuda", dtype=dtype)
        return torch.randn(batch, seq, h, dim, device="cuda", dtype=dtype).transpose(1, 2)

    return make(heads), make(kv_heads), make(kv_heads)


@pytest.mark.parametrize(
    "batch, heads, kv_heads, seq, dim, causal, heads_major",
    [
        (2, 4, 4, 1000, 128, True, False),
        (1, 8, 2, 777, 64, True, False),
        (3, 2, 1, 513, 128, False, False),
        (4, 4, 4, 256, 64, True, True),
    ],
)
def test_fa4_equals_the_reference(batch, heads, kv_heads, seq, dim, causal, heads_major):
    q, k, v = _qkv(batch, heads, kv_heads, seq, dim, heads_major=heads_major)
    assert fa4.takes(q, k, v, causal), fa4.why_not(q, k, v, causal)
    scale = dim**-0.5 * 1.3
    out, lse = torch.ops.moec.flash_attention(q, k, v, causal, scale, "fa4")
    want_out, want_lse = flash_attention_reference(q, k, v, causal, scale)
    assert out.shape == want_out.shape and out.stride() == want_out.stride()
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert _rel(out, want_out) < 1e-2
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)
    d_out = torch.randn_like(out)
    got = torch.ops.moec.flash_attention_backward(q, k, v, out, lse, d_out, causal, scale, "fa4")
    saved = AttentionSaved(q, k, v, out, lse)
    want = flash_attention_backward_reference(saved, d_out, causal, scale)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert g.shape == w.shape and g.stride() == w.stride(), name
        assert _rel(g, w) < 2e-2, f"d_{name}: {_rel(g, w):.2e}"


def test_fa4_forward_and_backward_never_sync_the_host():
    q, k, v = (t.requires_grad_() for t in _qkv(2, 4, 2, 512, 128))

    def step() -> torch.Tensor:
        out = torch.ops.moec.flash_attention(q, k, v, True, 128**-0.5, "fa4")[0]
        return torch.autograd.grad(out.float().square().sum(), (q, k, v))[0]

    step()  # FA4 compiles its kernels on first use
    for d_q in run_without_host_sync(step, 2):
        assert torch.isfinite(d_q).all()
