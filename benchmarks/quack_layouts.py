"""Which operand layouts quack's expert GEMMs run fastest in, at the MoE layer's shape.

The layer of ``benchmarks/moe_layer.py`` (16384 tokens top-8 over 32 experts: R = 131072 rows,
D = H = 1536, SwiGLU), one piece at a time, ms from ``do_bench``:

  up        h = x @ w_up: plain (n-major w_up, moec's layout; k-major), and with the gated
            activation in the epilogue (n-major interleaved, moec's ``cute_glu``; k-major
            interleaved; k-major ``[gate | up]`` through quack's ``concat_layout``, SonicMoE's),
            each also reading token rows through ``A_idx`` (no dispatched buffer)
  dgrad_act d_a = d_y @ w_down^T with the SwiGLU backward in the epilogue; also with the route
            weight as a row scale and its gradient reduced in the epilogue, reading the output
            gradient's token rows through ``A_idx`` (the combine's backward folded in)
  dgrad     d_x = d_h @ w_up^T, n-major and k-major w_up
  wgrad     d_w_up = x^T d_h (varlen-K): from the buffer, through ``A_idx``, and written k-major

Every variant is checked against the plain n-major result before it is timed.

    python benchmarks/quack_layouts.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from triton.testing import do_bench

from moec.kernels import cute_gemm

T, D, H, N, K = 16384, 1536, 1536, 32, 8


def _rel(a: Tensor, b: Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _interleave_rows(w: Tensor) -> Tensor:
    """(N, 2H, D) ``[gate | up]`` rows -> ``[g0, u0, g1, u1, ...]``."""
    gate, up = w.chunk(2, dim=1)
    return torch.stack((gate, up), dim=2).flatten(1, 2).contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from quack import gemm_interface as q

    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, D, **bf)
    experts = torch.rand(T, N, device="cuda").topk(K, dim=-1).indices.reshape(-1)
    order = experts.argsort(stable=True)
    sources = (order // K).to(torch.int32)  # buffer row -> token
    counts = torch.zeros(N, dtype=torch.int32, device="cuda").scatter_add_(
        0, experts, torch.ones_like(experts, dtype=torch.int32)
    )
    cu = cute_gemm.cu_seqlens(counts.cumsum(0).to(torch.int32))
    buf = x[sources.long()]
    rows = buf.shape[0]
    w_up = torch.randn(N, D, 2 * H, **bf) / D**0.5  # moec: n-major, [gate | up] columns
    w_up_k = w_up.transpose(1, 2).contiguous()  # (N, 2H, D): k-major
    w_up_ik = _interleave_rows(w_up_k)  # k-major interleaved
    w_up_in = w_up_ik.transpose(1, 2).contiguous()  # n-major interleaved (cute_glu)
    w_down = torch.randn(N, H, D, **bf) / H**0.5
    d_out = torch.randn(T, D, **bf)
    d_y = d_out[sources.long()]
    score = torch.rand(rows, device="cuda")

    def up_plain(w: Tensor) -> Callable[[], Tensor]:
        return lambda: q.gemm(buf, w, cu_seqlens_m=cu)

    def up_act(w: Tensor, gather: bool, concat: bool) -> Callable[[], Tensor]:
        a_rows, idx = (x, sources) if gather else (buf, None)
        return lambda: q.gemm_act(
            a_rows, w, activation="swiglu", cu_seqlens_m=cu, A_idx=idx, store_preact=True,
            concat_layout=("B",) if concat else None,
        )[1]  # fmt: skip

    ref_h = q.gemm(buf, w_up, cu_seqlens_m=cu)
    gate, up = ref_h.float().chunk(2, dim=-1)
    ref_a = (F.silu(gate) * up).to(torch.bfloat16)
    cases: dict[str, tuple[Callable[[], Tensor], Tensor]] = {
        "up plain n-major (moec cute)": (up_plain(w_up), ref_h),
        "up plain k-major": (up_plain(w_up_k.transpose(1, 2)), ref_h),
        "up swiglu n-major interleaved (cute_glu)": (up_act(w_up_in, False, False), ref_a),
        "up swiglu k-major interleaved": (up_act(w_up_ik.transpose(1, 2), False, False), ref_a),
        "up swiglu k-major concat": (up_act(w_up_k.transpose(1, 2), False, True), ref_a),
        "up swiglu k-major concat, A_idx": (up_act(w_up_k.transpose(1, 2), True, True), ref_a),
        "up swiglu n-major interleaved, A_idx": (up_act(w_up_in, True, False), ref_a),
    }
    h_i = q.gemm_act(buf, w_up_in, activation="swiglu", cu_seqlens_m=cu, store_preact=True)[0]
    w_down_t = w_down.transpose(1, 2)  # (N, D, H) view: k-major B for d_y @ w_down^T
    ref_dh = q.gemm_dact(d_y, w_down_t, h_i, activation="swiglu", cu_seqlens_m=cu)[0]
    ref_scaled = q.gemm_dact(
        d_y * score[:, None].to(d_y.dtype), w_down_t, h_i, activation="swiglu", cu_seqlens_m=cu
    )[0]
    cases["dgrad_act swiglu (cute_glu)"] = (
        lambda: q.gemm_dact(d_y, w_down_t, h_i, activation="swiglu", cu_seqlens_m=cu)[0],
        ref_dh,
    )
    cases["dgrad_act swiglu, row scale + reduce, A_idx"] = (
        lambda: q.gemm_dact(
            d_out,
            w_down_t,
            h_i,
            activation="swiglu",
            cu_seqlens_m=cu,
            A_idx=sources,
            colvec_scale=score,
            colvec_reduce=True,
        )[0],  # fmt: skip
        ref_scaled,
    )
    d_h = torch.randn(rows, 2 * H, **bf)
    ref_dx = q.gemm(d_h, w_up.transpose(1, 2), cu_seqlens_m=cu)
    cases["dgrad n-major w_up (moec)"] = (
        lambda: q.gemm(d_h, w_up.transpose(1, 2), cu_seqlens_m=cu),
        ref_dx,
    )
    cases["dgrad k-major w_up"] = (lambda: q.gemm(d_h, w_up_k, cu_seqlens_m=cu), ref_dx)
    ref_dw = cute_gemm.gmm_wgrad(buf, d_h, cu[1:], torch.bfloat16)
    cases["wgrad up from buffer (moec)"] = (
        lambda: cute_gemm.gmm_wgrad(buf, d_h, cu[1:], torch.bfloat16),
        ref_dw,
    )
    cases["wgrad up, A_idx"] = (
        lambda: cute_gemm.gmm_wgrad(x, d_h, cu[1:], torch.bfloat16, sources),
        ref_dw,
    )
    dw_k = torch.empty(N, 2 * H, D, **bf)

    def wgrad_k_major() -> Tensor:
        q.gemm(x.t(), d_h, out=dw_k.transpose(1, 2), cu_seqlens_k=cu, A_idx=sources)
        return dw_k.transpose(1, 2)

    cases["wgrad up, A_idx, written k-major"] = (wgrad_k_major, ref_dw)

    results = {}
    print(f"device: {torch.cuda.get_device_name()}  rows {rows}  D {D}  H {H}  experts {N}")
    for name, (fn, want) in cases.items():
        try:
            err = _rel(fn(), want)
            ms = do_bench(fn, rep=100)
        except Exception as e:  # a layout quack refuses: say so, time the rest
            print(f"{name:<48} failed: {type(e).__name__}: {str(e)[:160]}")
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        results[name] = {"ms": ms, "rel_err": err}
        print(f"{name:<48} {ms:7.3f} ms   (rel err {err:.1e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
