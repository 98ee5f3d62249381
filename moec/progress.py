"""The terminal progress bar of training runs (rich): the step, the loss, the eval loss, the
throughput so far (the summary's figure, labelled as the summary labels it: the task's
``tps_label``), drops and imbalance."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from moec.runtime.metrics import throughput_label


@contextlib.contextmanager
def training_progress() -> Iterator[tuple[Progress, Console]]:
    console = Console()
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss [cyan]{task.fields[loss]}"),
        TextColumn("eval [magenta]{task.fields[eval]}"),
        TextColumn("{task.fields[tps_label]} [green]{task.fields[tps]}"),
        TextColumn("drop {task.fields[drop]}"),
        TextColumn("imbalance {task.fields[imb]}"),
        TimeRemainingColumn(),
    )
    progress = Progress(*columns, console=console)
    defaults = {
        "loss": "-",
        "eval": "-",
        "tps": "-",
        "tps_label": throughput_label(gpu=False),
        "drop": "-",
        "imb": "-",
    }
    add_task = progress.add_task
    progress.add_task = lambda *a, **kw: add_task(*a, **{**defaults, **kw})  # type: ignore[method-assign]
    with progress:
        yield progress, console
