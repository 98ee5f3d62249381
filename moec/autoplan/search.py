"""The plan search: every layout of a world of GPUs, its predicted step time and per-rank memory.

:func:`search` enumerates, for a :class:`~moec.autoplan.profile.ModelProfile`, a GPU
and a global batch: pipeline degree ``pp`` (dividing the world, at most one stage per unit),
virtual stages and schedule (``1f1b``, ``gpipe``; ``interleaved_1f1b`` and ``zbv`` at v = 2; ``zbv``
only where the torch that runs the plan can split the backward and without FSDP: what
:func:`moec.analysis.pipeline_schedule.schedule_runs`, the pipeline pass's gate, accepts),
data parallel ``dp = world / pp``, EP degree (dividing dp and the experts) and path
(``rowwise``, ``a2a_capacity``), FSDP shard size (1: DDP, 8: HSDP inside a node, dp: FSDP),
sequences per microbatch (the microbatch count follows from the global batch), recompute
(``none``, ``block``), the low-precision scope (bf16, or the GPU's native FP8 format on the
routed experts, on the dense FFNs where the model has any, or on both: ``precision.scope``),
EP overlap (``none``, ``two_batch``) and, at EP = 1 with bf16 experts, whether the MoE
layers' dispatch and combine fold into the expert MLPs (``lowering.combine_in_experts``: less
memory, the expert GEMMs at ``Efficiency.folded_experts`` of their rate; priced with the
profile's :attr:`~moec.autoplan.profile.ModelProfile.folded` units).
Layouts are pruned early: divisibility, and memory lower bounds (a layout whose parameter state
alone does not fit skips every microbatch size; a microbatch that does not fit stops the larger
ones). A candidate whose plan a pass would turn down is no candidate (:func:`refusal`: the
plan's validation, the pipeline pass's ``check_splittable`` and each pass's ``declines``, the
passes' own checks called); :attr:`Search.refused` counts them by reason.
:meth:`Search.priced` prices the fastest candidates as ``moec plan show`` does (the program
built on the meta device) and keeps those that fit so.

Each candidate's step (:func:`evaluate`), per pipeline stage and microbatch, from the profile's
per-unit costs and :mod:`moec.analysis.cost.time`: compute (GEMMs by shape and precision,
attention, memory-bound ops at HBM bandwidth, forward + backward = 3x the forward), block
recompute (the blocks' forward again), EP exchanges exposed per MoE layer
(:func:`moec.analysis.cost.overlap.exposed_comm`, the link: NVLink inside a node, the network
across), pipeline P2P and bubble (:func:`~moec.analysis.cost.time.bubble_fraction`),
data-parallel gradient reduction (and FSDP gathers) not hidden by the backward
(``Efficiency.dp_hidden`` of it), and the optimizer step at HBM bandwidth (28 bytes per
parameter element, RESULTS.md's AdamW). The stage split is the ``pipeline`` pass's objective
(contiguous units, the least predicted forward time of the slowest stage, on the searched GPU):
half blocks, or whole blocks under block recompute or FSDP (a recompute region or an FSDP group
is not cut); the chosen plan carries it as ``parallel.pp_layout``, so the pass runs the split
that was priced.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator

from moec.analysis.cost.overlap import exposed_comm, once_per_rank_share, two_batch_half_share
from moec.analysis.cost.time import (
    Efficiency,
    ForwardWork,
    bubble_fraction,
    collective_time,
    expert_gemm_time,
    forward_time,
    forward_work,
    memory_time,
)
from moec.analysis.gpus import GPUSpec
from moec.analysis.pipeline_schedule import inflight_microbatches, schedule_runs, stage_rank
from moec.analysis.rank_memory import GIB, RankMemory
from moec.autoplan.memory import activation_memory, state_memory
from moec.autoplan.profile import ModelProfile, UnitProfile
from moec.errors import MoecError
from moec.kernels.gemm_backend import quack_importable
from moec.ops.routing import capacity
from moec.passes.manager import default_pipeline, registered
from moec.passes.pipeline.legality import check_splittable
from moec.plan import ParallelPlan, Plan, PlanError

PlanPricer = Callable[[Plan, int], RankMemory]
"""The per-rank memory of a plan at that many sequences per microbatch."""

OPTIMIZER_BYTES = 28
"""HBM bytes per parameter element of the AdamW step (RESULTS.md: 56 GB for 2.0B elements)."""


class NoPlanFitsError(MoecError, ValueError):
    """No layout of the world fits the GPU's memory (or none is legal)."""


@dataclasses.dataclass(frozen=True)
class Request:
    world: int
    gpu: GPUSpec
    global_batch: int
    """Tokens per optimizer step (the whole job)."""
    seq: int
    memory_fraction: float = 0.92
    """Share of the GPU's memory a plan may be predicted to use (allocator, buffers)."""
    eff: Efficiency = Efficiency()
    max_micro_seqs: int = 64
    min_micro_seqs: int = 1
    """Fewest sequences per microbatch: 2 for plans ``moec train`` runs today (it captures
    the model at the microbatch, and a batch of 1 would specialise the capture)."""
    pp: int | None = None
    """Only layouts of this pipeline degree (None: every divisor of the world)."""
    split_backward: bool | None = None
    """Whether the torch that runs the plans runs the zero-bubble schedules' split backward
    through moec's ops (None: whether this process's torch does,
    :func:`moec.analysis.pipeline_schedule.split_backward_runs`)."""
    fold_experts: bool | None = None
    """Whether plans may fold the MoE layers' dispatch and combine into the expert MLPs, which
    saves memory only where the expert GEMMs run on the CuTe DSL (None: whether this process
    imports quack-kernels, :func:`moec.kernels.gemm_backend.quack_importable`)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    pp: int
    virtual_stages: int
    schedule: str
    dp: int
    ep: int
    ep_path: str
    dp_shard: int
    micro_seqs: int
    microbatches: int
    recompute: str
    gemm: str
    overlap: str
    fold_experts: bool = False
    """Dispatch and combine folded into the expert MLPs (EP = 1, bf16 experts)."""
    scope: tuple[str, ...] = ()
    """The GEMMs in ``gemm`` precision (``precision.scope``); empty for bf16."""

    @property
    def expert_gemm(self) -> str:
        return self.gemm if "routed_experts" in self.scope else "bf16"

    @property
    def dense_ffn_gemm(self) -> str:
        return self.gemm if "dense_ffn" in self.scope else "bf16"

    @property
    def whole_blocks(self) -> bool:
        """Stages cut between blocks only: block recompute makes each block one region, FSDP
        gathers each block's parameters in one call."""
        return self.recompute == "block" or self.dp_shard > 1


@dataclasses.dataclass(frozen=True)
class Prediction:
    layout: Layout
    step_s: float
    compute_s: float
    exposed_comm_s: float
    bubble_s: float
    recompute_s: float
    memory: RankMemory
    tokens_per_s: float
    mfu: float
    pp_layout: tuple[int, ...] | None = None
    """Units per stage of the priced split (the pass's units: half blocks, or blocks under
    block recompute or FSDP); None without pipeline parallelism."""

    def plan(self, base: Plan) -> Plan:
        """``base`` with this layout and its priced split (:func:`layout_plan`)."""
        return layout_plan(base, self.layout, self.pp_layout)

    def rank_key(self) -> tuple[float, float]:
        """The search's order: fastest first, then the least memory."""
        return self.step_s, self.memory.total


def layout_plan(base: Plan, lay: Layout, pp_layout: tuple[int, ...] | None = None) -> Plan:
    """``base`` (its MoE, loss and lowering sections) with every choice of ``lay``: the
    parallel section (``microbatch_size`` included), recompute and precision, the two lowering
    flags that fold the experts, and ``pp_layout``; validated (:class:`~moec.plan.PlanError`)."""
    data = base.to_dict()
    data["parallel"] = {
        **data["parallel"],
        "dp": lay.dp,
        "dp_shard": lay.dp_shard,
        "ep": lay.ep,
        "ep_path": lay.ep_path,
        "pp": lay.pp,
        "virtual_stages": lay.virtual_stages,
        "pp_schedule": lay.schedule,
        "microbatches": lay.microbatches,
        "microbatch_size": lay.micro_seqs,
        "overlap": lay.overlap,
        "pp_layout": list(pp_layout) if pp_layout else None,
    }
    precision = dict(data["precision"])
    precision["compute_dtype"] = "bf16"
    precision["gemm"] = lay.gemm
    precision["scope"] = list(lay.scope) or ["routed_experts"]
    data["precision"] = precision
    data["recompute"] = {"policy": lay.recompute, "budget_bytes": None}
    data["lowering"] = {**data["lowering"], "combine_in_experts": lay.fold_experts}
    return Plan.from_dict(data)


def refusal(plan: Plan, units: int) -> str | None:
    """Why the compiler would not build ``plan`` as planned on a model of ``units`` pipeline
    units, or None: the pipeline pass's check (:func:`~moec.passes.pipeline.check_splittable`)
    and every pass of the plan's pipeline that :meth:`~moec.passes.base.Pass.declines` it; the
    passes' own checks, called, not copied."""
    if plan.parallel.pp > 1:
        try:
            check_splittable(plan.parallel, units)
        except PlanError as exc:
            return str(exc)
    passes = registered()
    for name in default_pipeline(plan):
        reason = passes[name].declines(plan)
        if reason is not None:
            return f"pass {name} declines: {reason}"
    return None


@functools.cache
def _runs_eagerly(dp_shard: int, recompute: str) -> bool:
    """Whether the default lowering (``lowering.inductor: auto``, on CUDA) leaves a one-stage
    plan of this sharding and recompute policy eager (:meth:`Plan.lowers_to_inductor`)."""
    parallel = {"dp": dp_shard, "dp_shard": dp_shard}
    plan = Plan.from_dict({"parallel": parallel, "recompute": {"policy": recompute}})
    return not plan.lowers_to_inductor("cuda")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Search:
    """The search over one profile and request (see module); caches per-unit sums."""

    def __init__(self, profile: ModelProfile, request: Request, base: Plan | None = None):
        if request.pp is not None and (request.pp < 1 or request.world % request.pp):
            raise NoPlanFitsError(
                f"pipeline degree pp = {request.pp} must be a divisor of the world "
                f"({request.world} GPUs)"
            )
        self.profile, self.req = profile, request
        self.base = base or Plan()
        """The plan whose MoE, loss and lowering sections every candidate keeps."""
        self.refused: dict[str, int] = {}
        self._refusals: dict[Layout, str | None] = {}
        """Candidates a pass would turn down, by the reason (:func:`refusal`)."""
        experts = {m.num_experts for u in profile.units for m in u.moe}
        self.experts = min(experts) if experts else 1
        self.capacity = request.gpu.memory_bytes * request.memory_fraction
        fold = quack_importable() if request.fold_experts is None else request.fold_experts
        self.fold = fold and profile.folded is not None
        dense_ffn = any(u.dense_ffn_flops(1, request.seq) > 0 for u in profile.units)
        self.low_scopes: list[tuple[str, ...]] = [("routed_experts",)]
        """The ``precision.scope`` s a low-precision layout may take."""
        if dense_ffn:
            self.low_scopes += [("dense_ffn",), ("dense_ffn", "routed_experts")]
        self._memories: dict[tuple, RankMemory] = {}
        self.smallest: tuple[float, str] = (math.inf, "")
        """The least per-rank memory seen, and the layout it belongs to."""
        self.evaluated = 0

    # --- enumeration ------------------------------------------------------------------------

    def layouts(self) -> Iterator[tuple[int, int, str, int, int, int]]:
        """(pp, v, schedule, dp, ep, dp_shard): the parameter layouts."""
        world, units = self.req.world, self.profile.num_units
        for pp in _divisors(world):
            if pp > units or (self.req.pp is not None and pp != self.req.pp):
                continue
            schedules = [(1, "1f1b")]
            if pp > 1:
                schedules += [(1, "gpipe"), (2, "interleaved_1f1b"), (2, "zbv")]
            dp = world // pp
            for v, schedule in schedules:
                if pp * v > units:
                    continue
                for ep in _divisors(dp):
                    if self.experts % ep:
                        continue
                    shards = sorted({1, dp} | ({8} if dp > 8 and dp % 8 == 0 else set()))
                    for dp_shard in shards:
                        if dp_shard > 1 and pp * v > self.profile.num_blocks:
                            continue  # an FSDP group is one unit: stages cut between blocks
                        if not schedule_runs(schedule, dp_shard, self.req.split_backward):
                            continue  # the pipeline pass refuses it (its one gate)
                        yield pp, v, schedule, dp, ep, dp_shard

    def candidates(self, prune: bool = True) -> Iterator[Prediction]:
        """Every legal candidate's prediction (with ``prune``: only those that can fit)."""
        req = self.req
        if req.global_batch % req.seq:
            raise NoPlanFitsError(
                f"global batch {req.global_batch} tokens is not a multiple of seq {req.seq}"
            )
        sequences = req.global_batch // req.seq
        for pp, v, schedule, dp, ep, dp_shard in self.layouts():
            if sequences % dp:
                continue
            per_rank = sequences // dp
            bound = self._state_lower_bound(pp, v, schedule, dp, ep, dp_shard)
            self._note(bound, f"pp {pp}, ep {ep}, dp_shard {dp_shard}: parameter state alone")
            if prune and bound > self.capacity:
                continue
            for micro in _divisors(per_rank):
                if micro > req.max_micro_seqs:
                    break
                if micro < req.min_micro_seqs:
                    continue
                m = per_rank // micro
                if pp > 1 and (m < pp or (v > 1 and m % pp)):
                    continue
                fitted = False
                for recompute in ("none", "block"):
                    if recompute == "block" and pp * v > self.profile.num_blocks:
                        continue  # a recompute region is one unit
                    precisions = [("bf16", ())]
                    precisions += [(req.gpu.low_precision(), s) for s in self.low_scopes]
                    for gemm, scope in precisions:
                        overlaps = ("none", "two_batch") if ep > 1 else ("none",)
                        paths = ("rowwise", "a2a_capacity") if ep > 1 else ("auto",)
                        fold = self.fold and ep == 1 and "routed_experts" not in scope
                        for overlap, path, folded in itertools.product(
                            overlaps, paths, (False, True) if fold else (False,)
                        ):
                            lay = Layout(
                                pp,
                                v,
                                schedule,
                                dp,
                                ep,
                                path,
                                dp_shard,
                                micro,
                                m,
                                recompute,
                                gemm,
                                overlap,
                                folded,
                                scope,
                            )
                            pred = self.evaluate(lay)
                            fits = pred.memory.total <= self.capacity
                            fitted |= fits
                            if (fits or not prune) and not self._refused(lay):
                                yield pred
                if prune and not fitted:
                    break  # a larger microbatch holds more activations

    def best(self, top: int = 5, prune: bool = True) -> list[Prediction]:
        """The ``top`` fitting candidates, fastest first; :class:`NoPlanFitsError` if none."""
        return self.ranked(prune)[:top]

    def ranked(self, prune: bool = True) -> list[Prediction]:
        """Every candidate that fits, fastest first; :class:`NoPlanFitsError` if none."""
        fitting = [p for p in self.candidates(prune) if p.memory.total <= self.capacity]
        if not fitting:
            raise self._nothing_fits()
        return sorted(fitting, key=Prediction.rank_key)

    def priced(self, top: int, price: PlanPricer, tries: int | None = None) -> list[Prediction]:
        """The ``top`` fastest candidates that fit by ``price`` (the memory ``moec plan show``
        predicts for a candidate's plan and its sequences per microbatch), each with that
        memory, in :meth:`ranked` order. At most ``tries`` (default ``3 * top + 2``) are
        priced: once a priced plan holds ``r`` times its estimate, candidates whose estimate
        times the largest ``r`` seen does not fit are passed over unpriced. Only priced plans
        are returned; :class:`NoPlanFitsError` if none fits."""
        chosen: list[Prediction] = []
        scale, left = 1.0, tries or 3 * top + 2
        closest: tuple[float, str] = (math.inf, "")
        for pred in self.ranked():
            if pred.memory.total * scale > self.capacity:
                continue
            memory = price(pred.plan(self.base), pred.layout.micro_seqs)
            scale = max(scale, memory.total / pred.memory.total)
            if memory.total <= self.capacity:
                chosen.append(dataclasses.replace(pred, memory=memory))
            else:
                closest = min(closest, (memory.total, str(pred.layout)))
            left -= 1
            if len(chosen) == top or not left:
                break
        if chosen:
            return chosen
        if math.isfinite(closest[0]):
            raise NoPlanFitsError(
                f"no plan fits {self.req.world} x {self.req.gpu.name} as built: the estimate "
                f"fits, but the closest priced as moec plan show prices it holds "
                f"{closest[0] / GIB:.1f} GiB per rank ({closest[1]}); use more GPUs, a GPU "
                "with more memory or a shorter sequence"
            )
        raise self._nothing_fits()

    def _refused(self, lay: Layout) -> bool:
        """Whether a pass turns ``lay``'s plan down (counted in :attr:`refused` by reason)."""
        if lay not in self._refusals:
            units = self.profile.num_blocks if lay.whole_blocks else self.profile.num_units
            try:
                self._refusals[lay] = refusal(layout_plan(self.base, lay), units)
            except PlanError as exc:
                self._refusals[lay] = str(exc)
        reason = self._refusals[lay]
        if reason is not None:
            self.refused[reason] = self.refused.get(reason, 0) + 1
        return reason is not None

    def _nothing_fits(self) -> NoPlanFitsError:
        gib = self.req.gpu.memory_bytes / GIB
        smallest, where = self.smallest
        if not where:
            return NoPlanFitsError(
                f"no legal layout of {self.req.world} GPUs for a global batch of "
                f"{self.req.global_batch} tokens at seq {self.req.seq} (the batch must split "
                "into whole sequences per data-parallel rank)"
            )
        return NoPlanFitsError(
            f"no plan fits {self.req.world} x {self.req.gpu.name} "
            f"({gib:.1f} GiB, {self.req.memory_fraction:.0%} usable): the smallest per-rank "
            f"memory found is {smallest / GIB:.1f} GiB ({where}); use more GPUs, a GPU with "
            "more memory or a shorter sequence"
        )

    # --- pipeline structure ----------------------------------------------------------------

    @functools.cache  # noqa: B019 (one Search per request)
    def split(self, stages: int, whole_blocks: bool = False) -> tuple[tuple[int, ...], ...]:
        """Contiguous units per stage minimising the slowest stage's predicted forward time
        (``whole_blocks``: cut between blocks only)."""
        units = self.profile.units
        seconds = [forward_time(self.work(u, 1, 1), self.req.gpu, self.req.eff) for u in units]
        cuts = [i for i in range(1, len(units) + 1) if not whole_blocks or i == len(units)
                or units[i].block != units[i - 1].block]  # fmt: skip
        n = len(cuts)
        ends = [0, *cuts]  # candidate stage ends, as unit indices
        prefix = [0.0]
        for t in seconds:
            prefix.append(prefix[-1] + t)
        best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
        choice = [[0] * (n + 1) for _ in range(stages + 1)]
        best[0][0] = 0.0
        for s in range(1, stages + 1):
            for j in range(s, n - (stages - s) + 1):
                for i in range(s - 1, j):
                    cand = max(best[s - 1][i], prefix[ends[j]] - prefix[ends[i]])
                    if cand < best[s][j]:
                        best[s][j], choice[s][j] = cand, i
        bounds, j = [], n
        for s in range(stages, 0, -1):
            i = choice[s][j]
            bounds.append(tuple(range(ends[i], ends[j])))
            j = i
        return tuple(bounds[::-1])

    def work(self, unit: UnitProfile, micro_seqs: int, ep: int) -> ForwardWork:
        """``unit``'s forward work per microbatch of ``micro_seqs`` sequences at EP ``ep``."""
        b, seq = micro_seqs, self.req.seq
        return forward_work(
            unit.matmul_flops(b, seq),
            unit.attention_flops(b, seq),
            unit.expert_flops(b, seq),
            [(m.top_k, m.num_experts) for m in unit.moe],
            unit.other_bytes(b, seq),
            b * seq,
            ep,
            unit.dense_ffn_flops(b, seq),
        )

    @functools.cache  # noqa: B019
    def unit_times(
        self,
        u: int,
        b: int,
        ep: int,
        ep_path: str,
        expert_gemm: str,
        dense_ffn_gemm: str,
        overlap: str,
        recompute: str,
        fold: bool = False,
    ) -> tuple[float, float, float]:
        """Seconds of unit ``u`` per microbatch of ``b`` sequences: compute (forward and
        backward), block recompute, and exposed EP exchanges (forward and backward); layouts
        that share these arguments share the answer."""
        req, prof, gpu, eff = self.req, self.profile, self.req.gpu, self.req.eff
        seq, unit = req.seq, prof.units[u]
        ep_link = gpu.ceiling("nvlink_gbps" if ep <= gpu.gpus_per_node else "inter_node_gbps")
        ep_rate = ep_link * 1e9 * eff.link * (eff.path_factor(ep_path) if ep > 1 else 1)
        work = self.work(unit, b, ep)
        fwd = forward_time(work, gpu, eff, expert_gemm, dense_ffn_gemm)
        if fold:  # the folded expert GEMMs run at a share of their rate
            experts = sum(
                expert_gemm_time(f, r, gpu, expert_gemm, eff) for f, r in work.expert_gemms
            )
            fwd += experts * (1 / eff.folded_experts - 1)
        comm = recomputed = 0.0
        for moe, (flops, rows) in zip(unit.moe, work.expert_gemms, strict=True):
            if ep == 1:
                break
            t_exp = expert_gemm_time(flops, rows, gpu, expert_gemm, eff)
            row_bytes = moe.dim * prof.act_itemsize * (ep - 1) / ep
            home = work.rows * moe.top_k * (moe.capacity_factor or 1.0) * row_bytes
            sent = 2 * home  # dispatch + combine, a row per route each way
            half = 0.5
            if ep_path == "rowwise":  # a row per token and rank
                share = once_per_rank_share(moe.top_k, moe.num_experts, ep)
                sent = 2 * work.rows * moe.top_k * share * row_bytes
            elif overlap == "two_batch":  # a half keeps the whole's per-expert capacity
                tokens = int(work.rows)
                cap = capacity(tokens, moe.top_k, moe.num_experts, moe.capacity_factor or 0.0)
                half = two_batch_half_share(ep_path, tokens, cap)
            # forward against the expert GEMMs; backward (the same exchanges reversed) against
            # twice their time
            for compute_s in (t_exp, 2 * t_exp):
                exposed = exposed_comm(sent, ep_rate, compute_s, overlap, eff.latency_s, half)
                comm += exposed.exposed
        if recompute == "block":
            total = sum(
                f(b, seq) for f in (unit.matmul_flops, unit.attention_flops, unit.expert_flops)
            )
            recomputed = fwd * (unit.recompute_flops(b, seq) / total if total else 0)
        return 3 * fwd, recomputed, comm

    @functools.cache  # noqa: B019
    def stage_times(self, units: tuple[int, ...], *args: object) -> tuple[float, float, float]:
        """:meth:`unit_times` summed over a stage's units (``args``: its arguments after the
        unit)."""
        times = [self.unit_times(u, *args) for u in units]
        return tuple(sum(t[i] for t in times) for i in range(3))  # type: ignore[return-value]

    @functools.cache  # noqa: B019
    def in_flight(self, pp: int, v: int, schedule: str, m: int) -> tuple[int, ...]:
        if pp == 1:
            return (1,)
        plan = ParallelPlan(pp=pp, virtual_stages=v, pp_schedule=schedule, microbatches=m)
        return tuple(inflight_microbatches(plan))

    def ranks(self, pp: int, v: int, schedule: str) -> list[list[int]]:
        """Stage indices held by each pipeline rank."""
        held: list[list[int]] = [[] for _ in range(pp)]
        for s in range(pp * v):
            held[stage_rank(s, pp, schedule) if pp > 1 else 0].append(s)
        return held

    @functools.cache  # noqa: B019
    def state(
        self,
        pp: int,
        v: int,
        schedule: str,
        dp: int,
        ep: int,
        dp_shard: int,
        m: int,
        whole_blocks: bool = False,
    ) -> tuple[tuple[int, int, int, int, int], ...]:
        """Per pipeline rank: its parameter state (rank_memory's first five lines)."""
        stages = self.split(pp * v, whole_blocks)
        return tuple(
            state_memory(self.profile, [u for s in held for u in stages[s]], ep, dp, dp_shard, m)
            for held in self.ranks(pp, v, schedule)
        )

    def _state_lower_bound(
        self, pp: int, v: int, schedule: str, dp: int, ep: int, dp_shard: int
    ) -> float:
        # bf16 gradients with one microbatch are the least state a layout can have
        states = self.state(pp, v, schedule, dp, ep, dp_shard, 1, dp_shard > 1)
        return max(sum(r) for r in states)

    # --- one candidate ---------------------------------------------------------------------

    def evaluate(self, lay: Layout) -> Prediction:
        self.evaluated += 1
        req, prof, gpu, eff = self.req, self.profile, self.req.gpu, self.req.eff
        seq, b, m = req.seq, lay.micro_seqs, lay.microbatches
        stages = self.split(lay.pp * lay.virtual_stages, lay.whole_blocks)
        flight = self.in_flight(lay.pp, lay.virtual_stages, lay.schedule, m)
        held = self.ranks(lay.pp, lay.virtual_stages, lay.schedule)
        node = gpu.gpus_per_node

        # per stage and microbatch: compute, recompute, exposed EP
        args = (
            b, lay.ep, lay.ep_path, lay.expert_gemm, lay.dense_ffn_gemm, lay.overlap,
            lay.recompute, lay.fold_experts,
        )  # fmt: skip
        stage_compute, stage_recompute, stage_comm = zip(
            *(self.stage_times(units, *args) for units in stages), strict=True
        )

        # pipeline: the slowest rank's busy time per microbatch, P2P at stage boundaries
        p2p = 0.0
        if lay.pp > 1:
            link = gpu.ceiling("nvlink_gbps" if req.world <= node else "inter_node_gbps")
            sent = b * seq * prof.hidden * prof.act_itemsize
            p2p = 2 * (eff.latency_s + sent / (link * 1e9 * eff.link))  # activation + its grad
        per_rank = []
        if lay.pp > 1:
            pace = eff.pp_stage  # measured on eager stages: includes eager
        else:
            pace = eff.eager if _runs_eagerly(lay.dp_shard, lay.recompute) else 1.0
        for stages_held in held:
            busy = sum(
                (stage_compute[s] + stage_recompute[s]) / pace + stage_comm[s] + p2p
                for s in stages_held
            )
            per_rank.append(busy)
        slowest = max(range(len(held)), key=per_rank.__getitem__)
        busy = per_rank[slowest]
        bubble = bubble_fraction(lay.schedule, lay.pp, lay.virtual_stages, m) * m * busy

        # data parallel: gradient reduction (and FSDP gathers) beyond the last backward
        states = self.state(
            lay.pp, lay.virtual_stages, lay.schedule, lay.dp, lay.ep, lay.dp_shard, m,
            lay.whole_blocks,
        )  # fmt: skip
        units_held = tuple(u for s in held[slowest] for u in stages[s])
        dense_el, expert_el = self._param_elements(units_held, lay.ep, lay.dp_shard)
        dp_link = gpu.ceiling("nvlink_gbps" if lay.dp <= node else "inter_node_gbps")
        if lay.dp_shard > 1:
            shard_link = gpu.ceiling("nvlink_gbps" if lay.dp_shard <= node else "inter_node_gbps")
            full = dense_el * lay.dp_shard
            dp_comm = collective_time("reduce_scatter", 4 * full, lay.dp_shard, shard_link, eff)
            dp_comm += collective_time(
                "all_reduce", 4 * dense_el, lay.dp // lay.dp_shard, dp_link, eff
            )
            gathers = 2 * m * collective_time("all_gather", 2 * full, lay.dp_shard, shard_link, eff)
        else:
            dp_comm = collective_time("all_reduce", 4 * dense_el, lay.dp, dp_link, eff)
            gathers = 0.0
        dp_comm += collective_time("all_reduce", 4 * expert_el, lay.dp // lay.ep, dp_link, eff)
        last_backward = sum(stage_compute[s] for s in held[slowest]) * 2 / 3
        exposed_dp = max(0.0, dp_comm - eff.dp_hidden * last_backward) + max(
            0.0, gathers - m * busy
        )
        optimizer = memory_time(OPTIMIZER_BYTES * (dense_el + expert_el), gpu, eff)

        step = m * busy + bubble + exposed_dp + optimizer
        compute = m * sum(stage_compute[s] for s in held[slowest]) / pace + optimizer
        recompute = m * sum(stage_recompute[s] for s in held[slowest]) / pace
        comm = m * sum(stage_comm[s] + p2p for s in held[slowest]) + exposed_dp

        # what a rank keeps does not depend on the GEMM precision or on how EP exchanges run
        key = (lay.pp, lay.virtual_stages, lay.schedule, lay.dp, lay.ep, lay.dp_shard,
               lay.micro_seqs, m, lay.recompute, lay.fold_experts)  # fmt: skip
        memory = self._memories.get(key)
        if memory is None:
            memory = self._memories[key] = self._memory(lay, stages, flight, held, states)
        self._note(
            memory.total,
            f"pp {lay.pp}, ep {lay.ep}, dp_shard {lay.dp_shard}, {lay.micro_seqs} x {seq} "
            f"tokens per microbatch, recompute {lay.recompute}",
        )
        tokens_per_s = req.global_batch / step
        peak = gpu.bf16_tflops * 1e12 * req.world
        mfu = prof.useful_flops_per_token(1, seq) * tokens_per_s / peak
        layout = None
        if lay.pp > 1:  # in the pass's units: blocks under block recompute
            units = [[prof.units[u].block for u in stage] for stage in stages]
            layout = tuple(len(set(s)) if lay.whole_blocks else len(s) for s in units)
        return Prediction(
            lay, step, compute, comm, bubble, recompute, memory, tokens_per_s, mfu, layout
        )

    def _note(self, nbytes: float, where: str) -> None:
        if nbytes < self.smallest[0]:
            self.smallest = (nbytes, where)

    @functools.cache  # noqa: B019
    def _param_elements(
        self, units: tuple[int, ...], ep: int, dp_shard: int
    ) -> tuple[float, float]:
        """(dense, expert) trainable elements whose gradients this rank reduces."""
        dense = expert = 0.0
        for u in units:
            for p in self.profile.units[u].params:
                if not p.trainable:
                    continue
                if p.expert:
                    expert += p.numel / ep
                else:
                    dense += p.numel / (dp_shard if p.fsdp else 1)
        return dense, expert

    def _memory(self, lay: Layout, stages, flight, held, states) -> RankMemory:
        worst = None
        profile = self.profile.folded if lay.fold_experts else self.profile
        for r, stages_held in enumerate(held):
            acts = activation_memory(
                profile,
                [stages[s] for s in stages_held],
                [flight[s] for s in stages_held],
                lay.micro_seqs,
                self.req.seq,
                lay.recompute,
            )
            memory = RankMemory(*states[r], acts)
            if worst is None or memory.total > worst.total:
                worst = memory
        return worst


def search(profile: ModelProfile, request: Request, top: int = 5) -> list[Prediction]:
    """The ``top`` fastest plans that fit (see module); :class:`NoPlanFitsError` if none."""
    return Search(profile, request).best(top)
