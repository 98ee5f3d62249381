"""The training loop around a trainer (:class:`~moec.train.trainer.Trainer`, which it knows
only as :class:`LoopTrainer`): log points (the one host read per window; under PP also the one
collective that brings the last stage's losses and every stage's routing statistics to rank
0), held-out evaluation (every ``eval_every`` steps and at the last, each a log point too:
:mod:`moec.train.evaluation`), metrics, throughput and summary, the non-finite stop, the
router-collapse watch, checkpoints on schedule.

Throughput (:func:`moec.runtime.metrics.tokens_per_s`, one definition everywhere) counts each
step's own tokens (its global batch under batch-size warmup, divided by the data-parallel ranks:
the tokens of this rank) over the steps' own time: checkpoint writes and evaluations are timed
apart (:mod:`moec.train.timing`) and reported as ``checkpoint_s`` and ``eval_s``. Each
``metrics.jsonl`` record has it over its log window; the summary over the steady steps (after
the warmup steps) up to the last log point, which is also what the progress line shows at
each log point, so its last figure is the summary's.

Every step's loss stays on the device, with the window's others, until the log point reads
them in one go; the record carries them (``step_losses``) with the learning rate of each step
(``step_lrs``), first step first."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from moec.data import Prefetcher
from moec.errors import MoecError
from moec.plan import Plan
from moec.runtime.compiled import CompiledModel
from moec.runtime.metrics import (
    THROUGHPUT,
    bf16_peak_tflops,
    count_host_syncs,
    throughput_label,
    tokens_per_s,
    useful_mfu,
)
from moec.runtime.profiling import ProfileWindow, StepProfiler
from moec.runtime.step_graph import StepGraph
from moec.train.config import TrainConfig
from moec.train.routing_health import CollapseWatch
from moec.train.timing import NonStepTime, StepClock, format_first_step, wait_for_device


class NonFiniteError(MoecError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


@dataclasses.dataclass
class TrainResult:
    losses: list[float]
    """Loss of every step this call ran (read at log points, so available for every step)."""
    summary: dict[str, Any]
    compiled: CompiledModel
    out: Path
    written: list[Path] = dataclasses.field(default_factory=list)
    """The files and checkpoints this call wrote."""
    routing: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Every MoE block's routing statistics at the last log point (under PP, every stage's)."""
    finished: bool = False
    """The run had already reached ``steps``: nothing was trained or written."""


class LoopTrainer(Protocol):
    """What the loop drives (:class:`moec.train.trainer.Trainer` is one): the step, the run's
    device-side counters, checkpoints, evaluation and the routing statistics a log point
    records."""

    cfg: TrainConfig
    plan: Plan
    compiled: CompiledModel
    device: torch.device
    out: Path
    rank: int
    dp: int
    step: int
    step_graph: StepGraph | None
    scheduler: torch.optim.lr_scheduler.LRScheduler
    evaluator: Callable[[], float] | None
    eval_source: str | None
    batches: Prefetcher
    first_loss: float | None
    skipped_steps: torch.Tensor
    longest_streak: torch.Tensor
    spike_skipped_steps: torch.Tensor
    checkpoint_errors: list[str]
    train_flops_per_token: float
    params: int
    active_params: int

    def train_step(self, eager: bool = False) -> torch.Tensor: ...
    def save_checkpoint(self) -> Any: ...
    def global_batch(self, step: int) -> int: ...
    def logged(self, values: torch.Tensor) -> list[float]: ...
    def routing_stats(self) -> dict[str, dict[str, Any]]: ...
    def _say(self, message: str) -> None: ...


class TrainingLoop:
    """One call's training loop: steps, log points (the host reads), checkpoints, timing."""

    def __init__(self, trainer: LoopTrainer, history: list[dict[str, Any]]):
        self.trainer, self.cfg = trainer, trainer.cfg
        self.history = history
        self.losses: list[float] = []
        self.pending: list[torch.Tensor] = []
        self.start_step = trainer.step
        warmup = self.cfg.warmup_log_steps
        if trainer.step_graph is not None:  # its eager steps and its capture are not steady
            warmup = max(warmup, trainer.step_graph.warmup + 1)
        self.steady_from = self.start_step + warmup
        self.non_step = NonStepTime(trainer.device)
        """Checkpoint writes: timed apart, not step time."""
        self.window = StepClock(self.non_step)
        """The log window's clock: started with the loop, restarted at each log point."""
        self.window_steps = 0
        self.steady: StepClock | None = None
        self.steady_steps = 0
        self.timed_s, self.timed_steps = 0.0, 0
        self.syncs: int | None = None
        self.first_step: dict[str, Any] | None = None
        """The time to this call's first step, by part (:class:`FirstStepClock`)."""
        self.skipped = 0
        self.spike_skipped = 0
        self.longest_streak = 0
        self.window_tokens = 0
        self.steady_tokens = 0
        self.steady_logged: tuple[float, int, int] | None = None
        """(step seconds, steps, tokens) of the steady window at the last log point."""
        self.window_lrs: list[float] = []
        """The learning rate of each step of the log window."""
        self.timed_tokens = 0
        moe = trainer.plan.moe
        self.collapse = CollapseWatch(
            self.cfg.on_router_collapse,
            self.cfg.lr,
            moe.lbl_coef,
            self.cfg.warmup_steps,
            moe.balance,
            moe.bias_update_rate,
        )

    def run(self, log, progress, written: list[Path]) -> None:
        t, cfg = self.trainer, self.cfg
        label = throughput_label(t.device.type == "cuda")
        task = (
            progress.add_task("training", total=cfg.steps, completed=t.step, tps_label=label)
            if progress
            else None
        )
        profiler = self._profiler()
        try:
            t.startup.step_starts()
            while t.step < cfg.steps:
                with profiler.step(t.step) if profiler else contextlib.nullcontext():
                    self._step(eager=profiler is not None and profiler.active)
                if self.first_step is None:
                    self.first_step = t.startup.finish()
                    t._say(format_first_step(self.first_step))
                self._after_step(log, progress, task, written)
        finally:
            if profiler is not None:
                written += profiler.close()

    def _profiler(self) -> StepProfiler | None:
        """The ``--profile`` window's profiler (None without one)."""
        t, cfg = self.trainer, self.cfg
        if not cfg.profile:
            return None
        window = ProfileWindow.parse(cfg.profile)
        window.check(cfg.steps, first_step=t.step)
        return StepProfiler(
            window, t.compiled, t.out / "profile", rank=t.rank, device=t.device, say=t._say
        )

    def _step(self, eager: bool) -> None:
        """One step; ``eager`` inside a profile window (no replayed CUDA graph)."""
        t = self.trainer
        self.window_lrs.append(t.scheduler.get_last_lr()[0])  # the rate this step trains at
        if t.step == self.steady_from and self.syncs is None:
            self.syncs = count_host_syncs(
                lambda: self.pending.append(t.train_step(eager)), t.device
            )
        else:
            self.pending.append(t.train_step(eager))

    def _after_step(self, log, progress, task, written: list[Path]) -> None:
        """Token and timing bookkeeping, the log point and the checkpoint after a step."""
        t, cfg = self.trainer, self.cfg
        tokens = self.tokens_of(t.step - 1)
        self.window_tokens += tokens
        self.window_steps += 1
        if t.step == self.steady_from:
            wait_for_device(t.device)
            self.steady, self.steady_steps, self.steady_tokens = StepClock(self.non_step), 0, 0
        elif self.steady is not None:
            self.steady_steps += 1
            self.steady_tokens += tokens
        done = t.step == cfg.steps
        evaluate = t.evaluator is not None and (t.step % cfg.eval_every == 0 or done)
        if t.step % cfg.log_every == 0 or done or evaluate:
            eval_loss = None
            if evaluate:  # before the window's clock is read: its time is not step time
                with self.non_step.timed("eval"):
                    eval_loss = t.evaluator()
            window = self.window_steps
            step_s = self.window.step_seconds()
            record = self._log_point(step_s / window, window)
            if evaluate:
                record["eval_loss"] = eval_loss
            record.update(self.non_step.fields(self.window.non_step_seconds()))
            self.timed_s += step_s
            self.timed_steps += window
            self.timed_tokens += self.window_tokens
            self.window, self.window_steps, self.window_tokens = StepClock(self.non_step), 0, 0
            self._log_steady()
            log.write(json.dumps(record) + "\n")
            log.flush()
            self._check_nonfinite()
            collapse = self.collapse.observe(t.step, window, record["routing"])
            if collapse:
                t._say(f"warning: {collapse}")
            if progress:
                so_far = self._throughput()["tokens_per_s"]
                progress.update(task, completed=t.step, **_progress_fields(record, so_far))
        if (cfg.checkpoint_every and t.step % cfg.checkpoint_every == 0) or done:
            with self.non_step.timed("checkpoint"):
                if t.first_loss is None:  # saved with the checkpoint: read before a log point
                    t.first_loss = t.logged(self.pending[0].float().reshape(1).clone())[0]
                committed = t.save_checkpoint()
            if committed is not None and done:
                written.append(committed.path)

    def tokens_of(self, step: int) -> float:
        """Tokens this rank trains on in step ``step``: its data-parallel rank's, shared by the
        ranks of its pipeline under PP."""
        t = self.trainer
        return t.global_batch(step) // t.dp * self.cfg.seq_len / t.plan.parallel.pp

    def _log_point(self, step_time: float, steps: int) -> dict[str, Any]:
        """Read the window's losses and the skip counters (the one host read per log window)
        and build the record."""
        t = self.trainer
        counters = torch.stack([t.skipped_steps, t.longest_streak, t.spike_skipped_steps])
        values = t.logged(torch.cat([torch.stack(self.pending).float(), counters.float()]))
        losses, (skipped, longest, spikes) = values[:-3], values[-3:]
        self.pending.clear()
        lrs, self.window_lrs = self.window_lrs, []
        if t.first_loss is None:
            t.first_loss = losses[0]
        self.losses += losses
        self.skipped, self.spike_skipped = int(skipped), int(spikes)
        tokens = self.window_tokens / steps  # the window's mean tokens per step
        record = self._record(losses[-1], step_time, tokens)
        record.update(step_losses=losses, step_lrs=lrs)
        self.history.append(record)
        self.longest_streak = int(longest)
        return record

    def _record(self, loss: float, step_time: float, tokens: float) -> dict[str, Any]:
        """The metrics record of a log point: the window's last ``loss``, its mean
        ``step_time`` and ``tokens`` per step, the skip counters just read, and every MoE
        block's routing statistics (the trainer's, under PP gathered from every stage)."""
        t = self.trainer
        routing = t.routing_stats()
        layers = list(routing.values())
        peak = bf16_peak_tflops(t.device)
        mfu = useful_mfu(t.train_flops_per_token * tokens, step_time, 1, peak)
        cuda = t.device.type == "cuda"
        return {
            "step": t.step,
            "loss": loss,
            "lr": t.scheduler.get_last_lr()[0],
            "step_time_s": step_time,
            THROUGHPUT: tokens_per_s(tokens, step_time),
            "useful_mfu": mfu,
            "skipped_steps": self.skipped,
            "spike_skipped_steps": self.spike_skipped,
            "global_batch": t.global_batch(t.step - 1),
            "drop_rate": mean_of(layer["drop_rate"] for layer in layers),
            "load_imbalance": max((layer["load_imbalance"] for layer in layers), default=None),
            "capacity_use": mean_of(layer["capacity_use"] for layer in layers),
            "lbl": mean_of(layer["lbl"] for layer in layers),
            "max_vio": max_vio(layers),
            "host_syncs_per_step": self.syncs,
            "data_stalls": t.batches.stalls,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(t.device) if cuda else None,
            "routing": {path: dict(stats) for path, stats in routing.items()},
        }

    def _check_nonfinite(self) -> None:
        t = self.trainer
        longest = self.longest_streak
        if longest >= self.cfg.max_nonfinite_steps:
            raise NonFiniteError(
                f"{int(longest)} consecutive steps had a non-finite loss or gradient norm "
                f"(skipped; by step {t.step}, {self.skipped} skipped in all), "
                f"TrainConfig.max_nonfinite_steps = {self.cfg.max_nonfinite_steps}: the run "
                "stopped. Lower the learning rate, check the data and the model's numerics, or "
                "resume from an earlier checkpoint"
            )

    def summary(self, error: str | None = None) -> dict[str, Any]:
        t = self.trainer
        throughput = self._throughput()
        peak = bf16_peak_tflops(t.device)
        step_time = throughput["step_time_s"]
        summary = {
            "plan": t.compiled.program.pass_pipeline,
            "device": torch.cuda.get_device_name(t.device) if t.device.type == "cuda" else "cpu",
            "steps": t.step,
            "first_loss": t.first_loss,
            "final_loss": self.losses[-1] if self.losses else None,
            "skipped_steps": self.skipped,
            "spike_skipped_steps": self.spike_skipped,
            "steady_step_time_s": step_time,
            THROUGHPUT: throughput["tokens_per_s"],
            "throughput_from": throughput["source"],
            "useful_mfu": useful_mfu(
                t.train_flops_per_token * throughput["tokens_per_step"], step_time or 0, 1, peak
            )
            if step_time
            else None,
            "bf16_peak_tflops": peak if peak else "unknown for this device",
            "train_flops_per_token": t.train_flops_per_token,
            "params": t.params,
            "active_params": t.active_params,
            "host_syncs_per_step": self.syncs,
            "first_step_s": None if self.first_step is None else self.first_step["total_s"],
            "first_step": self.first_step,
            "data_stalls": t.batches.stalls,
            "checkpoint_errors": t.checkpoint_errors,
            **self.non_step.fields(),
            "router_collapse": dict(self.collapse.collapsed),
            **self._balance(),
            **self._evaluation(),
        }
        if error is not None:
            summary["error"] = error
        return summary

    def _balance(self) -> dict[str, Any]:
        """The routers' balance at the last log point: the method, the LBL (mean over blocks),
        MaxVio (the worst block's) and MaxVio per block."""
        last = self.history[-1] if self.history else {}
        return {
            "balance": self.trainer.plan.moe.balance,
            "lbl": last.get("lbl"),
            "max_vio": last.get("max_vio"),
            "max_vio_by_block": {p: s["max_vio"] for p, s in last.get("routing", {}).items()},
        }

    def _evaluation(self) -> dict[str, Any]:
        """The held-out evaluation over the whole run (a resumed run's earlier records
        included): the eval data, the last and the best eval loss with their steps (None
        without one); its seconds are ``eval_s``."""
        points = [(r["step"], r["eval_loss"]) for r in self.history if "eval_loss" in r]
        last = points[-1] if points else (None, None)
        finite = [p for p in points if math.isfinite(p[1])]
        best = min(finite, key=lambda p: p[1]) if finite else (None, None)
        return {
            "eval_data": self.trainer.eval_source,
            "eval_loss": last[1],
            "eval_step": last[0],
            "best_eval_loss": best[1],
            "best_eval_step": best[0],
        }

    def _log_steady(self) -> None:
        """Take the steady window's time, steps and tokens at a log point (where the host has
        just read the device)."""
        if self.steady is None or self.steady_steps == 0:
            return
        wait_for_device(self.trainer.device)
        self.steady_logged = (self.steady.step_seconds(), self.steady_steps, self.steady_tokens)

    def _throughput(self) -> dict[str, Any]:
        """Steady-state step time up to the last log point where this call ran past its warmup
        steps by then; else the mean over every step it timed (a short resumed run), saying
        which. Both count the steps alone: checkpoint writes are timed apart
        (``checkpoint_s``)."""
        if self.steady_logged is not None:
            seconds, steps, tokens_in_all = self.steady_logged
            step_time = seconds / steps
            tokens = tokens_in_all / steps
            source = f"{steps} steady steps (after {self.cfg.warmup_log_steps} warmup)"
        elif self.timed_steps:
            step_time = self.timed_s / self.timed_steps
            tokens = self.timed_tokens / self.timed_steps
            source = f"all {self.timed_steps} steps of this call (too few for a steady window)"
        else:
            return {
                "step_time_s": None,
                "tokens_per_s": None,
                "tokens_per_step": 0,
                "source": "no step was timed",
            }
        return {
            "step_time_s": step_time,
            "tokens_per_s": tokens_per_s(tokens, step_time),
            "tokens_per_step": tokens,
            "source": source,
        }


def mean_of(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def max_vio(layers: list[dict[str, Any]]) -> float | None:
    """The worst block's MaxVio of the last finished step (None without one)."""
    return max((v for layer in layers if (v := layer["max_vio"]) is not None), default=None)


def _progress_fields(record: dict[str, Any], throughput: float | None) -> dict[str, str]:
    """The progress line's fields at the log point of ``record``, with the throughput so far
    (the summary's); ``eval`` only at eval points (the line keeps the last)."""
    drop = record["drop_rate"]
    evaluated = {"eval": f"{record['eval_loss']:.3f}"} if "eval_loss" in record else {}
    return {
        **evaluated,
        "loss": f"{record['loss']:.3f}",
        "tps": "-" if throughput is None else f"{throughput:,.0f}",
        "drop": "-" if drop is None else f"{100 * drop:.1f}%",
        "imb": "-" if record["load_imbalance"] is None else f"{record['load_imbalance']:.2f}",
    }
