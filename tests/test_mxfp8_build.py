"""The Blackwell build of every MXFP8 kernel, compiled on the CPU for sm_100 and sm_103.

Triton lowers ``tl.dot_scaled`` to native block-scaled MMA only on sm100+; the GEMM kernels'
PTX must contain ``tcgen05.mma ... block_scale`` (the test fails if Triton fell back to the
emulated path). No GPU is needed: ``triton.compile`` with a ``GPUTarget`` stops at PTX/cubin.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402

from moec.kernels import mxfp8  # noqa: E402

I32 = "i32"
# dot_scaled lowers to native block-scaled MMA only for 128-row tiles (64 falls back to f16 MMA)
GEMM_META = {"G": 4, "G_POW2": 4, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128}


def _gemm_signature(a: str, b: str) -> dict[str, str]:
    sig = {
        "a_ptr": a,
        "a_scale_ptr": "*u8",
        "b_ptr": b,
        "b_scale_ptr": "*u8",
        "out_ptr": "*bf16",
        "offsets_ptr": "*i32",
    }
    sig |= dict.fromkeys(["M", "N", "K"], I32)
    sig |= dict.fromkeys(
        [
            "stride_am",
            "stride_ak",
            "stride_asm",
            "stride_ask",
            "stride_bg",
            "stride_bn",
            "stride_bk",
            "stride_bsg",
            "stride_bsn",
            "stride_bsk",
            "stride_om",
            "stride_on",
        ],
        I32,
    )
    return sig


def _variants() -> dict[str, tuple[object, dict[str, str], dict[str, object], bool]]:
    """name -> (kernel, signature, constexprs, expects block-scaled MMA)."""
    quantize_sig = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*u8", "R": I32, "K": I32}
    quantize_sig |= dict.fromkeys(["stride_xr", "stride_xk", "stride_qr", "stride_sr"], I32)
    wgrad_sig = {
        "a_ptr": "*bf16",
        "b_ptr": "*bf16",
        "out_ptr": "*fp32",
        "offsets_ptr": "*i32",
        "K": I32,
        "N": I32,
    }
    wgrad_sig |= dict.fromkeys(
        ["stride_ar", "stride_ak", "stride_br", "stride_bn", "stride_og", "stride_ok", "stride_on"],
        I32,
    )
    return {
        "quantize": (
            mxfp8.mx_quantize_kernel,
            quantize_sig,
            {"BLOCK_R": 32, "BLOCK_K": 128},
            False,
        ),
        "gmm_prequantized": (
            mxfp8.mx_gmm_kernel,
            _gemm_signature("*u8", "*u8"),
            GEMM_META | {"A_QUANT": False, "B_QUANT": False},
            True,
        ),
        "gmm_fused_a": (
            mxfp8.mx_gmm_kernel,
            _gemm_signature("*bf16", "*u8"),
            GEMM_META | {"A_QUANT": True, "B_QUANT": False},
            True,
        ),
        "wgrad": (
            mxfp8.mx_gmm_wgrad_kernel,
            wgrad_sig,
            {"BLOCK_K": 128, "BLOCK_N": 128, "BLOCK_R": 128},
            True,
        ),
    }


def test_every_kernel_has_a_variant():
    covered = {kernel for kernel, *_ in _variants().values()}
    assert covered == set(mxfp8.KERNELS.values())


@pytest.mark.parametrize("capability", [100, 103], ids=["sm_100", "sm_103"])
@pytest.mark.parametrize("name", list(_variants()))
def test_blackwell_build_uses_block_scaled_mma(name, capability):
    kernel, signature, constexprs, expects_mma = _variants()[name]
    signature = signature | dict.fromkeys(constexprs, "constexpr")
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32))
    ptx = compiled.asm["ptx"]
    assert f".target sm_{capability}" in ptx
    mma = [line for line in ptx.splitlines() if "tcgen05.mma" in line]
    if expects_mma:
        assert mma, f"{name}: no tcgen05.mma in the sm_{capability} PTX (emulated dot_scaled?)"
        assert all("block_scale" in line for line in mma), mma[:2]
        assert any("kind::mxf8f6f4" in line for line in mma), mma[:2]
