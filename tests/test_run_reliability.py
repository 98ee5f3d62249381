"""Runs and checkpoints you can trust: run identity, committed checkpoints with fallback,
non-finite steps skipped on the device, finished-run resume, seeds, metrics across resume,
checkpoint write errors, input validation, and a kill -9 fault-injection run."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from moec.data import DataError, TextBatches
from moec.models import Llama, LlamaConfig
from moec.optim import AdamW
from moec.plan import Plan
from moec.runtime import checkpoint_store
from moec.runtime.checkpoint_store import CheckpointSpaceError, CheckpointWriteError
from moec.runtime.run_identity import RunIdentityError
from moec.train import (
    CheckpointLoadError,
    NonFiniteError,
    TrainConfig,
    TrainConfigError,
    Trainer,
    train,
)
from moec.train.summary import print_summary

PLAN = {"moe": {"num_experts": 4, "top_k": 2, "init": "random", "dense_first": 0}}
ROOT = Path(__file__).resolve().parents[1]


def tiny_llama(layers: int = 1) -> Llama:
    """One attention + MoE block: the smallest model with the whole MoE path."""
    cfg = LlamaConfig(dim=16, n_layers=layers, n_heads=2, n_kv_heads=1, ffn_hidden=32)
    return Llama(cfg)


def _cfg(out: Path, **kw) -> TrainConfig:
    base = dict(
        steps=4,
        batch_size=4,
        seq_len=16,
        warmup_steps=2,
        log_every=1,
        out=str(out),
        plots=False,
        device="cpu",
        synthetic=True,
    )
    return TrainConfig(**{**base, **kw})


def _committed(out: Path) -> list[str]:
    root = out / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _params(step_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """A committed checkpoint's model parameters (DCP -> one torch.save file)."""
    flat = tmp / f"{step_dir.parent.parent.name}_{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, flat)
    return torch.load(flat, weights_only=False)["model"]


# --- 1. run identity ----------------------------------------------------------------------------


def test_a_run_directory_is_continued_only_by_its_own_run(tmp_path):
    train(tiny_llama(), PLAN, _cfg(tmp_path, steps=2))
    with pytest.raises(RunIdentityError, match=r"--resume.*another --out.*--force"):
        Trainer(tiny_llama(), Plan.from_dict(PLAN), _cfg(tmp_path, steps=2))  # a new run
    with pytest.raises(RunIdentityError, match=r"seed: 0 -> 1.*--force"):
        Trainer(tiny_llama(), Plan.from_dict(PLAN), _cfg(tmp_path, resume=True, seed=1))
    with pytest.raises(RunIdentityError, match=r"data.seq_len: 16 -> 8"):
        Trainer(tiny_llama(), Plan.from_dict(PLAN), _cfg(tmp_path, resume=True, seq_len=8))
    with pytest.raises(RunIdentityError, match=r"moe.top_k: 2 -> 1"):
        plan = Plan.from_dict({"moe": {**PLAN["moe"], "top_k": 1}})
        Trainer(tiny_llama(), plan, _cfg(tmp_path, resume=True))
    with pytest.raises(RunIdentityError, match=r"model.class.*Llama"):
        model = torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256))
        Trainer(model, Plan.from_dict(PLAN), _cfg(tmp_path, resume=True))
    (tmp_path / "run.json").rename(tmp_path / "elsewhere.json")
    with pytest.raises(RunIdentityError, match="no run.json"):
        Trainer(tiny_llama(), Plan.from_dict(PLAN), _cfg(tmp_path, resume=True))
    (tmp_path / "elsewhere.json").rename(tmp_path / "run.json")
    resumed = train(tiny_llama(), PLAN, _cfg(tmp_path, resume=True, steps=3, seed=1, force=True))
    assert len(resumed.losses) == 1  # forced: continued from step 2
    assert json.loads((tmp_path / "run.json").read_text())["seed"] == 1
    fresh = train(tiny_llama(), PLAN, _cfg(tmp_path, steps=1, force=True))  # replaces it
    assert len(fresh.losses) == 1 and _committed(tmp_path) == ["step_1"]


# --- 2. non-finite steps ------------------------------------------------------------------------


def _poison(trainer: Trainer, steps: set[int]) -> None:
    """Make one parameter's gradient NaN at the given (0-based) steps."""
    param = next(p for p in trainer.compiled.parameters() if p.requires_grad)
    param.register_hook(lambda g: g * float("nan") if trainer.step in steps else g)


def _optimizer_state(trainer: Trainer) -> list[torch.Tensor]:
    state = [p.detach().clone() for p in trainer.compiled.parameters()]
    for s in trainer.optimizer.state.values():
        state += [t.clone() for t in s.values()]
    return state


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16: the working weights too
def test_a_non_finite_step_changes_no_parameter_nor_optimizer_state(tmp_path, dtype):
    plan = Plan.from_dict({**PLAN, "precision": {"compute_dtype": dtype}})
    trainer = Trainer(tiny_llama(), plan, _cfg(tmp_path))
    _poison(trainer, {1})
    trainer.train_step()
    before = _optimizer_state(trainer)
    trainer.train_step()  # poisoned
    after = _optimizer_state(trainer)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert trainer.skipped_steps.item() == 1
    if trainer.compiled.working_weights is not None:
        assert trainer.compiled.working_weights.refresh() == 0  # every copy equals its param
    trainer.train_step()
    steps = {float(s["step"]) for s in trainer.optimizer.state.values()}
    assert steps == {2.0}  # two updates made, the skipped one not counted
    assert all(torch.isfinite(p).all() for p in trainer.compiled.parameters())


@pytest.mark.parametrize("lr_on_device", [False, True])
def test_device_step_adamw_skip_then_step_equals_one_step(lr_on_device):
    skip_then_step_equals_torch((7, 3), lr_on_device)  # the torch-op reference on the CPU


def skip_then_step_equals_torch(shape: tuple[int, ...], lr_on_device: bool = False) -> None:
    """Skipping a step leaves moec's AdamW where it was: the step after it equals torch's.
    The learning rate follows a schedule (read from device memory with ``lr_on_device``)."""
    params = [torch.nn.Parameter(torch.randn(shape)) for _ in range(2)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kwargs = {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1}
    ours = AdamW(params, device_step=True, lr_on_device=lr_on_device, **kwargs)
    theirs = torch.optim.AdamW(twins, foreach=False, **kwargs)
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)) for o in (ours, theirs)
    ]
    for skip in (False, True, False, False):
        grads = [torch.randn(shape) for _ in params]
        for p, t, g in zip(params, twins, grads, strict=True):
            p.grad = g * float("nan") if skip else g.clone()
            t.grad = g.clone()
        ours.found_inf = torch.tensor(float(skip))
        ours.step()
        if not skip:
            theirs.step()
        for schedule in schedules:  # the skipped step counts in both schedules
            schedule.step()
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-7)
        assert float(ours.state[p]["step"]) == 3


def test_device_step_adamw_kernel_skips_under_the_interpreter():
    """The Triton kernel's device step, device lr and found_inf (the Triton interpreter on the
    CPU)."""
    script = (
        "from moec.kernels.adamw import kernel_applies; import torch; "
        "assert kernel_applies(torch.zeros(3000), torch.zeros(3000)); "
        "from tests.test_run_reliability import "
        "skip_then_step_equals_torch; skip_then_step_equals_torch((3000,)); "
        "skip_then_step_equals_torch((3000,), lr_on_device=True)"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=ROOT)


def test_non_finite_steps_are_counted_then_stop_the_run(tmp_path):
    trainer = Trainer(tiny_llama(), Plan.from_dict(PLAN), _cfg(tmp_path, steps=12))
    _poison(trainer, {2} | set(range(5, 12)))
    trainer.cfg.max_nonfinite_steps = 3
    with pytest.raises(NonFiniteError, match=r"3 consecutive steps.*max_nonfinite_steps = 3"):
        trainer.run()
    records = _metrics(tmp_path)
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1, 2, 3, 4]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["skipped_steps"] == 4 and "consecutive" in summary["error"]
    assert all(torch.isfinite(p).all() for p in trainer.compiled.parameters())


# --- 3. committed checkpoints ------------------------------------------------------------------


def test_resume_skips_damaged_checkpoints_and_uses_the_newest_good_one(tmp_path, capsys):
    cfg = dict(steps=10, checkpoint_every=2, keep_checkpoints=4)
    full = train(tiny_llama(), PLAN, _cfg(tmp_path, **cfg))
    root = tmp_path / "checkpoints"
    assert _committed(tmp_path) == ["step_10", "step_4", "step_6", "step_8"]  # the newest 4
    manifest = json.loads((root / "step_8" / "manifest.json").read_text())
    assert manifest["step"] == 8 and "trainer.pt" in manifest["files"]
    assert any(name.endswith(".distcp") for name in manifest["files"])
    (root / "step_10" / "manifest.json").unlink()  # written, never committed
    shard = next((root / "step_8").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-64:] = os.urandom(64)  # random bytes, size unchanged
    shard.write_bytes(bytes(data))
    trainer_file = root / "step_6" / "trainer.pt"
    trainer_file.write_bytes(trainer_file.read_bytes()[:100])
    capsys.readouterr()
    resumed = train(tiny_llama(), PLAN, _cfg(tmp_path, resume=True, **cfg))
    err = capsys.readouterr().err
    for reason in (
        "step_10: no manifest.json",
        f"step_8: {shard} does not match its manifest",
        f"step_6: {trainer_file} has 100 bytes",
        "resumed from step 4",
    ):
        assert reason in err, err
    assert resumed.losses == full.losses[4:]
    for trainer_file in root.glob("step_*/trainer.pt"):  # none verifies: refused
        trainer_file.write_bytes(b"")
    with pytest.raises(CheckpointLoadError, match=r"no checkpoint .* matches.*--force"):
        train(tiny_llama(), PLAN, _cfg(tmp_path, resume=True, **cfg))


# --- 5. seeds ----------------------------------------------------------------------------------


def _write_factory(tmp_path: Path) -> str:
    factory = tmp_path / "tiny_model.py"
    factory.write_text(
        "import torch\n"
        "from moec.models import Llama, LlamaConfig\n\n"
        "def make():\n"
        "    cfg = LlamaConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,\n"
        "                      ffn_hidden=32)\n"
        "    return Llama(cfg), (torch.zeros(1, 8, dtype=torch.long),)\n"
    )
    plan = tmp_path / "plan.yaml"
    plan.write_text("moe: {num_experts: 4, top_k: 2, init: random, dense_first: 1}\n")
    return f"{factory}:make"


def _train_args(model: str, tmp_path: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--model",
        model,
        "--plan",
        str(tmp_path / "plan.yaml"),
        "--batch-size",
        "2",
        "--seq-len",
        "8",
        "--log-every",
        "1",
        "--synthetic",
        "--device",
        "cpu",
        "--out",
        str(out),
        *extra,
    ]


def test_two_cli_runs_with_the_same_seed_are_bit_identical(tmp_path):
    from moec.cli import main

    model = _write_factory(tmp_path)
    for run in ("a", "b"):
        assert main(_train_args(model, tmp_path, tmp_path / run, "--steps", "3")) == 0
    losses = [[r["loss"] for r in _metrics(tmp_path / run)] for run in ("a", "b")]
    assert losses[0] == losses[1]
    a, b = (_params(tmp_path / run / "checkpoints" / "step_3", tmp_path) for run in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- 7. metrics across resume ------------------------------------------------------------------


def test_a_resumed_runs_metrics_summary_and_plots_cover_the_whole_run(
    tmp_path, monkeypatch, capsys
):
    import moec.plots

    full = train(tiny_llama(), PLAN, _cfg(tmp_path, steps=6, checkpoint_every=4))
    first_loss = full.summary["first_loss"]
    shutil.rmtree(tmp_path / "checkpoints" / "step_6")  # as if killed after logging step 6
    plotted = []
    monkeypatch.setattr(moec.plots, "write_plots", lambda out, h, *rest: plotted.append(h) or [])
    cfg = _cfg(tmp_path, steps=6, checkpoint_every=4, resume=True, plots=True)
    resumed = train(tiny_llama(), PLAN, cfg)
    assert len(resumed.losses) == 2  # resumed at step 4
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["first_loss"] == first_loss == full.losses[0]
    assert summary["tokens_per_s_per_device"] > 0 and "too few" in summary["throughput_from"]
    assert [r["step"] for r in plotted[0]] == [1, 2, 3, 4, 5, 6]
    _resume_of_a_finished_run_writes_nothing(tmp_path, cfg, capsys)  # item 4 of the issue


def _resume_of_a_finished_run_writes_nothing(out: Path, cfg: TrainConfig, capsys) -> None:
    files = [p for p in out.rglob("*") if p.is_file()]
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files}
    capsys.readouterr()
    result = train(tiny_llama(), PLAN, cfg)
    assert result.finished and result.losses == [] and result.summary["steps"] == cfg.steps
    assert "finished" in capsys.readouterr().err
    assert {
        p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()
    } == before


# --- 9. plots ----------------------------------------------------------------------------------


def test_without_matplotlib_the_run_lists_only_what_it_wrote(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    result = train(tiny_llama(), PLAN, _cfg(tmp_path, steps=1, plots=True))
    names = [str(p.relative_to(tmp_path)) for p in result.written]
    assert names == ["metrics.jsonl", "summary.json", str(Path("checkpoints", "step_1"))]
    print_summary(result)
    out = capsys.readouterr().out
    assert "no plots" in out and "matplotlib" in out and ".png" not in out


# --- 12. checkpoint write errors ---------------------------------------------------------------


def _fail_with(monkeypatch, target: str, code: int) -> None:
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(target, fail)


def test_a_full_disk_stops_the_run_with_its_metrics_and_summary_kept(tmp_path, monkeypatch):
    _fail_with(monkeypatch, "torch.distributed.checkpoint.save", errno.ENOSPC)
    with pytest.raises(CheckpointWriteError, match=r"step_2 was not written: disk full.*needs"):
        train(tiny_llama(), PLAN, _cfg(tmp_path, checkpoint_every=2))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 and "disk full" in summary["error"]
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2]
    assert _committed(tmp_path) == []  # no partial folder left, nothing committed


def test_a_failed_checkpoint_write_can_be_skipped(tmp_path, monkeypatch):
    _fail_with(monkeypatch, "torch.save", errno.EACCES)
    cfg = _cfg(tmp_path, checkpoint_every=2, on_checkpoint_error="continue")
    result = train(tiny_llama(), PLAN, cfg)
    assert len(result.losses) == 4 and _committed(tmp_path) == []
    errors = result.summary["checkpoint_errors"]
    assert len(errors) == 2 and all("permission denied" in e for e in errors)


def test_checkpoints_that_cannot_fit_are_refused_before_the_first_step(tmp_path, monkeypatch):
    usage = checkpoint_store.shutil.disk_usage(tmp_path)
    tiny = usage._replace(free=1000)
    monkeypatch.setattr(checkpoint_store.shutil, "disk_usage", lambda path: tiny)
    with pytest.raises(CheckpointSpaceError, match=r"need about .* each.*1000 B free"):
        train(tiny_llama(), PLAN, _cfg(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


# --- vocabulary and configuration --------------------------------------------------------------


def test_the_data_follows_the_models_vocabulary(tmp_path):
    big = Llama(LlamaConfig(vocab_size=1000, dim=16, n_layers=2, n_heads=2, n_kv_heads=1))
    trainer = Trainer(big, Plan.from_dict(PLAN), _cfg(tmp_path, batch_size=8, seq_len=64))
    assert trainer.data.batch(0)[0].max() >= 256
    small = Llama(LlamaConfig(vocab_size=100, dim=16, n_layers=2, n_heads=2, n_kv_heads=1))
    with pytest.raises(DataError, match=r"vocabulary has 100.*--synthetic"):
        Trainer(small, Plan.from_dict(PLAN), _cfg(tmp_path / "b", synthetic=False))
    assert TextBatches(2, 8, vocab_size=1000).batch(0)[0].max() < 256


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("steps", 0, r"--steps\) = 0: must be an integer >= 1"),
        ("batch_size", 0, r"--batch-size\) = 0: must be an integer >= 1"),
        ("seq_len", 1, r"--seq-len\) = 1: must be an integer >= 2"),
        ("on_checkpoint_error", "retry", r"one of stop, continue"),
        ("on_router_collapse", "raise", r"--on-router-collapse\) = 'raise'.*warn, stop, ignore"),
        ("device", "cuda" if not torch.cuda.is_available() else "tpu", r"--device"),
    ],
)
def test_train_config_rejects_values_out_of_range(field, value, message):
    with pytest.raises(TrainConfigError, match=message):
        TrainConfig(**{field: value})


# --- fault injection ---------------------------------------------------------------------------


@pytest.mark.slow
def test_kill_9_at_random_points_then_resume_equals_the_uninterrupted_run(tmp_path):
    model = _write_factory(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    steps = ["--steps", "12", "--checkpoint-every", "2", "--keep-checkpoints", "2"]

    def command(out: Path, *extra: str) -> list[str]:
        return [sys.executable, "-m", "moec", *_train_args(model, tmp_path, out, *steps, *extra)]

    subprocess.run(command(tmp_path / "whole"), env=env, check=True, capture_output=True)
    killed, rng = tmp_path / "killed", random.Random()
    kills = 0
    for attempt in range(3):  # the i-th kill after a random step in [4i + 1, 4i + 3]
        proc = subprocess.Popen(
            command(killed, *(["--resume"] if attempt else [])),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_for_step(
            proc, killed / "metrics.jsonl", rng.randint(4 * attempt + 1, 4 * attempt + 3)
        )
        time.sleep(rng.uniform(0.0, 0.05))  # anywhere in a step or a checkpoint write
        proc.send_signal(signal.SIGKILL)
        kills += proc.wait() == -signal.SIGKILL
    assert kills == 3
    subprocess.run(command(killed, "--resume"), env=env, check=True, capture_output=True)
    want = _params(tmp_path / "whole" / "checkpoints" / "step_12", tmp_path)
    got = _params(killed / "checkpoints" / "step_12", tmp_path)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert [r["step"] for r in _metrics(killed)] == list(range(1, 13))


def _wait_for_step(proc: subprocess.Popen, metrics: Path, step: int) -> None:
    """Until ``proc`` has logged ``step`` (or ended)."""
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if any(f'"step": {step},' in line for line in lines):
            return
        time.sleep(0.005)
