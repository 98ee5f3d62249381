"""PNG plots written at the end of a training run: loss, throughput, expert-load heatmap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moec.runtime.run_files import replacing


def write_plots(
    out: Path, history: list[dict[str, Any]], routing: dict[str, dict[str, Any]]
) -> list[Path]:
    """Write ``loss.png``, ``throughput.png`` and ``expert_load.png``; [] without matplotlib."""
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
        ax.plot(steps, [r[key] for r in history], marker=".")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        _save(fig, out / name)
        plt.close(fig)
        written.append(out / name)
    if routing:
        loads = [s["expert_load"] for s in routing.values()]
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


def _save(fig: Any, path: Path) -> None:
    """``fig`` as a PNG at ``path``, replacing (never following) a link there."""
    with replacing(path) as partial:
        fig.savefig(partial, format="png", dpi=100)
