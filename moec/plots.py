"""PNG plots written at the end of a training run: loss (and the held-out eval loss where the run
evaluated), throughput, balance (the load-balancing loss and each block's MaxVio against the
step), expert-load heatmap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moec.runtime.run_files import replacing


def write_plots(
    out: Path, history: list[dict[str, Any]], routing: dict[str, dict[str, Any]]
) -> list[Path]:
    """Write ``loss.png``, ``throughput.png``, ``balance.png`` (with MoE blocks) and
    ``expert_load.png`` (the last step's load summed over its microbatches and ranks, or the
    last forward's where no step finished); [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    steps = [r["step"] for r in history]
    for name, key, label in (
        ("loss.png", "loss", "training loss"),
        ("throughput.png", "tokens_per_s_per_gpu", "tokens/s/GPU"),
    ):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, [r[key] for r in history], marker=".", label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        if key == "loss":
            _eval_curve(ax, history)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        _save(fig, out / name)
        plt.close(fig)
        written.append(out / name)
    if routing:
        written.append(_balance(plt, out / "balance.png", history, list(routing)))
        loads = [s.get("step_load") or s["expert_load"] for s in routing.values()]
        shares = [[c / max(sum(row), 1) for c in row] for row in loads]
        fig, ax = plt.subplots(figsize=(6, 0.6 * len(loads) + 1.5))
        image = ax.imshow(shares, aspect="auto", cmap="viridis")
        ax.set_yticks(range(len(loads)), list(routing), fontsize=7)
        ax.set_xlabel("expert")
        ax.set_title("share of routes per expert (last step)")
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        _save(fig, out / "expert_load.png")
        plt.close(fig)
        written.append(out / "expert_load.png")
    return written


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
        vio.plot([s for s, _ in values], [v for _, v in values], marker=".", label=block)
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
