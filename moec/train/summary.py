"""The summary ``moec train`` and ``moec demo`` print at the end of a run, laid out for the
terminal's width (80 columns where the output is not a terminal):

- the pass pipeline on lines of its own, broken after its commas;
- the closing sentence (losses, throughput, timings, parameters) wrapped at spaces;
- the routing table, one row per MoE block: the block's path without the loss wrapper's
  prefix, elided in the middle where the table would be too wide: the part from where the
  blocks' paths start to differ (the layer index on) stays whole, with as much of the start as
  fits.
"""

from __future__ import annotations

import os
import textwrap
from typing import TYPE_CHECKING, Any

from moec.runtime.metrics import THROUGHPUT, throughput_label
from moec.train.routing_health import busiest_share

if TYPE_CHECKING:
    from moec.train.loop import TrainResult

WRAPPER_PREFIX = "model."
"""Where :class:`moec.train.LanguageModelWithLoss` holds the user's model: the prefix of every
path in a program ``moec train`` compiled."""

ELLIPSIS = "…"
PIPELINE_LABEL = "passes: "
MIN_NAME_WIDTH = 12
"""The least a block name is cut to, whatever the width."""


def block_name(path: str) -> str:
    """``path`` of an MoE block as the user's model names it: without the loss wrapper's prefix
    and the ``.moe`` the pass adds (``model.model.layers.3.mlp.moe`` -> ``model.layers.3.mlp``)."""
    name = path.removeprefix(WRAPPER_PREFIX)
    return name.removesuffix(".moe") or name


def elide_middle(text: str, width: int, keep_from: int | None = None) -> str:
    """``text`` cut to ``width`` characters by replacing its middle with an ellipsis, keeping
    a third of them from its start and the rest from its end, and less of its start where the
    end from ``keep_from`` on (what tells it from its neighbours) needs the room."""
    if len(text) <= width:
        return text
    keep = width - len(ELLIPSIS)
    head = keep // 3
    if keep_from is not None:
        head = max(0, min(head, keep - (len(text) - keep_from)))
    return f"{text[:head]}{ELLIPSIS}{text[len(text) - (keep - head) :]}"


def distinct_from(names: list[str]) -> int | None:
    """Where the names start to differ: the start of the first dotted part that is not common
    to all of them (None for fewer than two names)."""
    if len(names) < 2:
        return None
    common = os.path.commonprefix(names)
    return common.rfind(".") + 1


def wrap_pipeline(pipeline: str, width: int) -> list[str]:
    """The pass pipeline string as lines of at most ``width`` characters (where no piece is
    longer), ``passes: `` first and the continuation lines indented under it, broken after
    its commas only."""
    pieces = [piece + "," for piece in pipeline.split(",")]
    pieces[-1] = pieces[-1][:-1]
    rows = [""]
    for piece in pieces:
        if rows[-1] and len(PIPELINE_LABEL) + len(rows[-1]) + len(piece) > width:
            rows.append("")
        rows[-1] += piece
    indent = " " * len(PIPELINE_LABEL)
    return [(indent if i else PIPELINE_LABEL) + row for i, row in enumerate(rows)]


def closing_sentence(s: dict[str, Any]) -> str:
    """The run in one sentence: where, losses, eval, throughput, non-step time, parameters."""
    tokens = s.get(THROUGHPUT)
    parts = [
        f"on {s['device']}: loss {s['first_loss']:.3f} -> {s['final_loss']:.3f} in "
        f"{s['steps']} steps"
    ]
    if s.get("eval_loss") is not None and s.get("best_eval_loss") is not None:
        parts.append(
            f"eval loss {s['eval_loss']:.3f} at step {s['eval_step']} (best "
            f"{s['best_eval_loss']:.3f} at step {s['best_eval_step']}; {s['eval_s']:.1f} s, not "
            "counted as step time)"
        )
    if tokens:
        label = throughput_label(s["device"] != "cpu")
        parts.append(f"{tokens:,.0f} {label} ({s['throughput_from']})")
    if s.get("checkpoint_s"):
        parts.append(f"checkpoint writes {s['checkpoint_s']:.1f} s (not counted as step time)")
    if s["skipped_steps"]:
        parts.append(f"{s['skipped_steps']} non-finite steps skipped")
    if s.get("spike_skipped_steps"):
        parts.append(f"{s['spike_skipped_steps']} loss or gradient-norm spikes skipped")
    parts.append(f"{s['active_params']:,} of {s['params']:,} parameters active per token")
    return "; ".join(parts)


HEADERS = (
    ("MoE block", ""),
    ("drop", "rate"),
    ("load", "max/mean"),
    ("top-k share", "(uniform)"),
    ("capacity", "use"),
    ("LBL", ""),
    ("MaxVio", "(step)"),
)
GAP = "  "


def routing_table(stats: dict[str, dict[str, Any]], width: int) -> list[str]:
    """One row per MoE block (see module), every line at most ``width`` characters where the
    numbers leave the names :data:`MIN_NAME_WIDTH` of them."""
    rows = []
    for path, st in stats.items():
        load, k, vio = st["expert_load"], st["top_k"], st["max_vio"]
        rows.append(
            [
                block_name(path),
                f"{100 * st['drop_rate']:.1f}%",
                f"{st['load_imbalance']:.2f}",
                f"{100 * busiest_share(load, k):.0f}% ({100 * k / len(load):.0f}%)",
                f"{100 * st['capacity_use']:.0f}%",
                f"{st['lbl']:.3f}",
                "-" if vio is None else f"{vio:.2f}",
            ]
        )
    widths = [max(len(h[0]), len(h[1]), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADERS)]
    numbers = sum(widths[1:]) + len(GAP) * (len(HEADERS) - 1)
    widths[0] = min(widths[0], max(MIN_NAME_WIDTH, width - numbers))
    keep_from = distinct_from([row[0] for row in rows])
    for row in rows:
        row[0] = elide_middle(row[0], widths[0], keep_from)

    def line(cells) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(w) for cell, w in zip(cells[1:], widths[1:], strict=True))
        return GAP.join([first, *rest]).rstrip()

    header = [line([h[0] for h in HEADERS]), line([h[1] for h in HEADERS])]
    return [*header, "-" * len(header[0]), *(line(r) for r in rows)]


def summary_lines(result: TrainResult, width: int, plots: bool = True) -> list[str]:
    """Every line of the end-of-run summary, laid out for ``width`` columns (see module);
    ``plots``: the run was to write plots (where none were, matplotlib is missing)."""
    s = result.summary
    lines = wrap_pipeline(s["plan"], width)
    lines += textwrap.wrap(closing_sentence(s), width, break_on_hyphens=False)
    stats = result.routing
    if stats:
        lines += routing_table(stats, width)
    names = ", ".join(str(p.relative_to(result.out)) for p in result.written)
    lines += textwrap.wrap(f"wrote in {result.out}: {names}", width, break_on_hyphens=False)
    if plots and result.written and not any(p.suffix == ".png" for p in result.written):
        lines.append("no plots: they need matplotlib (pip install matplotlib)")
    return lines


def print_summary(result: TrainResult, console=None, plots: bool = True) -> None:
    """Print :func:`summary_lines` at the width of ``console`` (default: a rich ``Console``
    on stdout, 80 columns where stdout is not a terminal)."""
    from rich.console import Console

    console = console or Console()
    for line in summary_lines(result, console.width, plots):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
