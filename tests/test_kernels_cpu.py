"""The kernels under the Triton CPU interpreter (``TRITON_INTERPRET=1``) equal the reference ops.

float32 and float16 only: the interpreter's bf16 ``tl.dot`` is wrong. Integers exactly; cases
cover ties, capacity drops, dropless routing, empty experts, one expert taking every token, and
buffer tails poisoned with NaN / 1e4 that must not reach any result.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from moec.kernels import (  # noqa: E402
    activation,
    cross_entropy,
    ep_push,
    grouped_gemm,
    grouped_tma,
    movement,
    rope,
)
from moec.ops import experts as expert_ops  # noqa: E402
from moec.ops import routing as routing_ops  # noqa: E402
from moec.ops.activations import (  # noqa: E402
    ACTIVATIONS,
    activate,
    activate_backward,
    is_gated,
    kernel_activation,
)
from moec.ops.experts import bias_grads  # noqa: E402
from moec.ops.loss import cross_entropy_rows_reference  # noqa: E402
from moec.ops.movement import combine_reference, dispatch_reference  # noqa: E402
from moec.ops.rope import rotate  # noqa: E402
from moec.ops.routing import route_reference  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ops = torch.ops.moec
KERNELS = "kernels:rules"
"""The expert MLP's kernels implementation (the measured rules, no CuTe DSL: on the
interpreter every piece runs the pointer kernels)."""
route_kernels = routing_ops.IMPLEMENTATIONS["triton"]
glu_ops = importlib.import_module("moec.ops.glu")  # the module (moec.ops.glu is the op)
rope_ops = importlib.import_module("moec.ops.rope")
"""Triton decides interpretation when it is imported: without the variable set from the start,
this module re-runs itself in a subprocess that has it, and its tests here are skipped."""

interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET subprocess")


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETED, reason="already interpreting")
def test_kernels_under_the_interpreter():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        capture_output=True, text=True, env=env, cwd=root, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def _logits(tokens: int, num_experts: int, case: str, dtype: torch.dtype) -> torch.Tensor:
    logits = torch.randn(tokens, num_experts)
    if case == "ties":
        logits = (logits * 2).round()
    elif case == "one_expert":
        logits[:, 1] += 100.0
    elif case == "empty_experts":
        logits[:, num_experts // 2 :] -= 100.0
    return logits.to(dtype)


@interpreted
@pytest.mark.parametrize(
    "tokens,num_experts,top_k,cf,gating,normalize,case,dtype",
    [
        (600, 8, 2, 1.0, "softmax", True, "random", torch.float32),  # 3 blocks, drops
        (70, 6, 3, 1.25, "sigmoid", False, "ties", torch.bfloat16),
        (50, 12, 4, 0.0, "softmax", True, "one_expert", torch.float32),  # dropless
        (64, 16, 2, 1.0, "softmax", True, "one_expert", torch.float16),  # heavy drops
        (40, 10, 3, 1.25, "sigmoid", True, "empty_experts", torch.float32),
    ],
)
def test_route_equals_reference(tokens, num_experts, top_k, cf, gating, normalize, case, dtype):
    logits = _logits(tokens, num_experts, case, dtype)
    got = route_kernels(logits, top_k, cf, gating, normalize, "learned")
    want = route_reference(logits, top_k, cf, gating, normalize, "learned")
    for name, a, b in zip(["ids", "weights", "rows", "offsets", "counts"], got, want, strict=True):
        if name == "weights":
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        else:
            assert torch.equal(a, b), name


@interpreted
def test_route_of_non_finite_logits_picks_valid_experts():
    """A NaN row (a diverging step) gets in-range expert ids and NaN weights, so the loss is
    NaN and the step is skipped, instead of an out-of-range id crashing the device."""
    logits = torch.randn(40, 8)
    logits[3] = float("nan")
    logits[7, 2] = float("nan")
    ids, weights, rows, offsets, counts = route_kernels(logits, 2, 1.0, "softmax", True, "learned")
    assert ids.min() >= 0 and ids.max() < 8
    assert ids[3].unique().numel() == 2 and 2 not in ids[7].tolist()
    assert weights[3].isnan().all() and weights[7].isnan().all()
    assert int(counts.sum()) == 80 and rows.max() < 80


@interpreted
@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_route_with_a_selection_bias_equals_reference(gating):
    """``aux_free``: the experts chosen by scores + bias, ranked by the kernels."""
    logits = torch.randn(2, 90, 8)
    bias = torch.randn(8) * 0.2
    got = route_kernels(logits, 2, 1.0, gating, True, "learned", bias)
    want = route_reference(logits, 2, 1.0, gating, True, "learned", bias)
    assert not torch.equal(got[0], route_kernels(logits, 2, 1.0, gating, True, "learned")[0])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@interpreted
def test_route_uniform_policy_and_lead_dims():
    logits = torch.randn(3, 20, 8)
    got = route_kernels(logits, 2, 1.0, "softmax", True, "uniform")
    want = route_reference(logits, 2, 1.0, "softmax", True, "uniform")
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dispatch_combine_and_backward_ignore_poisoned_rows(dtype):
    tokens, dim, top_k = 30, 40, 3
    logits = _logits(tokens, 6, "random", torch.float32)
    _, weights, rows, offsets, _ = route_reference(logits, top_k, 1.0, "softmax", True, "learned")
    used = int(offsets[-1])
    x = torch.randn(tokens, dim).to(dtype)
    buf = movement.dispatch(x, rows)
    assert torch.equal(buf[:used], dispatch_reference(x, rows)[:used])
    y = torch.randn(tokens * top_k, dim).to(dtype)
    y[used:] = float("nan")
    out = movement.combine(y, weights, rows)
    torch.testing.assert_close(out, combine_reference(y, weights, rows))
    assert out._base is None  # not a view: a model may add to its FFN output in place
    d_out = torch.randn(tokens, dim).to(dtype)
    d_y, d_w = movement.combine_backward(y, weights, rows, d_out)
    y_ref = y.clone().requires_grad_()
    w_ref = weights.clone().requires_grad_()
    combine_reference(y_ref, w_ref, rows).backward(d_out)
    torch.testing.assert_close(d_y[:used], y_ref.grad[:used])
    torch.testing.assert_close(d_w, w_ref.grad)
    ones = torch.ones_like(weights)
    torch.testing.assert_close(movement.combine(y, None, rows), combine_reference(y, ones, rows))


@interpreted
@pytest.mark.parametrize("weighted", [False, True])
def test_rowwise_push_and_push_back_between_two_peer_buffers(weighted):
    """The EP rowwise copy kernel with host buffers standing in for two ranks' symmetric memory:
    every kept route's (weighted) token row lands at ``dest * cap + row``, dropped ones nowhere;
    the routes' ids pushed the same way give each row its origin, and pushing the rows back to
    their origins restores every kept route's row (zeros for dropped ones)."""
    tokens, top_k, dim, cap = 7, 2, 40, 6
    routes = tokens * top_k
    x = torch.randn(tokens, dim)
    weights = torch.rand(routes)
    address = torch.randperm(2 * cap)[: routes - 2]
    address = torch.cat([address, torch.full((2,), -1)])[torch.randperm(routes)]

    def push(src, at, rows, fill, k=1, scales=None):
        peers_rows = [torch.full((rows, src.shape[1]), fill, dtype=src.dtype) for _ in range(2)]
        peers = torch.tensor([b.data_ptr() for b in peers_rows])
        ep_push.push_rows(src, at, peers, rows, k, scales)
        return torch.cat(peers_rows)

    buffer = push(x, address, cap, float("nan"), top_k, weights if weighted else None)
    sent = x.repeat_interleave(top_k, 0) * (weights[:, None] if weighted else 1)
    kept = address >= 0
    torch.testing.assert_close(buffer[address[kept]], sent[kept])
    written = torch.zeros(2 * cap, dtype=torch.bool)
    written[address[kept]] = True
    assert buffer[~written].isnan().all()
    origins = push(torch.arange(routes)[:, None], address, cap, -1).view(-1)  # one source
    assert torch.equal(origins[address[kept]], torch.arange(routes)[kept])
    back = push(buffer, origins, routes, 0.0)[:routes]
    torch.testing.assert_close(back, torch.where(kept[:, None], sent, 0))


@interpreted
@pytest.mark.parametrize("vocab,dtype", [(37, torch.float32), (5000, torch.float16)])
def test_cross_entropy_rows_equals_reference(vocab, dtype):
    rows = 9
    logits = (torch.randn(rows, vocab) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,))
    targets[2] = -100  # ignored: zero loss and gradient
    targets[5] = vocab - 1  # the last column, in the tail block
    grad, want_grad = logits.clone(), logits.clone()
    loss = cross_entropy.cross_entropy_rows(grad, targets, -100)
    want = cross_entropy_rows_reference(want_grad, targets, -100)
    torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grad, want_grad, atol=2e-3 if dtype == torch.float16 else 1e-6,
                               rtol=1e-3)  # fmt: skip
    assert loss[2] == 0 and not grad[2].any()
    bad = targets.clone()
    bad[0] = vocab  # out of range, not ignored: NaN, never a silent number
    assert cross_entropy.cross_entropy_rows(logits.clone(), bad, -100)[0].isnan()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backward", [False, True])
def test_rope_equals_reference(dtype, backward):
    x = torch.randn(2, 37, 3, 12).to(dtype).transpose(1, 2)  # (B, H, S, D) view; 37 rows tail
    cos, sin = torch.randn(37, 12), torch.randn(1, 1, 37, 12)  # fp32 tables, two broadcasts
    got = rope.rope(x, cos, sin, dtype, backward)
    want = rotate(x, cos, sin, backward).to(dtype)
    torch.testing.assert_close(got, want, atol=1e-3 if dtype == torch.float16 else 1e-6, rtol=1e-3)


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


OFFSET_CASES = {
    "mixed": [5, 0, 17, 9],  # an empty expert, partial tiles
    "one_expert": [0, 41, 0, 0],  # every row to one expert
    "all_empty": [0, 0, 0, 0],
}


def _per_expert(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out, start = torch.zeros(x.shape[0], w.shape[-1]), 0
    for e, end in enumerate(offsets.tolist()):
        out[start:end] = x[start:end].float() @ w[e].float()
        start = end
    return out


@interpreted
@pytest.mark.parametrize("case", list(OFFSET_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gmm_and_wgrad(case, dtype):
    rows, depth, width = 48, 24, 20  # depth 24: K not a multiple of the block
    offsets = _offsets(OFFSET_CASES[case])
    used = int(offsets[-1])
    x = torch.randn(rows, depth).to(dtype)
    x[used:] = float("nan")
    w = (torch.randn(4, depth, width) / 4).to(dtype)
    ref = _per_expert(x, w, offsets)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(grouped_gemm.gmm(x, w, offsets)[:used].float(), ref[:used], **tol)
    dy = torch.randn(rows, width).to(dtype)
    dy[used:] = 1e4
    dw = grouped_gemm.gmm_wgrad(x, dy, offsets, out_dtype=torch.float32)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        want = x[start:end].float().t() @ dy[start:end].float()
        torch.testing.assert_close(dw[e], want, **tol)
        start = end


@interpreted
@pytest.mark.parametrize("case", list(OFFSET_CASES))
def test_tma_gmm_epilogues(case):
    """The persistent TMA kernel (float32): plain product through a weight and a transposed
    view, the fused SwiGLU forward and backward; K, width and rows not multiples of the tiles,
    poisoned rows past the offsets and outputs pre-filled with 1e4 there must stay untouched."""
    swiglu = kernel_activation("swiglu")
    offsets = _offsets(OFFSET_CASES[case])
    rows, depth, hidden, used = 48, 40, 24, int(offsets[-1])
    x = torch.randn(rows, depth)
    x[used:] = float("nan")
    w = torch.randn(4, depth, 2 * hidden) / depth**0.5
    w_t = torch.randn(4, 2 * hidden, depth).transpose(-1, -2)
    for weights in (w, w_t):
        out = torch.full((rows, 2 * hidden), 1e4)
        grouped_tma.launch_gmm(x, weights, offsets, out, None, None, 0, None)
        torch.testing.assert_close(out[:used], _per_expert(x, weights, offsets)[:used])
        assert (out[used:] == 1e4).all()
    h, a = torch.full((rows, 2 * hidden), 1e4), torch.full((rows, hidden), 1e4)
    grouped_tma.launch_gmm(x, w, offsets, a, h, None, 1, swiglu)
    h_ref = _per_expert(x, w, offsets)
    torch.testing.assert_close(h[:used], h_ref[:used])
    torch.testing.assert_close(a[:used], activate(h_ref, "swiglu")[:used])
    assert (h[used:] == 1e4).all() and (a[used:] == 1e4).all()
    d_y = torch.randn(rows, depth)
    w_down = torch.randn(4, hidden, depth) / hidden**0.5
    d_h, a = torch.full_like(h, 1e4), torch.full_like(a, 1e4)
    grouped_tma.launch_gmm(d_y, w_down.transpose(-1, -2), offsets, a, h, d_h, 2, swiglu)
    d_a = _per_expert(d_y, w_down.transpose(-1, -2), offsets)
    want = activate_backward(h_ref, d_a, "swiglu")
    torch.testing.assert_close(d_h[:used], want[:used], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a[:used], activate(h_ref, "swiglu")[:used])
    assert (d_h[used:] == 1e4).all()


@interpreted
@pytest.mark.parametrize(
    "activation_name,bias",
    [("swiglu", False), ("swiglu", True), ("geglu_tanh", False), ("gelu", True), ("relu", False)],
)
def test_expert_mlp_forward_backward(activation_name, bias):
    num_experts, rows, dim, hidden = 4, 40, 32, 20
    offsets = _offsets([5, 0, 17, 9])
    used = int(offsets[-1])
    gated = activation_name in ("swiglu", "geglu", "geglu_tanh")
    width = 2 * hidden if gated else hidden
    x = torch.randn(rows, dim)
    x[used:] = float("nan")
    w_up = torch.randn(num_experts, dim, width) / dim**0.5
    w_down = torch.randn(num_experts, hidden, dim) / hidden**0.5
    b_up = torch.randn(num_experts, width) if bias else None
    b_down = torch.randn(num_experts, dim) if bias else None
    y, h = ops.expert_mlp(x, w_up, w_down, offsets, b_up, b_down, activation_name, "bf16",
                          None, None, KERNELS)  # fmt: skip
    leaves = [t.double().requires_grad_() for t in (x, w_up, w_down, b_up, b_down) if t is not None]
    rb = (leaves[3], leaves[4]) if bias else (None, None)
    y_ref, h_ref = torch.ops.moec.expert_mlp(*leaves[:3], offsets, *rb, activation_name)
    torch.testing.assert_close(y[:used].double(), y_ref[:used], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h[:used].double(), h_ref[:used], atol=1e-4, rtol=1e-4)
    dy = torch.randn(rows, dim)
    dy[used:] = 1e4
    bias_dtypes = (torch.float32, torch.float32) if bias else (None, None)
    *grads, d_h, _ = ops.expert_mlp_backward(x, w_up, w_down, offsets, h, dy, activation_name,
                                             bias, "bf16", None, None, KERNELS)  # fmt: skip
    grads += bias_grads(d_h, dy, offsets, bias_dtypes)
    want = torch.autograd.grad(y_ref, leaves, dy.double())
    names = ["x", "w_up", "w_down", "b_up", "b_down"]
    for name, g, r in zip(names, grads, [*want, None, None][:5], strict=True):
        if r is None:
            assert g is None, name
            continue
        if name == "x":
            g, r = g[:used], r[:used]
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4, msg=name)


@interpreted
def test_activation_kernels_match_reference():
    """Every activation with a kernel form: the kernels' forward and backward (with and without
    the recomputed activation) equal the reference (plain ones on h, gated ones on h = [gate |
    up])."""
    with_kernel = [name for name in ACTIVATIONS if kernel_activation(name) is not None]
    assert {"gelu", "gelu_tanh", "silu", "relu", "swiglu", "geglu", "geglu_tanh", "reglu"} <= set(
        with_kernel
    )
    h = torch.randn(20, 2 * 33) * 3
    for name in with_kernel:
        act = kernel_activation(name)
        d_a = torch.randn(20, 33 if act.gated else 66)
        torch.testing.assert_close(activation.act_forward(h, act), activate(h, name), msg=name)
        d_h, a = activation.act_backward(h, d_a, act)
        # the tanh form's derivative holds 1 - tanh^2, which float32 rounds away at |h| ~ 3-10
        # (h is ~N(0, 9) here); the kernel and torch round it differently
        tol = 1e-4 if "tanh" in name else 1e-5
        torch.testing.assert_close(
            d_h, activate_backward(h, d_a, name), atol=tol, rtol=1e-5, msg=name
        )
        torch.testing.assert_close(a, activate(h, name), msg=name)
        # moec::glu's backward: the same gradient, without writing a
        assert torch.equal(activation.act_gradient(h, d_a, act), d_h), name


def _refuse(*args, **kwargs):
    raise AssertionError("a kernel ran on inputs it does not take")


@interpreted
def test_inputs_without_a_kernel_run_the_reference(monkeypatch):
    """The kernels implementations run the reference's activation for every activation without
    a kernel code (quick_gelu, relu2 and their gated forms today: the expert MLP's GEMMs stay
    on the grouped-GEMM kernels, the fused expert kernels never run) and the reference for a
    5-D rope input; the results are the reference's."""
    without_code = [name for name in ACTIVATIONS if kernel_activation(name) is None]
    assert without_code, "every built-in has a kernel code: withdraw one here to test this"
    for name in ("act_forward", "act_gradient"):
        monkeypatch.setattr(glu_ops, name, _refuse)
    for name in ("expert_mlp", "expert_mlp_backward"):
        monkeypatch.setattr(expert_ops.kernel_experts, name, _refuse)
    offsets = _offsets([3, 0, 6])
    x, w_down, d_y = torch.randn(9, 8), torch.randn(3, 12, 8), torch.randn(9, 8)
    close = dict(atol=1e-5, rtol=1e-5)
    for name in without_code:
        gated = is_gated(name)
        w_up = torch.randn(3, 8, 24 if gated else 12)
        args = (x, w_up, w_down, offsets)
        y, h = ops.expert_mlp(*args, None, None, name, "bf16", None, None, KERNELS)
        y_ref, h_ref = ops.expert_mlp(*args, None, None, name, "bf16", None, None, "reference")
        torch.testing.assert_close(y, y_ref, **close, msg=name)
        torch.testing.assert_close(h, h_ref, **close, msg=name)
        grads = ops.expert_mlp_backward(*args, h, d_y, name, False, "bf16", None, None, KERNELS)
        want = ops.expert_mlp_backward(*args, h, d_y, name, False, "bf16", None, None, "reference")
        for g, r in zip(grads, want, strict=True):
            torch.testing.assert_close(g, r, **close, msg=name)
        if gated:
            d_a = torch.randn(9, 12)
            forward, backward = glu_ops.IMPLEMENTATIONS["triton"]
            assert torch.equal(forward(h, name), activate(h, name)), name
            assert torch.equal(backward(h, d_a, name), activate_backward(h, d_a, name))
    monkeypatch.setattr(rope, "_rope_kernel", None)  # launching it would raise
    x5, cos, sin = torch.randn(2, 2, 3, 5, 8), torch.randn(5, 8), torch.randn(5, 8)
    rotated = rope_ops.IMPLEMENTATIONS["triton"](x5, cos, sin, torch.float32, False)
    assert torch.equal(rotated, rotate(x5, cos, sin, False))


@interpreted
def test_adamw_kernel_equals_torch_adamw_and_writes_the_working_copies():
    from moec.runtime.working_weights import WorkingWeights
    from tests.adamw_check import step_both_and_compare

    module = torch.nn.Module()
    module.a = torch.nn.Parameter(torch.randn(37, 5))  # one block
    module.b = torch.nn.Parameter(torch.randn(400, 5))  # crosses the 1024-element block edge
    # an fp16 copy: the interpreter truncates float32 -> bf16 (the GPU rounds to nearest even)
    module.register_buffer("copy", torch.full((437, 5), float("nan"), dtype=torch.float16))
    # a k-major expert weight: its copy, moments and gradients share its strides
    module.c = torch.nn.Parameter(torch.randn(3, 9, 130).transpose(1, 2))
    k_major_copy = torch.full((3, 9, 130), float("nan"), dtype=torch.float16).transpose(1, 2)
    module.register_buffer("k_major_copy", k_major_copy)
    copies = WorkingWeights(
        module, {"copy": ["a", "b"], "k_major_copy": ["c"]}, torch.bfloat16
    )  # bf16 gradients
    step_both_and_compare([module.a, module.b, module.c], copies, torch.tensor(1.7))
    for p in (module.a, module.b, module.c):
        assert torch.equal(copies.copy_of(p), p.detach().half())
    assert module.c.stride() == module.k_major_copy.stride() == (1170, 1, 130)


def test_adamw_kernel_takes_dense_layouts_alike_only():
    from moec.kernels.adamw import _dense

    w = torch.randn(3, 9, 130)
    k_major = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert _dense(w) and _dense(k_major) and _dense(torch.randn(4, 1, 6)[:, :, :])
    assert not _dense(w[:, :, ::2]) and not _dense(w[:, :5])
    assert not _dense(torch.randn(1, 6).expand(4, 6))
