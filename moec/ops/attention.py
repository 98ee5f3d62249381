"""``moec::flash_attention``: attention that keeps its softmax statistics for the backward.

flash_attention(q[B, Hq, S, D], k[B, Hkv, S, D], v[B, Hkv, S, Dv], is_causal, scale, impl)
    -> (out[B, Hq, S, Dv] in q's dtype, lse[B, Hq, S] float32)

``scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)`` without a mask or
dropout (query head h reads key head h // (Hq / Hkv), as SDPA's ``enable_gqa``), and ``lse``,
the natural-log sum of each query row's exponentiated scaled scores. The backward is the
internal op ``moec::flash_attention_backward(q, k, v, out, lse, d_out, is_causal, scale, impl)
-> (d_q, d_k, d_v)``, which reads ``out`` and ``lse`` instead of recomputing the forward.

Outputs are stored as (B, S, H, D) and seen as (B, H, S, D) (the layout FA4 writes; a model's
transpose back to tokens-major is then a view). The reference below materializes the score
matrix in float32: it is the oracle, for CPU tests. Both ops take a last ``impl``
(:mod:`moec.ops.binding`), a name of :data:`IMPLEMENTATIONS`: ``fa4`` runs FlashAttention 4's
kernels where :func:`moec.kernels.flash_attention.takes` the inputs, the reference elsewhere.
Pass ``bind`` puts the op where the target runs FA4 and FA4 takes the attention
(``plan.lowering.attention``). Under autocast the op casts its inputs to bf16, as SDPA does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moec.kernels import flash_attention as fa4
from moec.kernels.flash_attention import AttentionSaved
from moec.ops.binding import resolve


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    shapes_fit = (
        q.dim() == k.dim() == v.dim() == 4
        and q.shape[0] == k.shape[0] == v.shape[0]
        and k.shape[1:3] == v.shape[1:3]
        and q.shape[-1] == k.shape[-1]
        and k.shape[1] > 0
        and q.shape[1] % k.shape[1] == 0
    )
    if not shapes_fit:
        raise ValueError(
            f"moec::flash_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
            "expected (B, Hq, S, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv) with Hq a multiple of Hkv"
        )


def _heads_major_like(t: Tensor, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor:
    b, h, s, d = shape
    return t.new_empty((b, s, h, d), dtype=dtype).transpose(1, 2)


def _heads_major(t: Tensor) -> Tensor:
    """A (B, S, H, D)-stored copy of t (B, H, S, D), seen as (B, H, S, D): the fake's strides,
    size-1 dimensions included."""
    return _heads_major_like(t, t.shape, t.dtype).copy_(t)


def _shared_kv(t: Tensor, group: int) -> Tensor:
    """Each key/value head repeated for the ``group`` query heads that read it."""
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _scores(q: Tensor, k: Tensor, is_causal: bool, scale: float) -> Tensor:
    """Scaled float32 scores (B, Hq, S, Sk), -inf above the diagonal when causal."""
    k = _shared_kv(k, q.shape[1] // k.shape[1])
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if is_causal:
        above = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def flash_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    s = _scores(q, k, is_causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.matmul(p, _shared_kv(v, q.shape[1] // v.shape[1]).float())
    return _heads_major(out.to(q.dtype)), lse


def flash_attention_backward_reference(
    saved: AttentionSaved, d_out: Tensor, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v, out, lse = saved
    group = q.shape[1] // k.shape[1]
    p = torch.exp(_scores(q, k, is_causal, scale) - lse[..., None])
    d_out = d_out.float()
    d_p = torch.matmul(d_out, _shared_kv(v, group).float().transpose(-1, -2))
    delta = (d_out * out.float()).sum(-1, keepdim=True)  # rowsum(dO * O) = rowsum(P * dP)
    d_s = p * (d_p - delta) * scale
    d_q = torch.matmul(d_s, _shared_kv(k, group).float())
    d_k = torch.matmul(d_s.transpose(-1, -2), q.float())
    d_v = torch.matmul(p.transpose(-1, -2), d_out)

    def per_kv_head(t: Tensor) -> Tensor:
        return t.unflatten(1, (k.shape[1], group)).sum(2)

    return (
        _heads_major(d_q.to(q.dtype)),
        _heads_major(per_kv_head(d_k).to(k.dtype)),
        _heads_major(per_kv_head(d_v).to(v.dtype)),
    )


def _fa4_forward(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """FA4 where it takes the inputs, else the reference."""
    if not fa4.takes(q, k, v, is_causal):
        return flash_attention_reference(q, k, v, is_causal, scale)
    return fa4.forward(q, k, v, is_causal, scale)


def _fa4_backward(
    saved: AttentionSaved, d_out: Tensor, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    if not fa4.takes(saved.q, saved.k, saved.v, is_causal):
        return flash_attention_backward_reference(saved, d_out, is_causal, scale)
    return fa4.backward(saved, d_out, is_causal, scale)


IMPLEMENTATIONS = {
    "reference": (flash_attention_reference, flash_attention_backward_reference),
    "fa4": (_fa4_forward, _fa4_backward),
}
"""(forward, backward) of ``moec::flash_attention`` by implementation name."""


@torch.library.custom_op("moec::flash_attention", mutates_args=())
def flash_attention(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float, impl: str = "auto"
) -> tuple[Tensor, Tensor]:
    _check(q, k, v)
    forward, _ = IMPLEMENTATIONS[resolve("flash_attention", impl, q, IMPLEMENTATIONS)]
    return forward(q, k, v, is_causal, scale)


@flash_attention.register_fake
def _fake(q, k, v, is_causal, scale, impl="auto"):
    _check(q, k, v)
    out = _heads_major_like(q, (*q.shape[:3], v.shape[-1]), q.dtype)
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)


def _setup(ctx, inputs, output):
    q, k, v, is_causal, scale, impl = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)  # a statistic the backward reads, not a result to train on
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.is_causal, ctx.scale, ctx.impl = is_causal, scale, impl


@torch.library.custom_op("moec::flash_attention_backward", mutates_args=())
def flash_attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    d_out: Tensor,
    is_causal: bool,
    scale: float,
    impl: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    _check(q, k, v)
    _, backward = IMPLEMENTATIONS[resolve("flash_attention", impl, q, IMPLEMENTATIONS)]
    return backward(AttentionSaved(q, k, v, out, lse), d_out, is_causal, scale)


@flash_attention_backward.register_fake
def _backward_fake(q, k, v, out, lse, d_out, is_causal, scale, impl="auto"):
    _check(q, k, v)
    return tuple(_heads_major_like(t, t.shape, t.dtype) for t in (q, k, v))


def _backward(ctx, d_out, _d_lse):
    q, k, v, out, lse = ctx.saved_tensors
    grads = torch.ops.moec.flash_attention_backward(
        q, k, v, out, lse, d_out, ctx.is_causal, ctx.scale, ctx.impl
    )
    return *grads, None, None, None


flash_attention.register_autograd(_backward, setup_context=_setup)
for _device in ("cpu", "cuda"):
    torch.library.register_autocast("moec::flash_attention", _device, torch.bfloat16)
