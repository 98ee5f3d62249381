"""moec::route against a plain Python loop; capacity, ties, gradients, aux losses."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd import gradcheck
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
)

import moec.ops  # noqa: F401
from moec.ops.routing import capacity

route = torch.ops.moec.route


def python_route(logits, top_k, capacity_factor, gating, normalize):
    """The documented policy, written as the obvious loop."""
    tokens, n = logits.shape
    cap = (
        tokens
        if capacity_factor <= 0
        else min(tokens, math.ceil(capacity_factor * tokens * top_k / n))
    )
    ids, weights, rows = [], [], []
    taken = [0] * n
    slots = []
    for t in range(tokens):
        row = logits[t].tolist()
        order = sorted(range(n), key=lambda e: (-row[e], e))[:top_k]
        scores = (
            logits[t].double().softmax(-1) if gating == "softmax" else logits[t].double().sigmoid()
        )
        w = [float(scores[e]) for e in order]
        if normalize:
            w = [v / sum(w) for v in w]
        ids.append(order)
        weights.append(w)
        slot_row = []
        for e in order:
            slot_row.append(taken[e] if taken[e] < cap else -1)
            taken[e] += 1
        slots.append(slot_row)
    accepted = [min(c, cap) for c in taken]
    starts = [sum(accepted[:e]) for e in range(n)]
    rows = [[starts[e] + s if s >= 0 else -1 for e, s in zip(i, sl)] for i, sl in zip(ids, slots)]
    return ids, weights, rows, accepted, taken


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
@pytest.mark.parametrize("capacity_factor", [0.0, 0.5, 1.0, 1.25])
@pytest.mark.parametrize("normalize", [True, False])
def test_route_matches_python_loop(gating, capacity_factor, normalize):
    tokens, n, k = 37, 6, 3
    logits = torch.randn(tokens, n)
    ids, w, rows, offsets, counts = route(logits, k, capacity_factor, gating, normalize, "learned")
    ref_ids, ref_w, ref_rows, accepted, offered = python_route(
        logits, k, capacity_factor, gating, normalize
    )
    assert ids.tolist() == ref_ids
    assert rows.tolist() == ref_rows
    assert counts.tolist() == offered
    assert offsets.tolist() == torch.tensor(accepted).cumsum(0).tolist()
    torch.testing.assert_close(
        w.double(), torch.tensor(ref_w, dtype=torch.float64), rtol=1e-5, atol=1e-6
    )
    cap = capacity(tokens, k, n, capacity_factor)
    assert max(accepted) <= cap


def test_ties_break_towards_lower_expert_and_match_loop():
    tokens, n, k = 50, 8, 2
    logits = torch.randint(0, 3, (tokens, n)).float()  # many exact ties
    ids, _, rows, _, _ = route(logits, k, 1.0, "softmax", True, "learned")
    ref_ids, _, ref_rows, _, _ = python_route(logits, k, 1.0, "softmax", True)
    assert ids.tolist() == ref_ids and rows.tolist() == ref_rows


def test_one_expert_takes_everything_and_drops_are_counted():
    tokens, n = 40, 4
    logits = torch.randn(tokens, n)
    logits[:, 2] += 100
    _, _, rows, offsets, counts = route(logits, 1, 1.0, "softmax", True, "learned")
    cap = capacity(tokens, 1, n, 1.0)
    assert counts.tolist() == [0, 0, tokens, 0]
    assert int((rows >= 0).sum()) == cap and offsets.tolist() == [0, 0, cap, cap]
    # the first `cap` tokens in token order are the accepted ones
    assert (rows[:cap, 0] >= 0).all() and (rows[cap:, 0] == -1).all()


def test_rows_are_a_permutation_of_the_accepted_prefix():
    logits = torch.randn(3, 5, 7)  # leading dims are kept
    ids, _, rows, offsets, _ = route(logits, 2, 1.0, "softmax", True, "learned")
    assert ids.shape == rows.shape == (3, 5, 2)
    valid = rows[rows >= 0]
    assert sorted(valid.tolist()) == list(range(int(offsets[-1])))


@pytest.mark.parametrize("routing", ["random", "uniform"])
def test_benchmark_routings_pick_distinct_experts(routing):
    _, n, k = 64, 8, 3
    ids, w, rows, offsets, counts = route(torch.randn(64, n), k, 0.0, "softmax", True, routing)
    assert all(len(set(r)) == k for r in ids.tolist())
    assert int(counts.sum()) == 64 * k and int(offsets[-1]) == 64 * k
    if routing == "uniform":
        assert counts.tolist() == [64 * k // n] * n


@pytest.mark.parametrize(
    "gating, normalize", [("softmax", True), ("softmax", False), ("sigmoid", True)]
)
def test_route_weights_gradcheck(gating, normalize):
    logits = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda x: route(x, 2, 1.0, gating, normalize, "learned")[1], (logits,))


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_router_losses_gradcheck_and_balanced_value(gating, per_sequence):
    logits = torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True)
    ids = route(logits.detach(), 2, 0.0, gating, True, "learned")[0]
    fn = lambda x: torch.ops.moec.router_losses(x, ids, 2, gating, per_sequence)
    assert gradcheck(fn, (logits,))
    uniform = torch.zeros(16, 4, dtype=torch.float64)
    balanced = torch.tensor([[0, 1], [2, 3]]).repeat(8, 1)  # every expert 8 of 32 routes
    (lbl, z), scores = torch.ops.moec.router_losses(uniform, balanced, 2, gating, per_sequence)
    assert float(lbl) == pytest.approx(1.0)
    expected_z = math.log(4) ** 2
    assert float(z) == pytest.approx(expected_z)
    torch.testing.assert_close(scores, torch.full((4,), 0.25, dtype=torch.float64))


@pytest.mark.parametrize("tokens,cf", [(16, 1.25), (7, 0.3), (5, 0.0), (9, 100.0)])
def test_capacity_of_a_symbolic_token_count_adds_no_guard(tokens, cf):
    """Fake impls (``moec::ep_layout``'s buffer rows) size by ``capacity`` of a traced token
    count: the result stays symbolic, specializes nothing, and equals the integer rule."""
    env = ShapeEnv()
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    fake = FakeTensorMode(shape_env=env).from_tensor(
        torch.empty(tokens, 2), symbolic_context=dynamic
    )
    symbol = fake.shape[0].node.expr
    cap = capacity(fake.shape[0], 2, 8, cf)
    assert isinstance(cap, torch.SymInt)
    assert not env.guards
    assert int(cap.node.expr.subs(symbol, tokens)) == capacity(tokens, 2, 8, cf)
