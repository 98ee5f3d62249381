"""Per-rank memory of a plan: :func:`plan_memory` prices a plan on a model exactly as ``moec plan
show`` does (:mod:`moec.analysis.rank_memory` on the program the trainer compiles, built on the
meta device), and :func:`rank_memory_of` estimates it from a
:class:`~moec.autoplan.profile.ModelProfile` without building, fast enough for every layout of
the search.

``moec plan auto`` ranks and prunes the layouts by the estimate, then prices the plans it
reports with :func:`plan_memory`, so the memory it prints and the plan it writes are
``moec plan show``'s. The estimate: for the units a pipeline rank holds, with EP degree ``ep``
(an expert parameter keeps ``num_experts / ep`` of its dim 0) and FSDP over ``dp_shard`` ranks
(the parameters FSDP shards keep ``ceil(rows / dp_shard)`` rows and lose their working copy;
expert slices are split on dim 1 over ``dp / ep`` ranks when ``dp_shard > 1`` and ``dp > ep``),
the parameters, gradients (bf16 for a working-copy master with one microbatch), AdamW's two
float32 moments, the bf16 working copies, FSDP's gathered units (root, two block groups and one
expert group at a time; with several microbatches every unit's float32 gradients) and the
activations: per stage ``in_flight x kept + transient`` at the microbatch's (batch, seq), the
rank's largest stage. It leaves out the EP exchange buffers (tests hold the state lines equal
to ``rank_memory`` of built programs, the activations within 10%).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch

from moec.analysis.rank_memory import (
    RankMemory,
    gathered_peak,
    gradient_itemsize,
    rank_memory,
    shard_numel,
)
from moec.autoplan.profile import ModelProfile, ParamInfo
from moec.plan import Plan
from moec.program import EPGroup, Program

ModelLoader = Callable[[], tuple[torch.nn.Module, tuple, dict]]
"""Builds the model and its example inputs ``(model, args, kwargs)`` (called on meta)."""

F32 = 4
BF16 = 2


def _numel(p: ParamInfo, ep: int, shard: int, expert_shard: int) -> tuple[int, int]:
    """(elements this rank holds, elements padded to the whole shard group) of ``p``."""
    shape = list(p.shape)
    if p.expert:
        shape[0] //= ep
    if shard > 1 and p.fsdp and not p.expert:
        rows = shard_numel(shape, shard)
        return rows, rows * shard
    if expert_shard > 1 and p.fsdp and p.expert and len(shape) > 1:
        cols = shard_numel(shape, expert_shard, dim=1)
        return cols, cols * expert_shard
    return math.prod(shape), math.prod(shape)


def state_memory(
    profile: ModelProfile,
    units: Sequence[int],
    ep: int,
    dp: int,
    dp_shard: int,
    microbatches: int,
) -> tuple[int, int, int, int, int]:
    """(parameters, gradients, optimizer, working copies, gathered) bytes of the ``units`` one
    rank holds (see module)."""
    expert_shard = dp // ep if dp_shard > 1 and dp > ep else 1
    params = grads = optimizer = copies = 0
    gather: dict[str, list[int]] = {}
    expert_groups: set[str] = set()
    for u in units:
        for p in profile.units[u].params:
            numel, padded = _numel(p, ep, dp_shard, expert_shard)
            fsdp = p.fsdp and (dp_shard > 1 if not p.expert else expert_shard > 1)
            # under FSDP only expert slices keep working copies (the dense casts are gathers)
            master = p.master and not fsdp and (p.expert or dp_shard == 1)
            params += numel * p.itemsize
            if p.trainable:
                grads += numel * gradient_itemsize(p.itemsize, master, microbatches)
                optimizer += 2 * numel * F32
            if master:
                copies += numel * BF16
            if fsdp:
                # FSDP gathers in bf16 (a bf16 program: the profile's fsdp params are those)
                sizes = gather.setdefault(p.group, [0, 0, 0])
                sizes[0] += padded * BF16
                if p.trainable:
                    sizes[1] += padded * BF16
                    sizes[2] += padded * F32
                if p.expert:
                    expert_groups.add(p.group)
    if not gather:
        return params, grads, optimizer, copies, 0
    root = gather.pop("", [0, 0, 0])
    experts = [gather.pop(g) for g in sorted(expert_groups) if g in gather]
    gathered = gathered_peak(root, list(gather.values()), experts, microbatches)
    return params, grads, optimizer, copies, gathered


def activation_memory(
    profile: ModelProfile,
    stages: Sequence[Sequence[int]],
    in_flight: Sequence[int],
    batch: int,
    seq: int,
    recompute: str,
) -> int:
    """The largest stage's ``in_flight x kept + transient`` bytes over ``stages`` (unit lists,
    with their in-flight microbatches)."""
    peak = 0
    for units, flight in zip(stages, in_flight, strict=True):
        if recompute == "block":
            kept = sum(profile.units[u].saved_block(batch, seq) for u in units)
            transient = max(profile.units[u].transient_block(batch, seq) for u in units)
        else:
            kept = sum(profile.units[u].saved(batch, seq) for u in units)
            transient = 0
        peak = max(peak, round(flight * kept + transient))
    return peak


def rank_memory_of(
    profile: ModelProfile,
    stages: Sequence[Sequence[int]],
    in_flight: Sequence[int],
    *,
    ep: int,
    dp: int,
    dp_shard: int,
    microbatches: int,
    batch: int,
    seq: int,
    recompute: str = "none",
) -> RankMemory:
    """:class:`~moec.analysis.rank_memory.RankMemory` of one pipeline rank holding ``stages``."""
    units = [u for s in stages for u in s]
    state = state_memory(profile, units, ep, dp, dp_shard, microbatches)
    return RankMemory(*state, activation_memory(profile, stages, in_flight, batch, seq, recompute))


def without_named_code(plan: Plan) -> Plan:
    """``plan`` as ``moec plan show`` prices it, running no code the plan names: FFNs computing
    ``moe.activations`` stay dense."""
    return dataclasses.replace(plan, moe=dataclasses.replace(plan.moe, activations={}))


class CapturedModel:
    """The model ``load()`` builds (``name`` in messages) with its next-token loss, as ``moec
    train`` trains it, on the meta device (no parameter is allocated, so any size works),
    captured once: :meth:`program` builds each plan's program on a copy of the capture
    (:func:`moec.compiler.build_from`)."""

    def __init__(self, load: ModelLoader, name: str) -> None:
        from moec.compiler import captured_program, default_target
        from moec.debug import with_next_token_loss

        with torch.device("meta"):
            model, inputs, kwargs = load()
        model, inputs = with_next_token_loss(model, inputs, kwargs, name)
        self.name = name
        self.target = default_target(inputs, {})
        self.captured = captured_program(model, inputs, {}, training=True)

    def program(self, plan: Plan) -> Program:
        """The program ``moec train`` compiles for ``plan`` (unverified), at EP rank 0."""
        from moec.compiler import build_from

        p = plan.parallel
        mesh = SimpleNamespace(ep_info=EPGroup(0, p.ep, "moec-plan")) if p.ep > 1 else None
        return build_from(self.captured, plan, target=self.target, mesh=mesh, verify=False)


def plan_memory(model: CapturedModel, plan: Plan, batch: int, seq: int) -> tuple[RankMemory, int]:
    """(memory, pipeline rank) of the pipeline rank of ``plan`` that holds the most, EP rank 0,
    training on ``batch`` sequences of ``seq`` tokens per microbatch: ``model``'s program for
    ``plan`` priced by :func:`moec.analysis.rank_memory.rank_memory`."""
    p = plan.parallel
    program = model.program(plan)
    ranks = [rank_memory(program, p.microbatches, batch, seq, r) for r in range(p.pp)]
    fullest = max(range(p.pp), key=lambda r: ranks[r].total)
    return ranks[fullest], fullest
