"""What the ``pipeline`` pass emits: the stage graphs, their placement and their cost table.

:class:`PipelineSplit` (stored as ``gm.meta["moec_pipeline"]``) holds ``pp * v`` stage graphs
and one :class:`StageInfo` each: the rank that runs it, its blocks, the values it receives and
sends, and the predicted forward FLOPs and activation memory that balanced it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx

from moec.analysis.cost import format_count
from moec.errors import MoecError


class PipelinePassError(MoecError, RuntimeError):
    """The graph cannot be split; the message names the node or parameter that stopped it."""


@dataclasses.dataclass
class StageInfo:
    index: int
    rank: int
    """Pipeline rank holding the stage (loop placement, or V-shaped for zbv/dualpipev)."""
    blocks: list[str]
    """Module paths of the blocks in this stage."""
    inputs: list[str]
    """Names (in the full graph) of the values the stage receives."""
    outputs: list[str]
    """Names of the values it sends on (the last stage: the user outputs)."""
    aux_outputs: list[tuple[str, str]]
    flops: int
    saved_bytes: int
    """Activation bytes kept per microbatch between its forward and backward (a recompute
    region keeps its inputs)."""
    transient_bytes: int
    """Bytes live only while one block is recomputed in backward (recompute regions), else 0."""
    in_flight: int
    """Microbatches whose activations the stage holds at its peak under the schedule."""
    params: int

    @property
    def peak_activation_bytes(self) -> int:
        return self.in_flight * self.saved_bytes + self.transient_bytes


@dataclasses.dataclass
class PipelineSplit:
    """What the runtime needs: the stage graphs and their placement."""

    stages: list[fx.GraphModule]
    info: list[StageInfo]
    pp: int
    virtual_stages: int
    schedule: str
    microbatches: int
    freed: dict[str, int] | None = None
    """Set by the runtime once this rank keeps only its own stages' parameters: the name and
    stage of every parameter it freed. None while every stage's parameters are present."""

    def local_stages(self, pp_rank: int) -> list[int]:
        """Stage indices held by ``pp_rank``, in increasing order."""
        return [s.index for s in self.info if s.rank == pp_rank]


def stage_row(s: StageInfo) -> dict[str, Any]:
    """One stage's row of the pass's ``stage_table`` statistic."""
    return {
        "stage": s.index,
        "rank": s.rank,
        "blocks": f"{s.blocks[0]}..{s.blocks[-1]}" if len(s.blocks) > 1 else s.blocks[0],
        "flops": s.flops,
        "saved_bytes_per_mb": s.saved_bytes,
        "in_flight": s.in_flight,
        "peak_activation_bytes": s.peak_activation_bytes,
        "params": s.params,
    }


def format_stage_table(split: PipelineSplit) -> str:
    """The stage cost table as aligned text (``moec debug`` prints the stats' rows)."""
    head = f"{'stage':>5} {'rank':>4} {'blocks':<24} {'flops':>8} {'saved/mb':>9} {'in-flt':>6} "
    lines = [head + f"{'peak act':>9} {'params':>8}"]
    for s in split.info:
        row = stage_row(s)
        lines.append(
            f"{s.index:>5} {s.rank:>4} {row['blocks']:<24} {format_count(s.flops):>8} "
            f"{format_count(s.saved_bytes):>9} {s.in_flight:>6} "
            f"{format_count(s.peak_activation_bytes):>9} {format_count(s.params):>8}"
        )
    return "\n".join(lines)
