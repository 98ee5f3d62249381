"""Per-rank training memory of a compiled program, predicted from its shapes (no data needed).

For one rank of the program (``Program`` after the passes, so expert parameters are this EP
rank's slice and, under pipeline parallelism, the stages are known):

- ``parameters``: every parameter this rank holds, in its dtype;
- ``gradients``: one per trainable parameter, in the dtype the runtime accumulates it in (bf16
  for a parameter read through a bf16 working copy when a step has one microbatch, else the
  parameter's dtype; ``moec.runtime.working_weights.gradient_dtype``);
- ``optimizer``: AdamW's two float32 moments per trainable element (``moec.optim.AdamW``);
- ``working_copies``: the bf16 copies of the working-weights pass;
- ``gathered``: under FSDP/HSDP (``program.data_parallel``, pass ``fsdp``), the unsharded dense
  parameters and gradients that exist only during the step, at their peak (below); 0 otherwise;
- ``activations``: bytes saved for backward, from the cost model at the given batch (per
  microbatch) and sequence length: for a pipelined program the peak over this rank's stages of
  ``in_flight x saved + transient`` (the pipeline pass's stage table, scaled from the example
  sizes it was computed at); otherwise the graph's saved bytes (recompute regions count their
  inputs, :mod:`moec.analysis.cost.memory`).

Sharded parameters (``moec.runtime.fsdp``: FSDP2, experts ignored): a rank holds one dim-0
chunk of each, ``ceil(rows / shard)`` rows (FSDP2 pads every rank's shard to that size, and rank
0's chunk has it: the figures are those of the fullest rank), for the parameter, its float32
gradient and both AdamW moments. ``gathered`` counts, per FSDP unit (a block's group, or the
root: the sharded parameters of no group), with N its elements padded to ``shard x chunk``
rows, the unsharded parameters (N in the gather dtype), gradients (N in the gather dtype) and
float32 reduce-scatter input (N): the root's for the whole step, and two groups' (the block
running and the next one, prefetched) at a time, the largest, and as many expert units (a
block's experts, sharded over the expert-data-parallel ranks on dim 1 when ``dp > ep``: each
rank holds ``ceil(dim1 / expert_shard)`` of each expert slice) besides. With several
microbatches every unit's unsharded gradients are kept in float32 between microbatches
(FSDP2 accumulates them in its reduce dtype) and counted for all units.

Parameters, gradients, optimizer state and copies are exact for the program (tests compare
them with a training step's tensors, sharded ones included); activations are the cost model's
prediction (its error against measurement is in ``benchmarks/RESULTS.md``, recompute section).
``total`` adds every line, an upper bound of the step's peak under FSDP (the unsharded
gradients grow while the activations are freed). Allocator overhead, temporaries inside one
op and communication buffers other than FSDP's reduce-scatter input are not counted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import nn

from moec.analysis.cost import graph_cost
from moec.fx import under
from moec.program import Program, ShardedDataParallel

GIB = 1024**3
REDUCE_DTYPE = torch.float32
"""The dtype FSDP2 reduce-scatters (and accumulates) gradients in (``moec.runtime.fsdp``)."""


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """Predicted bytes held by one rank during a training step."""

    parameters: int
    gradients: int
    optimizer: int
    working_copies: int
    gathered: int
    activations: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in dataclasses.fields(self))

    def rows(self) -> list[tuple[str, int]]:
        """(what, bytes) for a table, total last."""
        fields = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        return [*fields, ("total", self.total)]


def rank_memory(
    program: Program, microbatches: int, batch: int, seq: int, pp_rank: int = 0
) -> RankMemory:
    """The memory of pipeline rank ``pp_rank`` of ``program`` (the program's own rank when it
    is not pipelined) training on ``batch`` sequences of ``seq`` tokens per microbatch."""
    graphs = _held_graphs(program, pp_rank)
    masters = {name for names in program.working_weights.values() for name in names}
    layout = program.data_parallel
    sharded = set(layout.params) if layout is not None else set()
    experts = set(layout.expert_params) if layout is not None else set()
    params = grads = optimizer = copies = gathered = 0
    for gm in graphs:
        for name, param in gm.named_parameters():
            numel = param.numel()
            if name in sharded:
                numel = shard_numel(param.shape, layout.shard)
            elif name in experts:
                numel = shard_numel(param.shape, layout.expert_shard, dim=1)
            params += numel * param.element_size()
            if param.requires_grad:
                itemsize = gradient_itemsize(param.element_size(), name in masters, microbatches)
                grads += numel * itemsize
                optimizer += 2 * numel * torch.float32.itemsize
        copies += sum(_bytes(gm.get_buffer(b)) for b in program.working_weights if _has(gm, b))
        if layout is not None:
            gathered += _gathered(gm, layout, microbatches)
    activations = _activations(program, pp_rank, batch, seq)
    return RankMemory(params, grads, optimizer, copies, gathered, activations)


def shard_numel(shape: Sequence[int], shard: int, dim: int = 0) -> int:
    """Elements of the fullest dim-``dim`` chunk (``torch.chunk``) of a tensor of ``shape``
    split ``shard`` ways (FSDP2 pads every rank's shard to it)."""
    if len(shape) <= dim:
        return math.prod(shape)
    return math.ceil(shape[dim] / shard) * math.prod(shape) // shape[dim]


def gradient_itemsize(itemsize: int, working_copy: bool, microbatches: int) -> int:
    """Bytes per element of the gradient of a parameter of ``itemsize`` as the runtime
    accumulates it: bf16 for a parameter read through a bf16 working copy when a step has one
    microbatch, else the parameter's dtype (``moec.runtime.working_weights.gradient_dtype``)."""
    return torch.bfloat16.itemsize if working_copy and microbatches == 1 else itemsize


UnitSizes = list[int]
"""An FSDP unit's [unsharded parameters, their gradients, float32 reduce-scatter input] bytes."""


def gathered_peak(
    root: UnitSizes, groups: list[UnitSizes], experts: list[UnitSizes], microbatches: int
) -> int:
    """Peak bytes of FSDP's unsharded parameters and gradients during a step, from its units:
    the ``root`` (the sharded parameters of no group) for the whole step, two block ``groups``
    and two expert units at a time, the largest; with several microbatches every unit's float32
    gradients are kept between microbatches (the module docstring)."""
    groups, experts = groups or [[0, 0, 0]], experts or [[0, 0, 0]]
    if microbatches > 1:
        kept = root[2] + sum(g[2] for g in groups + experts)
        running = max(g[0] + g[1] for g in groups) + max(g[0] + g[1] for g in experts)
        return root[0] + root[1] + kept + 2 * running
    return sum(root) + 2 * (max(sum(g) for g in groups) + max(sum(g) for g in experts))


def _gathered(gm: nn.Module, layout: ShardedDataParallel, microbatches: int) -> int:
    """Peak bytes of the unsharded parameters and gradients of ``gm``'s sharded parameters
    during a step (see the module docstring)."""
    names, experts = set(layout.params), set(layout.expert_params)
    gather = None if layout.gather_dtype is None else getattr(torch, layout.gather_dtype)
    units: dict[str, list[int]] = {}  # group path ("": the root) -> [params, grads, grads_f32]
    for name, param in gm.named_parameters():
        if name not in names | experts:
            continue
        if name in experts:
            group = next(g for g in layout.expert_groups if under(name, g))
            padded = shard_numel(param.shape, layout.expert_shard, 1) * layout.expert_shard
        else:
            group = next((g for g in layout.groups if under(name, g)), "")
            padded = shard_numel(param.shape, layout.shard) * layout.shard
        itemsize = (gather or param.dtype).itemsize
        sizes = units.setdefault(group, [0, 0, 0])
        sizes[0] += padded * itemsize
        if param.requires_grad:
            sizes[1] += padded * itemsize
            sizes[2] += padded * REDUCE_DTYPE.itemsize
    root = units.pop("", [0, 0, 0])
    expert_units = [units.pop(g) for g in layout.expert_groups if g in units]
    return gathered_peak(root, list(units.values()), expert_units, microbatches)


def _held_graphs(program: Program, pp_rank: int) -> list[nn.Module]:
    if program.pipeline is None:
        return [program.graph]
    return [program.pipeline.stages[s].graph for s in program.pipeline.local_stages(pp_rank)]


def _activations(program: Program, pp_rank: int, batch: int, seq: int) -> int:
    if program.pipeline is None:
        return graph_cost(program).evaluate(batch=batch, seq=seq).saved_bytes
    # the stage table is at the captured example's sizes: scale by the tokens per microbatch
    example = graph_cost(program).evaluate()
    scale = batch * seq / max(example.tokens, 1)
    split = program.pipeline
    return max(
        round(split.info[s].peak_activation_bytes * scale) for s in split.local_stages(pp_rank)
    )


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _has(gm: nn.Module, buffer: str) -> bool:
    try:
        gm.get_buffer(buffer)
    except AttributeError:
        return False
    return True


def format_rank_memory(memory: RankMemory, device_bytes: int | None = None) -> str:
    """A small table (GiB), with the device's memory and whether it fits when given."""
    lines = [f"{what:<15} {size / GIB:>9.3f} GiB" for what, size in memory.rows()]
    if device_bytes is not None:
        verdict = "fits" if memory.total <= device_bytes else "does NOT fit"
        lines.append(f"{'device':<15} {device_bytes / GIB:>9.3f} GiB ({verdict})")
    return "\n".join(lines)
