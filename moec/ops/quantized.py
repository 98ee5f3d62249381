"""Quantized GEMM ops: ``moec::quantized_expert_mlp`` and ``moec::quantized_linear``.

quantized_expert_mlp(x, w_up, w_down, offsets, b_up?, b_down?, activation, recipe) -> (y, h)
    ``moec::expert_mlp`` (same shapes and meaning) with its three GEMMs per pass in ``recipe``.
quantized_linear(x[*, K], weight[N, K], bias[N]?, recipe) -> y[*, N]
    ``aten.linear`` with its GEMMs in ``recipe``.

Recipes (the weights stay high precision masters; every step quantizes them afresh). The expert
MLP reads its weights in x's dtype, as ``moec::expert_mlp`` does (bf16 activations: the bf16
working copies where the runtime keeps them); the linear follows autocast like ``aten.linear``
(registered for CPU and CUDA), so under bf16 compute both quantize from bf16:

- ``mxfp8``: OCP MX v1.0 e4m3 with E8M0 scales per 32 contraction elements, for the forward,
  dgrad and wgrad GEMMs (wgrad blocks run along the rows of each group, from its first row).
- ``fp8_rowwise``: e4m3 with one fp32 scale per row of the activation and per output channel
  of the weight (``amax / 448``) for the forward and dgrad GEMMs; wgrad in high precision.

The functions here in plain torch are the oracle (:func:`mx_quantize_reference` follows the
spec literally); on CUDA (or under ``TRITON_INTERPRET=1``) the GEMMs run as the fused Triton
kernels of :mod:`moec.kernels.mxfp8`, which equal the reference bit for bit in quantization.
``fp8_rowwise`` on sm90 runs ``torch._scaled_grouped_mm``; the expert MLP there runs whole on
:mod:`moec.kernels.fp8_experts` (installed by :mod:`moec.ops.cuda`), its activation fused into
the down projection's quantizer.

Each op's backward GEMMs are an internal op, so AOTAutograd traces them as one opaque call
(never a kernel launch on fake tensors); bias gradients stay plain torch in the formulas::

    quantized_expert_mlp_backward(x, w_up, w_down, offsets, h, d_y, activation, recipe)
        -> (d_x, d_w_up, d_w_down, d_h)     (the shapes of x, the weights and h; d_h in x's dtype)
    quantized_linear_backward(x, weight, d_y, recipe) -> (d_x, d_weight)

All outputs are contiguous.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from moec.ops.activations import activate, activate_backward, check_activation, is_gated
from moec.ops.experts import bias_grads, expert_mlp_grads_like, h_saved_only
from moec.ops.grouped import add_row_bias, gmm, gmm_wgrad, row_experts

Recipe = Literal["mxfp8", "fp8_rowwise"]
RECIPES: tuple[str, ...] = ("mxfp8", "fp8_rowwise")
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


def _kernels_apply(a: Tensor, b: Tensor, recipe: str) -> bool:
    """Whether the Triton MXFP8 kernels take this call (device and dtypes)."""
    from moec.kernels import arch

    return recipe == "mxfp8" and arch.float_supported(a, b) and b.dtype in arch.KERNEL_DTYPES


def _rowwise_fast_path(a: Tensor, b: Tensor, recipe: str) -> bool:
    """fp8_rowwise through ``torch._scaled_grouped_mm``: bf16 on sm90, 16-aligned K and N."""
    if recipe != "fp8_rowwise" or a.device.type != "cuda" or a.dtype != torch.bfloat16:
        return False
    from moec.kernels import fp8_rowwise

    aligned = a.shape[-1] % 16 == 0 and b.shape[-1] % 16 == 0
    return aligned and fp8_rowwise.scaled_grouped_mm_available(a.device)


def quantized_gmm(
    a: Tensor, b: Tensor, offsets: Tensor, recipe: str, forward: bool = False
) -> Tensor:
    """``out[r] = a[r] @ b[e(r)]`` with a (R, K), b (G, K, N) each quantized along K from its
    own dtype (fp32 masters are not rounded to bf16 first); the result in a's dtype.
    ``forward``: a forward GEMM, which the sm90 fp8_rowwise path accumulates fast
    (:func:`moec.kernels.fp8_rowwise.rowwise_gmm`); dgrad accumulates exactly."""
    if _kernels_apply(a, b, recipe):
        from moec.kernels.mxfp8 import mx_gmm

        return mx_gmm(a, b, offsets, a.dtype)
    if _rowwise_fast_path(a, b, recipe):
        from moec.kernels import fp8_rowwise

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


def quantized_gmm_wgrad(a: Tensor, b: Tensor, offsets: Tensor, recipe: str) -> Tensor:
    """``out[g] = a_g^T @ b_g`` over the rows of group g: a (R, K), b (R, N) -> (G, K, N).

    mxfp8: both quantized along the rows, 32-row blocks from each group's first row.
    fp8_rowwise: unquantized, with float32 accumulation (bf16 operands stay bf16 on CUDA).
    """
    if _kernels_apply(a, b, recipe):
        from moec.kernels.mxfp8 import mx_gmm_wgrad

        return mx_gmm_wgrad(a, b, offsets, a.dtype)
    if recipe == "mxfp8":
        a, b = _fake_quantize_groups(a, offsets), _fake_quantize_groups(b, offsets)
    elif a.is_cuda and a.dtype == b.dtype == torch.bfloat16:
        return gmm_wgrad(a, b, offsets)  # the CUDA kernels accumulate bf16 products in float32
    return gmm_wgrad(a.float(), b.float(), offsets).to(a.dtype)


# --- moec::quantized_expert_mlp ------------------------------------------------------------------


def _check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"unknown quantization recipe {recipe!r}; known: {RECIPES}")


def check_quantized_mlp_args(x, w_up, w_down, offsets, activation, recipe) -> None:
    """Raise ValueError unless the shapes fit, the activation and the recipe are known."""
    check_activation(activation)
    _check_recipe(recipe)
    n, d, u = w_up.shape
    hidden = u // 2 if is_gated(activation) else u
    if x.shape[-1] != d or w_down.shape != (n, hidden, d) or offsets.shape != (n,):
        raise ValueError(
            f"moec::quantized_expert_mlp: shapes do not fit: x {tuple(x.shape)}, w_up "
            f"{tuple(w_up.shape)}, w_down {tuple(w_down.shape)}, offsets {tuple(offsets.shape)}"
        )


def quantized_expert_mlp_reference(x, w_up, w_down, offsets, b_up, b_down, activation, recipe):
    experts = row_experts(offsets, x.shape[0])
    w_up, w_down = w_up.to(x.dtype), w_down.to(x.dtype)
    h = quantized_gmm(x, w_up, offsets, recipe, forward=True)
    if b_up is not None:
        h = add_row_bias(h, b_up, experts)
    y = quantized_gmm(activate(h, activation), w_down, offsets, recipe, forward=True)
    if b_down is not None:
        y = add_row_bias(y, b_down, experts)
    return y, h


@torch.library.custom_op("moec::quantized_expert_mlp", mutates_args=())
def quantized_expert_mlp(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    b_up: Tensor | None,
    b_down: Tensor | None,
    activation: str,
    recipe: str,
) -> tuple[Tensor, Tensor]:
    check_quantized_mlp_args(x, w_up, w_down, offsets, activation, recipe)
    args = (x, w_up, w_down, offsets, b_up, b_down, activation, recipe)
    return quantized_expert_mlp_reference(*args)


@quantized_expert_mlp.register_fake
def _quantized_expert_mlp_fake(x, w_up, w_down, offsets, b_up, b_down, activation, recipe):
    check_quantized_mlp_args(x, w_up, w_down, offsets, activation, recipe)
    return x.new_empty(x.shape), x.new_empty((x.shape[0], w_up.shape[-1]))


def _mlp_setup(ctx, inputs, output):
    x, w_up, w_down, offsets, b_up, b_down, activation, recipe = inputs
    ctx.save_for_backward(x, w_up, w_down, offsets, output[1])
    h_saved_only(ctx, output[1])
    ctx.activation, ctx.recipe = activation, recipe
    ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in (b_up, b_down))


@torch.library.custom_op("moec::quantized_expert_mlp_backward", mutates_args=())
def quantized_expert_mlp_backward(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offsets: Tensor,
    h: Tensor,
    d_y: Tensor,
    activation: str,
    recipe: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_quantized_mlp_args(x, w_up, w_down, offsets, activation, recipe)
    return quantized_expert_mlp_backward_reference(
        x, w_up, w_down, offsets, h, d_y, activation, recipe
    )


def quantized_expert_mlp_backward_reference(x, w_up, w_down, offsets, h, d_y, activation, recipe):
    """The oracle backward without biases: (d_x, d_w_up, d_w_down, d_h)."""
    d_y = d_y.to(x.dtype)
    act = activate(h, activation)
    d_w_down = quantized_gmm_wgrad(act, d_y, offsets, recipe).to(w_down.dtype)
    d_act = quantized_gmm(d_y, w_down.to(x.dtype).transpose(-1, -2), offsets, recipe)
    d_h = activate_backward(h, d_act, activation).to(x.dtype)
    d_w_up = quantized_gmm_wgrad(x, d_h, offsets, recipe).to(w_up.dtype)
    d_x = quantized_gmm(d_h, w_up.to(x.dtype).transpose(-1, -2), offsets, recipe).to(x.dtype)
    return d_x.contiguous(), d_w_up.contiguous(), d_w_down.contiguous(), d_h.contiguous()


@quantized_expert_mlp_backward.register_fake
def _quantized_expert_mlp_backward_fake(x, w_up, w_down, offsets, h, d_y, activation, recipe):
    check_quantized_mlp_args(x, w_up, w_down, offsets, activation, recipe)
    return expert_mlp_grads_like(x, w_up, w_down, h)


def _mlp_backward(ctx, d_y, d_h_unused):
    if d_y is None:  # y was not used (h takes no gradient): no gradient flows
        return (None,) * 8
    x, w_up, w_down, offsets, h = ctx.saved_tensors
    d_y = d_y.to(x.dtype)
    d_x, d_w_up, d_w_down, d_h = torch.ops.moec.quantized_expert_mlp_backward(
        x, w_up, w_down, offsets, h, d_y, ctx.activation, ctx.recipe
    )
    d_b_up, d_b_down = bias_grads(d_h, d_y, offsets, ctx.bias_dtypes)
    return d_x, d_w_up, d_w_down, None, d_b_up, d_b_down, None, None


quantized_expert_mlp.register_autograd(_mlp_backward, setup_context=_mlp_setup)


# --- moec::quantized_linear ----------------------------------------------------------------------


def _one_group(rows: int, device: torch.device) -> Tensor:
    return torch.full((1,), rows, dtype=torch.int32, device=device)


def quantized_mm(a: Tensor, b: Tensor, recipe: str, forward: bool = False) -> Tensor:
    """``a @ b`` for a (R, K), b (K, N), each quantized along K: :func:`quantized_gmm` with one
    group, or on the sm90 fp8_rowwise path ``torch._scaled_mm`` (no offsets, no row mask)."""
    if _rowwise_fast_path(a, b, recipe):
        from moec.kernels import fp8_rowwise

        b_codes, b_scales = fp8_rowwise.quantize_weight(b[None])
        a_q = fp8_rowwise.rowwise_quantize(a)
        return fp8_rowwise.rowwise_mm(a_q, (b_codes[0], b_scales), a.dtype, fast_accum=forward)
    return quantized_gmm(a, b[None], _one_group(a.shape[0], a.device), recipe, forward)


def quantized_mm_wgrad(a: Tensor, b: Tensor, recipe: str) -> Tensor:
    """``a^T @ b`` over all rows of a (R, M) and b (R, K): :func:`quantized_gmm_wgrad` with one
    group; fp8_rowwise on CUDA is one unquantized ``mm`` (float32 accumulation, as there)."""
    if recipe == "fp8_rowwise" and a.is_cuda:
        return a.t().mm(b)
    return quantized_gmm_wgrad(a, b, _one_group(a.shape[0], a.device), recipe)[0]


def quantized_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: str):
    x2 = x.reshape(-1, x.shape[-1])
    y = quantized_mm(x2, weight.t(), recipe, forward=True)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("moec::quantized_linear", mutates_args=())
def quantized_linear(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: str) -> Tensor:
    _check_recipe(recipe)
    return quantized_linear_reference(x, weight, bias, recipe)


@quantized_linear.register_fake
def _quantized_linear_fake(x, weight, bias, recipe):
    _check_recipe(recipe)
    if x.shape[-1] != weight.shape[1]:
        shapes = f"x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        raise ValueError(f"moec::quantized_linear: shapes do not fit: {shapes}")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx, inputs, output):
    x, weight, bias, recipe = inputs
    ctx.save_for_backward(x, weight)
    ctx.recipe = recipe
    ctx.bias_dtype = None if bias is None else bias.dtype


@torch.library.custom_op("moec::quantized_linear_backward", mutates_args=())
def quantized_linear_backward(
    x: Tensor, weight: Tensor, d_y: Tensor, recipe: str
) -> tuple[Tensor, Tensor]:
    _check_recipe(recipe)
    x2, d_y2 = x.reshape(-1, x.shape[-1]), d_y.reshape(-1, d_y.shape[-1]).to(x.dtype)
    d_x = quantized_mm(d_y2, weight, recipe).reshape(x.shape)
    d_w = quantized_mm_wgrad(d_y2, x2, recipe).to(weight.dtype)
    return d_x.to(x.dtype).contiguous(), d_w.contiguous()


@quantized_linear_backward.register_fake
def _quantized_linear_backward_fake(x, weight, d_y, recipe):
    _check_recipe(recipe)
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _linear_backward(ctx, d_y):
    x, weight = ctx.saved_tensors
    d_x, d_w = torch.ops.moec.quantized_linear_backward(x, weight, d_y, ctx.recipe)
    d_y2 = d_y.reshape(-1, d_y.shape[-1]).to(x.dtype)
    d_b = None if ctx.bias_dtype is None else d_y2.float().sum(0).to(ctx.bias_dtype)
    return d_x, d_w, d_b, None


quantized_linear.register_autograd(_linear_backward, setup_context=_linear_setup)
for _device in ("cpu", "cuda"):
    torch.library.register_autocast("moec::quantized_linear", _device, torch.bfloat16)
