"""What a run shows its user: the end-of-run summary fits 80 columns with block names told apart
and the pass string on its own lines; one throughput figure, named one way, in the progress
line, ``metrics.jsonl``, ``summary.json`` and the plots; every step's loss and learning rate in
the metrics and the loss plot."""

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from moec.plan import Plan
from moec.runtime.metrics import THROUGHPUT, throughput_label
from moec.train import TrainConfig, Trainer
from moec.train.summary import (
    ELLIPSIS,
    block_name,
    elide_middle,
    print_summary,
    routing_table,
    wrap_pipeline,
)
from tests.models import hf_model, tiny_llama

PLAN = {"moe": {"num_experts": 4, "top_k": 2, "init": "random", "dense_first": 0}}


def _cfg(out: Path, **kw) -> TrainConfig:
    base = dict(
        steps=6,
        batch_size=2,
        seq_len=16,
        warmup_steps=2,
        warmup_log_steps=1,
        log_every=2,
        out=str(out),
        plots=False,
        device="cpu",
    )
    return TrainConfig(**{**base, **kw})


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# --- the summary at 80 columns ------------------------------------------------------------------


@pytest.mark.slow
def test_an_hf_models_summary_fits_80_columns_and_tells_its_blocks_apart(tmp_path):
    torch.manual_seed(0)
    result = Trainer(hf_model("llama"), Plan.from_dict(PLAN), _cfg(tmp_path, steps=2)).run()
    console = Console(width=80, file=io.StringIO())
    print_summary(result, console)
    lines = console.file.getvalue().splitlines()
    assert max(map(len, lines)) <= 80, "\n".join(lines)
    assert lines[0].startswith("passes: moe{") and lines[1].startswith(" " * 8)
    rows = [line.split()[0] for line in lines if line.startswith("model.layers.")]
    assert rows == ["model.layers.0.mlp", "model.layers.1.mlp"]  # no doubled "model." prefix
    assert "on cpu: loss" in "\n".join(lines)


def test_the_pass_string_breaks_only_after_its_commas():
    pipeline = (
        "moe{experts=8,top_k=2,init=random,gating=softmax,capacity=1.25,shared=0,"
        "dense_first=1,balance=microbatch,expert_weights=k_major},fused_loss,fuse_rope,fuse_glu"
    )
    lines = wrap_pipeline(pipeline, 80)
    assert len(lines) > 1 and all(len(line) <= 80 for line in lines)
    assert all(line.endswith(",") for line in lines[:-1])
    assert "".join(line[len("passes: ") :] for line in lines) == pipeline


def test_long_block_names_lose_their_middle_and_stay_distinct():
    paths = [
        f"model.model.decoder.transformer_blocks.{i}.feed_forward_network.moe" for i in (9, 10, 11)
    ]
    stats = {
        p: {
            "expert_load": [10, 30, 20, 40],
            "top_k": 2,
            "max_vio": 0.6,
            "drop_rate": 0.157,
            "load_imbalance": 1.6,
            "capacity_use": 0.8,
            "lbl": 1.02,
        }
        for p in paths
    }
    lines = routing_table(stats, 80)
    assert max(map(len, lines)) <= 80, "\n".join(lines)
    names = [line.split()[0] for line in lines[3:]]
    assert len(set(names)) == 3 and all(ELLIPSIS in n for n in names)
    for name, path in zip(names, paths, strict=True):
        assert block_name(path).endswith(name.split(ELLIPSIS)[1])  # the end is kept
    assert [n.split(ELLIPSIS)[1].split(".")[0] for n in names] == ["9", "10", "11"]
    assert elide_middle("abcdefghij", 7) == "ab" + ELLIPSIS + "ghij"
    assert elide_middle("abcdefghij", 7, keep_from=5) == "a" + ELLIPSIS + "fghij"
    assert elide_middle("short", 7) == "short"


# --- one throughput figure, every step's loss and learning rate -----------------------------------


class _Progress:
    """The part of rich's ``Progress`` the training loop uses, recording what it is told."""

    def __init__(self):
        self.fields: dict[str, str] = {}

    def add_task(self, description, **fields):
        self.fields.update({k: str(v) for k, v in fields.items()})
        return 0

    def update(self, task, **fields):
        self.fields.update({k: str(v) for k, v in fields.items()})


def test_the_progress_line_summary_and_metrics_show_one_throughput_named_one_way(tmp_path):
    progress = _Progress()
    torch.manual_seed(0)
    result = Trainer(tiny_llama(2), Plan.from_dict(PLAN), _cfg(tmp_path)).run(progress)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert progress.fields["tps"] == f"{summary[THROUGHPUT]:,.0f}"
    assert progress.fields["tps_label"] == throughput_label(gpu=False) == "tokens/s"
    records = _metrics(tmp_path)
    assert all(r[THROUGHPUT] > 0 for r in records)
    console = Console(width=80, file=io.StringIO())
    print_summary(result, console)
    closing = " ".join(console.file.getvalue().split())
    assert f"{summary[THROUGHPUT]:,.0f} tokens/s (" in closing and "GPU" not in closing


def test_metrics_carry_every_steps_loss_and_learning_rate(tmp_path):
    torch.manual_seed(0)
    trainer = Trainer(tiny_llama(2), Plan.from_dict(PLAN), _cfg(tmp_path, log_every=4))
    result = trainer.run()
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == [4, 6]
    assert [v for r in records for v in r["step_losses"]] == result.losses
    assert [r["step_losses"][-1] for r in records] == [r["loss"] for r in records]
    lrs = [v for r in records for v in r["step_lrs"]]
    schedule = trainer.scheduler.base_lrs[0]
    assert lrs == pytest.approx([schedule * trainer._lr_factor(s) for s in range(6)])
    assert lrs[0] < lrs[1]  # the warmup


def test_the_plots_draw_every_step_and_the_learning_rate_with_the_throughput_label(
    tmp_path, monkeypatch
):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from moec.plots import write_plots

    torch.manual_seed(0)
    result = Trainer(tiny_llama(2), Plan.from_dict(PLAN), _cfg(tmp_path, log_every=3)).run()
    drawn, labels = [], []
    plot, ylabel = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.set_ylabel
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "plot",
        lambda ax, x, y, *a, **k: drawn.append(list(x)) or plot(ax, x, y, *a, **k),
    )
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "set_ylabel",
        lambda ax, s, *a, **k: labels.append(s) or ylabel(ax, s, *a, **k),
    )
    history = _metrics(tmp_path)
    written = write_plots(tmp_path, history, result.compiled.routing_stats(), result.summary)
    assert tmp_path / "loss.png" in written and tmp_path / "throughput.png" in written
    every_step = list(range(1, 7))
    assert drawn.count(every_step) == 2  # the loss and the learning rate, each at every step
    assert {"training loss", "learning rate", "tokens/s"} <= set(labels)
    assert not any("GPU" in label for label in labels)
