"""The ``pipeline`` pass's stage cost table (its ``stage_table`` statistic, and as text).

:class:`moec.program.Pipeline` (the program's ``pipeline``) holds ``pp * v`` stage programs
and one :class:`~moec.program.StageInfo` each: the rank that runs it, its blocks, the values it
receives and sends, and the predicted forward FLOPs and activation memory that balanced it.
"""

from __future__ import annotations

from typing import Any

from moec.analysis.cost import format_count
from moec.program import Pipeline, StageInfo


def stage_row(s: StageInfo) -> dict[str, Any]:
    """One stage's row of the pass's ``stage_table`` statistic."""
    return {
        "stage": s.index,
        "rank": s.rank,
        "blocks": f"{s.blocks[0]}..{s.blocks[-1]}" if len(s.blocks) > 1 else s.blocks[0],
        "flops": s.flops,
        "forward_ms": s.forward_s * 1e3,
        "saved_bytes_per_mb": s.saved_bytes,
        "in_flight": s.in_flight,
        "peak_activation_bytes": s.peak_activation_bytes,
        "params": s.params,
    }


def format_stage_table(split: Pipeline) -> str:
    """The stage cost table as aligned text (``moec debug`` prints the stats' rows)."""
    head = f"{'stage':>5} {'rank':>4} {'units':<44} {'flops':>8} {'fwd ms':>7} {'saved/mb':>9} "
    lines = [head + f"{'in-flt':>6} {'peak act':>9} {'params':>8}"]
    for s in split.info:
        row = stage_row(s)
        lines.append(
            f"{s.index:>5} {s.rank:>4} {row['blocks']:<44} {format_count(s.flops):>8} "
            f"{row['forward_ms']:>7.3g} {format_count(s.saved_bytes):>9} {s.in_flight:>6} "
            f"{format_count(s.peak_activation_bytes):>9} {format_count(s.params):>8}"
        )
    return "\n".join(lines)
