"""PNG plots written at the end of a training run: every step's loss (and the held-out eval loss
where the run evaluated) above every step's learning rate, throughput (each log window's, and
the summary's over the steady steps; per GPU on GPUs only), balance (the load-balancing loss
and each block's MaxVio against the step), expert-load heatmap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moec.runtime.metrics import THROUGHPUT, throughput_label
from moec.runtime.run_files import replacing
from moec.train.summary import block_name


def write_plots(
    out: Path,
    history: list[dict[str, Any]],
    routing: dict[str, dict[str, Any]],
    summary: dict[str, Any] | None = None,
    device: torch.device | str = "cpu",
) -> list[Path]:
    """Write ``loss.png``, ``throughput.png``, ``balance.png`` (with MoE blocks) and
    ``expert_load.png`` (the last step's load summed over its microbatches and ranks, or the
    last forward's where no step finished) from the ``metrics.jsonl`` records ``history`` (and
    the run's ``summary``, for its throughput); [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = [
        _loss(plt, out / "loss.png", history),
        _throughput(plt, out / "throughput.png", history, summary or {}, device),
    ]
    if routing:
        written.append(_balance(plt, out / "balance.png", history, list(routing)))
        loads = [s.get("step_load") or s["expert_load"] for s in routing.values()]
        shares = [[c / max(sum(row), 1) for c in row] for row in loads]
        fig, ax = plt.subplots(figsize=(6, 0.6 * len(loads) + 1.5))
        image = ax.imshow(shares, aspect="auto", cmap="viridis")
        ax.set_yticks(range(len(loads)), [block_name(p) for p in routing], fontsize=7)
        ax.set_xlabel("expert")
        ax.set_title("share of routes per expert (last step)")
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        _save(fig, out / "expert_load.png")
        plt.close(fig)
        written.append(out / "expert_load.png")
    return written


def per_step(history: list[dict[str, Any]], key: str, window_key: str) -> list[tuple[int, float]]:
    """(step, value) of every step the records cover: a record's ``window_key`` list holds its
    window's values, first step first, ending at its ``step``; a record without one (written
    before moec kept them) gives its ``key`` at its step."""
    points = []
    for r in history:
        values = r.get(window_key)
        if values is None:
            values = [r[key]] if r.get(key) is not None else []
        first = r["step"] - len(values) + 1
        points += [(first + i, v) for i, v in enumerate(values)]
    return points


def _loss(plt: Any, path: Path, history: list[dict[str, Any]]) -> Path:
    """Every step's training loss (and the eval loss) above every step's learning rate."""
    fig, (loss, lr) = plt.subplots(
        2, 1, figsize=(6, 5), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    points = per_step(history, "loss", "step_losses")
    loss.plot([s for s, _ in points], [v for _, v in points], linewidth=0.8, label="training loss")
    loss.set_ylabel("training loss")
    _eval_curve(loss, history)
    rates = per_step(history, "lr", "step_lrs")
    lr.plot([s for s, _ in rates], [v for _, v in rates], color="tab:green")
    lr.set_ylabel("learning rate")
    lr.set_xlabel("step")
    for ax in (loss, lr):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def _throughput(
    plt: Any,
    path: Path,
    history: list[dict[str, Any]],
    summary: dict[str, Any],
    device: torch.device | str,
) -> Path:
    """Each log window's throughput and the summary's (the steady steps'), labelled as the
    progress line and the summary label it."""
    label = throughput_label(torch.device(device).type == "cuda")
    points = [(r["step"], r[THROUGHPUT]) for r in history if r.get(THROUGHPUT) is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in points], [v for _, v in points], marker=".", label="log window")
    if summary.get(THROUGHPUT):
        ax.axhline(
            summary[THROUGHPUT],
            color="tab:gray",
            linestyle="--",
            label=f"run ({summary.get('throughput_from', 'summary')})",
        )
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def _eval_curve(ax: Any, history: list[dict[str, Any]]) -> None:
    """The held-out eval loss of the eval points (``eval_loss``) beside the training loss,
    where the run evaluated."""
    points = [(r["step"], r["eval_loss"]) for r in history if r.get("eval_loss") is not None]
    if not points:
        return
    ax.plot([s for s, _ in points], [v for _, v in points], marker="o", label="eval loss")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)


def _save(fig: Any, path: Path) -> None:
    """``fig`` as a PNG at ``path``, replacing (never following) a link there."""
    with replacing(path) as partial:
        fig.savefig(partial, format="png", dpi=100)


def _balance(plt: Any, path: Path, history: list[dict[str, Any]], blocks: list[str]) -> Path:
    """The load-balancing loss (mean over blocks) and each block's MaxVio against the step."""
    fig, (lbl, vio) = plt.subplots(2, 1, figsize=(6, 5.5), sharex=True)
    points = [r for r in history if r.get("lbl") is not None]
    lbl.plot([r["step"] for r in points], [r["lbl"] for r in points], marker=".")
    lbl.set_ylabel("load-balancing loss")
    for block in blocks:
        values = [
            (r["step"], v)
            for r in history
            if (v := r.get("routing", {}).get(block, {}).get("max_vio")) is not None
        ]
        vio.plot(
            [s for s, _ in values], [v for _, v in values], marker=".", label=block_name(block)
        )
    vio.set_ylabel("MaxVio (step, all ranks)")
    vio.set_xlabel("step")
    if len(blocks) <= 12:
        vio.legend(fontsize=6)
    for ax in (lbl, vio):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path
