"""Ahead-of-time build of every moec kernel for a GPU target, without a GPU.

CI compiles each kernel for sm_90 (H100/H200), sm_100 (B200) and sm_103 (B300) with Triton's
``GPUTarget`` and checks the PTX: the Blackwell build of every kernel is known to compile even
where no Blackwell GPU runs the tests, and the GEMMs use the arch's MMA (wgmma on sm_90,
tcgen05.mma on sm_100+).

    python -m moec.kernels.build 90 100 103      # prints one line per (kernel, arch)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any

import triton
from triton.backends.compiler import GPUTarget

from moec.kernels import (
    activation,
    adamw,
    cross_entropy,
    ep_push,
    fp8_rowwise,
    grouped_gemm,
    grouped_tma,
    movement,
    rope,
    router,
)


@dataclass(frozen=True)
class KernelSpec:
    """One kernel specialization: pointer types by argument name, the constexprs, the config."""

    name: str
    fn: Any
    pointers: dict[str, str]
    constexprs: dict[str, Any]
    options: dict[str, int] = field(default_factory=dict)
    mma: bool = False  # a GEMM: its PTX must use the arch's tensor-core MMA

    def signature(self) -> dict[str, str]:
        sig = {}
        for arg in self.fn.arg_names:
            if arg in self.constexprs:
                sig[arg] = "constexpr"
            else:
                sig[arg] = self.pointers.get(arg, "i32")
        return sig


def _gmm_specs(family: str) -> list[KernelSpec]:
    common = {"NUM_EXPERTS": 32, "E_P2": 32, "ACT": 2, "IEEE": False}
    operands = ("x_ptr", "w_ptr", "h_ptr", "out_ptr", "d_h_ptr")
    pointer = (
        grouped_gemm._gmm_kernel, grouped_gemm.configs, "bias_ptr",
        {"HAS_BIAS": False, "EVEN_K": True},
        [("gmm", "gmm", {"EPILOGUE": 0, "GATED": False}),
         ("gmm_swiglu", "gmm2", {"EPILOGUE": 1, "GATED": True}),
         ("gmm_swiglu_backward", "gmm", {"EPILOGUE": 2, "GATED": True})],
    )  # fmt: skip
    tma = (
        grouped_tma._gmm_tma_kernel, grouped_tma.configs, None, {"NUM_SMS": 132},
        [("gmm_tma_dgrad", "gmm", {"EPILOGUE": 0, "GATED": False, "W_TRANSPOSED": True}),
         ("gmm_tma_swiglu", "gmm2", {"EPILOGUE": 1, "GATED": True, "W_TRANSPOSED": False}),
         ("gmm_tma_swiglu_backward", "gmm", {"EPILOGUE": 2, "GATED": True,
                                             "W_TRANSPOSED": True})],
    )  # fmt: skip
    specs = []
    for fn, configs, bias, extra_base, variants in (pointer, tma):
        ptrs = {n: "*bf16" for n in (*operands, bias) if n} | {"offsets_ptr": "*i32"}
        for name, kind, extra in variants:
            config = configs(kind, family)[0]
            specs.append(
                KernelSpec(
                    name, fn, ptrs, common | extra_base | extra | config.kwargs,
                    {"num_warps": config.num_warps, "num_stages": config.num_stages}, mma=True,
                )
            )  # fmt: skip
    config = grouped_gemm.configs("wgrad", family)[0]
    specs.append(
        KernelSpec(
            "gmm_wgrad", grouped_gemm._gmm_wgrad_kernel,
            {"x_ptr": "*bf16", "dy_ptr": "*bf16", "dw_ptr": "*fp32", "offsets_ptr": "*i32"},
            {"IEEE": False} | config.kwargs,
            {"num_warps": config.num_warps, "num_stages": config.num_stages}, mma=True,
        )
    )  # fmt: skip
    return specs


def kernel_specs(capability: int) -> list[KernelSpec]:
    """Every kernel of :mod:`moec.kernels` in the specialization the 2x8192-token layer uses."""
    family = "sm100" if capability >= 100 else "sm90"
    k = {"TOP_K": 8, "K_P2": 8}
    route_ptrs = {
        "logits_ptr": "*bf16", "ids_ptr": "*i64", "weights_ptr": "*fp32", 
        "hist_ptr": "*i32", "before_ptr": "*i32", "counts_ptr": "*i64", "offsets_ptr": "*i32",
        "starts_ptr": "*i32",
        "base_ptr": "*i32", "rows_ptr": "*i64",
    }  # fmt: skip
    move_ptrs = {
        "x_ptr": "*bf16", "buf_ptr": "*bf16", "y_ptr": "*bf16", "out_ptr": "*bf16",
        "d_out_ptr": "*bf16", "d_y_ptr": "*bf16", "rows_ptr": "*i64", "weights_ptr": "*fp32",
        "d_weights_ptr": "*fp32",
    }  # fmt: skip
    move = {"TOP_K": 8, "BLOCK_T": movement.BLOCK_T}
    act_ptrs = {n: "*bf16" for n in ("h_ptr", "d_a_ptr", "a_ptr", "d_h_ptr")}
    act = {"ACT": 2, "GATED": True, "BLOCK_R": 16, "BLOCK_H": 256}
    return [
        KernelSpec(
            "route_topk", router._route_topk_kernel, route_ptrs,
            k | {"N_P2": 32, "BLOCK_T": 128, "GATING": 0, "NORMALIZE": True, "LEARNED": True},
            {"num_warps": 8},
        ),
        KernelSpec(
            "route_scan", router._route_scan_kernel, route_ptrs, {"N_P2": 32, "BLOCK_B": 256}
        ),
        KernelSpec(
            "route_rows", router._route_rows_kernel, route_ptrs, k | {"N_P2": 32, "BLOCK_T": 128}
        ),
        KernelSpec("dispatch", movement._dispatch_kernel, move_ptrs, move | {"BLOCK_D": 512}),
        KernelSpec(
            "combine", movement._combine_kernel, move_ptrs,
            move | {"BLOCK_D": 512, "HAS_WEIGHTS": True},
        ),
        KernelSpec(
            "combine_backward", movement._combine_backward_kernel, move_ptrs,
            move | k | {"BLOCK_D": 256},
        ),
        KernelSpec("act_forward", activation._act_kernel, act_ptrs, act | {"BACKWARD": False}),
        KernelSpec("act_backward", activation._act_kernel, act_ptrs, act | {"BACKWARD": True}),
        KernelSpec(
            "cross_entropy_rows", cross_entropy._cross_entropy_rows_kernel,
            {"logits_ptr": "*bf16", "targets_ptr": "*i64", "loss_ptr": "*fp32"},
            {"BLOCK_V": 4096}, {"num_warps": 8},
        ),
        KernelSpec(
            "rope", rope._rope_kernel,
            {"x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*bf16"},
            {"BACKWARD": False, "BLOCK_R": rope.BLOCK_R, "HALF_P2": 64}, {"num_warps": 4},
        ),
        KernelSpec(
            "adamw", adamw._adamw_kernel,
            {"param_ptr": "*fp32", "grad_ptr": "*bf16", "exp_avg_ptr": "*fp32",
             "exp_avg_sq_ptr": "*fp32", "copy_ptr": "*bf16", "grad_scale_ptr": "*fp32",
             "step_ptr": "*fp32", "found_inf_ptr": "*fp32", "lr_ptr": "*fp32",
             **dict.fromkeys(_floats_after("n", "HAS_COPY", adamw._adamw_kernel), "fp32")},
            {"HAS_COPY": True, "HAS_SCALE": True, "DEVICE_STEP": True, "DEVICE_LR": True,
             "HAS_FOUND_INF": True, "BLOCK": adamw.BLOCK},
        ),
        *_ep_specs(),
        *_fp8_specs(),
        *_gmm_specs(family),
    ]  # fmt: skip


def _floats_after(first: str, stop: str, fn: Any) -> list[str]:
    """The argument names of ``fn`` after ``first`` and before ``stop`` (host floats)."""
    names = fn.arg_names
    return names[names.index(first) + 1 : names.index(stop)]


def _ep_specs() -> list[KernelSpec]:
    """The EP rowwise transport's copy kernel."""
    ptrs = {
        "src_ptr": "*bf16", "weights_ptr": "*fp32", "address_ptr": "*i64", "peers_ptr": "*i64",
    }  # fmt: skip
    tile = {"ROUTES": ep_push.ROUTES, "COLS": ep_push.COLS}
    return [
        KernelSpec(
            f"ep_push_rows_k{top_k}", ep_push._push_rows_kernel, ptrs,
            tile | {"TOP_K": top_k, "HAS_WEIGHTS": top_k > 1},
        )
        for top_k in (8, 1)  # dispatch (weighted in combine's backward); combine
    ]  # fmt: skip


def _fp8_specs() -> list[KernelSpec]:
    """The FP8 rowwise quantizers: rows (plain, after a fused SwiGLU, and wide rows in chunks)
    and weight columns (one program per column block, or K split over an amax and a codes
    kernel)."""
    rows = {"x_ptr": "*bf16", "codes_ptr": "*fp8e4nv", "scales_ptr": "*fp32"}
    one_pass = {"BLOCK_R": 4, "BLOCK_K": 2048, "ONE_PASS": True}
    weight = {"w_ptr": "*bf16", "codes_ptr": "*fp8e4nv", "scales_ptr": "*fp32"}
    tile = {"BLOCK_K": 64, "BLOCK_N": 64}
    return [
        KernelSpec(
            "fp8_quantize_rows", fp8_rowwise.rowwise_quantize_kernel, rows,
            one_pass | {"ACT": -1, "GATED": False},
        ),
        KernelSpec(
            "fp8_quantize_swiglu_rows", fp8_rowwise.rowwise_quantize_kernel, rows,
            one_pass | {"ACT": 2, "GATED": True},
        ),
        KernelSpec(
            "fp8_quantize_wide_rows", fp8_rowwise.rowwise_quantize_kernel, rows,
            {"BLOCK_R": 1, "BLOCK_K": fp8_rowwise.ROW_CHUNK, "ONE_PASS": False, "ACT": -1,
             "GATED": False},
            {"num_warps": 8},
        ),
        KernelSpec("fp8_quantize_weight", fp8_rowwise.columnwise_quantize_kernel, weight, tile),
        KernelSpec(
            "fp8_weight_amax", fp8_rowwise.column_amax_kernel,
            {"w_ptr": "*bf16", "amax_ptr": "*fp32"}, tile | {"SPLIT_K": 1024},
        ),
        KernelSpec(
            "fp8_weight_codes", fp8_rowwise.column_codes_kernel,
            weight | {"amax_ptr": "*fp32"}, tile,
        ),
    ]  # fmt: skip


def compile_spec(spec: KernelSpec, capability: int) -> str:
    """PTX of ``spec`` for ``sm_<capability>``."""
    src = triton.compiler.ASTSource(
        fn=spec.fn, signature=spec.signature(), constexprs=spec.constexprs
    )
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=spec.options)
    return compiled.asm["ptx"]


def check_ptx(spec: KernelSpec, capability: int, ptx: str) -> str | None:
    """None if the PTX is what the arch needs, else what is wrong."""
    if f".target sm_{capability}" not in ptx:
        return f"PTX does not target sm_{capability}"
    if spec.mma:
        needle = "tcgen05.mma" if capability >= 100 else "wgmma.mma_async"
        if needle not in ptx:
            return f"no {needle} in the PTX"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("capabilities", type=int, nargs="+", help="e.g. 90 100 103")
    args = parser.parse_args(argv)
    failed = 0
    for cap in args.capabilities:
        for spec in kernel_specs(cap):
            try:
                problem = check_ptx(spec, cap, compile_spec(spec, cap))
            except Exception as err:  # report every kernel, then fail
                problem = f"{type(err).__name__}: {err}".splitlines()[0]
            failed += problem is not None
            print(f"{'FAIL' if problem else 'ok  '} sm_{cap} {spec.name} {problem or ''}".rstrip())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
