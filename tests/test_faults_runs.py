"""Issue 49's run-folder cases, played as a user would meet them: two runs into one folder, a
stale lock left by kill -9, summaries that count checkpoint writes as step time, a resume that
extends a finished run's learning-rate schedule."""

from __future__ import annotations

import json
import time

from moec.plan import Plan
from moec.train import Trainer, train
from moec.train.cli import print_summary
from tests.test_run_reliability import PLAN, _cfg, _metrics, tiny_llama

# --- honest summaries ---------------------------------------------------------------------------


class _Clock:
    """``time.perf_counter`` that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_checkpoint_writes_are_reported_apart_from_step_time(tmp_path, monkeypatch, capsys):
    """Every step takes 1 s and every checkpoint write 100 s on the test's clock: step time is
    1 s in every log window and in the steady window (the final write included), and the
    writes are reported as ``checkpoint_s`` where they happened."""
    trainer = Trainer(
        tiny_llama(),
        Plan.from_dict(PLAN),
        _cfg(tmp_path, steps=10, checkpoint_every=4, log_every=2),
    )
    clock = _Clock()
    step, save = trainer.train_step, trainer.save_checkpoint
    monkeypatch.setattr(trainer, "train_step", lambda eager=False: _tick(clock, 1.0, step, eager))
    monkeypatch.setattr(trainer, "save_checkpoint", lambda: _tick(clock, 100.0, save))
    monkeypatch.setattr(time, "perf_counter", clock)
    result = trainer.run()
    records = _metrics(tmp_path)
    tokens = 4 * 16  # batch x sequence per step
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10]
    assert all(r["step_time_s"] == 1.0 and r["tokens_per_s_per_gpu"] == tokens for r in records)
    # the writes after steps 4 and 8 fall in the windows that follow; the last, after step 10,
    # in no window
    assert [r["checkpoint_s"] for r in records] == [0.0, 0.0, 100.0, 0.0, 100.0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == result.summary
    assert summary["steady_step_time_s"] == 1.0
    assert summary["tokens_per_s_per_gpu"] == tokens
    assert summary["checkpoint_s"] == 300.0
    capsys.readouterr()
    print_summary(result)
    closing = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert "checkpoint writes 300.0 s (not counted as step time)" in closing


def test_a_short_resumed_run_times_its_steps_without_its_checkpoints(tmp_path, monkeypatch):
    """Too few steps for a steady window: the mean over the timed steps leaves the checkpoint
    writes out as well."""
    train(tiny_llama(), PLAN, _cfg(tmp_path, steps=3))
    cfg = _cfg(tmp_path, steps=5, checkpoint_every=1, resume=True)
    trainer = Trainer(tiny_llama(), Plan.from_dict(PLAN), cfg)
    clock = _Clock()
    step, save = trainer.train_step, trainer.save_checkpoint
    monkeypatch.setattr(trainer, "train_step", lambda eager=False: _tick(clock, 2.0, step, eager))
    monkeypatch.setattr(trainer, "save_checkpoint", lambda: _tick(clock, 50.0, save))
    monkeypatch.setattr(time, "perf_counter", clock)
    summary = trainer.run().summary
    assert [(r["step_time_s"], r["checkpoint_s"]) for r in _metrics(tmp_path)[3:]] == [
        (2.0, 0.0),
        (2.0, 50.0),
    ]
    assert "too few" in summary["throughput_from"]
    assert summary["steady_step_time_s"] == 2.0 and summary["checkpoint_s"] == 100.0


def _tick(clock: _Clock, seconds: float, call, *args):
    """``call(*args)``, ``seconds`` later on ``clock``."""
    clock.now += seconds
    return call(*args)
