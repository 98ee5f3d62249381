"""``moec::expert_mlp_combined`` equals ``moec::combine(moec::expert_mlp_gathered(...)[0], ...)``.

Forward and backward (tokens, route weights, expert weights in both layouts) in float32 on the
CPU over routings with dropped routes, empty experts and one expert taking every row; its fake
implementations' shapes; its argument errors; the kernels' CuTe DSL path (the route weights and
their gradient in the down dgrad's epilogue, the output gradient's token rows read through
``A_idx``) on a stand-in for quack. And pass ``combine_experts`` on a tiny Llama: the same loss
and gradients as without it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moec
import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.ops.gathered_experts import by_row, row_sources
from moec.plan import PlanError
from tests.models import assert_same_grads, loss_and_grads, rewrite_reference
from tests.quack_stand_in import run_on_stand_in
from tests.test_gathered_experts import DIM, HIDDEN, TOKENS, TOP_K, routing, weights

ops = torch.ops.moec


def _k_major(t: torch.Tensor) -> torch.Tensor:
    return t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()


def _route_weights() -> torch.Tensor:
    return torch.rand(TOKENS, TOP_K).softmax(-1).requires_grad_()


@pytest.mark.parametrize("case", ["drops", "empty_experts", "one_expert"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("layout", ["n_major", "k_major"])
def test_combined_equals_gathered_then_combine(case, activation, layout):
    torch.manual_seed(0)
    rows, offsets = routing(case)
    x = torch.randn(2, TOKENS // 2, DIM, requires_grad=True)  # leading dims as the pass sees
    rows = rows.view(2, TOKENS // 2, TOP_K)
    route_weights = _route_weights().detach().view(2, TOKENS // 2, TOP_K).requires_grad_()
    w_up, w_down = weights(activation, False)[:2]
    if layout == "k_major":
        w_up, w_down = _k_major(w_up), _k_major(w_down)
    out, h = ops.expert_mlp_combined(x, rows, route_weights, w_up, w_down, offsets, activation)
    y, h_ref = ops.expert_mlp_gathered(x, rows, w_up, w_down, offsets, None, None, activation)
    out_ref = ops.combine(y, route_weights, rows)
    assert out.shape == x.shape and h.shape == h_ref.shape
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)

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


def test_by_row_places_each_route_value_at_its_row():
    torch.manual_seed(2)
    rows, _ = routing("drops")
    values = torch.randn(TOKENS, TOP_K)
    placed = by_row(values, rows)
    accepted = rows >= 0
    assert placed.shape == (TOKENS * TOP_K,)
    assert torch.equal(placed[rows[accepted]], values[accepted])
    unused = torch.ones(TOKENS * TOP_K, dtype=torch.bool)
    unused[rows[accepted]] = False
    assert (placed[unused] == 0).all()


def test_fake_shapes():
    rows, offsets = routing("drops")
    w_up, w_down = (t.detach() for t in weights("swiglu", False)[:2])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(2, TOKENS // 2, DIM).bfloat16())
        f_rows = mode.from_tensor(rows.view(2, TOKENS // 2, TOP_K))
        f_w = mode.from_tensor(torch.rand(2, TOKENS // 2, TOP_K))
        args = [mode.from_tensor(t) for t in (w_up, w_down, offsets)]
        out, h = ops.expert_mlp_combined(x, f_rows, f_w, *args, "swiglu")
        grads = ops.expert_mlp_combined_backward(x, f_rows, f_w, *args, h, out, "swiglu")
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert h.shape == (TOKENS * TOP_K, 2 * HIDDEN)
    assert [tuple(g.shape) for g in grads] == [
        (TOKENS * TOP_K, DIM),
        (2, TOKENS // 2, TOP_K),
        tuple(w_up.shape),
        tuple(w_down.shape),
        (TOKENS * TOP_K, 2 * HIDDEN),
    ]
    assert grads[1].dtype == torch.float32


@pytest.mark.parametrize(
    "weights_arg,message",
    [
        (torch.rand(TOKENS, TOP_K + 1), "weights .* one per route"),
        (torch.ones(TOKENS, TOP_K, dtype=torch.int64), "weights .* must be floating point"),
    ],
)
def test_bad_weights_raise_naming_them(weights_arg, message):
    rows, offsets = routing("drops")
    w_up, w_down = (t.detach() for t in weights("gelu", False)[:2])
    with pytest.raises(ValueError, match=f"moec::expert_mlp_combined: {message}"):
        ops.expert_mlp_combined(
            torch.randn(TOKENS, DIM), rows, weights_arg, w_up, w_down, offsets, "gelu"
        )


# --- the CuTe DSL path's plumbing, on a stand-in for quack -------------------------------------


@pytest.mark.parametrize("layout", ["n_major", "k_major"])
def test_cute_path_weighs_rows_in_the_dgrad_epilogue(monkeypatch, layout):
    """The kernels' combined backward with every piece on the CuTe DSL (quack stood in for by
    torch): every gradient equals the op's reference, the down dgrad read d_out's token rows
    through A_idx with the route weights as its row scale, and (k-major) no rows were gathered."""
    from moec.kernels import experts as kernel_experts
    from moec.ops.cuda import kernel_activation

    quack = run_on_stand_in(monkeypatch)
    torch.manual_seed(3)
    rows, offsets = routing("drops")
    x = torch.randn(TOKENS, DIM)
    route_weights = _route_weights().detach()
    w_up, w_down = (t.detach() for t in weights("swiglu", False)[:2])
    if layout == "k_major":
        w_up, w_down = (_k_major(w).detach() for w in (w_up, w_down))
    act = kernel_activation("swiglu")
    sources = row_sources(rows)
    d_out = torch.randn(TOKENS, DIM)

    _, h = kernel_experts.expert_mlp(x, w_up, w_down, offsets, None, None, act, sources)
    if layout == "k_major":  # every row read through A_idx: nothing gathered
        monkeypatch.setattr(torch.Tensor, "index_select", None)
    d_rows, d_row_weights, d_w_up, d_w_down, _ = kernel_experts.expert_mlp_combined_backward(
        x, sources, by_row(route_weights, rows), w_up, w_down, offsets, h, d_out, act
    )
    monkeypatch.undo()
    assert "dact" in quack.gathered
    _, h_ref = ops.expert_mlp_gathered(x, rows, w_up, w_down, offsets, None, None, "swiglu")
    want = ops.expert_mlp_combined_backward(  # the reference on the CPU: h in its own layout
        x, rows, route_weights, w_up, w_down, offsets, h_ref, d_out, "swiglu"
    )
    accepted = rows >= 0
    close = dict(atol=1e-5, rtol=1e-5)
    d_weights = torch.where(accepted, d_row_weights[rows.clamp(min=0)], 0.0)
    torch.testing.assert_close(d_weights, want[1], **close, msg="d_weights")
    used = int(offsets[-1])
    torch.testing.assert_close(d_rows[:used], want[0][:used], **close, msg="d_rows")
    torch.testing.assert_close(d_w_up, want[2], **close, msg="d_w_up")
    torch.testing.assert_close(d_w_down, want[3], **close, msg="d_w_down")
    assert d_w_up.stride() == w_up.stride() and d_w_down.stride() == w_down.stride()


# --- the pass on a whole model -----------------------------------------------------------------


def _compiled(model, ids, combine: bool, recompute: str = "none"):
    plan = {
        "moe": {"num_experts": 4, "top_k": 2, "dense_first": 1},
        "recompute": {"policy": recompute},
        "lowering": {"gather_up": True, "combine_in_experts": combine},
    }
    return moec.compile(copy.deepcopy(model), moec.Plan.from_dict(plan), (ids,))


@pytest.fixture(scope="module")
def llama_case():
    """The reference without the pass (gather_up only)."""
    return rewrite_reference(lambda model, ids: _compiled(model, ids, False), "combine_experts")


@pytest.mark.parametrize("recompute", ["none", "block"])
def test_tiny_llama_same_loss_and_gradients_with_combine_in_experts(llama_case, recompute):
    model, ids, (want_loss, want) = llama_case
    combined = _compiled(model, ids, True, recompute)
    stats = combined.pass_results["combine_experts"].stats
    assert stats["fused"] == 1 and stats["in_regions"] == (recompute != "none")
    gm = combined.graph_module
    targets = {n.target for sub in gm.modules() if hasattr(sub, "graph") for n in sub.graph.nodes}
    assert ops.expert_mlp_combined.default in targets and ops.combine.default not in targets
    got_loss, got = loss_and_grads(combined, ids)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-6, rtol=1e-6)
    assert_same_grads(got, want, atol=1e-6, rtol=1e-5)


def test_combine_in_experts_needs_gather_up():
    with pytest.raises(PlanError, match=r"lowering\.combine_in_experts.*gather_up"):
        moec.Plan.from_dict({"lowering": {"combine_in_experts": True}})
