"""The CUDA kernels behind the moec:: ops equal the reference ops (forward and backward).

Integers (ids, rows, offsets, counts) exactly; floats at a per-dtype tolerance. Inputs are fresh
random tensors; cases include empty experts, one expert taking every token, capacity drops and
buffer tails poisoned with NaN / 1e4. Also: a steady-state layer step raises no host sync.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import triton

from moec.kernels import activation, cute_gemm, grouped_gemm
from moec.kernels.gemm_backend import GemmPolicy
from moec.kernels.target import Target
from moec.ops import grouped
from moec.ops.activations import is_gated, kernel_activation
from moec.ops.movement import combine_reference, dispatch_reference
from moec.ops.routing import route_reference
from moec.runtime.metrics import run_without_host_sync

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-2, "rtol": 2e-2},
    torch.bfloat16: {"atol": 6e-2, "rtol": 6e-2},
}


TARGET = Target.detect("cuda") if torch.cuda.is_available() else Target()
POLICY = TARGET.expert_impl("bf16")
"""The expert MLP's implementation this GPU binds (the measured rules)."""


def _forced(backend: str) -> str:
    """The expert MLP's implementation with ``backend`` forced for every piece."""
    return f"kernels:{backend}"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12)).item()


def _logits(tokens: int, experts: int, case: str, dtype: torch.dtype) -> torch.Tensor:
    logits = torch.randn(tokens, experts, device="cuda")
    if case == "ties":
        logits = (logits * 2).round()
    elif case == "one_expert":
        logits[:, 3] += 100.0
    elif case == "empty_experts":
        logits[:, experts // 2 :] -= 100.0
    return logits.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,experts,top_k,cf,gating,normalize,case",
    [
        (4096, 32, 8, 1.25, "softmax", True, "random"),
        (1000, 8, 2, 1.0, "sigmoid", False, "ties"),
        (333, 16, 4, 0.0, "softmax", True, "one_expert"),
        (512, 64, 6, 1.25, "softmax", True, "empty_experts"),
        (77, 5, 5, 2.0, "sigmoid", True, "random"),
        (128, 256, 8, 1.0, "softmax", True, "random"),
    ],
)
def test_route_equals_reference(tokens, experts, top_k, cf, gating, normalize, case, dtype):
    logits = _logits(tokens, experts, case, dtype)
    got = torch.ops.moec.route(logits, top_k, cf, gating, normalize, "learned")
    want = route_reference(logits.cpu(), top_k, cf, gating, normalize, "learned")
    for name, a, b in zip(["ids", "weights", "rows", "offsets", "counts"], got, want, strict=True):
        if name == "weights":
            torch.testing.assert_close(a.cpu(), b, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("routing", ["uniform"])
def test_route_given_policies(routing):
    logits = torch.randn(300, 12, device="cuda")
    got = torch.ops.moec.route(logits, 3, 1.0, "softmax", True, routing)
    want = route_reference(logits.cpu(), 3, 1.0, "softmax", True, routing)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu(), b)


def test_route_backward():
    logits = torch.randn(200, 16, device="cuda", requires_grad=True)
    _, w, _, _, _ = torch.ops.moec.route(logits, 4, 1.0, "softmax", True, "learned")
    g = torch.randn_like(w)
    (d,) = torch.autograd.grad(w, logits, g)
    ref_logits = logits.detach().cpu().requires_grad_()
    _, w_ref, _, _, _ = route_reference(ref_logits, 4, 1.0, "softmax", True, "learned")
    (d_ref,) = torch.autograd.grad(w_ref, ref_logits, g.cpu())
    torch.testing.assert_close(d.cpu(), d_ref, atol=1e-5, rtol=1e-5)


def _route(tokens: int, experts: int, top_k: int, cf: float, case: str = "random"):
    logits = _logits(tokens, experts, case, torch.float32)
    return torch.ops.moec.route(logits, top_k, cf, "softmax", True, "learned")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["random", "one_expert"])
def test_dispatch_combine_forward_backward(dtype, case):
    tokens, dim, experts, top_k = 700, 200, 8, 3
    _, weights, rows, offsets, _ = _route(tokens, experts, top_k, 1.0, case)
    x = torch.randn(tokens, dim, device="cuda", dtype=dtype, requires_grad=True)
    buf = torch.ops.moec.dispatch(x, rows)
    used = int(offsets[-1])
    want_buf = dispatch_reference(x.detach(), rows)
    assert torch.equal(buf[:used], want_buf[:used])
    # poison everything past the accepted rows: nothing may leak into results or grads
    y = torch.randn(tokens * top_k, dim, device="cuda", dtype=dtype)
    y[used:] = float("nan")
    y.requires_grad_()
    w = weights.detach().clone().requires_grad_()
    out = torch.ops.moec.combine(y, w, rows)
    y_ref = y.detach().clone().requires_grad_()
    w_ref = w.detach().clone().requires_grad_()
    want = combine_reference(y_ref, w_ref, rows)
    torch.testing.assert_close(out, want, **TOL[dtype])
    g = torch.randn_like(out)
    d_y, d_w = torch.autograd.grad(out, (y, w), g)
    d_y_ref, d_w_ref = torch.autograd.grad(want, (y_ref, w_ref), g)
    torch.testing.assert_close(d_y[:used], d_y_ref[:used], **TOL[dtype])
    torch.testing.assert_close(d_w, d_w_ref, **TOL[dtype])
    assert torch.isfinite(out).all() and torch.isfinite(d_w).all()
    (d_x,) = torch.autograd.grad(buf, x, buf.detach().clone().nan_to_num_(0.0))
    d_x_ref = combine_reference(want_buf, torch.ones_like(weights), rows)
    torch.testing.assert_close(d_x, d_x_ref, **TOL[dtype])


def _expert_case(case: str, experts: int, rows: int) -> torch.Tensor:
    if case == "empty_experts":
        counts = torch.zeros(experts, dtype=torch.long)
        counts[1::3] = torch.randint(1, rows // experts * 2, (len(counts[1::3]),))
    elif case == "one_expert":
        counts = torch.zeros(experts, dtype=torch.long)
        counts[experts // 2] = rows - 37
    else:
        counts = torch.multinomial(torch.ones(experts), rows - 50, replacement=True).bincount(
            minlength=experts
        )
    return counts.cumsum(0).to(torch.int32).cuda()


needs_quack = pytest.mark.skipif(
    not TARGET.quack, reason="quack-kernels (moec[cutlass]) is not installed"
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("case", ["random", "empty_experts", "one_expert"])
@pytest.mark.parametrize("backend", ["pointer", "tma", "grouped_mm"])
@pytest.mark.parametrize("bias", [False, True])
def test_expert_mlp_forward_backward(dtype, activation, case, backend, bias):
    """Every GEMM backend (forced for all pieces; bf16 only: float32 always runs the pointer
    kernels) against the float64 reference, with NaN rows past the offsets."""
    if backend != "pointer" and dtype == torch.float32:
        pytest.skip("float32 GEMMs run the pointer kernels whatever the policy")
    _check_expert_mlp(dtype, activation, case, bias, impl=_forced(backend))


@needs_quack
@pytest.mark.parametrize("backend", ["cute", "cute_glu"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh", "reglu", "silu", "gelu", "relu"])
@pytest.mark.parametrize("case", ["random", "empty_experts", "one_expert"])
@pytest.mark.parametrize("shape", [(8, 1000, 128, 96), (32, 8192, 512, 384)])
def test_expert_mlp_on_the_cute_dsl(backend, activation, case, shape):
    """The CuTe DSL backends on every piece (varlen-M GEMMs with and without activation
    epilogues, varlen-K wgrad) against the float64 reference, with poisoned rows past the
    offsets. ReLU's step derivative flips where the kernels' h (bf16-cast weights) and the
    reference's (float32 masters) straddle zero, on every backend (the pointer kernels measured
    3-4% on d_x too): a wider tolerance for the ReLU family."""
    tol = 5e-2 if "relu" in activation or "reglu" in activation else 2e-2
    _check_expert_mlp(torch.bfloat16, activation, case, False, shape, tol, impl=_forced(backend))


@needs_quack
@pytest.mark.parametrize("backend", ["policy", "cute"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh", "silu"])
@pytest.mark.parametrize("case", ["random", "empty_experts", "one_expert"])
@pytest.mark.parametrize("shape", [(8, 8192, 128, 96), (32, 8192, 512, 384)])
def test_expert_mlp_with_k_major_weights(backend, activation, case, shape):
    """k-major weights (stacked nn.Linear layout): a gated up projection runs quack's gated
    epilogues reading w_up's [gate | up] dim as pairs (concat_layout) in the GEMM, its dgrad and
    its wgrad; against the float64 reference, poisoned tails, gradients k-major."""
    impl = _forced("cute") if backend == "cute" else POLICY
    _check_expert_mlp(torch.bfloat16, activation, case, False, shape, 2e-2, True, impl)


def _check_expert_mlp(
    dtype, activation, case, bias, shape=(8, 1000, 128, 96), tol=None, k_major=False, impl=POLICY
):
    experts, rows, dim, hidden = shape
    gated = is_gated(activation)
    width = 2 * hidden if gated else hidden
    offsets = _expert_case(case, experts, rows)
    used = int(offsets[-1])
    x = torch.randn(rows, dim, device="cuda", dtype=dtype)
    x[used:] = float("nan")
    x.requires_grad_()
    masters = dict(device="cuda", dtype=torch.float32)
    w_up = torch.randn(experts, dim, width, **masters) / dim**0.5
    w_down = torch.randn(experts, hidden, dim, **masters) / hidden**0.5
    if k_major:
        w_up, w_down = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w_up, w_down))
    w_up, w_down = w_up.requires_grad_(), w_down.requires_grad_()
    b_up = torch.randn(experts, width, **masters).requires_grad_() if bias else None
    b_down = torch.randn(experts, dim, **masters).requires_grad_() if bias else None
    y, h = torch.ops.moec.expert_mlp(
        x, w_up, w_down, offsets, b_up, b_down, activation, "bf16", None, None, impl
    )
    leaves = [t for t in (x, w_up, w_down, b_up, b_down) if t is not None]
    dy = torch.randn_like(y)
    dy[used:] = 1e4
    grads = torch.autograd.grad(y, leaves, dy)

    # the reference op on the CPU in float64 (reference forward + the op's own backward)
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in leaves]
    rx, rwu, rwd = ref_leaves[:3]
    rbu, rbd = (ref_leaves[3], ref_leaves[4]) if bias else (None, None)
    y_ref, h_ref = torch.ops.moec.expert_mlp(rx, rwu, rwd, offsets.cpu(), rbu, rbd, activation)
    ref_grads = torch.autograd.grad(y_ref, ref_leaves, dy.double().cpu())
    tol = tol or (2e-2 if dtype == torch.bfloat16 else 1e-5)
    assert _rel(y[:used].cpu(), y_ref[:used]) < tol
    act = kernel_activation(activation)
    policy = GemmPolicy.parse(impl.partition(":")[2])
    if act is not None and grouped_gemm.h_interleaved(x, w_up.to(dtype), bias, act, policy):
        h = cute_gemm.deinterleave(h[None], h.dtype)[0]
    assert _rel(h[:used].cpu(), h_ref[:used]) < tol
    for name, g, r in zip(
        ["x", "w_up", "w_down", "b_up", "b_down"], grads, ref_grads, strict=False
    ):
        if name == "x":
            g, r = g[:used], r[:used]
        assert torch.isfinite(g).all(), name
        assert _rel(g.cpu(), r) < tol, name
    assert grads[1].dtype == torch.float32
    assert grads[1].stride() == w_up.stride() and grads[2].stride() == w_down.stride()


@pytest.mark.parametrize("activation", ["quick_gelu", "relu2_glu"])
def test_expert_mlp_without_a_kernel_code_runs_the_reference(activation):
    """An activation the kernels do not compute runs the op's reference on CUDA, forward and
    backward, instead of failing in the kernels."""
    assert kernel_activation(activation) is None
    _check_expert_mlp(torch.float32, activation, "random", bias=True)


def test_kernel_gmm_equals_the_reference_loop():
    """The grouped-GEMM kernels (the bound policy) equal the reference's masked loop."""
    x = torch.randn(300, 64, device="cuda")
    w = torch.randn(4, 64, 48, device="cuda")
    offsets = torch.tensor([50, 50, 200, 260], device="cuda", dtype=torch.int32)
    policy = TARGET.gemm_policy()
    got = grouped_gemm.gmm(x, w, offsets, None, "down", policy)
    want = grouped.gmm(x, w, offsets, loop=True)
    want_w = grouped.gmm_wgrad(x, got, offsets, loop=True)
    torch.testing.assert_close(got[:260], want[:260])
    got_w = grouped_gemm.gmm_wgrad(x, got, offsets, None, policy)
    torch.testing.assert_close(got_w, want_w, atol=1e-3, rtol=1e-4)


def _layer(x, router, w_up, w_down, impl=POLICY):
    ops = torch.ops.moec
    _, weights, rows, offsets, _ = ops.route(x @ router, 8, 1.25, "softmax", True, "learned")
    buf = ops.dispatch(x, rows)
    y, _ = ops.expert_mlp(buf, w_up, w_down, offsets, None, None, "swiglu", "bf16", None, None,
                          impl)  # fmt: skip
    return ops.combine(y, weights, rows)


@pytest.mark.parametrize(
    "backend",
    [
        "policy",
        *(pytest.param(b, marks=needs_quack) for b in ("cute", "cute_glu", "policy_k_major")),
    ],
)
def test_layer_step_is_sync_free_and_runs_ahead(backend):
    """With the policy's backends, with every piece forced onto the CuTe DSL kernels, and with
    k-major expert weights (the gated epilogues reading them as they are)."""
    if backend.startswith("policy"):
        _check_layer_step(k_major=backend == "policy_k_major")
    else:
        _check_layer_step(impl=_forced(backend))


def layer_inputs(k_major: bool = False) -> tuple[torch.Tensor, ...]:
    """(x, router, w_up, w_down) of benchmarks/moe_layer.py's layer (top-8, SwiGLU), bf16 leaves
    on the GPU, fresh random values; ``k_major``: the expert weights' contraction dim
    unit-stride."""
    tokens, dim, experts, hidden = 16384, 1536, 32, 1536
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, dim, **bf, requires_grad=True)
    router = torch.randn(dim, experts, **bf, requires_grad=True)
    w_up = torch.randn(experts, dim, 2 * hidden, **bf) / dim**0.5
    w_down = torch.randn(experts, hidden, dim, **bf) / hidden**0.5
    if k_major:
        w_up, w_down = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w_up, w_down))
    return x, router, w_up.requires_grad_(), w_down.requires_grad_()


def _check_layer_step(k_major: bool = False, impl: str = POLICY):
    x, router, w_up, w_down = layer_inputs(k_major)

    def step():
        _layer(x, router, w_up, w_down, impl).float().square().mean().backward()

    for _ in range(3):  # warm-up: autotuning and compilation may sync
        step()
    run_without_host_sync(step, 1)
    torch.cuda.synchronize()
    # run-ahead: behind a device sleep far longer than submitting takes, the host queues five
    # steps and returns while the device is still asleep: nothing in a step waited on it
    torch.cuda._sleep(4_000_000_000)  # about 2 s at Hopper's clocks
    asleep = torch.cuda.Event()
    asleep.record()
    start = time.perf_counter()
    for _ in range(5):
        step()
    host = time.perf_counter() - start
    still_asleep = not asleep.query()
    torch.cuda.synchronize()
    assert still_asleep, f"the host waited on the device: 5 steps queued in {host:.2f} s"


@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_kernel_equals_reference(bias):
    from moec.ops import loss as loss_op

    chunk = 1024 * 10007  # 3 chunks, the last one short
    rows, dim, vocab = 2500, 256, 10007  # vocab: 3 kernel blocks, the last one partial
    bf = dict(device="cuda", dtype=torch.bfloat16)
    h = torch.randn(rows, dim, **bf, requires_grad=True)
    weight = (torch.randn(vocab, dim, device="cuda") / dim**0.5).requires_grad_()  # fp32 master
    b = torch.randn(vocab, device="cuda", requires_grad=True) if bias else None
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    targets[::7] = -100
    params = [t for t in (h, weight, b) if t is not None]
    op = torch.ops.moec.linear_cross_entropy
    got = op(h, weight, b, targets, -100, "mean", chunk_elements=chunk)[0]
    want = loss_op.linear_cross_entropy_reference(h, weight, b, targets, -100, "mean")
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    for g, r in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
        assert g.dtype == r.dtype and torch.isfinite(g).all()
        assert _rel(g, r) < 1e-2


def quack_loss_calls(monkeypatch) -> list[int]:
    """Counts the calls of quack's scaled-exp loss pipeline (what ``cute_loss`` runs)."""
    import quack.linear_cross_entropy as quack_lce

    calls: list[int] = []
    original = quack_lce.scaled_exp_linear_cross_entropy_fwd

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(quack_lce, "scaled_exp_linear_cross_entropy_fwd", counted)
    return calls


@needs_quack
@pytest.mark.parametrize("rows", [2048, 1000])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_on_quacks_fused_gemms_equals_reference(monkeypatch, rows, reduction):
    """bf16 autocast over an fp32 weight, chunks of 512 rows (1000: the last one short, padded
    by quack), a seventh of the rows ignored: the op runs quack's pipeline where it takes the
    head, and its loss and gradients equal the reference's and moec's own chunks'."""
    from moec.ops import loss as loss_op

    dim, vocab = 384, 32768
    chunk = 512 * vocab
    calls = quack_loss_calls(monkeypatch)
    h = torch.randn(rows, dim, device="cuda", requires_grad=True)
    weight = (torch.randn(vocab, dim, device="cuda") / dim**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    targets[::7] = -100

    def loss_and_grads(op) -> tuple[torch.Tensor, ...]:
        with torch.autocast("cuda", torch.bfloat16):
            loss = op(h, weight, None, targets, -100, reduction)
        return loss, *torch.autograd.grad(loss, (h, weight))

    op = torch.ops.moec.linear_cross_entropy
    got = loss_and_grads(lambda *a: op(*a, True, chunk, "cute")[0])
    assert len(calls) == 1
    chunked = loss_and_grads(lambda *a: op(*a, True, chunk, "triton")[0])
    assert len(calls) == 1
    want = loss_and_grads(loss_op.linear_cross_entropy_reference)
    for other in (want, chunked):
        torch.testing.assert_close(got[0], other[0], atol=2e-3, rtol=1e-3)
        for g, w in zip(got[1:], other[1:]):
            assert g.dtype == w.dtype and torch.isfinite(g).all()
            assert _rel(g, w) < 1e-2


@needs_quack
def test_quacks_fused_loss_gives_a_target_past_the_vocabulary_a_nan_loss(monkeypatch):
    """As moec's row kernel does; the row otherwise counts as ignored (no write past the
    logits, no gradient), the other rows as they were."""
    from moec.kernels import cute_loss

    rows, dim, vocab = 256, 128, 1024
    calls = quack_loss_calls(monkeypatch)
    h = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16) / dim**0.5
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    ignored = targets.clone()
    targets[5], ignored[5] = vocab + 3, -100
    assert cute_loss.takes(h, weight, rows)
    loss, d_h, d_weight = cute_loss.linear_cross_entropy(h, weight, targets, -100, rows)
    want = cute_loss.linear_cross_entropy(h, weight, ignored, -100, rows)
    assert len(calls) == 2
    others = torch.arange(rows, device="cuda") != 5
    assert loss[5].isnan() and torch.isfinite(loss[others]).all()
    torch.testing.assert_close(loss[others], want[0][others])
    torch.testing.assert_close(d_h, want[1])
    torch.testing.assert_close(d_weight, want[2])


@pytest.mark.parametrize("backward", [False, True])
def test_rope_kernel_equals_reference(backward):
    from moec.kernels import rope
    from moec.ops.rope import rotate

    x = torch.randn(3, 8192, 12, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    cos, sin = (torch.randn(8192, 128, device="cuda") for _ in range(2))  # fp32 tables
    for dtype in (torch.bfloat16, torch.float32):
        got = rope.rope(x, cos, sin, dtype, backward)
        want = rotate(x, cos, sin, backward).to(dtype)
        assert got.dtype == dtype and got.is_contiguous()
        torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 2e-2,
                                   rtol=1e-5 if dtype == torch.float32 else 1e-2)  # fmt: skip


@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh", "quick_gelu_glu"])
def test_glu_op_runs_the_kernel_and_equals_reference(activation):
    """On the kernel when it computes the activation (quick_gelu_glu: on the reference)."""
    from moec.ops.activations import activate

    h = torch.randn(3, 1000, 2 * 700, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    got = torch.ops.moec.glu(h, activation)
    want = activate(h.float().reshape(-1, 1400), activation).view(3, 1000, 700)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
    d_a = torch.randn_like(got)
    (d_h,) = torch.autograd.grad(got, h, d_a)
    (ref,) = torch.autograd.grad(want, h, d_a.float())
    assert d_h.dtype == torch.bfloat16 and _rel(d_h.float(), ref) < 1e-2


@pytest.mark.parametrize("tile", range(len(activation.TILES)))
def test_every_activation_tile_equals_the_reference_and_the_gradient_alone_leaves_a(tile):
    """Each autotune candidate of the activation kernel on ragged rows and columns: forward,
    backward with a recomputed, and backward alone, which never writes a (poisoned, kept)."""
    from moec.ops.activations import activate, activate_backward

    config = activation.TILES[tile]
    rows, hidden = 1000 + tile, 700 + 3 * tile
    h = torch.randn(rows, 2 * hidden, device="cuda", dtype=torch.bfloat16)
    d_a = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    want_a = activate(h.float(), "swiglu")
    want_d_h = activate_backward(h.float(), d_a.float(), "swiglu")
    tile_rows, tile_cols = config.kwargs["BLOCK_R"], config.kwargs["BLOCK_H"]
    grid = (triton.cdiv(rows, tile_rows), triton.cdiv(hidden, tile_cols))
    for backward, store_a in ((False, True), (True, True), (True, False)):
        a = torch.full_like(d_a, float("nan"))
        d_h = torch.full_like(h, float("nan"))
        activation._act_kernel[grid](
            h, d_a, a, d_h, rows, hidden, h.stride(0), a.stride(0),
            ACT=activation.UNARY_CODES["silu"], GATED=True, BACKWARD=backward, STORE_A=store_a,
            num_warps=config.num_warps, **config.kwargs,
        )  # fmt: skip
        if store_a:
            assert _rel(a.float(), want_a) < 1e-2
        else:
            assert a.isnan().all()
        if backward:
            assert _rel(d_h.float(), want_d_h) < 1e-2


def test_adamw_kernel_equals_torch_adamw_and_writes_bf16_copies():
    from moec.runtime.working_weights import WorkingWeights
    from tests.adamw_check import step_both_and_compare

    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.randn(3000, 1000, device="cuda"))  # bf16 gradients
    module.b = torch.nn.Parameter(torch.randn(77, device="cuda"))  # float32, no copy
    module.register_buffer("copy", torch.full_like(module.w, float("nan"), dtype=torch.bfloat16))
    # a k-major expert weight (lowering.expert_weights): copy and moments follow its strides
    module.e = torch.nn.Parameter(torch.randn(4, 300, 500, device="cuda").transpose(1, 2))
    e_copy = torch.full_like(module.e, float("nan"), dtype=torch.bfloat16)
    module.register_buffer("e_copy", e_copy)
    copies = WorkingWeights(module, {"copy": ["w"], "e_copy": ["e"]}, torch.bfloat16)
    scale = torch.tensor(3.0, device="cuda")
    synced = functools.partial(run_without_host_sync, steps=1)
    step_both_and_compare([module.w, module.b, module.e], copies, scale, synced)
    for p in (module.w, module.e):
        assert torch.equal(copies.copy_of(p), p.detach().bfloat16())
    assert module.e_copy.stride() == module.e.stride() == (150000, 1, 500)
