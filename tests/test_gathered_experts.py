"""``moec::expert_mlp_gathered`` equals ``moec::expert_mlp(moec::dispatch(x, rows), ...)``.

Forward (every row below ``offsets[-1]``) and backward (x, weights, biases) in float32 on the
CPU, on routings with dropped routes, empty experts and one expert taking every row; its fake
implementation's shapes; its argument errors; the kernels' CuTe DSL path (token rows read
through quack's ``A_idx``) with a torch stand-in for quack. And pass ``gather_up`` on a tiny
Llama: the same loss and gradients as without it, with and without recompute regions.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.ops.experts import expert_mlp_reference
from moec.ops.gathered_experts import row_sources
from moec.ops.routing import assign_rows
from tests.models import assert_same_grads, assert_same_work, loss_and_grads, rewrite_reference
from tests.quack_stand_in import FakeQuack, run_on_stand_in

ops = torch.ops.moec
TOKENS, TOP_K, DIM, EXPERTS, HIDDEN = 24, 3, 16, 6, 12


def routing(case: str, tokens: int = TOKENS, top_k: int = TOP_K) -> tuple[torch.Tensor, ...]:
    """(rows [T, K], offsets [N] int32) of a routing: ``drops`` (capacity below the load),
    ``empty_experts`` (half the experts get nothing), ``one_expert`` (every route to expert 2)."""
    if case == "one_expert":
        ids = torch.full((tokens, top_k), 2)
    else:
        scores = torch.randn(tokens, EXPERTS)
        if case == "empty_experts":
            scores[:, ::2] -= 100.0
        ids = scores.topk(top_k, dim=-1).indices
    cap = max(1, tokens * top_k // EXPERTS - 2) if case == "drops" else tokens * top_k
    rows, offsets, _ = assign_rows(ids, EXPERTS, cap)
    return rows, offsets


def weights(activation: str, bias: bool) -> list[torch.Tensor | None]:
    width = 2 * HIDDEN if activation in ("swiglu", "geglu") else HIDDEN
    leaves = [
        torch.randn(EXPERTS, DIM, width) / DIM**0.5,
        torch.randn(EXPERTS, HIDDEN, DIM) / HIDDEN**0.5,
        torch.randn(EXPERTS, width) if bias else None,
        torch.randn(EXPERTS, DIM) if bias else None,
    ]
    return [None if t is None else t.requires_grad_() for t in leaves]


@pytest.mark.parametrize("case", ["drops", "empty_experts", "one_expert"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("bias", [False, True])
def test_gathered_equals_dispatch_then_expert_mlp(case, activation, bias):
    torch.manual_seed(0)
    rows, offsets = routing(case)
    used = int(offsets[-1])
    if case == "drops":
        assert (rows < 0).any()
    if case == "empty_experts":
        assert (offsets.diff(prepend=offsets.new_zeros(1)) == 0).any()
    x = torch.randn(2, TOKENS // 2, DIM, requires_grad=True)  # leading dims as the pass sees
    rows = rows.view(2, TOKENS // 2, TOP_K)
    w_up, w_down, b_up, b_down = weights(activation, bias)
    y, h = ops.expert_mlp_gathered(x, rows, w_up, w_down, offsets, b_up, b_down, activation)
    buffer = ops.dispatch(x, rows)
    y_ref, h_ref = ops.expert_mlp(buffer, w_up, w_down, offsets, b_up, b_down, activation)
    assert y.shape == y_ref.shape and h.shape == h_ref.shape
    torch.testing.assert_close(y[:used], y_ref[:used], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h[:used], h_ref[:used], atol=1e-5, rtol=1e-5)

    d_y = torch.randn_like(y)
    d_y[used:] = float("nan")  # rows past the offsets contribute nothing
    leaves = [t for t in (x, w_up, w_down, b_up, b_down) if t is not None]
    got = torch.autograd.grad(y, leaves, d_y)
    want = torch.autograd.grad(y_ref, leaves, d_y)
    for name, g, w in zip(["x", "w_up", "w_down", "b_up", "b_down"], got, want, strict=False):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=name)


def test_bf16_weights_get_gradients_in_their_dtype():
    torch.manual_seed(1)
    rows, offsets = routing("drops")
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    w_up, w_down = (t.detach().bfloat16().requires_grad_() for t in weights("gelu", False)[:2])
    y, _ = ops.expert_mlp_gathered(x, rows, w_up, w_down, offsets, None, None, "gelu")
    d_x, d_w_up, d_w_down = torch.autograd.grad(y[: int(offsets[-1])].sum(), (x, w_up, w_down))
    assert (d_x.dtype, d_w_up.dtype, d_w_down.dtype) == (x.dtype, torch.bfloat16, torch.bfloat16)


def test_row_sources_maps_each_accepted_row_to_its_token():
    torch.manual_seed(2)
    rows, offsets = routing("drops")
    sources = row_sources(rows)
    assert sources.shape == (TOKENS * TOP_K,) and sources.dtype == torch.int32
    token, k = (rows >= 0).nonzero(as_tuple=True)
    assert torch.equal(sources[rows[token, k]].long(), token)
    assert ((sources >= 0) & (sources < TOKENS)).all()


def test_fake_shapes():
    rows, offsets = routing("drops")
    w_up, w_down, b_up, b_down = (
        None if t is None else t.detach() for t in weights("swiglu", True)
    )
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx_ = mode.from_tensor(torch.randn(2, TOKENS // 2, DIM).bfloat16())
        f_rows = mode.from_tensor(rows.view(2, TOKENS // 2, TOP_K))
        args = [mode.from_tensor(t) for t in (w_up, w_down, offsets, b_up, b_down)]
        y, h = ops.expert_mlp_gathered(fx_, f_rows, *args, "swiglu")
        grads = ops.expert_mlp_gathered_backward(
            fx_, f_rows, args[0], args[1], args[2], h, y, "swiglu", True
        )
    assert y.shape == (TOKENS * TOP_K, DIM) and h.shape == (TOKENS * TOP_K, 2 * HIDDEN)
    assert y.dtype == h.dtype == torch.bfloat16
    assert [tuple(g.shape) for g in grads] == [
        (TOKENS * TOP_K, DIM),
        tuple(w_up.shape),
        tuple(w_down.shape),
        (TOKENS * TOP_K, 2 * HIDDEN),
    ]


@pytest.mark.parametrize(
    "change,message",
    [
        ({"x": torch.randn(TOKENS + 1, DIM)}, "x .* and rows .* must share"),
        ({"rows": torch.zeros(TOKENS, TOP_K)}, "rows must be int32 or int64"),
        ({"x": torch.randn(TOKENS, DIM + 1)}, "x .* has not w_up's D"),
        ({"w_down": torch.randn(EXPERTS, HIDDEN + 1, DIM)}, "w_down .* does not fit w_up"),
        (
            {"offsets": torch.zeros(EXPERTS + 1, dtype=torch.int32)},
            "offsets .*: expected one per expert",
        ),
    ],
)
def test_bad_arguments_raise_naming_them(change, message):
    rows, offsets = routing("drops")
    w_up, w_down = (t.detach() for t in weights("gelu", False)[:2])
    args = {"x": torch.randn(TOKENS, DIM), "rows": rows, "w_up": w_up, "w_down": w_down}
    args["offsets"] = offsets
    args.update(change)
    with pytest.raises(ValueError, match=f"moec::expert_mlp_gathered: {message}"):
        ops.expert_mlp_gathered(*args.values(), None, None, "gelu")


# --- the pass on a whole model -----------------------------------------------------------------


def _compiled(model, ids, gather_up: bool, recompute: str):
    import moec

    plan = {
        "moe": {"num_experts": 4, "top_k": 2, "dense_first": 1},
        "recompute": {"policy": recompute},
        "lowering": {"gather_up": gather_up},
    }
    return moec.compile(copy.deepcopy(model), moec.Plan.from_dict(plan), (ids,))


@pytest.fixture(scope="module")
def llama_case():
    """The reference without the pass (for recompute too: recompute keeps gradients,
    tests/test_recompute.py)."""
    return rewrite_reference(lambda model, ids: _compiled(model, ids, False, "none"), "gather_up")


@pytest.mark.parametrize("recompute", ["none", "block"])
def test_tiny_llama_same_loss_and_gradients_with_gather_up(llama_case, recompute):
    model, ids, (want_loss, want) = llama_case
    gathered = _compiled(model, ids, True, recompute)
    stats = gathered.pass_results["gather_up"].stats
    assert stats["fused"] == 1 and stats["in_regions"] == (recompute != "none")
    got_loss, got = loss_and_grads(gathered, ids)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-6, rtol=1e-6)
    assert_same_work(gathered, _compiled(model, ids, False, recompute))
    assert_same_grads(got, want, atol=1e-6, rtol=1e-5)


# --- the CuTe DSL path's plumbing, on a stand-in for quack -------------------------------------


@pytest.mark.parametrize(
    "backend,activation", [("cute", "silu"), ("cute", "relu"), ("cute_glu", "swiglu")]
)
def test_cute_path_reads_token_rows_through_a_idx(monkeypatch, backend, activation):
    """The kernels' gathered expert MLP with every piece on the CuTe DSL, quack stood in for by
    torch: y, h and every gradient equal the plain expert MLP on the dispatched buffer, the up
    GEMM and its wgrad ran with A_idx, and no buffer was gathered."""
    from moec.kernels import experts as kernel_experts
    from moec.ops.cuda import kernel_activation

    quack = run_on_stand_in(monkeypatch, backend)
    torch.manual_seed(3)
    rows, offsets = routing("drops")
    used = int(offsets[-1])
    x = torch.randn(TOKENS, DIM)
    w_up, w_down = (t.detach() for t in weights(activation, False)[:2])
    act = kernel_activation(activation)
    sources = row_sources(rows)
    buffer = x[sources.long()]
    d_y = torch.randn(TOKENS * TOP_K, DIM)

    monkeypatch.setattr(torch.Tensor, "index_select", None)  # the buffer path would call it
    y, h = kernel_experts.expert_mlp(x, w_up, w_down, offsets, None, None, act, sources)
    assert quack.gathered == ["m"]
    got = kernel_experts.expert_mlp_gathered_backward(
        x, sources, w_up, w_down, offsets, h, d_y, act
    )
    assert quack.gathered == ["m", "k"]
    y_ref, h_ref = kernel_experts.expert_mlp(buffer, w_up, w_down, offsets, None, None, act)
    want = kernel_experts.expert_mlp_backward(buffer, w_up, w_down, offsets, h_ref, d_y, act)
    close = dict(atol=1e-5, rtol=1e-5)
    oracle = expert_mlp_reference(buffer, w_up, w_down, offsets, None, None, activation)[0]
    torch.testing.assert_close(y[:used], oracle[:used], **close)  # the stand-in is quack's math
    torch.testing.assert_close(y[:used], y_ref[:used], **close)
    torch.testing.assert_close(h[:used], h_ref[:used], **close)
    for name, g, w in zip(["d_rows", "d_w_up", "d_w_down", "d_h"], got, want, strict=True):
        if name in ("d_rows", "d_h"):
            g, w = g[:used], w[:used]
        torch.testing.assert_close(g, w, **close, msg=name)


def test_k_major_w_up_runs_the_gated_epilogues_without_weight_copies(monkeypatch):
    """k-major expert weights (stacked nn.Linear layout): the policy's ``cute`` becomes
    ``cute_glu``, quack reads w_up's [gate | up] dim as pairs in the up projection, the dgrad and
    the wgrad (concat_layout), no interleave copy runs, every value equals the n-major run, and
    both weight gradients are written k-major."""
    from moec.kernels import cute_gemm, grouped_gemm
    from moec.kernels import experts as kernel_experts
    from moec.ops.cuda import kernel_activation

    quack = FakeQuack()
    monkeypatch.setattr(cute_gemm, "_quack", lambda: quack)
    policy = {"up": "cute_glu"}  # the reference: n-major w_up on cute_glu (interleave copies)

    def backend(piece, x, w, kernels=True, glu_epilogue=False):
        return policy.get(piece, "cute")

    for module in (grouped_gemm, kernel_experts):
        monkeypatch.setattr(module, "backend", backend)
    torch.manual_seed(5)
    rows, offsets = routing("empty_experts")
    used = int(offsets[-1])
    buffer = torch.randn(TOKENS * TOP_K, DIM)
    w_up, w_down = (t.detach() for t in weights("swiglu", False)[:2])
    w_up_k, w_down_k = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w_up, w_down))
    assert cute_gemm.k_major(w_up_k) and not cute_gemm.k_major(w_up)
    act = kernel_activation("swiglu")
    d_y = torch.randn(TOKENS * TOP_K, DIM)

    y_ref, h_ref = kernel_experts.expert_mlp(buffer, w_up, w_down, offsets, None, None, act)
    want = kernel_experts.expert_mlp_backward(buffer, w_up, w_down, offsets, h_ref, d_y, act)
    assert quack.concat == []  # n-major: interleaved copies of w_up and of its gradient
    policy.clear()  # the policy says "cute" for the k-major run: up_backend makes it cute_glu

    def no_copy(*args):
        raise AssertionError("a k-major w_up needs no interleave copy")

    monkeypatch.setattr(cute_gemm, "interleave", no_copy)
    monkeypatch.setattr(cute_gemm, "deinterleave", no_copy)
    y, h = kernel_experts.expert_mlp(buffer, w_up_k, w_down_k, offsets, None, None, act)
    got = kernel_experts.expert_mlp_backward(buffer, w_up_k, w_down_k, offsets, h, d_y, act)
    assert quack.concat == ["B", "out", "B^T"]
    close = dict(atol=1e-5, rtol=1e-5)
    oracle = expert_mlp_reference(buffer, w_up, w_down, offsets, None, None, "swiglu")[0]
    torch.testing.assert_close(y[:used], oracle[:used], **close)
    torch.testing.assert_close(y[:used], y_ref[:used], **close)
    torch.testing.assert_close(h[:used], h_ref[:used], **close)  # both interleaved
    for name, g, w in zip(["d_x", "d_w_up", "d_w_down", "d_h"], got, want, strict=True):
        if name in ("d_x", "d_h"):
            g, w = g[:used], w[:used]
        torch.testing.assert_close(g, w, **close, msg=name)
    assert cute_gemm.k_major(got[1]) and cute_gemm.k_major(got[2])  # written so, not copied


@pytest.mark.parametrize("op", ["expert_mlp", "expert_mlp_gathered"])
def test_weight_gradients_come_back_in_the_weights_layout(op):
    """Weight gradients have the weights' strides (a k-major weight, k-major gradient: autograd
    accumulates it without a copy), values as with contiguous weights; the fake agrees."""
    torch.manual_seed(6)
    rows, offsets = routing("drops")
    x = torch.randn(TOKENS, DIM)
    w_up, w_down = (t.detach() for t in weights("swiglu", False)[:2])

    def run(w_up, w_down):
        w_up, w_down = w_up.clone().requires_grad_(), w_down.clone().requires_grad_()
        if op == "expert_mlp":
            y, _ = ops.expert_mlp(ops.dispatch(x, rows), w_up, w_down, offsets, None, None,
                                  "swiglu")  # fmt: skip
        else:
            y, _ = ops.expert_mlp_gathered(x, rows, w_up, w_down, offsets, None, None, "swiglu")
        used = int(offsets[-1])
        (y[:used] * torch.arange(used * DIM).view(used, DIM).cos()).sum().backward()
        return w_up.grad, w_down.grad

    def k_major(w):
        return w.transpose(1, 2).contiguous().transpose(1, 2)

    want = run(w_up, w_down)
    got = run(k_major(w_up), k_major(w_down))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        assert g.stride() == k_major(w).stride()
