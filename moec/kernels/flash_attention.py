"""Attention on FlashAttention 4's CuTe DSL kernels (package flash-attn-4, ``flash_attn.cute``).

forward(q, k, v, causal, scale) -> (out, lse)
    q (B, Hq, S, D), k and v (B, Hkv, S, D) in ``scaled_dot_product_attention``'s layout (Hq a
    multiple of Hkv); out (B, Hq, S, D), lse (B, Hq, S) float32: the natural-log sum of the
    scaled scores' exponentials of each query row.
backward(q, k, v, out, lse, d_out, causal, scale) -> (d_q, d_k, d_v)   the inputs' shapes

FA4 reads and writes (B, S, H, D). A model that builds q/k/v as (B, S, H, D) and transposes
them for attention (Llama does) hands over views FA4 reads in place; ``out`` is a (B, S, H, D)
buffer seen as (B, H, S, D), so the model's transpose back is a view again. Other layouts are
copied by FA4 as it needs them. The gradients are (B, S, H, D) buffers too, whatever the
inputs' layout (FA4 would make each like its input; the op's fake promises one layout). Its
kernels are compiled on first use per shape class (the CuTe DSL's JIT), then cached in the
process.

:func:`takes` says where it runs: FA4 importable, a CUDA device of compute capability 9.x
(Hopper) or 10.x (Blackwell: the production target, FA4's first), bf16 or fp16 of one dtype
and device, head dims FA4 takes on that chip, query heads a multiple of key heads, and under a
causal mask as many queries as keys (FA4 aligns the mask to the last key, SDPA to the first:
they agree only there). :func:`why_not` names the first condition that fails;
:func:`device_why_not` and :func:`shapes_why_not` are its halves, for a caller that knows the
device and the shapes apart (the lowering decides from a graph's shapes).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

HALF_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def installed() -> bool:
    """Whether FA4 (``flash_attn.cute``, package flash-attn-4) can be imported."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:  # no flash_attn package at all
        return False


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _head_dims_taken(major: int, head_dim: int, head_dim_v: int, alignment: int) -> bool:
    """FA4's head dims on sm90 (8-256) and sm100 (8-128, or 256 for both)."""
    if head_dim % alignment or head_dim_v % alignment:
        return False
    if major == 9:
        return 8 <= head_dim <= 256 and 8 <= head_dim_v <= 256
    return (8 <= head_dim <= 128 and 8 <= head_dim_v <= 128) or head_dim == head_dim_v == 256


def device_why_not(device: torch.device) -> str | None:
    """Why FA4 does not run on ``device`` (None: it does)."""
    if not installed():
        return "flash-attn-4 (flash_attn.cute) is not installed"
    if device.type != "cuda":
        return f"{device}: FA4 runs on a CUDA device"
    major, _ = _capability(device.index if device.index is not None else 0)
    if major not in (9, 10):
        return f"compute capability {major}.x: FA4 runs here on 9.x (Hopper) and 10.x (Blackwell)"
    return None


def shapes_why_not(
    q: Sequence[int],
    k: Sequence[int],
    v: Sequence[int],
    causal: bool,
    major: int | None,
    element_size: int = 2,
) -> str | None:
    """Why FA4 does not take q/k/v of these (B, H, S, D) shapes (None: it does) on a chip of
    compute capability ``major``.x (None: either chip's, so both take them)."""
    if len(q) != 4 or len(k) != 4 or len(v) != 4:
        return f"q/k/v of {len(q)}, {len(k)}, {len(v)} dims: expected (B, H, S, D) each"
    batch, heads, queries, head_dim = q
    if tuple(k[:3]) != tuple(v[:3]) or k[-1] != head_dim or k[0] != batch:
        return f"k {tuple(k)} and v {tuple(v)} do not fit q {tuple(q)}"
    if heads % k[1]:
        return f"{heads} query heads over {k[1]} key heads: not a multiple"
    if causal and queries != k[2]:
        return f"causal with {queries} queries over {k[2]} keys (masks differ from SDPA's)"
    chips = (9, 10) if major is None else (major,)
    alignment = 16 // element_size
    if not all(_head_dims_taken(chip, head_dim, v[-1], alignment) for chip in chips):
        return f"head dims {head_dim}/{v[-1]} are not FA4's on compute capability {major}.x"
    return None


def why_not(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> str | None:
    """Why FA4 does not take this attention (None: it does)."""
    if not (k.device == q.device and v.device == q.device):
        return f"q/k/v on {q.device}, {k.device}, {v.device}: FA4 runs on one device"
    why = device_why_not(q.device)
    if why is not None:
        return why
    if q.dtype not in HALF_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: FA4 takes one of bf16 or fp16"
    major, _ = _capability(q.device.index if q.device.index is not None else 0)
    return shapes_why_not(q.shape, k.shape, v.shape, causal, major, q.element_size())


def takes(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> bool:
    """Whether :func:`forward` and :func:`backward` run these inputs (see the module doc)."""
    return why_not(q, k, v, causal) is None


def _swap_heads_and_tokens(t: Tensor) -> Tensor:
    """(B, H, S, D) <-> (B, S, H, D), as views: SDPA's layout and FA4's."""
    return t.transpose(1, 2)


def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) of softmax(q k^T scale (causally masked)) v; see the module doc."""
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(
        _swap_heads_and_tokens(q),
        _swap_heads_and_tokens(k),
        _swap_heads_and_tokens(v),
        softmax_scale=scale,
        causal=causal,
        return_lse=True,
    )
    return _swap_heads_and_tokens(out), lse


class AttentionSaved(NamedTuple):
    """What an attention's backward reads of its forward (FA4's and the reference's alike): the
    inputs ``q`` (B, Hq, S, D), ``k`` and ``v`` (B, Hkv, Sk, D), the output ``out`` and its
    float32 log-sum-exp ``lse`` (B, Hq, S)."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor


def backward(
    saved: AttentionSaved, d_out: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(d_q, d_k, d_v) of :func:`forward` for the output gradient ``d_out``."""
    from flash_attn.cute.interface import _flash_attn_bwd

    out, lse = saved.out, saved.lse
    q, k, v = (_swap_heads_and_tokens(t) for t in (saved.q, saved.k, saved.v))
    # the gradients in (B, S, H, D) storage whatever the inputs' strides (FA4 would make each
    # like its input): the strides the op's fake promises
    d_q, d_k, d_v = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    _flash_attn_bwd(
        q,
        k,
        v,
        _swap_heads_and_tokens(out),
        _swap_heads_and_tokens(d_out.to(out.dtype)),
        lse,
        scale,
        causal,
        dq=d_q,
        dk=d_k,
        dv=d_v,
    )
    return _swap_heads_and_tokens(d_q), _swap_heads_and_tokens(d_k), _swap_heads_and_tokens(d_v)
