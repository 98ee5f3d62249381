"""Pipelined plans train through the Trainer's one step (issue 51, item 1): a PP = 2 job on CPU
gloo logs every loss and held-out eval loss of the same plan at PP = 1 (float32), on rank 0 and
on the last stage's rank alike; resumed from its checkpoint it continues equal, at PP = 2 and at
PP = 1 (and PP = 1's checkpoint at PP = 2); every schedule the installed torch runs trains so,
spike skips decided alike on every rank; ``moec train`` under torchrun runs ``dp x pp``
processes, and trains the example PP plan at its declared size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moec.analysis.pipeline_schedule import SPLIT_BACKWARD, schedule_runs
from moec.plan import Plan
from moec.runtime.distributed import NO_MULTICAST_ENV, TORCHRUN_VARS, DistributedError
from moec.train import TrainConfig, Trainer
from tests.distributed import free_port, spawn
from tests.models import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
MOE = {"num_experts": 4, "top_k": 2, "init": "random", "capacity_factor": None, "dense_first": 1}
"""Dropless: every layout keeps the same routes."""
STEPS, HALF = 6, 3
RTOL = 1e-5
"""float32: the pipelined step sums the same terms in another order (the gradient norm over
the stages, the cross-entropy's mean over the microbatches)."""


def _plan(pp: int, schedule: str = "1f1b") -> dict:
    parallel: dict = {"pp": pp, "microbatches": 4}
    if pp > 1:
        virtual = 1 if schedule in ("gpipe", "1f1b") else 2
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


def _records(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def _logged(out: Path, key: str = "loss", name: str = "metrics.jsonl") -> list[float]:
    return [r[key] for r in _records(out, name) if key in r]


def _pp_worker(rank: int, world: int, runs: list[tuple[dict, str, dict]]) -> None:
    """The runs, one after the other; each rank's result holds every stage's MoE blocks (what
    ``moec train`` prints)."""
    for plan, out, kw in runs:
        torch.manual_seed(0)
        trainer = Trainer(tiny_llama(4), Plan.from_dict(plan), _cfg(Path(out), **kw))
        result = trainer.run()
        assert list(result.routing) == [m.path for m in trainer.compiled.moe_layers]


def _close(got: list[float], want: list[float], where: str) -> None:
    assert len(got) == len(want), (where, got, want)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0, msg=lambda m: f"{where}: {m}")


EVAL = {"eval_every": HALF, "eval_batches": 3, "checkpoint_every": HALF}


@pytest.mark.slow
def test_pp2_trains_evaluates_resumes_and_reshards_as_pp1(tmp_path):
    """PP = 2 (1F1B) logs every step's loss and every eval loss of PP = 1, the same on rank 0
    (first stage) and rank 1 (last stage); resumed from its checkpoint of step 3 it logs the
    uninterrupted run's next losses, at PP = 2 and at PP = 1; PP = 1's checkpoint resumes at
    PP = 2 alike."""
    flat = tmp_path / "pp1"
    want = _train(_plan(1), flat, **EVAL)
    assert want[-1] < want[0], want
    want_eval = _logged(flat, "eval_loss")
    assert len(want_eval) == 2

    piped = tmp_path / "pp2"
    spawn(_pp_worker, 2, [(_plan(2), str(piped), EVAL)])
    _close(_logged(piped), want, "pp2")
    _close(_logged(piped, name="metrics_rank1.jsonl"), want, "pp2 rank 1")
    _close(_logged(piped, "eval_loss"), want_eval, "pp2 eval")
    summary = json.loads((piped / "summary.json").read_text())
    assert summary["first_loss"] == _logged(piped)[0] and summary["steps"] == STEPS
    routing = _records(piped)[-1]["routing"]  # both stages' blocks, in the model's order
    assert list(routing) == list(_records(flat)[-1]["routing"]) and len(routing) == 3
    assert all(block["max_vio"] is not None for block in routing.values())

    resumes = {"pp2_to_pp2": piped, "pp2_to_pp1": piped, "pp1_to_pp2": flat}
    for where, source in resumes.items():
        _copy_run(source, tmp_path / where, HALF)
    _train(_plan(1), tmp_path / "pp2_to_pp1", resume=True, **EVAL)
    again = {"resume": True, **EVAL}
    runs = [(_plan(2), str(tmp_path / w), again) for w in ("pp2_to_pp2", "pp1_to_pp2")]
    spawn(_pp_worker, 2, runs)
    for where in resumes:
        out = tmp_path / where
        assert [r["step"] for r in _records(out)] == list(range(1, STEPS + 1)), where
        _close(_logged(out)[HALF:], want[HALF:], where)
        _close(_logged(out, "eval_loss"), want_eval, f"{where} eval")


def _copy_run(source: Path, out: Path, step: int) -> None:
    """``source``'s run folder as it was after ``step``: its checkpoint of that step alone and
    the records up to it."""
    (out / "checkpoints").mkdir(parents=True)
    shutil.copy(source / "run.json", out / "run.json")
    shutil.copytree(source / "checkpoints" / f"step_{step}", out / "checkpoints" / f"step_{step}")
    kept = [json.dumps(r) + "\n" for r in _records(source) if r["step"] <= step]
    (out / "metrics.jsonl").write_text("".join(kept))


SCHEDULES = [s for s in ("gpipe", "interleaved_1f1b", "zbv", "dualpipev") if schedule_runs(s)]
"""Every other schedule this torch runs (1F1B above)."""
SPIKES = {"steps": 4, "spike_sigma": 0.1, "spike_window": 4, "spike_min_steps": 2}
"""Skip-step guard on: from step 3 every step here is judged a spike (its loss or gradient
norm above the last steps' mean plus 0.1 sigma) and skipped."""


@pytest.mark.slow
def test_every_schedule_trains_as_pp1_with_the_same_skips(tmp_path):
    """GPipe, Interleaved 1F1B (and ZBV, DualPipeV where torch runs them: the last stage on
    pipeline rank 0) at PP = 2 log PP = 1's losses; with the spike guard on, every rank skips
    the steps PP = 1 skips; a profile window traces each rank's steps, with its stages' block
    ranges outside the zero-bubble schedules (the ranges are identities: the losses stay
    equal)."""
    want = _train(_plan(1), tmp_path / "pp1", **SPIKES)
    skips = _logged(tmp_path / "pp1", "spike_skipped_steps")
    assert skips[-1] > 0, skips
    runs = [(_plan(2, s), str(tmp_path / s), {**SPIKES, "profile": "1:1"}) for s in SCHEDULES]
    spawn(_pp_worker, 2, runs)
    for schedule in SCHEDULES:
        out = tmp_path / schedule
        for name in ("metrics.jsonl", "metrics_rank1.jsonl"):
            _close(_logged(out, name=name), want, f"{schedule} {name}")
            assert _logged(out, "spike_skipped_steps", name) == skips, schedule
        summaries = "".join((out / "profile" / f"summary_rank{r}.txt").read_text() for r in (0, 1))
        ranges = [f"block model.layers.{i} (backward)" in summaries for i in range(4)]
        assert all(ranges) if schedule not in SPLIT_BACKWARD else not any(ranges), schedule


def _host_reads_worker(rank: int, world: int, out: str) -> None:
    from tests.test_pipeline import _HostReads

    torch.manual_seed(0)
    cfg = _cfg(Path(out), spike_sigma=3.0)
    trainer = Trainer(tiny_llama(4), Plan.from_dict(_plan(2)), cfg)
    for _ in range(2):  # the schedule's first step infers shapes
        trainer.train_step()
    with _HostReads() as reads:
        trainer.train_step()
    assert not reads.found, f"rank {rank}: ops that read device values on the host: {reads.found}"


@pytest.mark.slow
def test_pp2_trainer_step_reads_no_device_value_on_the_host(tmp_path):
    """A steady PP = 2 step of the Trainer (schedule, clipping over the stages, spike guard,
    device-step AdamW) reads no device value on the host, on either pipeline rank."""
    spawn(_host_reads_worker, 2, str(tmp_path))


# --- moec train under torchrun -----------------------------------------------------------------

FACTORY = """
import torch
from moec.models import Llama, LlamaConfig


def model():
    cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128)
    return Llama(cfg), (torch.zeros(2, 16, dtype=torch.long),)
"""


def _moec_train(tmp_path: Path, ranks: int, plan: Path, out: Path, *flags: str) -> None:
    """``moec train`` in a fresh process, under torchrun with ``ranks`` processes (1: alone)."""
    launch = ["-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
    launch += ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    command = [
        sys.executable,
        *(launch if ranks > 1 else []),
        "-m",
        "moec",
        "train",
        "--model",
        f"{tmp_path / 'factory.py'}:model",
        "--plan",
        str(plan),
        "--out",
        str(out),
        "--device",
        "cpu",
        *flags,
    ]
    env = {**os.environ, **NO_MULTICAST_ENV, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.mark.slow
def test_moec_train_under_torchrun_runs_dp_x_pp_processes(tmp_path):
    """``torchrun --nproc-per-node 2 -m moec train`` with a PP = 2 plan logs the losses of
    ``moec train`` with the plan at PP = 1 in one process."""
    (tmp_path / "factory.py").write_text(FACTORY)
    flags = ["--steps", "3", "--batch-size", "8", "--seq-len", "16", "--log-every", "1"]
    for pp in (1, 2):
        (tmp_path / f"pp{pp}.yaml").write_text(json.dumps(_plan(pp)))
        _moec_train(tmp_path, pp, tmp_path / f"pp{pp}.yaml", tmp_path / f"pp{pp}", *flags)
    _close(_logged(tmp_path / "pp2"), _logged(tmp_path / "pp1"), "torchrun pp2")
    assert (tmp_path / "pp2" / "metrics_rank1.jsonl").is_file()


@pytest.mark.slow
def test_example_pp_plan_trains_from_the_cli_at_its_size(tmp_path):
    """``examples/plans/pp2_ep4_mxfp8_recompute.yaml`` (PP = 2 x DP = 4 x EP = 4, MXFP8
    expert GEMMs emulated on the CPU, block recompute) trains under torchrun with its
    ``dp x pp`` = 8 processes."""
    plan = ROOT / "examples" / "plans" / "pp2_ep4_mxfp8_recompute.yaml"
    p = Plan.load(plan).parallel
    assert (p.pp, p.dp, p.ep) == (2, 4, 4)
    (tmp_path / "factory.py").write_text(FACTORY)
    out = tmp_path / "run"
    flags = ["--steps", "2", "--batch-size", "8", "--seq-len", "32", "--log-every", "1"]
    _moec_train(tmp_path, p.dp * p.pp, plan, out, *flags)
    losses = _logged(out)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), losses
    assert sorted(f.name for f in out.glob("metrics_rank*.jsonl")) == [
        f"metrics_rank{r}.jsonl" for r in range(1, 8)
    ]


def test_first_loss_is_saved_by_a_checkpoint_before_the_first_log_point(tmp_path):
    """The run's first loss, read at log points, is read for a checkpoint that comes first (its
    run state carries it to a resumed run's summary)."""
    torch.manual_seed(0)
    cfg = _cfg(tmp_path, steps=2, log_every=5, checkpoint_every=1)
    result = Trainer(tiny_llama(2), Plan.from_dict(_plan(1)), cfg).run()
    state = torch.load(tmp_path / "checkpoints" / "step_1" / "trainer.pt")
    assert state["first_loss"] == result.summary["first_loss"] == result.losses[0]


def test_pp_plan_outside_torchrun_says_how_many_processes(tmp_path, monkeypatch):
    """A PP = 2 x DP = 2 plan started as one process names the ``dp x pp`` = 4 processes to
    launch under torchrun."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    plan = {"moe": MOE, "parallel": {"pp": 2, "dp": 2, "microbatches": 4}}
    with pytest.raises(DistributedError, match=r"runs 4 processes.*torchrun --nproc-per-node 4"):
        Trainer(tiny_llama(4), Plan.from_dict(plan), _cfg(tmp_path))
