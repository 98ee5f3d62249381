"""Router kernels: fused gating + top-k + capacity slot assignment for ``moec::route``.

route(logits[*, N], top_k, cap, gating, normalize, chosen?) -> expert_ids[*, K] i64,
weights[*, K] f32, rows[*, K] i64, offsets[N] i32, counts[N] i64, as the op's reference computes
them (integers exactly): top-k of the gate scores (``chosen`` None), or the given expert ids and
weights; an expert accepts its first ``cap`` routes in token-major order, the rest are dropped
(row -1); accepted routes of expert e fill rows ``[offsets[e-1], offsets[e])``.

Three launches, all static-shaped and sync-free (T tokens in blocks of BLOCK_T, B blocks):

1. ``_route_topk_kernel`` (grid B): logits -> softmax/sigmoid scores -> top-k by repeated argmax
   (ties -> lower expert id, like the reference's stable descending sort of the logits) ->
   normalized weights. It also writes, for every token and expert e, the number of earlier
   tokens of its block that chose e (an exclusive cumsum over the (BLOCK_T, N) "chosen"
   matrix: the in-block rank of a route to e), and the block's per-expert histogram.
   With ``LEARNED=False`` it reads given expert ids (random/uniform routing) and only ranks.
2. ``_route_scan_kernel`` (grid 1): exclusive scan of the histograms over blocks -> per-block
   bases; counts, capacity-clamped accepted counts, offsets = cumsum(accepted).
3. ``_route_rows_kernel`` (grid B): rank = base[block, e] + in-block rank; row = start[e] + rank
   when rank < capacity else -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

GATING_CODES = {"softmax": 0, "sigmoid": 1}


@triton.jit
def _route_topk_kernel(
    # pointers
    logits_ptr,  # (T, N) any float
    ids_ptr,  # (T, TOP_K) int64: written when LEARNED, read otherwise
    weights_ptr,  # (T, TOP_K) float32, written when LEARNED
    before_ptr,  # (T, N_P2) int32: earlier tokens of the block that chose each expert
    hist_ptr,  # (B, N_P2) int32: routes per expert in each block
    # sizes
    T,
    N,
    stride_lt,
    # meta-parameters
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    N_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    GATING: tl.constexpr,  # 0 softmax, 1 sigmoid
    NORMALIZE: tl.constexpr,
    LEARNED: tl.constexpr,
):
    pid = tl.program_id(0)
    tok = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, N_P2)
    ks = tl.arange(0, K_P2)
    tok_ok = tok < T
    col_ok = cols < N
    route_mask = tok_ok[:, None] & (ks[None, :] < TOP_K)
    route_off = tok[:, None] * TOP_K + ks[None, :]
    if LEARNED:
        x = tl.load(
            logits_ptr + tok[:, None] * stride_lt + cols[None, :],
            mask=tok_ok[:, None] & col_ok[None, :],
            other=float("-inf"),
        ).to(tl.float32)
        if GATING == 0:
            peak = tl.max(tl.where(col_ok[None, :], x, float("-inf")), axis=1)
            p = tl.where(col_ok[None, :], tl.exp(x - peak[:, None]), 0.0)
            scores = p / tl.sum(p, axis=1)[:, None]
        else:
            scores = 1.0 / (1.0 + tl.exp(-x))
        chosen = tl.zeros((BLOCK_T, N_P2), dtype=tl.int32)
        ids = tl.zeros((BLOCK_T, K_P2), dtype=tl.int32)
        picked = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            free = (chosen == 0) & col_ok[None, :]
            # NaN ranks lowest, so a non-finite row still picks valid experts (its NaN
            # weights make the loss NaN and the step is skipped, never an out-of-range id)
            cand = tl.where(free & (x == x), x, float("-inf"))
            best = tl.max(cand, axis=1)
            idx = tl.min(tl.where(free & (cand == best[:, None]), cols[None, :], N_P2), axis=1)
            hit = cols[None, :] == idx[:, None]
            chosen = tl.where(hit, 1, chosen)
            score = tl.sum(tl.where(hit, scores, 0.0), axis=1)
            ids = tl.where(ks[None, :] == k, idx[:, None], ids)
            picked = tl.where(ks[None, :] == k, score[:, None], picked)
        if NORMALIZE:
            picked = picked / tl.sum(picked, axis=1)[:, None]
        tl.store(ids_ptr + route_off, ids.to(tl.int64), mask=route_mask)
        tl.store(weights_ptr + route_off, picked, mask=route_mask)
    else:
        ids = tl.load(ids_ptr + route_off, mask=route_mask, other=-1).to(tl.int32)
        chosen = tl.zeros((BLOCK_T, N_P2), dtype=tl.int32)
        for k in tl.static_range(TOP_K):
            idx = tl.sum(tl.where(ks[None, :] == k, ids, 0), axis=1)
            chosen = tl.where(cols[None, :] == idx[:, None], 1, chosen)
    chosen = tl.where(tok_ok[:, None], chosen, 0)
    # earlier tokens of the block choosing e: strictly-lower-triangular ones @ chosen (exact)
    earlier = (tl.arange(0, BLOCK_T)[None, :] < tl.arange(0, BLOCK_T)[:, None]).to(tl.float16)
    before = tl.dot(earlier, chosen.to(tl.float16)).to(tl.int32)
    tl.store(before_ptr + tok[:, None] * N_P2 + cols[None, :], before, mask=tok_ok[:, None])
    tl.store(hist_ptr + pid * N_P2 + cols, tl.sum(chosen, axis=0))


@triton.jit
def _route_scan_kernel(
    # pointers
    hist_ptr,  # (B, N_P2) int32 in: histograms; out: exclusive prefix over blocks
    counts_ptr,  # (N,) int64
    offsets_ptr,  # (N,) int32
    starts_ptr,  # (N_P2,) int32: first row of each expert
    # sizes
    num_blocks,
    N,
    cap,
    # meta-parameters
    N_P2: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    cols = tl.arange(0, N_P2)
    running = tl.zeros((N_P2,), dtype=tl.int32)
    for b0 in range(0, num_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        ptrs = hist_ptr + blocks[:, None] * N_P2 + cols[None, :]
        mask = (blocks < num_blocks)[:, None]
        h = tl.load(ptrs, mask=mask, other=0)
        incl = tl.cumsum(h, axis=0)
        tl.store(ptrs, incl - h + running[None, :], mask=mask)
        running += tl.sum(h, axis=0)
    accepted = tl.minimum(running, cap)
    offsets = tl.cumsum(accepted, axis=0)
    tl.store(counts_ptr + cols, running.to(tl.int64), mask=cols < N)
    tl.store(offsets_ptr + cols, offsets, mask=cols < N)
    tl.store(starts_ptr + cols, offsets - accepted)


@triton.jit
def _route_rows_kernel(
    # pointers
    ids_ptr,  # (T, TOP_K) int64
    before_ptr,  # (T, N_P2) int32
    base_ptr,  # (B, N_P2) int32 exclusive prefix of the histograms
    starts_ptr,  # (N_P2,) int32
    rows_ptr,  # (T, TOP_K) int64 out
    # sizes
    T,
    cap,
    # meta-parameters
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    N_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    tok = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    ks = tl.arange(0, K_P2)
    mask = (tok < T)[:, None] & (ks[None, :] < TOP_K)
    off = tok[:, None] * TOP_K + ks[None, :]
    ids = tl.load(ids_ptr + off, mask=mask, other=0).to(tl.int32)
    rank = tl.load(before_ptr + tok[:, None] * N_P2 + ids, mask=mask, other=0)
    rank += tl.load(base_ptr + pid * N_P2 + ids, mask=mask, other=0)
    row = tl.load(starts_ptr + ids, mask=mask, other=0) + rank
    tl.store(rows_ptr + off, tl.where(rank < cap, row, -1).to(tl.int64), mask=mask)


def _block_tokens(n_p2: int) -> int:
    """Tokens per block: (BLOCK_T, N_P2) tiles of 4K elements, 16 per thread at 8 warps (larger
    tiles compile for tens of seconds)."""
    return max(16, min(256, 4096 // n_p2))


def route(
    logits: Tensor,
    top_k: int,
    cap: int,
    gating: str,
    normalize: bool,
    chosen: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The routes of every token (see module). ``gating``: a key of :data:`GATING_CODES`;
    ``chosen``: (expert_ids, weights) of shape (T, K) for T = the tokens of ``logits``, when a
    policy other than top-k picked the experts (the kernels then only rank the routes)."""
    lead, num_experts = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, num_experts)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    tokens = flat.shape[0]
    device = flat.device
    n_p2 = max(16, triton.next_power_of_2(num_experts))  # >= 16: a tl.dot operand
    k_p2 = triton.next_power_of_2(top_k)
    block_t = _block_tokens(n_p2)
    num_blocks = max(1, triton.cdiv(tokens, block_t))
    learned = chosen is None
    if learned:
        ids = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
        weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    else:
        ids, weights = chosen[0].contiguous(), chosen[1]
    before = torch.empty(tokens, n_p2, dtype=torch.int32, device=device)
    hist = torch.empty(num_blocks, n_p2, dtype=torch.int32, device=device)
    _route_topk_kernel[(num_blocks,)](
        flat, ids, weights, before, hist,
        tokens, num_experts, flat.stride(0),
        TOP_K=top_k, K_P2=k_p2, N_P2=n_p2, BLOCK_T=block_t,
        GATING=GATING_CODES[gating], NORMALIZE=normalize, LEARNED=learned, num_warps=8,
    )  # fmt: skip
    counts = torch.empty(num_experts, dtype=torch.int64, device=device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=device)
    starts = torch.empty(n_p2, dtype=torch.int32, device=device)
    _route_scan_kernel[(1,)](
        hist, counts, offsets, starts, num_blocks, num_experts, cap,
        N_P2=n_p2, BLOCK_B=max(16, min(1024, 8192 // n_p2)),
    )  # fmt: skip
    rows = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    _route_rows_kernel[(num_blocks,)](
        ids, before, hist, starts, rows, tokens, cap,
        TOP_K=top_k, K_P2=k_p2, N_P2=n_p2, BLOCK_T=block_t,
    )  # fmt: skip
    shape = (*lead, top_k)
    return ids.view(shape), weights.view(shape), rows.view(shape), offsets, counts
