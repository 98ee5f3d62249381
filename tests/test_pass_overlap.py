"""Pass ``overlap``: two interleaved batch halves per MoE block compute what one chain computes
(same routing, capacity binding or not): outputs, losses and gradients at EP = 1 and, on gloo,
at EP = 2 and 4 with the exchanges split into issue and wait (run asynchronously on gloo, each
wait after the other half's experts in the lowered graph); its legality (odd batch),
the issue order it records, recompute on top, pipeline stages of a two_batch program."""

from __future__ import annotations

import copy
import dataclasses
import math
import operator

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import moec
from moec.analysis.cost.overlap import (
    exposed_comm,
    once_per_rank_share,
    overlap_gain,
    two_batch_half_share,
)
from moec.kernels.target import Target
from moec.models import Llama, LlamaConfig
from moec.ops import ep as ep_ops
from moec.passes.manager import default_pipeline
from moec.passes.overlap import EP_SCHEDULE, SCHEDULE, schedule_overlap
from moec.runtime import distributed as mdist
from tests import test_ep
from tests.distributed import spawn

CFG = LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128)
N, K = 8, 2
TOL = {"rtol": 1e-5, "atol": 1e-6}
NAN = float("nan")
ops = torch.ops.moec


def _plan(overlap: str, cf: float | None = 1.0, **parallel) -> moec.Plan:
    moe = {"num_experts": N, "top_k": K, "capacity_factor": cf, "init": "random"}
    return moec.Plan.from_dict({"moe": moe, "parallel": {"overlap": overlap, **parallel}})


def _batch(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, CFG.vocab_size, (batch, 17), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _dense() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG)


def _step(model, tokens, targets):
    """Logits, loss (with the router losses), every parameter's gradient, the aux outputs."""
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss = loss + model.aux_loss()
    loss.backward()
    grads = {n: p.grad for n, p in model.graph_module.named_parameters()}
    return logits, loss, grads


def _assert_same(a, b) -> None:
    torch.testing.assert_close(a[0], b[0], **TOL)
    torch.testing.assert_close(a[1], b[1], **TOL)
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _issue_order(gm) -> list[str]:
    """The movement/expert ops of the first MoE block in graph order, as SCHEDULE names them."""
    names = {
        ops.dispatch.default: "dispatch",
        ops.ep_dispatch.default: "dispatch",
        ops.expert_mlp.default: "experts",
        ops.combine.default: "combine",
        ops.ep_combine.default: "combine",
    }
    seen: dict[str, int] = {}
    order = []
    for node in gm.graph.nodes:
        kind = names.get(node.target)
        if kind is None:
            continue
        half = "AB"[seen.get(kind, 0)]
        seen[kind] = seen.get(kind, 0) + 1
        order.append(f"{half}.{kind}")
        if len(order) == len(SCHEDULE):
            return order
    return order


def _split_exchange_order(gm) -> list[str]:
    """The first MoE block's layouts, exchange issues/waits and expert ops in graph order, named
    as EP_SCHEDULE names them; checks that the exchanges are split: no fused ep_dispatch or
    ep_combine, and each wait after the other half's expert op (found by data flow)."""
    nodes = list(gm.graph.nodes)
    assert not [n for n in nodes if n.target in (ops.ep_dispatch.default, ops.ep_combine.default)]
    pos = {n: i for i, n in enumerate(nodes)}
    mlps = [n for n in nodes if n.target is ops.expert_mlp.default][:2]
    half: dict = {}
    for letter, mlp in zip("AB", mlps, strict=True):
        d_wait = mlp.args[0]
        assert d_wait.target is ops.ep_dispatch_wait.default
        d_issue = d_wait.args[0]
        assert d_issue.target is ops.ep_dispatch_issue.default
        (y,) = [u for u in mlp.users if u.args[1] == 0]
        (c_issue,) = y.users
        assert c_issue.target is ops.ep_combine_issue.default
        (c_pending,) = c_issue.users
        assert c_pending.target is operator.getitem and c_pending.args[1] == 0
        (c_wait,) = c_pending.users
        assert c_wait.target is ops.ep_combine_wait.default
        layout = d_issue.args[2].args[0]
        half[letter] = {
            "layout": layout,
            "dispatch.issue": d_issue,
            "dispatch.wait": d_wait,
            "experts": mlp,
            "combine.issue": c_issue,
            "combine.wait": c_wait,
        }
    a, b = half["A"], half["B"]
    # B's exchange is in flight while A's experts run, A's combine while B's experts run
    assert pos[b["dispatch.issue"]] < pos[a["experts"]] < pos[b["dispatch.wait"]]
    assert pos[a["combine.issue"]] < pos[b["experts"]] < pos[a["combine.wait"]]
    named = {n: f"{h}.{step}" for h, steps in half.items() for step, n in steps.items()}
    return [named[n] for n in sorted(named, key=pos.__getitem__)]


class _ExchangeLog(TorchDispatchMode):
    """Records, in call order, the split exchanges (issue: its result's storage; wait: its
    input's) and the expert ops, forward and backward alike."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.name().removeprefix("moec::").split(".")[0]
        if name.endswith("_issue"):
            pending = out[0] if isinstance(out, tuple) else out  # combine: (pending, weights)
            self.calls.append(("issue", pending.untyped_storage().data_ptr()))
        elif name.endswith("_wait") and name.startswith("ep_"):
            self.calls.append(("wait", args[0].untyped_storage().data_ptr()))
        elif name.startswith("expert_mlp"):
            self.calls.append(("experts", 0))
        return out


def _experts_under_exchanges(calls: list[tuple[str, int]]) -> list[int]:
    """Per exchange (issue to its wait, in wait order): the expert ops that ran in between."""
    under = []
    for j, (kind, ptr) in enumerate(calls):
        if kind == "wait":
            i = max(i for i, c in enumerate(calls[:j]) if c == ("issue", ptr))
            under.append(sum(k == "experts" for k, _ in calls[i:j]))
    return under


@pytest.fixture(scope="module")
def dense():
    return _dense()


def test_pipeline_places_overlap_after_expert_parallel_before_recompute():
    plan = moec.Plan.from_dict(
        {"parallel": {"overlap": "two_batch", "dp": 2, "ep": 2}, "recompute": {"policy": "block"}}
    )
    names = default_pipeline(plan)
    assert names.index("expert_parallel") < names.index("overlap") < names.index("recompute")
    assert "overlap" not in default_pipeline(_plan("none"))


@pytest.mark.parametrize("cf", [1.0, None], ids=["capacity_binding", "dropless"])
def test_ep1_two_batch_equals_one_chain(dense, cf):
    tokens, targets = _batch(4)
    ref = moec.compile(copy.deepcopy(dense), _plan("none", cf), (tokens,))
    two = moec.compile(copy.deepcopy(dense), _plan("two_batch", cf), (tokens,))
    stats = two.pass_results["overlap"].stats
    assert stats["applied"] and stats["declined"] is None and stats["halves"] == [2, 2]
    assert stats["blocks"] == {f"layers.{i}.ffn.moe": "two_batch" for i in range(2)}
    assert stats["buffer_rows"]["layers.0.ffn.moe"] == {"whole": 4 * 16 * K, "half": 2 * 16 * K}
    assert _issue_order(two.graph_module) == list(SCHEDULE) == stats["schedule"]
    if cf is not None:  # the comparison covers drops: capacity 16 of 64 tokens * 2 routes / 8
        ref(tokens)
        assert int(ref.aux_outputs[("layers.0.ffn.moe", "expert_counts")].max()) > 16
    _assert_same(_step(two, tokens, targets), _step(ref, tokens, targets))
    # another even batch runs through the same program; an odd one is refused on the host
    other, other_targets = _batch(6, seed=2)
    _assert_same(_step(two, other, other_targets), _step(ref, other, other_targets))
    with pytest.raises(RuntimeError, match="must be even"):
        two(_batch(3)[0])


def test_odd_batch_declines_and_leaves_the_program_alone(dense):
    tokens, _ = _batch(3)
    with pytest.warns(UserWarning, match="overlap left the program unchanged"):
        two = moec.compile(copy.deepcopy(dense), _plan("two_batch"), (tokens,))
    result = two.pass_results["overlap"]
    assert not result.modified and not result.stats["applied"]
    assert "even batch >= 2" in result.stats["declined"] and "is 3" in result.stats["declined"]
    assert all("is 3" in why for why in result.stats["blocks"].values())
    assert sum(n.target is ops.dispatch.default for n in two.graph_module.graph.nodes) == 2


def test_recompute_block_composes(dense):
    tokens, targets = _batch(4)
    ref = moec.compile(copy.deepcopy(dense), _plan("none"), (tokens,))
    plan = _plan("two_batch")
    plan.recompute.policy = "block"
    two = moec.compile(copy.deepcopy(dense), plan, (tokens,))
    assert two.pass_results["overlap"].stats["applied"]
    assert two.pass_results["recompute"].stats["blocks_recomputed"] == 2
    _assert_same(_step(two, tokens, targets), _step(ref, tokens, targets))


def test_pipeline_stages_split_a_two_batch_program(dense):
    """Overlap composes with the pipeline pass: the stage graphs of a two_batch program, run one
    after the other, give the unsplit one-chain program's logits."""
    tokens, _ = _batch(4)
    ref = moec.compile(copy.deepcopy(dense), _plan("none"), (tokens,))
    two = moec.compile(copy.deepcopy(dense), _plan("two_batch", pp=2, microbatches=2), (tokens,))
    assert two.pass_results["overlap"].stats["applied"]
    split = two.program.pipeline
    values = [tokens]
    for stage, info in zip(split.stages, split.info, strict=True):
        values = list(stage.graph(*values)[: len(info.outputs)])
    torch.testing.assert_close(values[0], ref(tokens), **TOL)


# --- EP = 2 on gloo ----------------------------------------------------------------------------


def _ep_exchanges(compiled) -> dict[str, dict]:
    """The arguments of the program's EP exchanges (the ops that take ``poison``) by op."""
    found = {}
    for node in compiled.graph_module.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if schema is not None and any(a.name == "poison" for a in schema.arguments):
            found[schema.name] = node.kwargs
    return found


def _ep_worker(rank: int, world: int) -> None:
    tokens, targets = _batch(4, seed=10 + rank)
    dense = _dense()
    # rows no route writes hold NaN (garbage must not leak); gloo's exchanges left running
    # from issue to wait, as NCCL's are; a copy-kernel cap (the emulated transport has none)
    target = dataclasses.replace(
        Target.detect("cpu"), ep_poison=NAN, ep_asynchronous=True, ep_copy_programs=4
    )

    def build(overlap: str, path: str, cf: float | None = 1.0):
        plan = _plan(overlap, cf, dp=world, ep=world, ep_path=path)
        mesh = mdist.build_mesh(plan)
        return moec.compile(copy.deepcopy(dense), plan, (tokens,), mesh=mesh, target=target)

    ref, two = build("none", "a2a_capacity"), build("two_batch", "a2a_capacity")
    exchanges = _ep_exchanges(two)
    split_ops = ("dispatch_issue", "dispatch_wait", "combine_issue", "combine_wait")
    assert set(exchanges) == {f"moec::ep_{op}" for op in split_ops}
    for kwargs in exchanges.values():  # what bind set from the target
        assert math.isnan(kwargs["poison"]) and kwargs["asynchronous"] is True
        assert kwargs["copy_programs"] == 4
    stats = two.pass_results["overlap"].stats
    assert stats["applied"] and stats["path"] == "a2a_capacity"
    assert stats["schedule"] == list(EP_SCHEDULE)
    assert stats["overlap"] == schedule_overlap(EP_SCHEDULE)
    # C = ceil(1.0 * 64 * 2 / 8) = 16 < 32 tokens per half: each half's buffer is N * 16 rows
    assert stats["buffer_rows"]["layers.0.ffn.moe"] == {"whole": N * 16, "half": N * 16}
    assert _split_exchange_order(two.graph_module) == list(EP_SCHEDULE)
    for _ in range(2):  # the second step reuses whatever the first left behind
        _assert_same(_step(two, tokens, targets), _step(ref, tokens, targets))
        assert ep_ops.pending_exchanges() == 0  # every issued exchange was waited for
    # what ran: per block, forward B.dispatch under A's experts and A.combine under B's; in
    # backward (autograd's order) the mirror: A's combine and B's dispatch backward under the
    # other half's expert backward; A.dispatch, B.combine and their backwards exposed
    forward, backward = _ExchangeLog(), _ExchangeLog()
    with forward:
        logits = two(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    with backward:
        (loss + two.aux_loss()).backward()
    for log in (forward, backward):
        assert _experts_under_exchanges(log.calls) == [0, 1, 1, 0] * CFG.n_layers, log.calls
    for name, value in ref.aux_outputs.items():  # drops, counts, offsets, router losses
        torch.testing.assert_close(two.aux_outputs[name], value, **TOL)
    # rowwise (dropless: its rank capacity never binds), on the CPU stand-in for its transport
    with test_ep._emulated_rowwise("rowwise"):
        ref, two = build("none", "rowwise", None), build("two_batch", "rowwise", None)
        assert two.pass_results["overlap"].stats["applied"]
        assert _split_exchange_order(two.graph_module) == list(EP_SCHEDULE)
        for _ in range(2):
            _assert_same(_step(two, tokens, targets), _step(ref, tokens, targets))
            assert ep_ops.pending_exchanges() == 0


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ep_two_batch_split_exchanges_equal_one_chain(world):
    """a2a_capacity, and rowwise on the emulated transport (benchmarks/ep.py --overlap and
    tests/gpu/test_multigpu.py run its symmetric-memory one on GPUs)."""
    spawn(_ep_worker, world)


# --- the cost model of exposed communication ---------------------------------------------------


def test_exposed_comm_none_is_every_exchange():
    cost = exposed_comm(8e6, 4e9, 3e-3)
    assert cost.comm == pytest.approx(2e-3) and cost.exposed == pytest.approx(2e-3)
    assert cost.makespan == pytest.approx(5e-3) and cost.hidden == pytest.approx(0.0)


@pytest.mark.parametrize("compute", [2e-3, 5e-3])
def test_two_batch_hides_all_but_the_first_dispatch_and_last_combine_when_compute_bound(compute):
    comm = 2e-3  # 8 MB at 4 GB/s
    cost = exposed_comm(8e6, 4e9, compute, "two_batch")
    assert cost.comm == pytest.approx(comm)
    assert cost.exposed == pytest.approx(comm / 2)  # A.dispatch + B.combine, a quarter each
    assert overlap_gain(8e6, 4e9, compute) == pytest.approx(comm / 2)


def test_two_batch_without_compute_hides_nothing_and_latency_can_make_it_lose():
    assert exposed_comm(8e6, 4e9, 0.0, "two_batch").exposed == pytest.approx(2e-3)
    # latency-bound exchanges: four half exchanges pay 4 latencies where none pays 2
    assert overlap_gain(0.0, 4e9, 1e-5, latency_s=1e-4) < 0
    for compute in (0.0, 1e-4, 1e-3, 1e-2):  # with no latency it never loses
        for nbytes in (1e3, 1e6, 1e8):
            assert overlap_gain(nbytes, 4e9, compute) >= -1e-15


def test_exposed_comm_rejects_bad_inputs():
    with pytest.raises(ValueError, match="bandwidth"):
        exposed_comm(1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="compute_s"):
        exposed_comm(1.0, 1.0, -1.0)
    with pytest.raises(ValueError, match="'none' or 'two_batch'"):
        exposed_comm(1.0, 1.0, 1.0, "three_batch")


def test_a2a_capacity_halves_keep_the_whole_capacity_and_move_up_to_twice_the_bytes():
    # T = 64 tokens, C = 16 <= T/2: each half's buffer is the whole's, N * C rows
    assert two_batch_half_share("a2a_capacity", 64, 16) == 1.0
    assert two_batch_half_share("a2a_capacity", 64, 48) == pytest.approx(32 / 48)
    assert two_batch_half_share("a2a_capacity", 64, None) == 0.5  # dropless: C = T
    assert two_batch_half_share("rowwise", 64, 16) == 0.5
    doubled = exposed_comm(8e6, 4e9, 5e-3, "two_batch", half_share=1.0)
    assert doubled.comm == pytest.approx(4e-3)  # four exchanges of the whole's dispatch bytes
    assert doubled.exposed == pytest.approx(2e-3)  # A.dispatch and B.combine, a half each
    assert overlap_gain(8e6, 4e9, 5e-3, half_share=1.0) == pytest.approx(0.0)
    assert overlap_gain(8e6, 4e9, 1e-3, half_share=1.0) < 0  # too little compute: it costs
    with pytest.raises(ValueError, match="half_share"):
        exposed_comm(1.0, 1.0, 1.0, "two_batch", half_share=1.5)
    with pytest.raises(ValueError, match="'a2a_capacity' or 'rowwise'"):
        two_batch_half_share("sync_1d", 64, 16)


@pytest.mark.parametrize("top_k,num_experts,ep", [(3, 8, 2), (3, 8, 4), (2, 6, 3), (8, 8, 2)])
def test_once_per_rank_share_is_the_mean_over_every_choice_of_experts(top_k, num_experts, ep):
    """Rows per route when a token crosses to each rank it reaches once: the mean over every
    set of ``top_k`` distinct experts of (ranks reached) / top_k."""
    import itertools

    local = num_experts // ep
    choices = list(itertools.combinations(range(num_experts), top_k))
    reached = [len({e // local for e in chosen}) for chosen in choices]
    want = sum(reached) / len(choices) / top_k
    assert once_per_rank_share(top_k, num_experts, ep) == pytest.approx(want)
    assert once_per_rank_share(top_k, num_experts, 1) == pytest.approx(1 / top_k)
    with pytest.raises(ValueError, match="ep dividing num_experts"):
        once_per_rank_share(top_k, num_experts, num_experts + 1)


def test_the_schedule_hides_b_dispatch_and_a_combine_under_the_other_halfs_experts():
    """What pass overlap reports as hidden: each exchange's compute between issue and wait."""
    assert schedule_overlap(EP_SCHEDULE) == {
        "A.dispatch": [],
        "B.dispatch": ["A.experts"],
        "A.combine": ["B.experts"],
        "B.combine": [],
    }
    swapped = ("A.dispatch.issue", "A.experts", "A.dispatch.wait")
    assert schedule_overlap(swapped) == {"A.dispatch": ["A.experts"]}
