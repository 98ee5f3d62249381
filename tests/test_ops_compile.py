"""Every ``moec::`` op is traceable by ``torch.compile``, forward and backward.

- ``torch.library.opcheck`` on CPU for every registered ``moec::`` op (schema, fake impl against
  the real one including strides, autograd registration, AOTAutograd forward and backward with
  dynamic shapes); a registered op without a case here fails the coverage test.
- Inductor over compiled moec models (fp32, the fused loss, bf16, MXFP8 expert GEMMs) gives
  eager's outputs and parameter gradients; the EP ops under Inductor in a one-rank group.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.testing._internal.optests import aot_autograd_check

import moec
import moec.ops.ep as ep_ops  # registers the moec::ep_* ops
import moec.ops.quantized  # noqa: F401  (registers the moec::quantized_* ops)
from moec.train import LanguageModelWithLoss
from tests import rowwise_emulation
from tests.models import tiny_llama, tokens

T, D, N, K, H = 6, 8, 4, 2, 8
"""Tokens, model width, experts, top-k and expert hidden width of the op samples."""

Sample = tuple[tuple, dict]


def _randn(*shape: int, grad: bool = False, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _routed(cf: float = 1.0, lead: tuple[int, ...] = (T,)):
    """(weights, rows, offsets, counts) of a route of random logits (cf 1.0 drops some)."""
    logits = torch.randn(*lead, N)
    _, weights, rows, offsets, counts = torch.ops.moec.route(
        logits, K, cf, "softmax", True, "learned"
    )
    return weights, rows, offsets, counts


def _route() -> list[Sample]:
    return [
        ((_randn(T, N, grad=True), K, cf, gating, True, "learned"), {})
        for cf, gating in ((1.0, "softmax"), (0.0, "sigmoid"))
    ] + [
        ((_randn(2, 3, N, grad=True), K, 1.25, "softmax", False, "uniform"), {}),
        ((_randn(T, N, grad=True), K, 1.0, "sigmoid", True, "learned", _randn(N)), {}),
    ]


def _router_losses() -> list[Sample]:
    samples = []
    for lead, gating, per_sequence in (((T,), "softmax", False), ((2, 3), "sigmoid", True)):
        logits = _randn(*lead, N, grad=True)
        ids = torch.ops.moec.route(logits.detach(), K, 1.0, gating, True, "learned")[0]
        samples.append(((logits, ids, K, gating, per_sequence), {}))
    return samples


def _dispatch() -> list[Sample]:
    _, rows, _, _ = _routed()
    _, rows3, _, _ = _routed(lead=(2, 3))
    return [((_randn(T, D, grad=True), rows), {}), ((_randn(2, 3, D, grad=True), rows3), {})]


def _dispatch_backward() -> list[Sample]:
    _, rows, _, _ = _routed()
    return [((_randn(T * K, D), rows), {})]


def _combine() -> list[Sample]:
    weights, rows, _, _ = _routed()
    return [((_randn(T * K, D, grad=True), weights.detach().requires_grad_(), rows), {})]


def _combine_backward() -> list[Sample]:
    weights, rows, _, _ = _routed()
    return [((_randn(T * K, D), weights, rows, _randn(T, D)), {})]


def _expert_weights(activation: str, grad: bool, bias: bool):
    up = 2 * H if activation == "swiglu" else H
    biases = (_randn(N, up, grad=grad), _randn(N, D, grad=grad)) if bias else (None, None)
    return _randn(N, D, up, grad=grad), _randn(N, H, D, grad=grad), *biases


def _expert_mlp() -> list[Sample]:
    """Plain (with and without biases), the combine inside (tokens of one and two leading
    dims) and the low-precision recipes."""
    samples = []
    for activation, bias in (("swiglu", False), ("gelu", True)):
        _, _, offsets, _ = _routed(0.0)  # dropless: no garbage rows, whose values are undefined
        w_up, w_down, b_up, b_down = _expert_weights(activation, True, bias)
        args = (_randn(T * K, D, grad=True), w_up, w_down, offsets, b_up, b_down, activation)
        samples.append((args, {}))
    for activation, lead in (("swiglu", (T,)), ("gelu", (2, 3))):
        weights, rows, offsets, _ = _routed(0.0, lead)  # dropless: no garbage rows in h
        w_up, w_down, _, _ = _expert_weights(activation, True, False)
        x, weights = _randn(*lead, D, grad=True), weights.detach().requires_grad_()
        args = (x, w_up, w_down, offsets, None, None, activation, "bf16", rows, weights)
        samples.append((args, {}))
    for recipe, bias in (("mxfp8", False), ("fp8_rowwise", True)):
        _, _, offsets, _ = _routed()
        w_up, w_down, b_up, b_down = _expert_weights("swiglu", True, bias)
        args = (_randn(T * K, D, grad=True), w_up, w_down, offsets, b_up, b_down, "swiglu", recipe)
        samples.append((args, {}))
    return samples


def _expert_mlp_backward() -> list[Sample]:
    samples = []
    for activation, recipe in (("swiglu", "bf16"), ("relu2", "bf16"), ("swiglu", "mxfp8"),
                               ("swiglu", "fp8_rowwise")):  # fmt: skip
        _, _, offsets, _ = _routed(0.0)
        w_up, w_down, _, _ = _expert_weights(activation, False, False)
        h = _randn(T * K, w_up.shape[-1])
        args = (_randn(T * K, D), w_up, w_down, offsets, h, _randn(T * K, D), activation, False)
        samples.append(((*args, recipe), {}))
    weights, rows, offsets, _ = _routed(0.0)
    w_up, w_down, _, _ = _expert_weights("swiglu", False, False)
    h = _randn(T * K, w_up.shape[-1])
    args = (_randn(T, D), w_up, w_down, offsets, h, _randn(T, D), "swiglu", False, "bf16")
    samples.append(((*args, rows, weights), {}))
    return samples


def _glu() -> list[Sample]:
    return [((_randn(T, 2 * H, grad=True), "swiglu"), {}),
            ((_randn(2, 3, 2 * H, grad=True), "geglu"), {})]  # fmt: skip


def _glu_backward() -> list[Sample]:
    return [((_randn(2, 3, 2 * H), _randn(2, 3, H), "swiglu"), {})]


def _transposed(*shape: int, grad: bool = False) -> torch.Tensor:
    """A (B, H, S, D) view of a (B, S, H, D) tensor, as attention's q and k arrive."""
    b, heads, s, d = shape
    return torch.randn(b, s, heads, d).transpose(1, 2).detach().requires_grad_(grad)


def _flash_attention() -> list[Sample]:
    def qkv(heads: int, kv_heads: int, s: int) -> tuple[torch.Tensor, ...]:
        shapes = ((2, heads, s, 8), (2, kv_heads, s, 8), (2, kv_heads, s, 8))
        return tuple(_transposed(*shape, grad=True) for shape in shapes)

    return [((*qkv(4, 2, 5), True, 0.3), {}), ((*qkv(2, 1, 6), False, 0.5), {})]


def _flash_attention_backward() -> list[Sample]:
    q, k, v = _transposed(2, 4, 5, 8), _transposed(2, 2, 5, 8), _transposed(2, 2, 5, 8)
    out, lse = torch.ops.moec.flash_attention(q, k, v, True, 0.3)
    return [((q, k, v, out, lse, torch.randn_like(out), True, 0.3), {})]


def _rope() -> list[Sample]:
    cos, sin = torch.randn(5, 8), torch.randn(1, 1, 5, 8)
    return [
        ((_transposed(2, 3, 5, 8, grad=True), cos, sin, None), {}),
        ((_randn(2, 3, 5, 8, grad=True), cos, sin, torch.bfloat16), {}),
    ]


def _rope_backward() -> list[Sample]:
    cos, sin = torch.randn(5, 8), torch.randn(1, 1, 5, 8)
    return [
        ((_transposed(2, 3, 5, 8), cos, sin, dtype), {})
        for dtype in (torch.float32, torch.bfloat16)
    ]


def _linear_cross_entropy() -> list[Sample]:
    targets = torch.randint(0, 16, (10,))
    targets[3] = -100
    samples = []
    for bias, reduction, with_grads in (
        (True, "mean", True),
        (False, "sum", True),
        (True, "mean", False),
    ):
        # without grads the op is forward-only (it refuses a backward): inputs need no grad
        b = _randn(16, grad=with_grads) if bias else None
        h, weight = _randn(10, D, grad=with_grads), _randn(16, D, grad=with_grads)
        args = (h, weight, b, targets, -100, reduction)
        samples.append(((*args, with_grads), {}))
    return samples


def _quantized_linear() -> list[Sample]:
    return [
        ((_randn(2, 3, 32, grad=True), _randn(16, 32, grad=True), bias, recipe), {})
        for recipe, bias in (("mxfp8", None), ("fp8_rowwise", _randn(16, grad=True)))
    ]


def _quantized_linear_backward() -> list[Sample]:
    return [
        ((_randn(2, 3, 32), _randn(16, 32), _randn(2, 3, 16), recipe), {})
        for recipe in ("mxfp8", "fp8_rowwise")
    ]


# --- EP ops in a one-rank group ----------------------------------------------------------------

EP_PATHS = ("a2a_capacity", "sync_1d", "rowwise")
"""``rowwise`` runs on :mod:`tests.rowwise_emulation` (the fixture registers it: its transport
needs CUDA)."""


def _group() -> str:
    return dist.group.WORLD.group_name


def _ep_layout_of(path: str, cf: float = 1.0):
    weights, rows, offsets, _ = _routed(cf)
    layout = torch.ops.moec.ep_layout(rows, offsets, _group(), 1, cf, path)
    return weights, rows, offsets, layout


def _ep_layout() -> list[Sample]:
    samples = []
    for path in EP_PATHS:
        _, rows, offsets, _ = _ep_layout_of(path)
        samples.append(((rows, offsets, _group(), 1, 1.0, path), {}))
    return samples


def _ep_comm(layout) -> tuple:
    slots, recv_rows, _, counts, sent, _ = layout
    return slots, recv_rows, sent, counts


def _ep_dispatch() -> list[Sample]:
    samples = []
    for path in EP_PATHS:
        _, _, _, layout = _ep_layout_of(path)
        args = (_randn(T, D, grad=True), *_ep_comm(layout), _group(), 1, path)
        samples.append((args, {}))
    return samples


def _ep_dispatch_backward() -> list[Sample]:
    samples = []
    for path in EP_PATHS:
        _, _, _, layout = _ep_layout_of(path)
        rows = layout[1].shape[0]
        samples.append(((_randn(rows, D), *_ep_comm(layout), _group(), 1, path), {}))
    return samples


def _ep_combine() -> list[Sample]:
    samples = []
    for path in EP_PATHS:
        weights, _, _, layout = _ep_layout_of(path)
        y = _randn(layout[1].shape[0], D, grad=True)
        args = (y, weights.detach().requires_grad_(), *_ep_comm(layout), _group(), 1, path)
        samples.append((args, {}))
    return samples


def _ep_combine_backward() -> list[Sample]:
    """What ``ep_combine`` saves: the picked rows home (a2a paths), or the route weights and
    the expert output on the experts' side (rowwise)."""
    samples = []
    for path in EP_PATHS:
        weights, _, _, layout = _ep_layout_of(path)
        rows = layout[1].shape[0]
        saved, y = (
            (_randn(rows), _randn(rows, D)) if path == "rowwise" else (_randn(T * K, D), None)
        )
        args = (_randn(T, D), weights, saved, y, *_ep_comm(layout), _group(), 1, path)
        samples.append((args, {}))
    return samples


SPLIT_PATHS = ("a2a_capacity", "rowwise")
"""The paths whose exchanges split into issue and wait."""


def _split_layouts():
    """Per split path: the route weights, the layout's exchange arguments, the expert buffer's
    rows R and an issued exchange's rows P."""
    for path in SPLIT_PATHS:
        weights, _, _, layout = _ep_layout_of(path)
        comm = (*_ep_comm(layout), _group(), 1, path)
        yield weights, comm, layout[1].shape[0], ep_ops.pending_rows(layout[0], layout[1], 1, path)


def _ep_dispatch_issue() -> list[Sample]:
    """rowwise sends its rows unweighted (its combine weights on the experts' side)."""
    samples = []
    for weights, comm, _, _ in _split_layouts():
        samples.append(((_randn(T, D, grad=True), None, *comm), {}))
        if comm[-1] != "rowwise":
            samples.append(((_randn(T, D), weights, *comm), {}))
    return samples


def _ep_dispatch_wait() -> list[Sample]:
    return [((_randn(p, D, grad=True), *comm), {}) for _, comm, _, p in _split_layouts()]


def _ep_combine_issue() -> list[Sample]:
    samples = []
    for weights, comm, rows, _ in _split_layouts():
        samples.append(((_randn(rows, D, grad=True), None, *comm), {}))
        samples.append(((_randn(rows, D, grad=True), weights.detach().requires_grad_(), *comm), {}))
    return samples


def _ep_combine_wait() -> list[Sample]:
    samples = []
    for weights, comm, _, pending in _split_layouts():
        samples.append(
            ((_randn(pending, D, grad=True), weights.detach().requires_grad_(), *comm), {})
        )
        samples.append(((_randn(pending, D), None, *comm), {}))
    return samples


def _ep_combine_issue_backward() -> list[Sample]:
    return [
        (
            (
                _randn(pending, D),
                weights,
                _randn(rows, dtype=torch.float32),
                _randn(rows, D),
                *comm,
            ),
            {},
        )
        for weights, comm, rows, pending in _split_layouts()
        if comm[-1] == "rowwise"
    ]


SAMPLES: dict[str, Callable[[], list[Sample]]] = {
    "route": _route,
    "router_losses": _router_losses,
    "dispatch": _dispatch,
    "dispatch_backward": _dispatch_backward,
    "combine": _combine,
    "combine_backward": _combine_backward,
    "expert_mlp": _expert_mlp,
    "expert_mlp_backward": _expert_mlp_backward,
    "glu": _glu,
    "glu_backward": _glu_backward,
    "flash_attention": _flash_attention,
    "flash_attention_backward": _flash_attention_backward,
    "rope": _rope,
    "rope_backward": _rope_backward,
    "linear_cross_entropy": _linear_cross_entropy,
    "quantized_linear": _quantized_linear,
    "quantized_linear_backward": _quantized_linear_backward,
    "ep_layout": _ep_layout,
    "ep_dispatch": _ep_dispatch,
    "ep_dispatch_backward": _ep_dispatch_backward,
    "ep_combine": _ep_combine,
    "ep_combine_backward": _ep_combine_backward,
    "ep_dispatch_issue": _ep_dispatch_issue,
    "ep_dispatch_wait": _ep_dispatch_wait,
    "ep_combine_issue": _ep_combine_issue,
    "ep_combine_wait": _ep_combine_wait,
    "ep_combine_issue_backward": _ep_combine_issue_backward,
}
"""Sample inputs per ``moec::`` op (float32, small, random)."""


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A one-rank gloo process group for the EP ops (left as found when one exists), with the
    emulated rowwise transport registered."""
    loader = ep_ops.register_rowwise_transport(lambda: rowwise_emulation)
    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        ep_ops.register_rowwise_transport(loader)
        if created:
            dist.destroy_process_group()


def test_every_registered_op_has_opcheck_samples():
    registered = {
        name.removeprefix("moec::")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("moec::")
    }
    assert registered == set(SAMPLES), (
        f"ops without samples: {sorted(registered - set(SAMPLES))}; "
        f"samples without an op: {sorted(set(SAMPLES) - registered)}"
    )


def _opcheck(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
    """``opcheck`` with its default tests. Its AOTAutograd test sums the outputs into the first
    one, which fails for an integer first output (``moec::route``'s expert ids) when gradients
    are checked: that test then runs on the op with its outputs floating first."""
    outputs = op(*args, **kwargs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    needs_grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    if outputs[0].is_floating_point() or not needs_grad:
        torch.library.opcheck(op, args, kwargs)
        return
    rest = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(op, args, kwargs, test_utils=rest)

    def floating_first(*args, **kwargs):
        args, kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
        out = op(*args, **kwargs)
        return sorted(out, key=lambda t: not t.is_floating_point())

    aot_autograd_check(floating_first, args, kwargs, dynamic=True, check_gradients="auto")


@pytest.mark.parametrize("name", list(SAMPLES))
def test_opcheck(name, one_rank_group):
    op = getattr(torch.ops.moec, name).default
    for args, kwargs in SAMPLES[name]():
        _opcheck(op, args, kwargs)


def test_rope_results_keep_the_layout_of_a_transposed_view():
    """moec::rope and its gradient come back in ``empty_like``'s layout (a transposed q keeps its
    (B, S, H, D) memory order, so attention's output returns to (B, S, H*D) as a view)."""
    x = _transposed(2, 3, 5, 8, grad=True)
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)
    out = torch.ops.moec.rope(x, cos, sin, None)
    assert out.stride() == x.stride()
    (d_x,) = torch.autograd.grad(out, x, _transposed(2, 3, 5, 8))
    assert d_x.stride() == x.stride()


# --- Inductor over compiled models ---------------------------------------------------------------

MOE = {"num_experts": 4, "top_k": 2, "dense_first": 1}


def _moec_ops(model: moec.CompiledModel) -> set[str]:
    return {
        node.target.name().removeprefix("moec::").split(".")[0]
        for node in model.graph_module.graph.nodes
        if node.op == "call_function" and str(getattr(node.target, "namespace", "")) == "moec"
    }


def _inductor_matches_eager(model, inputs: tuple, loss: Callable, atol: float, rtol: float):
    """Outputs and parameter gradients of Inductor's program equal eager's."""
    expected = model(*inputs)
    loss(expected).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    out = torch.compile(model, backend="inductor")(*inputs)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    loss(out).backward()
    for (name, p), grad in zip(model.named_parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, grad, atol=atol, rtol=rtol, msg=name)


def test_inductor_equals_eager():
    """fp32, with a dense block (moec::glu) and an MoE block."""
    model = moec.compile(tiny_llama(2), {"moe": MOE}, (tokens(),))
    assert {"route", "dispatch", "expert_mlp", "combine", "rope", "glu"} <= _moec_ops(model)
    _inductor_matches_eager(model, (tokens(),), lambda y: y.square().mean(), 1e-5, 1e-5)


@pytest.mark.slow
def test_inductor_equals_eager_bf16():
    plan = {"moe": {**MOE, "dense_first": 0}, "precision": {"compute_dtype": "bf16"}}
    model = moec.compile(tiny_llama(1), plan, (tokens(),))
    assert {"expert_mlp", "rope"} <= _moec_ops(model)
    _inductor_matches_eager(model, (tokens(),), lambda y: y.float().square().mean(), 2e-2, 2e-2)


@pytest.mark.slow
def test_inductor_equals_eager_with_the_fused_loss_and_mxfp8_experts():
    ids = tokens(2, 17)
    inputs = (ids[:, :-1], ids[:, 1:])
    plan = {"moe": {**MOE, "dense_first": 0}, "precision": {"gemm": "mxfp8"}}
    model = moec.compile(LanguageModelWithLoss(tiny_llama(1)), plan, inputs)
    assert {"linear_cross_entropy", "expert_mlp"} <= _moec_ops(model)
    _inductor_matches_eager(model, inputs, lambda loss: loss, 1e-5, 1e-5)


@pytest.mark.parametrize(
    "path, split", [*((p, False) for p in EP_PATHS), *((p, True) for p in SPLIT_PATHS)]
)
def test_inductor_runs_the_ep_ops(path, split, one_rank_group):
    """The EP exchange (layout, dispatch, expert MLP, combine; ``split``: each exchange as issue
    and wait ops around the expert MLP) under Inductor equals eager."""
    w_up, w_down, _, _ = _expert_weights("swiglu", True, False)
    x, gate = _randn(T, D, grad=True), torch.nn.Linear(D, N)

    def layer(x):
        _, weights, rows, offsets, _ = torch.ops.moec.route(
            gate(x), K, 1.0, "softmax", True, "learned"
        )
        slots, recv, local, counts, sent, _ = torch.ops.moec.ep_layout(
            rows, offsets, _group(), 1, 1.0, path
        )
        comm = (slots, recv, sent, counts, _group(), 1, path)
        if split:
            pending = torch.ops.moec.ep_dispatch_issue(x, None, *comm)
            buffer = torch.ops.moec.ep_dispatch_wait(pending, *comm)
        else:
            buffer = torch.ops.moec.ep_dispatch(x, *comm)
        y, _ = torch.ops.moec.expert_mlp(buffer, w_up, w_down, local, None, None, "swiglu")
        if split:
            pending, _ = torch.ops.moec.ep_combine_issue(y, weights, *comm)
            out, _ = torch.ops.moec.ep_combine_wait(pending, weights, *comm)
        else:
            out, _ = torch.ops.moec.ep_combine(y, weights, *comm)
        return out

    params = [x, w_up, w_down, *gate.parameters()]
    expected = layer(x)
    grads = torch.autograd.grad(expected.square().sum(), params)
    torch._dynamo.reset()
    out = torch.compile(layer, backend="inductor", fullgraph=True)(x)
    torch.testing.assert_close(out, expected)
    for got, want in zip(torch.autograd.grad(out.square().sum(), params), grads, strict=True):
        # fp32 rounding relative to the largest entry: the router's gradient sums terms that
        # cancel, so an entry near zero carries the rounding of its large terms
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-5)
