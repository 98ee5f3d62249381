"""moec::dispatch and moec::combine against loops; gradients; garbage rows never leak."""

import torch
from torch.autograd import gradcheck

import moec.ops  # noqa: F401

route, dispatch, combine = torch.ops.moec.route, torch.ops.moec.dispatch, torch.ops.moec.combine


def _routes(tokens=12, n=4, k=2, cf=1.0, dtype=torch.float32):
    return route(torch.randn(tokens, n, dtype=dtype), k, cf, "softmax", True, "learned")


def test_dispatch_places_rows_like_a_loop():
    x = torch.randn(12, 8)
    _, _, rows, offsets, _ = _routes(cf=0.75)
    buf = dispatch(x, rows)
    assert buf.shape == (24, 8)
    for t in range(12):
        for k in range(2):
            if rows[t, k] >= 0:
                assert torch.equal(buf[rows[t, k]], x[t])


def test_combine_sums_weighted_rows_like_a_loop_and_ignores_poison():
    _, w, rows, offsets, _ = _routes(cf=0.75)
    y = torch.randn(24, 8)
    y[int(offsets[-1]) :] = float("nan")  # rows no route points at
    out = combine(y, w, rows)
    for t in range(12):
        expect = sum((w[t, k] * y[rows[t, k]] for k in range(2) if rows[t, k] >= 0), torch.zeros(8))
        torch.testing.assert_close(out[t], expect)
    assert torch.isfinite(out).all()


def test_gradchecks():
    _, w, rows, _, _ = _routes(dtype=torch.float64, cf=0.75)
    x = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda x: dispatch(x, rows), (x,))
    y = torch.randn(24, 8, dtype=torch.float64, requires_grad=True)
    weights = w.detach().clone().requires_grad_(True)
    assert gradcheck(lambda y, w: combine(y, w, rows), (y, weights))


def test_dispatch_then_combine_with_unit_weights_sums_accepted_copies():
    x = torch.randn(3, 4, 8)  # leading dims kept
    _, _, rows, _, _ = route(torch.randn(3, 4, 5), 2, 0.0, "softmax", True, "learned")
    out = combine(dispatch(x, rows), torch.ones(3, 4, 2), rows)
    torch.testing.assert_close(out, 2 * x)
