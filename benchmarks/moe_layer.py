"""One MoE layer forward + backward: moec kernels vs a per-expert loop vs sort + _grouped_mm.

The report's profiling workload: tokens 2 x 8192, d 1536, 32 routed experts top-8 with SwiGLU
width 1536, one shared SwiGLU expert of width 1536, capacity factor 1.25, bf16 weights.

  moec      torch.ops.moec.{route, dispatch, expert_mlp, combine} on the implementations this
            machine's target binds (moec.kernels.target.Target.detect)
  loop      (a) torch routing, then per expert: nonzero -> gather -> two matmuls -> index_add
  sorted    (b) torch routing (stable sort ranks), gather, torch._grouped_mm x2, bmm combine
  reference the ops' reference implementations under autograd, the grouped GEMMs as a masked
            loop (the oracle all three must match)
  moec_k_major  the moec layer with k-major expert weights (stacked nn.Linear layout, what
            SonicMoE keeps): with quack, the gated epilogues read w_up's [gate | up] dim as
            pairs, no weight copies
  moec_combined  k-major weights, moec.expert_mlp with the dispatch and combine inside
            (lowering.combine_in_experts): with quack, the up projection reads token rows
            through A_idx, the route weights and their gradient in the down dgrad's epilogue
  sonic     the anchor, where sonic-moe is installed: SonicMoE's layer (its top-k router,
            quack GEMMs with the gather in the up projection's A loads, route weights and their
            gradient in the down projection's dgrad epilogue) + the same shared expert, its
            weights held in its own layout (gate/up interleaved, contraction dim contiguous)

Prints the layer time, the expert-path TFLOP/s (expert_mlp forward + backward alone, FLOPs of
the accepted routes) and ratios; ``--pieces`` also times each expert GEMM on every backend
(moec's pointer and TMA kernels, ``torch._grouped_mm``, the CuTe DSL kernels of quack-kernels
when installed), which is how :data:`moec.kernels.gemm_backend.GEMM_BACKENDS` is set. With quack
installed, "moec" runs the policy with its CuTe DSL rules and "moec_triton" the same policy
without them (a target without quack: what runs where quack is not installed), both in the
same run.

``--kernels N`` profiles a few steps of the moec layer (and of the anchor, where installed) and
prints each one's N largest kernels, ms per step: where the two layers' time differs.

    python benchmarks/moe_layer.py [--pieces] [--kernels N] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from triton.testing import do_bench

from moec.kernels import gemm_backend, grouped_gemm
from moec.kernels.gemm_backend import GemmPolicy
from moec.kernels.target import Target
from moec.ops.activations import kernel_activation
from moec.ops.movement import combine_reference, dispatch_reference
from moec.ops.routing import assign_rows, capacity, route_reference

T, D, N, K, H, CF = 2 * 8192, 1536, 32, 8, 1536, 1.25
TARGET = Target.detect("cuda" if torch.cuda.is_available() else "cpu")
"""This machine's GPU (the CPU's target where there is none: ``--help`` runs anywhere)."""
EXPERTS = TARGET.expert_impl("bf16")
"""The expert MLP's implementation on this machine (the CuTe DSL rules where quack is)."""
WITHOUT_QUACK = dataclasses.replace(TARGET, quack=False).expert_impl("bf16")
BACKENDS = ("pointer", "tma", "grouped_mm") + (("cute", "cute_glu") if TARGET.quack else ())


def make_params(device: str) -> dict[str, Tensor]:
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape: int, fan_in: int) -> Tensor:
        w = torch.randn(*shape, device=device, generator=g) / fan_in**0.5
        return w.to(torch.bfloat16).requires_grad_()

    return {
        "router": rnd(D, N, fan_in=D),
        "w_up": rnd(N, D, 2 * H, fan_in=D),
        "w_down": rnd(N, H, D, fan_in=H),
        "s_up": rnd(D, 2 * H, fan_in=D),
        "s_down": rnd(H, D, fan_in=H),
    }


def swiglu(h: Tensor) -> Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def shared(x: Tensor, p: dict[str, Tensor]) -> Tensor:
    return swiglu(x @ p["s_up"]) @ p["s_down"]


def layer_moec(x: Tensor, p: dict[str, Tensor], impl: str = EXPERTS) -> Tensor:
    """The layer on the ops, the expert MLP on implementation ``impl``."""
    ops = torch.ops.moec
    _, weights, rows, offsets, _ = ops.route(x @ p["router"], K, CF, "softmax", True, "learned")
    buf = ops.dispatch(x, rows)
    y, _ = ops.expert_mlp(buf, p["w_up"], p["w_down"], offsets, None, None, "swiglu", "bf16",
                          None, None, impl)  # fmt: skip
    return ops.combine(y, weights, rows) + shared(x, p)


def layer_moec_combined(x: Tensor, p: dict[str, Tensor], impl: str = EXPERTS) -> Tensor:
    """The layer with the dispatch and combine inside the expert MLP."""
    ops = torch.ops.moec
    _, weights, rows, offsets, _ = ops.route(x @ p["router"], K, CF, "softmax", True, "learned")
    out, _ = ops.expert_mlp(x, p["w_up"], p["w_down"], offsets, None, None, "swiglu", "bf16",
                            rows, weights, impl)  # fmt: skip
    return out + shared(x, p)


def layer_reference(x: Tensor, p: dict[str, Tensor]) -> Tensor:
    """The reference implementations, the grouped GEMMs as the masked per-expert loop
    (independent of the kernels and of torch._grouped_mm)."""
    _, weights, rows, offsets, _ = route_reference(
        x @ p["router"], K, CF, "softmax", True, "learned"
    )
    buf = dispatch_reference(x, rows)
    y, _ = torch.ops.moec.expert_mlp(buf, p["w_up"], p["w_down"], offsets, None, None, "swiglu",
                                     "bf16", None, None, "loop")  # fmt: skip
    return combine_reference(y, weights, rows) + shared(x, p)


def _torch_routing(x: Tensor, p: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    logits = (x @ p["router"]).float()
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :K]
    weights = logits.softmax(-1).gather(-1, ids)
    weights = weights / weights.sum(-1, keepdim=True)
    rows, offsets, _ = assign_rows(ids, N, capacity(T, K, N, CF))
    return ids, weights, rows, offsets


def layer_sorted(x: Tensor, p: dict[str, Tensor]) -> Tensor:
    _, weights, rows, offsets = _torch_routing(x, p)
    valid = rows >= 0
    token = torch.arange(T * K, device=x.device) // K
    slot = torch.where(valid, rows, T * K).view(-1)
    row_token = torch.zeros(T * K + 1, dtype=torch.long, device=x.device).scatter_(0, slot, token)
    buf = x[row_token[: T * K]]
    h = torch._grouped_mm(buf, p["w_up"], offs=offsets)
    y = torch._grouped_mm(swiglu(h), p["w_down"], offs=offsets)
    picked = torch.where(valid[..., None], y[rows.clamp(min=0)], 0.0)  # (T, K, D)
    w = torch.where(valid, weights, 0.0).to(x.dtype)
    return torch.bmm(w[:, None, :], picked)[:, 0] + shared(x, p)


def layer_loop(x: Tensor, p: dict[str, Tensor]) -> Tensor:
    ids, weights, rows, _ = _torch_routing(x, p)
    out = torch.zeros(T, D, device=x.device, dtype=torch.float32)
    for e in range(N):
        tok, k = ((ids == e) & (rows >= 0)).nonzero(as_tuple=True)
        ye = swiglu(x[tok] @ p["w_up"][e]) @ p["w_down"][e]
        out = out.index_add(0, tok, ye.float() * weights[tok, k, None])
    return out.to(x.dtype) + shared(x, p)


LAYERS: dict[str, Callable[[Tensor, dict[str, Tensor]], Tensor]] = {
    "moec": layer_moec,
    "sorted": layer_sorted,
    "loop": layer_loop,
}

K_MAJOR_LAYERS: dict[str, Callable[[Tensor, dict[str, Tensor]], Tensor]] = {
    "moec_k_major": layer_moec,
    "moec_combined": layer_moec_combined,
}
"""Rows run with k-major expert weights (the compiler's default layout), where quack is."""


def sonic_params(p: dict[str, Tensor]) -> dict[str, Tensor]:
    """p in SonicMoE's layouts, as leaves: router (N, D); w1 (N, 2H, D) with gate and up rows
    interleaved; w2 (N, D, H). Same keys order as p, so gradients line up."""

    def leaf(t: Tensor) -> Tensor:
        return t.detach().contiguous().requires_grad_()

    gate, up = p["w_up"].detach().chunk(2, dim=-1)
    w1 = torch.stack((gate, up), dim=-1).flatten(-2).transpose(1, 2)
    return {
        "router": leaf(p["router"].t()),
        "w1": leaf(w1),
        "w2": leaf(p["w_down"].transpose(1, 2)),
        "s_up": p["s_up"],
        "s_down": p["s_down"],
    }


def sonic_grads_to_p(grads: list[Tensor]) -> list[Tensor]:
    """[x, router, w1, w2, s_up, s_down] gradients in p's layouts."""
    d_x, d_router, d_w1, d_w2, *rest = grads
    d_w1 = d_w1.transpose(1, 2)  # (N, D, 2H), interleaved
    d_up = torch.cat((d_w1[..., 0::2], d_w1[..., 1::2]), dim=-1)
    return [d_x, d_router.t(), d_up, d_w2.transpose(1, 2), *rest]


def k_major_leaf(w: Tensor) -> Tensor:
    """``w`` (N, K, M) with the same values, its contraction dim K unit-stride."""
    return w.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()


def layer_sonic(x: Tensor, ps: dict[str, Tensor]) -> Tensor:
    from sonicmoe.functional import moe_TC_softmax_topk_layer

    out, _, _ = moe_TC_softmax_topk_layer(
        x, ps["router"], ps["w1"].permute(1, 2, 0), None, ps["w2"].permute(1, 2, 0), None, K,
        torch.cuda.current_stream().cuda_stream, "swiglu",
    )  # fmt: skip
    return out + shared(x, ps)


def have_sonic() -> bool:
    try:
        import sonicmoe  # noqa: F401
    except ImportError:
        return False
    return True


def fwd_bwd(fn: Callable, x: Tensor, p: dict[str, Tensor], grad: Tensor) -> list[Tensor]:
    for t in (x, *p.values()):
        t.grad = None
    fn(x, p).backward(grad)
    return [x.grad, *(t.grad for t in p.values())]


def reference(x: Tensor, p: dict[str, Tensor], grad: Tensor) -> list[Tensor]:
    """Output and gradients of :func:`layer_reference`."""
    out = layer_reference(x, p).detach()
    return [out, *fwd_bwd(layer_reference, x, p, grad)]


def check(name: str, fn: Callable, x: Tensor, p: dict[str, Tensor], grad: Tensor,
          want: list[Tensor], to_p: Callable = lambda g: g) -> float:  # fmt: skip
    """Max relative error over the output and all gradients (``to_p`` maps them into the
    reference's layouts) against the reference."""
    got = [fn(x, p).detach(), *to_p(fwd_bwd(fn, x, p, grad))]
    errs = [
        (a.float() - b.float()).norm() / b.float().norm() for a, b in zip(got, want, strict=True)
    ]
    worst = max(e.item() for e in errs)
    if not worst < 2e-2:
        raise AssertionError(f"{name}: relative error {worst:.3g} against the reference")
    return worst


def expert_path(
    buf: Tensor, offsets: Tensor, p: dict[str, Tensor], dy: Tensor, impl: str = EXPERTS
) -> dict[str, float]:
    """Milliseconds of expert_mlp forward + backward on ``impl``: moec op (n-major weights, and
    k-major where quack is installed) vs _grouped_mm under autograd."""
    w_up, w_down = p["w_up"], p["w_down"]

    def moec_step(w_up: Tensor = w_up, w_down: Tensor = w_down) -> None:
        y, _ = torch.ops.moec.expert_mlp(buf, w_up, w_down, offsets, None, None, "swiglu",
                                         "bf16", None, None, impl)  # fmt: skip
        torch.autograd.grad(y, (buf, w_up, w_down), dy)

    def sorted_step() -> None:
        h = torch._grouped_mm(buf, w_up, offs=offsets)
        y = torch._grouped_mm(swiglu(h), w_down, offs=offsets)
        torch.autograd.grad(y, (buf, w_up, w_down), dy)

    times = {"moec": do_bench(moec_step), "sorted": do_bench(sorted_step)}
    if TARGET.quack:
        k_up, k_down = k_major_leaf(w_up), k_major_leaf(w_down)
        times["k_major"] = do_bench(lambda: moec_step(k_up, k_down))
    return times


def pieces(buf: Tensor, offsets: Tensor, p: dict[str, Tensor]) -> list[dict]:
    """Each expert GEMM on every backend (ms); how :data:`GEMM_BACKENDS` is set."""
    w_up, w_down = p["w_up"].detach(), p["w_down"].detach()
    x = buf.detach()
    swiglu = kernel_activation("swiglu")
    h, a = grouped_gemm.gmm_act(x, w_up, offsets, None, swiglu, None, TARGET.gemm_policy())
    dy = torch.randn_like(x)
    d_h = torch.randn_like(h)
    gg = grouped_gemm

    def cases(policy: GemmPolicy) -> dict[str, Callable[[], object]]:
        def dgrad_act() -> tuple[Tensor, Tensor]:  # the forced backend's h layout (timing only)
            interleaved = gg.h_interleaved(x, w_up, False, swiglu, policy)
            return gg.gmm_act_backward(dy, w_down, offsets, h, swiglu, interleaved, policy)

        return {
            "up": lambda: gg.gmm_act(x, w_up, offsets, None, swiglu, None, policy),
            "down": lambda: gg.gmm(a, w_down, offsets, None, "down", policy),
            "dgrad_act": dgrad_act,
            "dgrad": lambda: gg.gmm(d_h, w_up.transpose(-1, -2), offsets, None, "dgrad", policy),
            "wgrad_down": lambda: gg.gmm_wgrad(a, dy, offsets, None, policy),
            "wgrad_up": lambda: gg.gmm_wgrad(x, d_h, offsets, None, policy),
        }

    out = []
    for name in cases(TARGET.gemm_policy()):
        times = {}
        for backend in BACKENDS:
            if (backend == "tma" and name.startswith("wgrad")) or (
                backend == "cute_glu" and name not in ("up", "dgrad_act")
            ):  # no TMA wgrad; cute_glu differs from cute on the gated pieces alone
                continue
            times[backend] = do_bench(cases(GemmPolicy.parse(backend))[name])
        out.append({"piece": name, **times})
    return out


def profiled_kernels(fn: Callable, x: Tensor, p: dict[str, Tensor], grad: Tensor,
                     steps: int = 5) -> dict[str, tuple[float, int]]:  # fmt: skip
    """Device ms and launches per fwd+bwd step of ``fn``, by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.profile_step import kernel_times

    fwd_bwd(fn, x, p, grad)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fwd_bwd(fn, x, p, grad)
        torch.cuda.synchronize()
    return {k: (ms / steps, n // steps) for k, (ms, n) in kernel_times(prof).items()}


def print_kernels(name: str, kernels: dict[str, tuple[float, int]], top: int) -> None:
    total = sum(ms for ms, _ in kernels.values())
    print(f"\n=== {name}: {total:.3f} ms of kernels per step; the {top} largest (ms, launches)")
    for kernel, (ms, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {ms:7.3f} {count:4d}  {kernel[:110]}")


def base_ms(results: dict) -> float:
    return results["layers"]["moec"]["ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pieces", action="store_true", help="time each expert GEMM both ways")
    parser.add_argument("--skip-loop", action="store_true")
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="profile the moec (and anchor) layer: N largest kernels each",
    )
    parser.add_argument(
        "--layers", default=None, help="comma-separated rows to run (default all; moec always)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    p = make_params(dev)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16).requires_grad_()
    grad = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(gemm_backend.policy_text(TARGET.arch, TARGET.gemm_policy()))

    _, _, rows, offsets, _ = torch.ops.moec.route(
        x @ p["router"], K, CF, "softmax", True, "learned"
    )
    accepted = int(offsets[-1])
    expert_flops = 6 * accepted * D * 3 * H  # up (D x 2H) + down (H x D), fwd + 2x bwd
    print(f"accepted routes {accepted} of {T * K}; expert-path GFLOP {expert_flops / 1e9:.0f}")

    results: dict = {"accepted": accepted, "layers": {}, "policy": gemm_backend.GEMM_BACKENDS}
    wanted = set(args.layers.split(",")) if args.layers else None

    def runs(name: str) -> bool:
        return wanted is None or name in wanted or name == "moec"

    names = [n for n in LAYERS if not (args.skip_loop and n == "loop") and runs(n)]
    want = reference(x, p, grad)
    for name in names:
        err = check(name, LAYERS[name], x, p, grad, want)
        ms = do_bench(lambda fn=LAYERS[name]: fwd_bwd(fn, x, p, grad), rep=200)
        results["layers"][name] = {"ms": ms, "max_rel_err": err}
        print(f"{name:<8} fwd+bwd {ms:8.3f} ms   (max rel err vs reference {err:.2e})")
    pk = {**p, "w_up": k_major_leaf(p["w_up"]), "w_down": k_major_leaf(p["w_down"])}
    for name, layer in K_MAJOR_LAYERS.items():
        if not (TARGET.quack and runs(name)):
            continue
        err = check(name, layer, x, pk, grad, want)
        ms = do_bench(lambda layer=layer: fwd_bwd(layer, x, pk, grad), rep=200)
        results["layers"][name] = {"ms": ms, "max_rel_err": err}
        names.append(name)
        print(f"{name:<8} fwd+bwd {ms:8.3f} ms   (max rel err vs reference {err:.2e})")
    if not runs("sonic"):
        pass
    elif have_sonic() and accepted < T * K:
        print("sonic-moe is dropless and the capacity dropped routes: no anchor row")
    elif have_sonic():
        ps = sonic_params(p)
        err = check("sonic", layer_sonic, x, ps, grad, want, sonic_grads_to_p)
        ms = do_bench(lambda: fwd_bwd(layer_sonic, x, ps, grad), rep=200)
        results["layers"]["sonic"] = {"ms": ms, "max_rel_err": err}
        names.append("sonic")
        print(f"{'sonic':<8} fwd+bwd {ms:8.3f} ms   (max rel err vs reference {err:.2e})")
    else:
        print("sonic-moe not installed: no anchor row")
    if TARGET.quack and runs("moec_triton"):  # the same target without the CuTe DSL
        fn = functools.partial(layer_moec, impl=WITHOUT_QUACK)
        err = check("moec_triton", fn, x, p, grad, want)
        ms = do_bench(lambda: fwd_bwd(fn, x, p, grad), rep=200)
        results["layers"]["moec_triton"] = {"ms": ms, "max_rel_err": err}
        names.append("moec_triton")
        print(f"moec_triton fwd+bwd {ms:8.3f} ms   (max rel err vs reference {err:.2e})")

    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keep the device busy: measure what the host alone takes
    start = time.perf_counter()
    for _ in range(5):
        fwd_bwd(layer_moec, x, p, grad)
    host_ms = (time.perf_counter() - start) / 5 * 1e3
    torch.cuda.synchronize()
    results["moec_host_submit_ms"] = host_ms
    print(f"moec host submit {host_ms:.2f} ms/step (device {base_ms(results):.2f} ms/step)")

    buf = torch.ops.moec.dispatch(x.detach(), rows).requires_grad_()
    dy = torch.randn_like(buf)
    ep = expert_path(buf, offsets, p, dy)
    if TARGET.quack and runs("moec_triton"):
        ep["moec_triton"] = expert_path(buf, offsets, p, dy, WITHOUT_QUACK)["moec"]
    results["expert_path_ms"] = ep
    for name, ms in ep.items():
        print(f"expert path {name:<7} {ms:8.3f} ms  {expert_flops / ms / 1e9:7.1f} TFLOP/s")
    base = results["layers"]
    for name in names[1:]:
        print(f"moec vs {name}: {base[name]['ms'] / base['moec']['ms']:.2f}x layer")
    print(f"moec vs sorted, expert path: {ep['sorted'] / ep['moec']:.2f}x")
    if args.pieces:
        results["pieces"] = pieces(buf, offsets, p)
        for r in results["pieces"]:
            times = "  ".join(f"{b} {ms:6.3f}" for b, ms in r.items() if b != "piece")
            print(f"piece {r['piece']:<11} {times} ms")
    if args.kernels:
        profiled = {"moec": (layer_moec, p)}
        for name, layer in K_MAJOR_LAYERS.items():
            if name in results["layers"]:
                profiled[name] = (layer, pk)
        if "sonic" in results["layers"]:
            profiled["sonic"] = (layer_sonic, ps)
        results["kernels"] = {}
        for name, (fn, params) in profiled.items():
            kernels = profiled_kernels(fn, x, params, grad)
            results["kernels"][name] = kernels
            print_kernels(name, kernels, args.kernels)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
