"""Quantized GEMMs: the recipes of ``moec::expert_mlp`` and the op ``moec::quantized_linear``.

quantized_linear(x[*, K], weight[N, K], bias[N]?, recipe, impl="auto") -> y[*, N]
    ``aten.linear`` with its GEMMs in ``recipe``.

Recipes (the weights stay high precision masters; every step quantizes them afresh). The expert
MLP (``moec::expert_mlp`` with a ``recipe``) reads its weights in x's dtype (bf16 activations:
the bf16 working copies where the runtime keeps them); the linear follows autocast like
``aten.linear`` (registered for CPU and CUDA), so under bf16 compute both quantize from bf16:

- ``mxfp8``: OCP MX v1.0 e4m3 with E8M0 scales per 32 contraction elements, for the forward,
  dgrad and wgrad GEMMs (wgrad blocks run along the rows of each group, from its first row).
- ``fp8_rowwise``: e4m3 with one fp32 scale per row of the activation and per output channel
  of the weight (``amax / 448``) for the forward and dgrad GEMMs; wgrad in high precision.

Every GEMM here takes a ``path``, the bound implementation (:data:`PATHS`): ``reference``, the
oracle in plain torch (:func:`mx_quantize_reference` follows the spec literally);
``kernels``, mxfp8 on the fused Triton kernels of :mod:`moec.kernels.mxfp8` (which equal the
reference bit for bit in quantization; their MMA is native on sm100, emulated elsewhere);
``native``, the recipe on the arch's own kernels (mxfp8 as ``kernels``; fp8_rowwise on sm90's
``torch._scaled_grouped_mm``, never called elsewhere). Where neither runs a recipe, ``kernels``
and ``native`` multiply the fake-quantized operands on the grouped-GEMM kernels; a path that
does not take some operands runs the reference for them.
:meth:`moec.kernels.target.Target.expert_impl` binds the path.

The linear's backward GEMMs are an internal op, so AOTAutograd traces them as one opaque call
(never a kernel launch on fake tensors); the bias gradient stays plain torch in the formula::

    quantized_linear_backward(x, weight, d_y, recipe, impl) -> (d_x, d_weight)

All outputs are contiguous.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from moec.kernels.arch import HAVE_TRITON, KERNEL_DTYPES, float_supported
from moec.ops.binding import detected
from moec.ops.grouped import gmm, gmm_wgrad, row_experts

if HAVE_TRITON:
    from moec.kernels import fp8_rowwise
    from moec.kernels import grouped_gemm as kernel_gemm
    from moec.kernels.mxfp8 import mx_gmm, mx_gmm_wgrad

Recipe = Literal["mxfp8", "fp8_rowwise"]
RECIPES: tuple[str, ...] = ("mxfp8", "fp8_rowwise")
PATHS: tuple[str, ...] = ("reference", "kernels", "native")
MX_BLOCK = 32
E4M3_MAX = 448.0
E4M3_EMAX = 8
"""Exponent of the largest power of two in e4m3 (448 = 1.75 * 2^8): the spec's emax_elem."""
E8M0_NAN = 255
E4M3_NAN_CODE = 0x7F


# --- quantization references -------------------------------------------------------------------


def mx_quantize_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    """OCP MX v1.0 section 6.3 along the last dim: (codes float8_e4m3fn [*, K], scales uint8
    [*, ceil(K / 32)]); a short last block is padded with zeros. A block whose amax is inf or
    NaN gets scale 0xFF (NaN) and stores 0x7F in every element."""
    k = x.shape[-1]
    pad = -k % MX_BLOCK
    v = torch.nn.functional.pad(x.float(), (0, pad)).unflatten(-1, (-1, MX_BLOCK))
    amax = v.abs().amax(-1)  # NaN if any element is NaN
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): floor(log2 amax) = exp - 1
    shared = torch.where(amax > 0, exp - 1 - E4M3_EMAX, -127).clamp(-127, 127)
    finite = torch.isfinite(amax)
    scales = torch.where(finite, shared + 127, E8M0_NAN).to(torch.uint8)
    y = v * torch.ldexp(torch.ones_like(amax), -shared.where(finite, 0))[..., None]
    codes = y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(finite[..., None], codes, E4M3_NAN_CODE)
    codes = codes.flatten(-2)[..., :k].contiguous().view(torch.float8_e4m3fn)
    return codes, scales


def mx_dequantize(codes: Tensor, scales: Tensor) -> Tensor:
    """codes [*, K] e4m3, scales [*, ceil(K / 32)] E8M0 -> float32 [*, K] (NaN for NaN scales)."""
    k = codes.shape[-1]
    pad = -k % MX_BLOCK
    # 2^(s - 127) as two normal factors: a denormal 2^-127 operand would make every product
    # with a zero take the CPU's slow path (zero blocks are common: padding, empty groups).
    exp = scales.int() - 127
    ones = torch.ones_like(scales, dtype=torch.float32)
    high, low = torch.ldexp(ones, exp // 2), torch.ldexp(ones, exp - exp // 2)
    low = torch.where(scales == E8M0_NAN, torch.nan, low)
    v = torch.nn.functional.pad(codes.float(), (0, pad)).unflatten(-1, (-1, MX_BLOCK))
    return (v * high[..., None] * low[..., None]).flatten(-2)[..., :k]


def mx_fake_quantize(x: Tensor, dim: int = -1) -> Tensor:
    """x quantized to MXFP8 along ``dim`` and dequantized (float32, x's shape)."""
    moved = x.movedim(dim, -1)
    return mx_dequantize(*mx_quantize_reference(moved)).movedim(-1, dim)


def rowwise_quantize_reference(x: Tensor, dim: int = -1) -> tuple[Tensor, Tensor]:
    """e4m3 codes of x and fp32 scales ``amax / 448`` reduced over ``dim`` (kept as size 1);
    an all-zero slice gets scale 1."""
    x = x.float()
    amax = x.abs().amax(dim, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    codes = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def rowwise_fake_quantize(x: Tensor, dim: int = -1) -> Tensor:
    codes, scale = rowwise_quantize_reference(x, dim)
    return codes.float() * scale


# --- quantized grouped GEMMs ---------------------------------------------------------------------


def _valid_rows(out: Tensor, offsets: Tensor) -> Tensor:
    """Zero the rows past ``offsets[-1]`` (the kernels' contract; never garbage)."""
    rows = torch.arange(out.shape[0], device=out.device)
    return torch.where((rows < offsets[-1])[:, None], out, 0)


def _mx_kernels(a: Tensor, b: Tensor, recipe: str, path: str) -> bool:
    """Whether the Triton MXFP8 kernels run this call (path, recipe, device and dtypes)."""
    return (
        path in ("kernels", "native")
        and recipe == "mxfp8"
        and float_supported(a, b)
        and b.dtype in KERNEL_DTYPES
    )


def _rowwise_native(a: Tensor, b: Tensor, recipe: str, path: str) -> bool:
    """fp8_rowwise through ``torch._scaled_grouped_mm``: the native path, bf16 on sm90,
    16-aligned K and N."""
    if path != "native" or recipe != "fp8_rowwise" or a.dtype != torch.bfloat16:
        return False
    aligned = a.shape[-1] % 16 == 0 and b.shape[-1] % 16 == 0
    return aligned and fp8_rowwise.scaled_grouped_mm_available(a.device)


def quantized_gmm(
    a: Tensor, b: Tensor, offsets: Tensor, recipe: str, path: str, forward: bool = False
) -> Tensor:
    """``out[r] = a[r] @ b[e(r)]`` with a (R, K), b (G, K, N) each quantized along K from its
    own dtype (fp32 masters are not rounded to bf16 first) on ``path``; the result in a's
    dtype. ``forward``: a forward GEMM, which the sm90 fp8_rowwise path accumulates fast
    (:func:`moec.kernels.fp8_rowwise.rowwise_gmm`); dgrad accumulates exactly."""
    if _mx_kernels(a, b, recipe, path):
        return mx_gmm(a, b, offsets, a.dtype)
    if _rowwise_native(a, b, recipe, path):
        out = fp8_rowwise.rowwise_gmm(
            fp8_rowwise.rowwise_quantize(a),
            fp8_rowwise.quantize_weight(b),
            offsets,
            a.dtype,
            fast_accum=forward,
        )
        return _valid_rows(out, offsets)
    if recipe == "mxfp8":
        aq, bq = mx_fake_quantize(a), mx_fake_quantize(b, dim=-2)
    else:
        aq, bq = rowwise_fake_quantize(a), rowwise_fake_quantize(b, dim=-2)
    if path != "reference" and float_supported(aq):  # emulated on the grouped-GEMM kernels
        return _valid_rows(kernel_gemm.gmm(aq, bq, offsets), offsets).to(a.dtype)
    return _valid_rows(gmm(aq, bq, offsets), offsets).to(a.dtype)


def _fake_quantize_groups(x: Tensor, offsets: Tensor) -> Tensor:
    """MXFP8 along the rows of each group, 32-row blocks from the group's first row: every
    group is moved to a 32-aligned start of a padded buffer (static length), quantized
    columnwise there and moved back; rows past ``offsets[-1]`` become zeros."""
    rows, groups = x.shape[0], offsets.shape[0]
    experts = row_experts(offsets, rows)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    padded = (counts + MX_BLOCK - 1) // MX_BLOCK * MX_BLOCK
    padded_start = torch.cumsum(padded, 0) - padded
    group = experts.clamp(max=groups - 1)
    valid = experts < groups
    positions = torch.arange(rows, device=x.device)
    dest = padded_start[group] + positions - (offsets[group] - counts[group])
    length = rows + MX_BLOCK * groups
    dest = torch.where(valid, dest, length)  # garbage rows go to a dump row
    buffer = x.new_zeros(length + 1, x.shape[1]).index_copy(0, dest.long(), x)[:length]
    quantized = mx_fake_quantize(buffer, dim=0)
    return torch.where(valid[:, None], quantized[dest.clamp(max=length - 1)], 0)


def quantized_gmm_wgrad(a: Tensor, b: Tensor, offsets: Tensor, recipe: str, path: str) -> Tensor:
    """``out[g] = a_g^T @ b_g`` over the rows of group g: a (R, K), b (R, N) -> (G, K, N).

    mxfp8: both quantized along the rows, 32-row blocks from each group's first row.
    fp8_rowwise: unquantized, with float32 accumulation (bf16 operands stay bf16 on CUDA).
    """
    if _mx_kernels(a, b, recipe, path):
        return mx_gmm_wgrad(a, b, offsets, a.dtype)
    if recipe == "mxfp8":
        a, b = _fake_quantize_groups(a, offsets), _fake_quantize_groups(b, offsets)
    elif a.is_cuda and a.dtype == b.dtype == torch.bfloat16:
        return gmm_wgrad(a, b, offsets)  # the CUDA kernels accumulate bf16 products in float32
    return gmm_wgrad(a.float(), b.float(), offsets).to(a.dtype)


def _check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"unknown quantization recipe {recipe!r}; known: {RECIPES}")


# --- moec::quantized_linear ----------------------------------------------------------------------


def _one_group(rows: int, device: torch.device) -> Tensor:
    return torch.full((1,), rows, dtype=torch.int32, device=device)


def quantized_mm(a: Tensor, b: Tensor, recipe: str, path: str, forward: bool = False) -> Tensor:
    """``a @ b`` for a (R, K), b (K, N), each quantized along K: :func:`quantized_gmm` with one
    group, or on the sm90 fp8_rowwise path ``torch._scaled_mm`` (no offsets, no row mask)."""
    if _rowwise_native(a, b, recipe, path):
        b_codes, b_scales = fp8_rowwise.quantize_weight(b[None])
        a_q = fp8_rowwise.rowwise_quantize(a)
        return fp8_rowwise.rowwise_mm(a_q, (b_codes[0], b_scales), a.dtype, fast_accum=forward)
    return quantized_gmm(a, b[None], _one_group(a.shape[0], a.device), recipe, path, forward)


def quantized_mm_wgrad(a: Tensor, b: Tensor, recipe: str, path: str) -> Tensor:
    """``a^T @ b`` over all rows of a (R, M) and b (R, K): :func:`quantized_gmm_wgrad` with one
    group; fp8_rowwise on CUDA is one unquantized ``mm`` (float32 accumulation, as there)."""
    if recipe == "fp8_rowwise" and a.is_cuda:
        return a.t().mm(b)
    return quantized_gmm_wgrad(a, b, _one_group(a.shape[0], a.device), recipe, path)[0]


def linear_path(x: Tensor, recipe: str, impl: str) -> str:
    """The GEMM path of ``moec::quantized_linear``'s ``impl`` (``auto``: detected for x's
    device, as the expert MLP binds it)."""
    if impl == "auto":
        impl = detected(x.device).expert_impl(recipe)
    path = impl.partition(":")[0]
    if path not in PATHS or (path != "reference" and not HAVE_TRITON):
        raise ValueError(f"moec::quantized_linear: impl {impl!r}; known: 'auto', {PATHS}")
    return path


def quantized_linear_reference(
    x: Tensor, weight: Tensor, bias: Tensor | None, recipe: str, path: str = "reference"
):
    x2 = x.reshape(-1, x.shape[-1])
    y = quantized_mm(x2, weight.t(), recipe, path, forward=True)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("moec::quantized_linear", mutates_args=())
def quantized_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, recipe: str, impl: str = "auto"
) -> Tensor:
    _check_recipe(recipe)
    return quantized_linear_reference(x, weight, bias, recipe, linear_path(x, recipe, impl))


@quantized_linear.register_fake
def _quantized_linear_fake(x, weight, bias, recipe, impl="auto"):
    _check_recipe(recipe)
    if x.shape[-1] != weight.shape[1]:
        shapes = f"x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        raise ValueError(f"moec::quantized_linear: shapes do not fit: {shapes}")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx, inputs, output):
    x, weight, bias, recipe, impl = inputs
    ctx.save_for_backward(x, weight)
    ctx.recipe, ctx.impl = recipe, impl
    ctx.bias_dtype = None if bias is None else bias.dtype


@torch.library.custom_op("moec::quantized_linear_backward", mutates_args=())
def quantized_linear_backward(
    x: Tensor, weight: Tensor, d_y: Tensor, recipe: str, impl: str = "auto"
) -> tuple[Tensor, Tensor]:
    _check_recipe(recipe)
    path = linear_path(x, recipe, impl)
    x2, d_y2 = x.reshape(-1, x.shape[-1]), d_y.reshape(-1, d_y.shape[-1]).to(x.dtype)
    d_x = quantized_mm(d_y2, weight, recipe, path).reshape(x.shape)
    d_w = quantized_mm_wgrad(d_y2, x2, recipe, path).to(weight.dtype)
    return d_x.to(x.dtype).contiguous(), d_w.contiguous()


@quantized_linear_backward.register_fake
def _quantized_linear_backward_fake(x, weight, d_y, recipe, impl="auto"):
    _check_recipe(recipe)
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _linear_backward(ctx, d_y):
    x, weight = ctx.saved_tensors
    d_x, d_w = torch.ops.moec.quantized_linear_backward(x, weight, d_y, ctx.recipe, ctx.impl)
    d_y2 = d_y.reshape(-1, d_y.shape[-1]).to(x.dtype)
    d_b = None if ctx.bias_dtype is None else d_y2.float().sum(0).to(ctx.bias_dtype)
    return d_x, d_w, d_b, None, None


quantized_linear.register_autograd(_linear_backward, setup_context=_linear_setup)
for _device in ("cpu", "cuda"):
    torch.library.register_autocast("moec::quantized_linear", _device, torch.bfloat16)
