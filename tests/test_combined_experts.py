"""``moec::expert_mlp`` with the combine inside (``rows``, ``weights``) equals
``moec::combine(moec::expert_mlp(moec::dispatch(x, rows), ...)[0], weights, rows)``.

Forward and backward (x, route weights, expert weights in either layout) in float32 on the CPU,
on routings with dropped routes, empty experts and one expert taking every row; float64
gradcheck; its fake implementation's shapes; its argument errors; the kernels' CuTe DSL path
(token rows read through quack's ``A_idx``, route weights applied in the down dgrad's epilogue)
with a torch stand-in for quack. And pass ``combine_experts`` on a tiny Llama: the same loss and
gradients as without it, with and without recompute regions.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd import gradcheck

import moec
import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.kernels.gemm_backend import GemmPolicy
from moec.ops.activations import kernel_activation
from moec.ops.grouped import by_row, row_sources
from moec.ops.routing import assign_rows
from tests.models import assert_same_grads, loss_and_grads, rewrite_reference
from tests.quack_stand_in import FakeQuack, run_on_stand_in

ops = torch.ops.moec
TOKENS, TOP_K, DIM, EXPERTS, HIDDEN = 24, 3, 16, 6, 12
ON_CUTE = GemmPolicy(quack=True)
"""The rules, the CuTe DSL allowed (the stand-in routes every piece to it)."""


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


def weights(activation: str) -> list[torch.Tensor]:
    width = 2 * HIDDEN if activation in ("swiglu", "geglu") else HIDDEN
    leaves = [
        torch.randn(EXPERTS, DIM, width) / DIM**0.5,
        torch.randn(EXPERTS, HIDDEN, DIM) / HIDDEN**0.5,
    ]
    return [t.requires_grad_() for t in leaves]


def _k_major(t: torch.Tensor) -> torch.Tensor:
    return t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()


def _route_weights() -> torch.Tensor:
    return torch.rand(TOKENS, TOP_K).softmax(-1).requires_grad_()


def combined(x, rows, route_weights, w_up, w_down, offsets, activation, impl="auto"):
    """The op with the combine inside."""
    return ops.expert_mlp(
        x, w_up, w_down, offsets, None, None, activation, "bf16", rows, route_weights, impl
    )


@pytest.mark.parametrize("case", ["drops", "empty_experts", "one_expert"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("layout", ["n_major", "k_major"])
def test_combine_inside_equals_dispatch_expert_mlp_combine(case, activation, layout):
    rows, offsets = routing(case)
    if case == "drops":
        assert (rows < 0).any()
    x = torch.randn(2, TOKENS // 2, DIM, requires_grad=True)  # leading dims as the pass sees
    rows = rows.view(2, TOKENS // 2, TOP_K)
    route_weights = _route_weights().detach().view(2, TOKENS // 2, TOP_K).requires_grad_()
    w_up, w_down = weights(activation)
    if layout == "k_major":
        w_up, w_down = _k_major(w_up), _k_major(w_down)
    out, h = combined(x, rows, route_weights, w_up, w_down, offsets, activation)
    y, h_ref = ops.expert_mlp(ops.dispatch(x, rows), w_up, w_down, offsets, None, None, activation)
    out_ref = ops.combine(y, route_weights, rows)
    assert out.shape == x.shape and h.shape == h_ref.shape
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    used = int(offsets[-1])
    torch.testing.assert_close(h[:used], h_ref[:used], atol=1e-5, rtol=1e-5)

    d_out = torch.randn_like(out)
    leaves = (x, route_weights, w_up, w_down)
    got = torch.autograd.grad(out, leaves, d_out)
    want = torch.autograd.grad(out_ref, leaves, d_out)
    for name, g, w in zip(["x", "weights", "w_up", "w_down"], got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=name)
    assert got[2].stride() == w_up.stride() and got[3].stride() == w_down.stride()
    if case == "drops":  # a dropped route's weight scales nothing: no gradient
        assert (got[1][rows < 0] == 0).all()


@pytest.mark.parametrize("impl", ["reference", "loop"])
def test_combine_inside_gradcheck(impl):
    """Float64 gradients of tokens, route weights and both expert weights (a drop included)."""
    rows, offsets = routing("drops", tokens=5, top_k=2)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    route_weights = torch.rand(5, 2, dtype=torch.float64, requires_grad=True)
    w_up = torch.randn(EXPERTS, 4, 6, dtype=torch.float64, requires_grad=True)
    w_down = torch.randn(EXPERTS, 3, 4, dtype=torch.float64, requires_grad=True)

    def fn(x, route_weights, w_up, w_down):
        return combined(x, rows, route_weights, w_up, w_down, offsets, "swiglu", impl)[0]

    assert gradcheck(fn, (x, route_weights, w_up, w_down))


def test_by_row_places_each_route_value_at_its_row():
    rows, _ = routing("drops")
    values = torch.randn(TOKENS, TOP_K)
    placed = by_row(values, rows)
    accepted = rows >= 0
    assert placed.shape == (TOKENS * TOP_K,)
    assert torch.equal(placed[rows[accepted]], values[accepted])
    unused = torch.ones(TOKENS * TOP_K, dtype=torch.bool)
    unused[rows[accepted]] = False
    assert (placed[unused] == 0).all()


def test_row_sources_maps_each_accepted_row_to_its_token():
    rows, _ = routing("drops")
    sources = row_sources(rows)
    assert sources.shape == (TOKENS * TOP_K,) and sources.dtype == torch.int32
    token, k = (rows >= 0).nonzero(as_tuple=True)
    assert torch.equal(sources[rows[token, k]].long(), token)
    assert ((sources >= 0) & (sources < TOKENS)).all()


def test_fake_shapes():
    rows, offsets = routing("drops")
    w_up, w_down = (t.detach() for t in weights("swiglu"))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(2, TOKENS // 2, DIM).bfloat16())
        f_rows = mode.from_tensor(rows.view(2, TOKENS // 2, TOP_K))
        f_w = mode.from_tensor(torch.rand(2, TOKENS // 2, TOP_K))
        up, down, offs = (mode.from_tensor(t) for t in (w_up, w_down, offsets))
        out, h = combined(x, f_rows, f_w, up, down, offs, "swiglu")
        grads = ops.expert_mlp_backward(
            x, up, down, offs, h, out, "swiglu", False, "bf16", f_rows, f_w
        )
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert h.shape == (TOKENS * TOP_K, 2 * HIDDEN)
    assert [tuple(g.shape) for g in grads] == [
        (TOKENS * TOP_K, DIM),
        tuple(w_up.shape),
        tuple(w_down.shape),
        (TOKENS * TOP_K, 2 * HIDDEN),
        (2, TOKENS // 2, TOP_K),
    ]
    assert grads[4].dtype == torch.float32


@pytest.mark.parametrize(
    "change,message",
    [
        ({"x": torch.randn(TOKENS + 1, DIM)}, "x .* and rows .* must share"),
        ({"rows": torch.zeros(TOKENS, TOP_K)}, "rows must be int32 or int64"),
        ({"route_weights": torch.rand(TOKENS, TOP_K + 1)}, "weights .* one per route"),
        ({"route_weights": torch.ones(TOKENS, TOP_K, dtype=torch.int64)}, "weights .* floating"),
        ({"route_weights": None}, "rows and weights come together"),
    ],
)
def test_bad_arguments_raise_naming_them(change, message):
    rows, offsets = routing("drops")
    w_up, w_down = (t.detach() for t in weights("gelu"))
    args = {"x": torch.randn(TOKENS, DIM), "rows": rows, "route_weights": torch.rand(TOKENS, 3)}
    args.update(change)
    with pytest.raises(ValueError, match=f"moec::expert_mlp: {message}"):
        combined(args["x"], args["rows"], args["route_weights"], w_up, w_down, offsets, "gelu")


def test_the_combine_inside_takes_no_biases():
    rows, offsets = routing("drops")
    w_up, w_down = (t.detach() for t in weights("gelu"))
    bias = torch.zeros(EXPERTS, DIM)
    with pytest.raises(ValueError, match="takes no biases"):
        ops.expert_mlp(torch.randn(TOKENS, DIM), w_up, w_down, offsets, None, bias, "gelu",
                       "bf16", rows, torch.rand(TOKENS, TOP_K))  # fmt: skip


# --- the CuTe DSL path's plumbing, on a stand-in for quack -------------------------------------


@pytest.mark.parametrize(
    "backend,activation", [("cute", "silu"), ("cute", "relu"), ("cute_glu", "swiglu")]
)
def test_cute_path_reads_token_rows_through_a_idx(monkeypatch, backend, activation):
    """The kernels' expert MLP given the rows' sources, every piece on the CuTe DSL (quack stood
    in for by torch): y and h equal the plain expert MLP on the dispatched buffer, the up GEMM
    ran with A_idx, and no buffer was gathered."""
    from moec.kernels import experts as kernel_experts

    quack = run_on_stand_in(monkeypatch, backend)
    rows, offsets = routing("drops")
    used = int(offsets[-1])
    x = torch.randn(TOKENS, DIM)
    w_up, w_down = (t.detach() for t in weights(activation))
    act = kernel_activation(activation)
    sources = row_sources(rows)
    buffer = x[sources.long()]

    monkeypatch.setattr(torch.Tensor, "index_select", None)  # the buffer path would call it
    operands = kernel_experts.ExpertOperands(x, w_up, w_down, offsets)
    y, h = kernel_experts.expert_mlp(operands, None, None, act, ON_CUTE, sources)
    assert quack.gathered == ["m"]
    monkeypatch.undo()
    quack = run_on_stand_in(monkeypatch, backend)
    y_ref, h_ref = kernel_experts.expert_mlp(operands._replace(x=buffer), None, None, act, ON_CUTE)
    close = dict(atol=1e-5, rtol=1e-5)
    oracle = ops.expert_mlp(buffer, w_up, w_down, offsets, None, None, activation)[0]
    torch.testing.assert_close(y[:used], oracle[:used], **close)  # the stand-in is quack's math
    torch.testing.assert_close(y[:used], y_ref[:used], **close)
    torch.testing.assert_close(h[:used], h_ref[:used], **close)


@pytest.mark.parametrize("layout", ["n_major", "k_major"])
def test_cute_path_weighs_rows_in_the_dgrad_epilogue(monkeypatch, layout):
    """The kernels' combined backward with every piece on the CuTe DSL (quack stood in for by
    torch): every gradient equals the op's reference, the down dgrad read d_out's token rows
    through A_idx with the route weights as its row scale, the up wgrad read the token rows
    through A_idx, and (k-major) no rows were gathered."""
    from moec.kernels import experts as kernel_experts

    quack = run_on_stand_in(monkeypatch)
    rows, offsets = routing("drops")
    x = torch.randn(TOKENS, DIM)
    route_weights = _route_weights().detach()
    w_up, w_down = (t.detach() for t in weights("swiglu"))
    if layout == "k_major":
        w_up, w_down = (_k_major(w).detach() for w in (w_up, w_down))
    act = kernel_activation("swiglu")
    sources = row_sources(rows)
    d_out = torch.randn(TOKENS, DIM)

    operands = kernel_experts.ExpertOperands(x, w_up, w_down, offsets)
    _, h = kernel_experts.expert_mlp(operands, None, None, act, ON_CUTE, sources)
    if layout == "k_major":  # every row read through A_idx: nothing gathered
        monkeypatch.setattr(torch.Tensor, "index_select", None)
    d_rows, d_row_weights, d_w_up, d_w_down, _ = kernel_experts.expert_mlp_combined_backward(
        operands, sources, by_row(route_weights, rows), h, d_out, act, ON_CUTE
    )
    monkeypatch.undo()
    assert "dact" in quack.gathered and "k" in quack.gathered
    _, h_ref = combined(x, rows, route_weights, w_up, w_down, offsets, "swiglu")
    want = ops.expert_mlp_backward(  # the reference on the CPU: h in its own layout
        x, w_up, w_down, offsets, h_ref, d_out, "swiglu", False, "bf16", rows, route_weights
    )
    accepted = rows >= 0
    close = dict(atol=1e-5, rtol=1e-5)
    d_weights = torch.where(accepted, d_row_weights[rows.clamp(min=0)], 0.0)
    torch.testing.assert_close(d_weights, want[4], **close, msg="d_weights")
    used = int(offsets[-1])
    torch.testing.assert_close(d_rows[:used], want[0][:used], **close, msg="d_rows")
    torch.testing.assert_close(d_w_up, want[1], **close, msg="d_w_up")
    torch.testing.assert_close(d_w_down, want[2], **close, msg="d_w_down")
    assert d_w_up.stride() == w_up.stride() and d_w_down.stride() == w_down.stride()


def test_k_major_w_up_runs_the_gated_epilogues_without_weight_copies(monkeypatch):
    """k-major expert weights (stacked nn.Linear layout): the policy's ``cute`` becomes
    ``cute_glu``, quack reads w_up's [gate | up] dim as pairs in the up projection, the dgrad and
    the wgrad (concat_layout), no interleave copy runs, every value equals the n-major run, and
    both weight gradients are written k-major."""
    from moec.kernels import cute_gemm, grouped_gemm
    from moec.kernels import experts as kernel_experts

    quack = FakeQuack()
    monkeypatch.setattr(cute_gemm, "_quack", lambda: quack)
    policy = {"up": "cute_glu"}  # the reference: n-major w_up on cute_glu (interleave copies)

    def backend(piece, x, w, policy_=None, glu_epilogue=False):
        return policy.get(piece, "cute")

    for module in (grouped_gemm, kernel_experts):
        monkeypatch.setattr(module, "backend", backend)
    rows, offsets = routing("empty_experts")
    used = int(offsets[-1])
    buffer = torch.randn(TOKENS * TOP_K, DIM)
    w_up, w_down = (t.detach() for t in weights("swiglu"))
    w_up_k, w_down_k = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w_up, w_down))
    assert cute_gemm.k_major(w_up_k) and not cute_gemm.k_major(w_up)
    act = kernel_activation("swiglu")
    d_y = torch.randn(TOKENS * TOP_K, DIM)

    def run(w_up, w_down):
        operands = kernel_experts.ExpertOperands(buffer, w_up, w_down, offsets)
        y, h = kernel_experts.expert_mlp(operands, None, None, act, ON_CUTE)
        grads = kernel_experts.expert_mlp_backward(operands, h, d_y, act, ON_CUTE)
        return y, h, grads

    y_ref, h_ref, want = run(w_up, w_down)
    assert quack.concat == []  # n-major: interleaved copies of w_up and of its gradient
    policy.clear()  # the policy says "cute" for the k-major run: up_backend makes it cute_glu

    def no_copy(*args):
        raise AssertionError("a k-major w_up needs no interleave copy")

    monkeypatch.setattr(cute_gemm, "interleave", no_copy)
    monkeypatch.setattr(cute_gemm, "deinterleave", no_copy)
    y, h, got = run(w_up_k, w_down_k)
    assert quack.concat == ["B", "out", "B^T"]
    close = dict(atol=1e-5, rtol=1e-5)
    oracle = ops.expert_mlp(buffer, w_up, w_down, offsets, None, None, "swiglu")[0]
    torch.testing.assert_close(y[:used], oracle[:used], **close)
    torch.testing.assert_close(y[:used], y_ref[:used], **close)
    torch.testing.assert_close(h[:used], h_ref[:used], **close)  # both interleaved
    for name, g, w in zip(["d_x", "d_w_up", "d_w_down", "d_h"], got, want, strict=True):
        if name in ("d_x", "d_h"):
            g, w = g[:used], w[:used]
        torch.testing.assert_close(g, w, **close, msg=name)
    assert cute_gemm.k_major(got[1]) and cute_gemm.k_major(got[2])  # written so, not copied


# --- the pass on a whole model -----------------------------------------------------------------


def _compiled(model, ids, combine: bool, recompute: str = "none"):
    plan = {
        "moe": {"num_experts": 4, "top_k": 2, "dense_first": 1},
        "recompute": {"policy": recompute},
        "lowering": {"combine_in_experts": combine},
    }
    return moec.compile(copy.deepcopy(model), moec.Plan.from_dict(plan), (ids,))


@pytest.fixture(scope="module")
def llama_case():
    """The reference without the pass."""
    return rewrite_reference(lambda model, ids: _compiled(model, ids, False), "combine_experts")


@pytest.mark.parametrize("recompute", ["none", "block"])
def test_tiny_llama_same_loss_and_gradients_with_combine_in_experts(llama_case, recompute):
    model, ids, (want_loss, want) = llama_case
    folded = _compiled(model, ids, True, recompute)
    stats = folded.pass_results["combine_experts"].stats
    assert stats["fused"] == 1 and stats["in_regions"] == (recompute != "none")
    gm = folded.graph_module
    nodes = [n for sub in gm.modules() if hasattr(sub, "graph") for n in sub.graph.nodes]
    targets = {n.target for n in nodes}
    assert ops.combine.default not in targets and ops.dispatch.default not in targets
    mlps = [n for n in nodes if n.target == ops.expert_mlp.default]
    assert len(mlps) == 1 and mlps[0].args[8] is not None  # the rows: combine inside
    got_loss, got = loss_and_grads(folded, ids)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-6, rtol=1e-6)
    assert_same_grads(got, want, atol=1e-6, rtol=1e-5)
