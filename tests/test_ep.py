"""Expert parallelism on CPU/gloo: EP = n equals EP = 1, the drop policy, poisoned buffers,
training, the rowwise index math against Python loops, and every documented error.

Multi-process tests spawn ``world`` gloo ranks inside pytest (each on a free port).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moec
from moec.models import Llama, LlamaConfig
from moec.ops import ep as ep_ops
from moec.ops.ep import index as ep_index
from moec.ops.routing import capacity
from moec.passes.base import PassContext
from moec.passes.expert_parallel import ExpertParallelError, ExpertParallelPass
from moec.program import EPGroup
from moec.runtime import distributed as mdist
from tests import rowwise_emulation
from tests.distributed import spawn

ops = torch.ops.moec
N, K = 8, 2

# --- harness -----------------------------------------------------------------------------------


def _route(logits: torch.Tensor, cf: float):
    _, weights, rows, offsets, _ = ops.route(logits, K, cf, "softmax", True, "learned")
    return weights, rows, offsets


def _reference_accepted(expert_ids: torch.Tensor, cap: int) -> torch.Tensor:
    """The documented drop policy as a Python loop: per expert, the first ``cap`` routes in
    token-major order are accepted."""
    seen: dict[int, int] = {}
    accepted = torch.zeros(expert_ids.shape, dtype=torch.bool)
    for t in range(expert_ids.shape[0]):
        for k in range(expert_ids.shape[1]):
            e = int(expert_ids[t, k])
            accepted[t, k] = seen.get(e, 0) < cap
            seen[e] = seen.get(e, 0) + 1
    return accepted


# --- op-level EP = n vs EP = 1 (world 2 and 4) -------------------------------------------------


def _ops_worker(
    rank: int, world: int, path: str, cf: float, poison: bool, split=False, device="cpu"
) -> None:
    """``split``: the exchanges as issue and wait ops (pass overlap's), run asynchronously, with
    the other exchange issued between each issue and its wait, in forward and backward.
    ``poison``: the buffer rows no route writes hold NaN (checked), which must not leak."""
    tokens, dim, hidden = 12, 16, 8
    full = torch.Generator().manual_seed(0)
    w_up = torch.randn(N, dim, 2 * hidden, generator=full, dtype=torch.float64) * 0.3
    w_down = torch.randn(N, hidden, dim, generator=full, dtype=torch.float64) * 0.3
    mine = torch.Generator().manual_seed(100 + rank)
    x, logits, grad = (
        torch.randn(tokens, d, generator=mine, dtype=torch.float64) for d in (dim, N, dim)
    )
    x, logits, grad, w_up, w_down = (t.to(device) for t in (x, logits, grad, w_up, w_down))
    weights, rows, offsets = _route(logits, cf)
    expert_ids = ops.route(logits, K, cf, "softmax", True, "learned")[0]
    cap = capacity(tokens, K, N, cf)
    assert torch.equal((rows >= 0).cpu(), _reference_accepted(expert_ids.cpu(), cap))

    # EP = world: this rank's slice of the experts
    local = N // world
    part = slice(rank * local, (rank + 1) * local)
    leaves = [t.clone().requires_grad_() for t in (x, weights, w_up[part], w_down[part])]
    ex, ew, eup, edown = leaves
    group = dist.group.WORLD.group_name
    slots, recv, loffs, counts, sent, dropped = ops.ep_layout(rows, offsets, group, world, cf, path)
    exchange = (slots, recv, sent, counts, group, world, path, float("nan") if poison else None)
    if split:
        out = _split_layer(ex, ew, eup, edown, (*exchange, True), loffs, cf)
    else:
        buffer = ops.ep_dispatch(ex, *exchange)
        _check_poisoned(buffer, loffs, poison, cf)
        y, _ = ops.expert_mlp(buffer, eup, edown, loffs, None, None, "swiglu")
        out, _ = ops.ep_combine(y, ew, *exchange)
    out.backward(grad)
    assert ep_ops.pending_exchanges() == 0

    # EP = 1 on this rank's batch with every expert, without the routes the exchange dropped
    # (rowwise's rank capacity; the other paths drop nothing beyond the route's own capacity)
    kept = torch.where(slots < 0, -1, rows)
    assert int(dropped) == int((rows >= 0).sum() - (kept >= 0).sum())
    if path != "rowwise" or cf >= N / K:
        assert int(dropped) == 0
    ref_leaves = [t.clone().requires_grad_() for t in (x, weights, w_up, w_down)]
    rx, rw, rup, rdown = ref_leaves
    y, _ = ops.expert_mlp(ops.dispatch(rx, kept), rup, rdown, offsets, None, None, "swiglu")
    out_ref = ops.combine(y, rw, kept)
    out_ref.backward(grad)
    for g in (rup.grad, rdown.grad):
        dist.all_reduce(g)  # every token of the group reaches the expert

    accepted = ep_index.accepted_counts(offsets)
    everyone = [torch.empty_like(accepted) for _ in range(world)]
    dist.all_gather(everyone, accepted)
    assert torch.equal(counts, torch.stack(everyone)[:, part])
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(ex.grad, rx.grad)
    torch.testing.assert_close(ew.grad, rw.grad)
    torch.testing.assert_close(eup.grad, rup.grad[part])
    torch.testing.assert_close(edown.grad, rdown.grad[part])


def _check_poisoned(buffer, local_offsets, poison: bool, cf: float) -> None:
    """With ``poison``, the expert buffer's rows past its experts' (no route writes them) hold
    NaN, and at a capacity that does not bind (``cf >= N/K``) there are such rows."""
    if poison:
        tail = buffer[int(local_offsets[-1]) :]
        assert tail.isnan().all() and (cf < N / K or tail.numel() > 0), tail


def _split_layer(x, weights, w_up, w_down, comm, local_offsets, cf):
    """The layer on split exchanges, twice on the same inputs and interleaved as pass overlap
    interleaves two halves: both dispatches issued (both left running: ``comm`` asks for
    asynchronous exchanges), then each copy's wait, experts and combine issue, each combine
    waited after the other copy's experts (autograd mirrors it). Returns the mean of the two
    copies: exactly one layer's output and, in binary floating point, exactly its gradients."""
    issued = [ops.ep_dispatch_issue(x, None, *comm) for _ in range(2)]
    assert ep_ops.pending_exchanges() == 2
    returning = []
    for pending in issued:
        buffer = ops.ep_dispatch_wait(pending, *comm)
        _check_poisoned(buffer, local_offsets, comm[7] is not None, cf)
        y, _ = ops.expert_mlp(buffer, w_up, w_down, local_offsets, None, None, "swiglu")
        returning.append(ops.ep_combine_issue(y, weights, *comm)[0])
    outs = [ops.ep_combine_wait(pending, weights, *comm)[0] for pending in returning]
    return (outs[0] + outs[1]) * 0.5


CASES = {
    # (path, capacity factor, poison[, split]): cf = 4.0 = N/K never binds, 0.6 binds
    2: [
        ("a2a_capacity", 4.0, False),
        ("sync_1d", 0.6, False),
        ("a2a_capacity", 0.6, True),
        ("sync_1d", 4.0, True),
        ("a2a_capacity", 0.6, True, True),
        ("rowwise", 4.0, True),
        ("rowwise", 0.6, True),
        ("rowwise", 4.0, True, True),
        ("rowwise", 0.6, True, True),  # split, and the rank capacity drops routes
    ],
    4: [
        ("a2a_capacity", 0.6, False),
        ("sync_1d", 4.0, False),
        ("a2a_capacity", 4.0, True),
        ("a2a_capacity", 4.0, True, True),
        ("rowwise", 0.6, True),
        ("rowwise", 4.0, False, True),
    ],
}
"""One spawn per world size runs all its cases (a process spends ~10 s importing torch).
``rowwise`` runs on :mod:`tests.rowwise_emulation` here (its transport needs CUDA)."""


@contextlib.contextmanager
def _emulated_rowwise(path: str) -> Iterator[None]:
    """``rowwise`` on :mod:`tests.rowwise_emulation` (CPU) for the block, then the runtime's."""
    if path != "rowwise":
        yield
        return
    loader = ep_ops.register_rowwise_transport(lambda: rowwise_emulation)
    try:
        yield
    finally:
        ep_ops.register_rowwise_transport(loader)


def rowwise_layer(x, weights, rows, offsets, experts, cf: float, split: bool):
    """An MoE layer on the rowwise path of the world group (``experts``: this rank's ``w_up``
    and ``w_down``): ``(out, slots, recv_rows)``; ``split``: its exchanges as pass overlap's
    issue and wait ops."""
    group, world = dist.group.WORLD.group_name, dist.get_world_size()
    slots, recv, local, counts, sent, _ = ops.ep_layout(rows, offsets, group, world, cf, "rowwise")
    comm = (slots, recv, sent, counts, group, world, "rowwise")
    if split:
        buffer = ops.ep_dispatch_wait(ops.ep_dispatch_issue(x, None, *comm), *comm)
    else:
        buffer = ops.ep_dispatch(x, *comm)
    y, _ = ops.expert_mlp(buffer, *experts, local, None, None, "swiglu")
    if split:
        pending, _ = ops.ep_combine_issue(y, weights, *comm)
        out, _ = ops.ep_combine_wait(pending, weights, *comm)
    else:
        out, _ = ops.ep_combine(y, weights, *comm)
    return out, slots, recv


def _rows_crossing_worker(rank: int, world: int, split: bool) -> None:
    """``rowwise`` layer forward + backward on a transport that counts the rows each exchange
    pushes: the four ``[*, D]`` exchanges (dispatch, combine and their backwards; ``split``: as
    pass overlap's issue and wait ops) each move, summed over the group, one row per (token,
    rank its accepted routes reach), not one per route; the route weights and their gradients
    cross as one float per route, once each (the split backward reuses the issue's)."""
    tokens, dim, hidden, cf = 12, 16, 8, 4.0
    pushed: list[tuple[int, int]] = []

    def counted(push):
        def count(push_: ep_ops.Push, *args, **kwargs):
            pushed.append((push_.x.shape[-1], int((push_.address >= 0).sum())))
            return push(push_, *args, **kwargs)

        return staticmethod(count)

    counting = type(
        "Counting",
        (),
        {
            "send": counted(rowwise_emulation.send),
            "issue": counted(rowwise_emulation.issue),
            "check_available": staticmethod(rowwise_emulation.check_available),
        },
    )
    loader = ep_ops.register_rowwise_transport(lambda: counting)
    try:
        g = torch.Generator().manual_seed(200 + rank)
        x = torch.randn(tokens, dim, generator=g, dtype=torch.float64, requires_grad=True)
        logits = torch.randn(tokens, N, generator=g, dtype=torch.float64)
        w_up = torch.randn(N // world, dim, 2 * hidden, generator=g, dtype=torch.float64)
        w_down = torch.randn(N // world, hidden, dim, generator=g, dtype=torch.float64)
        weights, rows, offsets = _route(logits, cf)
        weights.requires_grad_()
        out, slots, recv = rowwise_layer(x, weights, rows, offsets, (w_up, w_down), cf, split)
        out.backward(torch.randn(out.shape, generator=g, dtype=torch.float64))
    finally:
        ep_ops.register_rowwise_transport(loader)
    reached = ep_index.token_rank_addresses(slots.view(-1), recv.shape[0], K, world, rank)
    wide = [n for width, n in pushed if width == dim]
    narrow = [n for width, n in pushed if width == 1]
    totals = torch.tensor([int((reached >= 0).sum()), int((slots >= 0).sum()), *wide, *narrow])
    dist.all_reduce(totals)
    pairs, routes = int(totals[0]), int(totals[1])
    assert pairs < routes  # top-2 of 8 experts on 2 ranks: some tokens keep both routes on one
    assert totals[2 : 2 + len(wide)].tolist() == [pairs] * 4, (pairs, routes, pushed)
    # the layout's route ids, the route weights (forward) and their gradients (backward)
    assert totals[2 + len(wide) :].tolist() == [routes] * 3, (routes, pushed)


def _ops_cases_worker(rank: int, world: int) -> None:
    for case in CASES[world]:
        with _emulated_rowwise(case[0]):
            _ops_worker(rank, world, *case)
    if world == 2:
        _errors_worker(rank, world)
        for split in (False, True):
            _rows_crossing_worker(rank, world, split)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ep_ops_equal_ep1_binding_or_not_and_poisoned(world):
    """EP = world equals EP = 1 for both sync-free and synced paths; with a binding capacity the
    accepted routes are the Python reference policy's; NaN in unwritten slots changes nothing;
    (world 2) every documented error of a live process group is raised."""
    spawn(_ops_cases_worker, world)


# --- the bundled Llama: outputs, loss, reduced gradients; then training -----------------------

CFG = LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128)
INDUCTOR_TOL = {"rtol": 1e-4, "atol": 1e-5}
MOE = {"num_experts": N, "top_k": K, "capacity_factor": 4.0, "init": "random"}


def _plan(world: int, ep: int, path: str = "auto", inductor: bool | str = "auto") -> moec.Plan:
    parallel = {"dp": world, "ep": ep, "ep_path": path}
    lowering = {"inductor": inductor}
    return moec.Plan.from_dict({"moe": MOE, "parallel": parallel, "lowering": lowering})


def _batch(rank: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    seq = torch.randint(0, CFG.vocab_size, (2, 17), generator=g).to(device)
    return seq[:, :-1], seq[:, 1:]


def _loss(model, tokens, targets) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(tokens)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return logits, ce + model.aux_loss()


def _compile(world: int, paths: list[str], tokens: torch.Tensor, inductor: bool | str = "auto"):
    """The EP = 1 reference (run as its plan's default lowering) and one EP = world model per
    path (``inductor``: its ``plan.lowering.inductor``), from one dense Llama (on the device of
    ``tokens``)."""
    torch.manual_seed(0)
    dense = Llama(CFG).to(tokens.device)
    plans = [_plan(world, 1)] + [_plan(world, world, path, inductor) for path in paths]
    meshes = [mdist.build_mesh(plan) for plan in plans]
    models = [  # a copy each: compiled models share the dense parameters of their source
        moec.compile(copy.deepcopy(dense), plan, (tokens,), mesh=mesh, verify=plan.parallel.ep > 1)
        for plan, mesh in zip(plans, meshes, strict=True)
    ]
    return models, meshes


def _llama_worker(rank: int, world: int, paths=("a2a_capacity",), device="cpu") -> None:
    """EP = world equals EP = 1 for each path: outputs, loss, reduced gradients. On GPUs the
    expert GEMMs sum the rows of an expert in another order: float32 tolerances widen."""
    tokens, _ = _batch(rank, device)
    (ref, *eps), (mesh1, *ep_meshes) = _compile(world, list(paths), tokens)
    tol = {} if tokens.device.type == "cpu" else {"rtol": 1e-4, "atol": 1e-5}
    for path, ep, mesh in zip(paths, eps, ep_meshes, strict=True):
        for model in (ref, ep):
            model.zero_grad(set_to_none=True)
        _check_equal(rank, world, path, ref, ep, mesh1, mesh, device, tol)


def _check_equal(rank, world, path, ref, ep, mesh1, mesh_ep, device, tol) -> None:
    tokens, targets = _batch(rank, device)
    stats = ep.pass_results["expert_parallel"].stats
    assert stats["blocks_rewritten"] == 2 and stats["path"] == path
    role = ep.program.role
    assert role("layers.0.ffn.moe.w_up") == "expert" and role("embed.weight") == "dense"
    reducers = [mdist.GradientReducer(ref, mesh1), mdist.GradientReducer(ep, mesh_ep)]
    results = []
    for model, reducer in zip((ref, ep), reducers, strict=True):
        logits, loss = _loss(model, tokens, targets)
        loss.backward()
        reducer.finish()
        results.append((logits, loss))
    torch.testing.assert_close(results[1][0], results[0][0], **tol)
    torch.testing.assert_close(results[1][1], results[0][1], **tol)
    local = N // world
    full = dict(ref.graph_module.named_parameters())
    for name, param in ep.graph_module.named_parameters():
        expected = full[name].grad
        if role(name) == "expert":
            expected = expected[rank * local : (rank + 1) * local]
        torch.testing.assert_close(param.grad, expected, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_llama_ep2_equals_ep1_outputs_loss_reduced_grads():
    spawn(_llama_worker, 2)


def _inductor_worker(rank: int, world: int) -> None:
    """EP = world lowered to Inductor (its exchanges opaque ``moec::`` calls inside the compiled
    graphs, forward and backward) equals the eager EP = 1 program; Inductor's fused float32
    arithmetic rounds differently, hence the tolerance."""
    tokens, _ = _batch(rank)
    counters.clear()
    (ref, ep), (mesh1, mesh_ep) = _compile(world, ["a2a_capacity"], tokens, inductor=True)
    _check_equal(rank, world, "a2a_capacity", ref, ep, mesh1, mesh_ep, "cpu", INDUCTOR_TOL)
    assert counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"]


@pytest.mark.slow
def test_llama_ep2_lowered_to_inductor_equals_ep1():
    spawn(_inductor_worker, 2)


def _train_worker(rank: int, world: int) -> None:
    tokens, targets = _batch(rank)
    models, meshes = _compile(world, ["a2a_capacity"], tokens)
    curves = []
    for model, mesh, zero in zip(models, meshes, (False, True), strict=True):
        reducer = mdist.GradientReducer(model, mesh, bucket_bytes=64 * 1024)
        optimizer = mdist.build_optimizer(model, mesh, torch.optim.AdamW, zero=zero, lr=3e-3)
        losses = []
        for _ in range(20):
            _, loss = _loss(model, tokens, targets)
            loss.backward()
            reducer.finish()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        curves.append(losses)
    ep1, ep2 = curves
    assert ep2[-1] < 0.8 * ep2[0], ep2
    assert all(math.isclose(a, b, rel_tol=2e-3) for a, b in zip(ep1, ep2, strict=True)), curves


@pytest.mark.slow
def test_training_ep2_lowers_loss_like_ep1():
    spawn(_train_worker, 2)


# --- rowwise index math vs Python loops --------------------------------------------------------


def _rowwise_reference(rows_all, offsets_all, ep_size, rank_cap):
    """Addresses and per-source drops by the documented policy, as loops: each destination fills
    its rows expert by expert, source by source, each source's routes in rank order."""
    local = N // ep_size
    address = [torch.full_like(r.reshape(-1), -1) for r in rows_all]
    dropped = [0] * len(rows_all)
    for dest in range(ep_size):
        row = 0
        for e in range(dest * local, (dest + 1) * local):
            for s, (rows, offsets) in enumerate(zip(rows_all, offsets_all, strict=True)):
                start = int(offsets[e - 1]) if e else 0
                for j in range(int(offsets[e]) - start):
                    route = int((rows.reshape(-1) == start + j).int().argmax())
                    if row < rank_cap:
                        address[s][route] = dest * rank_cap + row
                    else:
                        dropped[s] += 1
                    row += 1
    return address, dropped


@pytest.mark.parametrize("ep_size,cf", [(2, 0.4), (4, 0.3), (4, 4.0), (2, 0.0)])
def test_rowwise_route_map_matches_python_loop(ep_size, cf):
    tokens = 10
    routed = [_route(torch.randn(tokens, N), cf) for _ in range(ep_size)]
    rows_all = [r for _, r, _ in routed]
    offsets_all = [o for _, _, o in routed]
    all_counts = torch.stack([ep_index.accepted_counts(o) for o in offsets_all])
    rank_cap = ep_index.rank_capacity(tokens, K, N, ep_size, cf)
    expected, expected_dropped = _rowwise_reference(rows_all, offsets_all, ep_size, rank_cap)
    for s in range(ep_size):
        address, dropped = ep_index.rowwise_route_map(
            rows_all[s], offsets_all[s], all_counts, s, rank_cap
        )
        assert torch.equal(address, expected[s])
        assert int(dropped) == expected_dropped[s]
    local = N // ep_size
    for dest in range(ep_size):
        counts = all_counts[:, dest * local : (dest + 1) * local]
        ends = [min(int(counts[:, : lo + 1].sum()), rank_cap) for lo in range(local)]
        assert ep_index.local_offsets(counts, rank_cap).tolist() == ends


@pytest.mark.parametrize("ep_size,cf", [(2, 0.4), (4, 4.0)])
def test_rowwise_tokens_cross_once_per_rank(ep_size, cf):
    """The dispatch direction's addresses (one per token and rank that gets any of its
    accepted routes, into row source*T + t of that rank's token workspace), the receiver's
    expansion (each buffer row reads its route's token) and the table dispatch's backward sums
    a token's rows by equal Python loops, and a token's row crosses to a rank once, however many
    of its routes go there."""
    tokens = 10
    routed = [_route(torch.randn(tokens, N), cf) for _ in range(ep_size)]
    all_counts = torch.stack([ep_index.accepted_counts(o) for _, _, o in routed])
    rank_cap = ep_index.rank_capacity(tokens, K, N, ep_size, cf)
    slots = [
        ep_index.rowwise_route_map(r, o, all_counts, s, rank_cap)[0]
        for s, (_, r, o) in enumerate(routed)
    ]
    recv = [torch.full((rank_cap,), -1, dtype=torch.int64) for _ in range(ep_size)]
    for s, address in enumerate(slots):  # the layout's origins: source * T*K + route
        for route, a in enumerate(address.tolist()):
            if a >= 0:
                recv[a // rank_cap][a % rank_cap] = s * tokens * K + route
    for s, address in enumerate(slots):
        got = ep_index.token_rank_addresses(address, rank_cap, K, ep_size, s).view(tokens, ep_size)
        for t in range(tokens):
            ranks = {a // rank_cap for a in address[t * K : (t + 1) * K].tolist() if a >= 0}
            for d in range(ep_size):
                want = d * ep_size * tokens + s * tokens + t if d in ranks else -1
                assert int(got[t, d]) == want
        routes_sent = int((address >= 0).sum())
        assert (
            int((got >= 0).sum())
            == sum(
                len({a // rank_cap for a in address[t * K : (t + 1) * K].tolist() if a >= 0})
                for t in range(tokens)
            )
            <= routes_sent
        )
    for dest in range(ep_size):
        got = ep_index.token_workspace_rows(recv[dest], tokens, K).tolist()
        table = ep_index.token_route_table(recv[dest], tokens, K, ep_size)
        want_table = torch.full((ep_size * tokens, K), -1, dtype=torch.int64)
        for r, origin in enumerate(recv[dest].tolist()):
            source, route = divmod(origin, tokens * K)
            assert got[r] == (-1 if origin < 0 else source * tokens + route // K)
            if origin >= 0:  # dispatch's backward sums these rows per (source, token)
                want_table[source * tokens + route // K, route % K] = r
        assert torch.equal(table, want_table)


def test_receive_maps_match_python_loop():
    ep_size, local, cap = 3, 2, 4
    counts = torch.randint(0, cap + 1, (ep_size, local))
    capacity_map = ep_index.capacity_receive_map(counts, cap).tolist()
    num_rows = ep_size * local * cap
    packed_map = ep_index.packed_receive_map(counts, cap, num_rows).tolist()
    expected_capacity, expected_packed = [-1] * num_rows, [-1] * num_rows
    row = 0
    for lo in range(local):
        for s in range(ep_size):
            for j in range(int(counts[s, lo])):
                expected_capacity[(s * local + lo) * cap + j] = row
                packed = int(counts[:s].sum()) + int(counts[s, :lo].sum()) + j
                expected_packed[packed] = row
                row += 1
    assert capacity_map == expected_capacity
    assert packed_map == expected_packed


# --- errors ------------------------------------------------------------------------------------


def _errors_worker(rank: int, world: int) -> None:
    bad_world = moec.Plan.from_dict({"moe": {"num_experts": 6}, "parallel": {"dp": 3, "ep": 3}})
    with pytest.raises(mdist.DistributedError, match="does not divide the world size 2"):
        mdist.build_mesh(bad_world)
    with pytest.raises(mdist.DistributedError, match="parallel.dp=4"):
        mdist.build_mesh(_plan(4, 2))
    weights, rows, offsets = _route(torch.randn(6, N), 1.0)
    group = dist.group.WORLD.group_name
    with pytest.raises(ep_ops.EPPathError, match="a2a_capacity"):
        ops.ep_layout(rows, offsets, group, 2, 1.0, "rowwise")
    with pytest.raises(ep_ops.EPPathError, match="has 2 ranks, not 4"):
        ops.ep_layout(rows, offsets, group, 4, 1.0, "a2a_capacity")


def test_errors_without_process_group(monkeypatch):
    with pytest.raises(moec.PlanError, match="num_experts"):
        moec.Plan.from_dict({"moe": {"num_experts": 6}, "parallel": {"dp": 4, "ep": 4}})
    with pytest.raises(mdist.DistributedError, match="no process group"):
        mdist.build_mesh(_plan(2, 2))
    for name in mdist.TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(mdist.DistributedError, match="torchrun"):
        mdist.init_from_env(_plan(2, 2))
    with pytest.raises(ExpertParallelError, match="needs a process group"):
        ExpertParallelPass().run(None, PassContext(_plan(2, 2)))
    weights, rows, offsets = _route(torch.randn(6, N), 1.0)
    with pytest.raises(ep_ops.EPPathError, match="initialized process group"):
        ops.ep_layout(rows, offsets, "0", 2, 1.0, "a2a_capacity")
    with pytest.raises(ValueError, match="unknown EP path"):
        ops.ep_layout(rows, offsets, "0", 2, 1.0, "nvshmem")
    wrong = PassContext(_plan(2, 2), ep_group=EPGroup(rank=0, size=4, group="0"))
    with pytest.raises(ExpertParallelError, match="has 4 ranks but plan.parallel.ep=2"):
        ExpertParallelPass().run(None, wrong)


def test_rowwise_unavailable_names_a2a_capacity():
    pytest.importorskip("triton")
    from moec.runtime import ep_rowwise

    with pytest.raises(ep_ops.EPPathError, match="ep_path='a2a_capacity'"):
        ep_rowwise.check_available(torch.zeros(4, 8))
