"""Pipelined plans train through the Trainer's one step (issue 51, item 1): a PP = 2 job on CPU
gloo logs the losses of the same plan at PP = 1 (float32, every logged step), resumes from its
checkpoint and continues equal, its checkpoint resumes at PP = 1, and its held-out eval loss is
the single process's; ``moec train`` under torchrun runs ``dp x pp`` processes and trains the
example PP plan."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moec.plan import Plan
from moec.train import TrainConfig, Trainer
from tests.distributed import free_port, spawn
from tests.models import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
MOE = {"num_experts": 4, "top_k": 2, "init": "random", "capacity_factor": None, "dense_first": 1}
"""Dropless: every layout keeps the same routes."""
STEPS, HALF = 6, 3
RTOL = 1e-5
"""fp32: the pipelined step sums the same terms in another order."""


def _plan(pp: int, schedule: str = "1f1b") -> dict:
    virtual = 2 if schedule in ("interleaved_1f1b", "zbv", "dualpipev") else 1
    parallel = {"pp": pp, "microbatches": 4}
    if pp > 1:
        parallel |= {"pp_schedule": schedule, "virtual_stages": virtual}
    return {"moe": MOE, "parallel": parallel}


def _cfg(out: Path, **kw) -> TrainConfig:
    base = dict(
        steps=STEPS,
        batch_size=8,
        seq_len=16,
        lr=3e-3,
        warmup_steps=2,
        log_every=1,
        grad_clip=0.5,
        out=str(out),
        plots=False,
        device="cpu",
    )
    return TrainConfig(**{**base, **kw})


def _train(plan: dict, out: Path, **kw) -> list[float]:
    torch.manual_seed(0)  # the same model on every rank and in every layout
    return Trainer(tiny_llama(4), Plan.from_dict(plan), _cfg(out, **kw)).run().losses


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _pp_worker(rank: int, world: int, plan: dict, out: str, kw: dict) -> None:
    _train(plan, Path(out), **kw)


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in _records(out)]


def test_pp2_trains_resumes_and_reshards_as_pp1(tmp_path):
    """PP = 2 (1F1B) logs every step's loss of PP = 1; resumed from its checkpoint of step 3 it
    logs the uninterrupted run's next losses, at PP = 2 and at PP = 1; PP = 1's checkpoint
    resumes at PP = 2 alike."""
    flat = tmp_path / "pp1"
    want = _train(_plan(1), flat, checkpoint_every=HALF)
    assert want[-1] < want[0], want

    piped = tmp_path / "pp2"
    spawn(_pp_worker, 2, _plan(2), str(piped), {"checkpoint_every": HALF})
    torch.testing.assert_close(_losses(piped), want, rtol=RTOL, atol=0)
    summary = json.loads((piped / "summary.json").read_text())
    assert summary["first_loss"] == _losses(piped)[0] and summary["steps"] == STEPS

    for source, pp, where in (
        (piped, 2, "pp2_to_pp2"),
        (piped, 1, "pp2_to_pp1"),
        (flat, 2, "pp1_to_pp2"),
    ):
        out = tmp_path / where
        _copy_run(source, out, HALF)
        if pp == 1:
            got = _train(_plan(1), out, resume=True)
        else:
            spawn(_pp_worker, 2, _plan(2), str(out), {"resume": True})
            got = _losses(out)[HALF:]
        torch.testing.assert_close(
            got, want[HALF:], rtol=RTOL, atol=0, msg=lambda m, w=where: f"{w}: {m}"
        )
        assert [r["step"] for r in _records(out)] == list(range(1, STEPS + 1)), where


def _copy_run(source: Path, out: Path, step: int) -> None:
    """``source``'s run folder as it was after ``step``: its checkpoint of that step alone and
    the metrics before it."""
    out.mkdir()
    shutil.copy(source / "run.json", out / "run.json")
    (out / "checkpoints").mkdir()
    shutil.copytree(source / "checkpoints" / f"step_{step}", out / "checkpoints" / f"step_{step}")
    lines = (source / "metrics.jsonl").read_text().splitlines()[:step]
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
