"""MXFP8 / FP8 quantization, quantized ops, the precision pass and a short quantized training run.

The quantizer is checked bit for bit against an independent per-element reading of the OCP MX
v1.0 rules (float64 arithmetic and a decoded table of every e4m3 value), against torchao's
``to_mx`` where installed, and the Triton kernels under ``TRITON_INTERPRET=1`` (triton >= 3.8)
against the torch reference in a subprocess (the interpreter is chosen at import time).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import moec
from moec.analysis.structure import find_structure
from moec.models import Llama, LlamaConfig
from moec.ops.experts import expert_mlp
from moec.ops.quantized import (
    mx_dequantize,
    mx_quantize_reference,
    quantized_gmm,
)

ops = torch.ops.moec

# --- an independent reading of the spec --------------------------------------------------------


def _e4m3_table() -> torch.Tensor:
    """Values of the non-negative finite e4m3 codes 0..126, decoded from the bit layout."""
    values = []
    for code in range(127):
        exp, man = code >> 3, code & 7
        values.append(man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return torch.tensor(values, dtype=torch.float64)


def _encode_e4m3(y: torch.Tensor) -> torch.Tensor:
    """float64 values -> e4m3 codes: nearest value (ties to the even code), saturating at 448."""
    table = _e4m3_table()
    a = y.abs().clamp(max=448.0)
    diff = (a[:, None] - table[None, :]).abs()
    best = diff.argmin(dim=1)  # the lower code on a tie
    nxt = (best + 1).clamp(max=126)
    gap = lambda idx: diff.gather(1, idx[:, None])[:, 0]  # noqa: E731
    tie = (gap(nxt) == gap(best)) & (nxt != best)
    best = torch.where(tie & (best % 2 == 1), nxt, best)
    negative = torch.signbit(y)
    return (best | torch.where(negative, 0x80, 0)).to(torch.uint8)


def spec_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, K), K % 32 == 0 -> (codes uint8, scales uint8), one block at a time."""
    blocks = x.double().reshape(-1, 32)
    codes, scales = [], []
    for block in blocks:
        amax = block.abs().max().item()
        if not math.isfinite(amax):
            scales.append(255)
            codes.append(torch.full((32,), 0x7F, dtype=torch.uint8))
            continue
        shared = -127 if amax == 0 else max(math.frexp(amax)[1] - 1 - 8, -127)
        scales.append(shared + 127)
        codes.append(_encode_e4m3(block / 2.0**shared))
    shape = x.shape
    return (
        torch.stack(codes).reshape(shape),
        torch.tensor(scales, dtype=torch.uint8).reshape(shape[0], -1),
    )


def adversarial_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    randn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    huge = randn(16, 256) * torch.logspace(-44, 38, 256)
    special = randn(8, 64)
    special[0] = 0.0
    special[1, :5] = float("nan")
    special[2, 3] = float("inf")
    special[3, 40] = -float("inf")
    special[4, ::2] = -0.0
    special[5] = 449.0 * 2.0**-8 * torch.sign(randn(64))  # saturates past 448
    special[6] = randn(64) * 1e-39  # fp32 denormals
    special[7, :32] = torch.arange(32) * 2.0**-9 + 2.0**-10  # ties in the subnormal range
    ties = (torch.arange(1, 17)[:, None] * 0.0625 + 1.03125) * 2.0 ** torch.arange(-8, 8)[None, :]
    return {
        "random": randn(32, 128),
        "huge_range": huge,
        "special": special,
        "zeros": torch.zeros(4, 64),
        "denormal_only": randn(4, 64) * 1e-42,
        "ties": torch.cat([ties.reshape(8, 32), -ties.reshape(8, 32)]),
        "bf16_denormal": (randn(4, 64) * 1e-39).bfloat16(),
    }


@pytest.mark.parametrize("name", list(adversarial_inputs()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_reference_matches_spec_bit_for_bit(name, dtype):
    x = adversarial_inputs()[name].to(dtype)
    codes, scales = mx_quantize_reference(x)
    want_codes, want_scales = spec_quantize(x)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes)


def test_zero_block_has_min_scale_and_nan_block_propagates():
    x = adversarial_inputs()["special"]
    codes, scales = mx_quantize_reference(x)
    assert scales[0].tolist() == [0, 0]
    assert scales[1, 0] == 255 and scales[2, 0] == 255 and scales[3, 1] == 255
    back = mx_dequantize(codes, scales)
    assert back[1:4].isnan().any(dim=1).all()
    assert (back[5].abs() == 448 * 2.0**-8).all()  # saturated, not rounded up to 2^9 * X


def test_quantize_matches_torchao_to_mx():
    """Equal except where torchao <= 0.18 departs from the spec (newer torchao follows it):
    blocks holding an inf get a finite scale, and blocks of scale 2^-127 (amax < 2^-119) are
    divided by 2^-126; elements of NaN-scale blocks are unspecified."""
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    for name, x in adversarial_inputs().items():
        scale, data = mx_tensor.to_mx(x.contiguous(), torch.float8_e4m3fn, 32)
        codes, scales = mx_quantize_reference(x)
        has_inf = x.float().reshape(*scales.shape, 32).isinf().any(-1)
        theirs = scale.view(torch.uint8).reshape(scales.shape)
        assert torch.equal(theirs[~has_inf], scales[~has_inf]), name
        finite = ((scales != 255) & (scales != 0)).repeat_interleave(32, dim=1)
        got = data.view(torch.uint8).reshape(codes.shape)[finite]
        assert torch.equal(got, codes.view(torch.uint8)[finite]), name


# --- GEMM error ----------------------------------------------------------------------------------


def _relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.double() - exact).norm() / exact.norm())


def test_gemm_error_vs_bf16_within_mxfp8_range():
    """MXFP8 (3 mantissa bits per operand) vs bf16 (8 bits) on N(0, 1) data, K = 512."""
    a, w = torch.randn(256, 512), torch.randn(4, 512, 128)
    offsets = torch.tensor([64, 128, 200, 256], dtype=torch.int32)
    experts = torch.searchsorted(offsets, torch.arange(256, dtype=torch.int32), right=True)
    exact = torch.einsum("rk,rkn->rn", a.double(), w.double()[experts])
    mx = _relative_error(quantized_gmm(a, w, offsets, "mxfp8", "reference"), exact)
    rowwise = _relative_error(quantized_gmm(a, w, offsets, "fp8_rowwise", "reference"), exact)
    bf16 = _relative_error(
        torch.einsum("rk,rkn->rn", a.bfloat16().double(), w.bfloat16().double()[experts]), exact
    )
    print(f"relative Frobenius error: mxfp8 {mx:.4f}, fp8_rowwise {rowwise:.4f}, bf16 {bf16:.5f}")
    assert bf16 < 0.005
    assert 0.01 < mx < 0.05  # e4m3 rounding ~ 2^-4 / sqrt(12) per operand, two operands
    assert 0.01 < rowwise < 0.06


# --- ops: autograd with high-precision masters ---------------------------------------------------


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_rowwise"])
def test_quantized_expert_mlp_grads_close_to_bf16_op(recipe):
    n, d, hidden, rows = 4, 64, 96, 160
    x = torch.randn(rows, d, requires_grad=True)
    w_up = (torch.randn(n, d, 2 * hidden) / 8).requires_grad_()
    w_down = (torch.randn(n, hidden, d) / 8).requires_grad_()
    offsets = torch.tensor([30, 30, 100, 150], dtype=torch.int32)
    grads = []
    for used in ("bf16", recipe):
        y, _ = expert_mlp(x, w_up, w_down, offsets, None, None, "swiglu", used)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(0))
        grads.append((y, *torch.autograd.grad(y, (x, w_up, w_down), g)))
    for i, (want, got) in enumerate(zip(*grads, strict=True)):
        assert got.dtype == want.dtype
        if i < 2:  # y and d_x: rows past offsets[-1] are garbage for expert_mlp, zeros here
            assert got[150:].abs().max() == 0
            want, got = want[:150], got[:150]
        assert _relative_error(got, want.double()) < 0.1


# --- the precision pass and a short training run -----------------------------------------------

TINY = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=64)
TRAIN = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=64)
SCOPES = ["routed_experts", "shared_expert", "attn_qkv", "attn_out"]


def _plan(gemm: str, scope: list[str]) -> moec.Plan:
    return moec.Plan.from_dict(
        {
            "moe": {"num_experts": 4, "top_k": 2, "shared_expert": True},
            "precision": {"gemm": gemm, "scope": scope},
        }
    )


def test_precision_pass_rewrites_every_scope():
    tokens = torch.randint(0, 64, (2, 16))
    dense = Llama(TINY)
    compiled = moec.compile(dense, _plan("mxfp8", SCOPES), (tokens,))
    stats = compiled.pass_results["precision"].stats
    assert stats["experts_quantized"] == 2
    assert stats["shared_linears_quantized"] == 6  # gate, up, down per block
    assert stats["qkv_linears_quantized"] == 6
    assert stats["out_linears_quantized"] == 2
    mlps = [n for n in compiled.graph_module.graph.nodes if n.target == ops.expert_mlp.default]
    assert len(mlps) == 2 and {n.args[7] for n in mlps} == {"mxfp8"}
    assert {n.kwargs["impl"] for n in mlps} == {"reference"}  # bound for this CPU
    baseline = moec.compile(dense, _plan("bf16", SCOPES), (tokens,))
    assert "precision" not in baseline.pass_results
    out, ref = compiled(tokens), baseline(tokens)
    # ~4% per MXFP8 GEMM (see the GEMM test), compounded over 2 blocks and occasional top-k flips
    assert _relative_error(out, ref.double()) < 0.1


def test_precision_pass_scope_routed_only_leaves_linears():
    tokens = torch.randint(0, 64, (2, 16))
    compiled = moec.compile(Llama(TINY), _plan("fp8_rowwise", ["routed_experts"]), (tokens,))
    stats = compiled.pass_results["precision"].stats
    assert stats["experts_quantized"] == 2 and stats["qkv_linears_quantized"] == 0
    ops = [n.target for n in compiled.graph_module.graph.nodes]
    assert torch.ops.moec.quantized_linear.default not in ops


def _quantized_nodes(compiled) -> list:
    def quantized(node) -> bool:
        if node.target == torch.ops.moec.quantized_linear.default:
            return True
        recipe = node.args[7] if len(node.args) > 7 else "bf16"
        return node.target == torch.ops.moec.expert_mlp.default and recipe != "bf16"

    return [n for n in compiled.graph_module.graph.nodes if quantized(n)]


def _weights_read(node) -> list:
    """The weight nodes a quantized op reads: a gated pair that ``fuse_glu`` joined reads the
    concatenation of both."""
    weights = (
        node.args[1:3] if node.target.__name__.startswith("quantized_expert") else [node.args[1]]
    )
    return [
        w for n in weights for w in (n.args[0] if n.target == torch.ops.aten.cat.default else [n])
    ]


@pytest.mark.parametrize("compute_dtype", ["fp32", "bf16"])
def test_shared_scope_stops_at_its_block(compute_dtype):
    """The shared expert's linears only: not the router beside it, nor the dense FFN, the
    attention or the MoE block before it. The search stops at the block's MoE input, which
    dispatch reads through a view (fp32) or a bf16 cast (bf16 compute) of the norm's output
    that the shared expert reads directly."""
    tokens = torch.randint(0, 64, (2, 16))
    plan = _plan("fp8_rowwise", ["shared_expert"])
    plan.moe.dense_first = 1
    plan.precision.compute_dtype = compute_dtype
    config = LlamaConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=64)
    compiled = moec.compile(Llama(config), plan, (tokens,))
    assert compiled.pass_results["precision"].stats["shared_linears_quantized"] == 6
    if compute_dtype == "fp32":  # the weights are the parameters (no working copies)
        weights = sorted(w.name for n in _quantized_nodes(compiled) for w in _weights_read(n))
        projections = ("down", "gate", "up")
        assert weights == [f"layers_{i}_ffn_{p}_proj_weight" for i in (1, 2) for p in projections]


def test_shared_scope_without_a_shared_expert_quantizes_nothing():
    """Without a shared expert the add after each combine is the residual add: the scope must
    not take the attention and FFN linears up the residual stream for a shared expert's."""
    tokens = torch.randint(0, 64, (2, 16))
    plan = _plan("fp8_rowwise", ["shared_expert"])
    plan.moe.shared_expert = False
    plan.moe.dense_first = 1
    config = LlamaConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=64)
    compiled = moec.compile(Llama(config), plan, (tokens,))
    assert compiled.pass_results["precision"].stats["shared_linears_quantized"] == 0
    assert not _quantized_nodes(compiled)


@pytest.mark.parametrize("compute_dtype", ["fp32", "bf16"])
def test_dense_ffn_scope_quantizes_the_dense_blocks_ffn_as_one_gated_gemm(compute_dtype):
    """``dense_ffn``: the FFN of the block ``moe.dense_first`` keeps dense, not the shared
    experts beside the routed ones; ``fuse_glu`` joins its quantized gate and up linears into one
    quantized GEMM of the concatenated weights, so the block runs quantized GEMM, ``moec.glu``,
    quantized GEMM. The values stay those of the unquantized program within FP8's error."""
    tokens = torch.randint(0, 64, (2, 16))
    config = LlamaConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=64)
    dense = Llama(config)
    plans = []
    for gemm in ("fp8_rowwise", "bf16"):
        plan = _plan(gemm, ["dense_ffn"])
        plan.moe.dense_first = 1
        plan.precision.compute_dtype = compute_dtype
        plans.append(plan)
    compiled, baseline = (moec.compile(dense, plan, (tokens,)) for plan in plans)
    assert compiled.pass_results["precision"].stats["dense_ffn_linears_quantized"] == 3
    assert compiled.pass_results["fuse_glu"].stats["fused"] == 3  # the dense FFN, 2 shared
    nodes = _quantized_nodes(compiled)
    assert len(nodes) == 2
    up, down = sorted(nodes, key=lambda n: n.meta["val"].shape[-1], reverse=True)
    (glu,) = up.users
    assert glu.target == torch.ops.moec.glu.default and glu.args[1] == "swiglu"
    assert up.meta["val"].shape[-1] == 2 * 128 and down.args[0] is glu
    # still the block's FFN for the passes that find blocks by structure (recompute, pipeline)
    ffn = find_structure(compiled.graph_module).blocks[0].ffn
    assert ffn.down.node is down and [s.node for s in ffn.ups] == [up, up]
    if compute_dtype == "fp32":  # the weights are the parameters (no working copies)
        weights = [w.target for n in (up, down) for w in _weights_read(n)]
        assert weights == [f"layers.0.ffn.{p}_proj.weight" for p in ("gate", "up", "down")]
    out, ref = compiled(tokens), baseline(tokens)
    assert _relative_error(out, ref.double()) < 0.1


def test_bf16_compute_quantizes_bf16_working_copies():
    """Under bf16 compute the quantized ops read bf16 activations and the weights' bf16 working
    copies, as the bf16 GEMMs they replace do (not float32 activations and masters)."""
    tokens = torch.randint(0, 64, (2, 16))
    plan = _plan("fp8_rowwise", SCOPES)
    plan.precision.compute_dtype = "bf16"
    compiled = moec.compile(Llama(TINY), plan, (tokens,))
    nodes = _quantized_nodes(compiled)
    assert len(nodes) == 14  # 2 blocks: experts, 2 shared (gate and up joined), 3 qkv, 1 out
    for node in nodes:
        assert node.args[0].meta["val"].dtype == torch.bfloat16, node
        for w in _weights_read(node):
            assert w.meta["val"].dtype == torch.bfloat16 and w.target.__name__ == "working_copy", (
                node
            )


def _train(gemm: str, steps: int = 50) -> list[float]:
    torch.manual_seed(0)
    seq = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    compiled = moec.compile(Llama(TRAIN), _plan(gemm, ["routed_experts"]), (seq[:, :-1],))
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):  # memorize one batch: a steady, deterministic loss curve
        logits = compiled(seq[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        (loss + compiled.aux_loss()).backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_mxfp8_training_tracks_bf16_loss():
    bf16, mx = _train("bf16"), _train("mxfp8")
    end_bf16, end_mx = sum(bf16[-5:]) / 5, sum(mx[-5:]) / 5
    print(f"loss after 50 steps: bf16 {end_bf16:.4f}, mxfp8 {end_mx:.4f} (start {bf16[0]:.3f})")
    assert end_bf16 < 0.7 * bf16[0]  # it learned something
    assert abs(end_mx - end_bf16) / end_bf16 < 0.05


# --- Triton kernels under the interpreter ------------------------------------------------------

_INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    from moec.kernels.mxfp8 import mx_gmm, mx_gmm_wgrad, mx_quantize, mx_quantize_weight
    from moec.ops.grouped import gmm
    from moec.ops.quantized import mx_fake_quantize, mx_quantize_reference, quantized_gmm_wgrad
    from tests.test_mxfp8 import adversarial_inputs
    for name, x in adversarial_inputs().items():
        for view in (x, x.t().contiguous().t(), x.bfloat16()):
            q, (codes, scales) = mx_quantize(view), mx_quantize_reference(view)
            assert torch.equal(q.scales, scales), name
            assert torch.equal(q.codes.view(torch.uint8), codes.view(torch.uint8)), name
        if x.shape[0] % 32 == 0:  # columnwise: a transposed view, no copy
            q, (codes, _) = mx_quantize(x.t()), mx_quantize_reference(x.t())
            assert torch.equal(q.codes.view(torch.uint8), codes.view(torch.uint8)), name
    a, w = torch.randn(100, 96), torch.randn(3, 96, 48)
    offsets = torch.tensor([30, 30, 90], dtype=torch.int32)
    ref = gmm(mx_fake_quantize(a), mx_fake_quantize(w, dim=-2), offsets)
    ref[90:] = 0
    fused = mx_gmm(a, w, offsets, torch.float32)
    pre = mx_gmm(mx_quantize(a), mx_quantize_weight(w), offsets, torch.float32)
    for out in (fused, pre):
        assert (out - ref).abs().max() < 1e-4, (out - ref).abs().max()
        assert out[90:].abs().max() == 0  # rows past offsets[-1]
    dy = torch.randn(100, 40)
    got = mx_gmm_wgrad(a, dy, offsets, torch.float32)
    want = quantized_gmm_wgrad(a, dy, offsets, "mxfp8", "reference")
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    print("interpreter kernels OK")
    """
)


def _triton_interprets_dot_scaled() -> bool:
    try:
        import triton
    except ImportError:
        return False
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 8)


@pytest.mark.skipif(not _triton_interprets_dot_scaled(), reason="tl.dot_scaled interpreted >= 3.8")
def test_kernels_under_interpreter_match_reference():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_CHECK],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "interpreter kernels OK" in done.stdout
