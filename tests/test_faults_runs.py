"""Issue 49's run-folder cases, played as a user would meet them: two runs into one folder, a
stale lock left by kill -9, summaries that count checkpoint writes as step time, a resume that
extends a finished run's learning-rate schedule."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moec.cli import build_parser
from moec.cli import main as cli_main
from moec.plan import Plan
from moec.runtime.run_identity import RunIdentityError
from moec.train import RunLockError, TrainConfig, Trainer, run_lock, train
from moec.train.config import lr_factor
from moec.train.run_lock import LOCK_FILE, lock_run_dir
from moec.train.summary import print_summary
from tests.distributed import spawn
from tests.test_run_reliability import (
    PLAN,
    ROOT,
    _cfg,
    _metrics,
    _train_args,
    _write_factory,
    tiny_llama,
)

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
    assert all(r["step_time_s"] == 1.0 and r["tokens_per_s_per_device"] == tokens for r in records)
    # the writes after steps 4 and 8 fall in the windows that follow; the last, after step 10,
    # in no window
    assert [r["checkpoint_s"] for r in records] == [0.0, 0.0, 100.0, 0.0, 100.0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == result.summary
    assert summary["steady_step_time_s"] == 1.0
    assert summary["tokens_per_s_per_device"] == tokens
    assert summary["checkpoint_s"] == 300.0
    capsys.readouterr()
    print_summary(result)
    closing = _unwrapped(capsys.readouterr().out)
    assert _unwrapped("checkpoint writes 300.0 s (not counted as step time)") in closing


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


def _unwrapped(text: str) -> str:
    """``text`` without whitespace: a console may wrap lines anywhere, paths included."""
    return "".join(text.split())


def _tick(clock: _Clock, seconds: float, call, *args):
    """``call(*args)``, ``seconds`` later on ``clock``."""
    clock.now += seconds
    return call(*args)


# --- one run per folder -------------------------------------------------------------------------


def _lock(out: Path) -> dict:
    return json.loads((out / LOCK_FILE).read_text())


def _dead_holders_lock(out: Path) -> int:
    """A lock left in ``out`` by a process that took it and died without releasing it (as a
    killed run does); that process's pid."""
    script = "import sys; from pathlib import Path; from moec.train.run_lock import lock_run_dir\n"
    script += "lock_run_dir(Path(sys.argv[1]), print)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script, str(out)], env=env, check=True)
    assert done.returncode == 0
    return _lock(out)["pid"]


def test_a_run_into_a_folder_another_live_run_holds_is_refused_naming_it(tmp_path, capsys):
    out, made = tmp_path / "run", tmp_path / "model"
    out.mkdir()
    made.mkdir()
    model = _write_factory(made)
    held = lock_run_dir(out, print)  # a live holder: this process
    try:
        with pytest.raises(RunLockError) as refused:
            train(tiny_llama(), PLAN, _cfg(out, steps=2))
        message = str(refused.value)
        for part in (
            f"{out} is in use by another run",
            f"pid {os.getpid()} on {socket.gethostname()}",
            "still running",
            "another --out",
        ):
            assert part in message, message
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # nothing written
        assert _lock(out)["token"] == held.holder["token"]  # still the holder's
        capsys.readouterr()
        assert cli_main(_train_args(model, made, out, "--steps", "2", "--resume")) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("moec: error: ") and "is in use" in err
    finally:
        held.release()
    assert not (out / LOCK_FILE).exists()


def test_the_lock_is_released_after_the_run_and_after_its_error(tmp_path, monkeypatch):
    train(tiny_llama(), PLAN, _cfg(tmp_path / "done", steps=1))
    assert not (tmp_path / "done" / LOCK_FILE).exists()
    trainer = Trainer(tiny_llama(), Plan.from_dict(PLAN), _cfg(tmp_path / "failed", steps=2))

    def fail(eager: bool = False):
        assert (tmp_path / "failed" / LOCK_FILE).exists()  # held while the run runs
        raise RuntimeError("a step that fails")

    monkeypatch.setattr(trainer, "train_step", fail)
    with pytest.raises(RuntimeError, match="a step that fails"):
        trainer.run()
    assert not (tmp_path / "failed" / LOCK_FILE).exists()
    train(tiny_llama(), PLAN, _cfg(tmp_path / "failed", steps=1, force=True))  # free again


def test_a_stale_lock_of_a_dead_process_is_taken_over_and_said(tmp_path, capsys):
    dead = _dead_holders_lock(tmp_path)
    capsys.readouterr()
    result = train(tiny_llama(), PLAN, _cfg(tmp_path, steps=2))
    assert len(result.losses) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / LOCK_FILE} was left by pid {dead} on {socket.gethostname()}" in err
    assert "no longer running" in err and "takes the folder over" in err
    assert not (tmp_path / LOCK_FILE).exists()
    assert not list(tmp_path.glob("*.stale"))  # the stale lock is gone, not kept aside


def test_a_lock_held_on_another_host_is_refused_since_it_cannot_be_checked(tmp_path):
    _dead_holders_lock(tmp_path)  # dead here, but said to be elsewhere: cannot be judged
    dead = _lock(tmp_path)
    for elsewhere in ({"host": "another-host"}, {"pid_ns": "pid:[1]"}):  # or another container
        (tmp_path / LOCK_FILE).write_text(json.dumps({**dead, **elsewhere}))
        with pytest.raises(RunLockError, match=r"in another container, which this one cannot"):
            train(tiny_llama(), PLAN, _cfg(tmp_path, steps=1))
    (tmp_path / LOCK_FILE).write_text("")  # a lock that names no run
    with pytest.raises(RunLockError, match=r"names no run.*remove it"):
        lock_run_dir(tmp_path, print)


def test_a_live_pid_that_started_after_the_holder_is_a_reused_pid():
    """The holder's pid alive again, in a process that started at another time (pid reuse)
    or that ended unreaped (a zombie), is not the holder."""
    me = {"pid": os.getpid(), "process_start": run_lock._process_start(os.getpid())}
    assert run_lock._alive(me)
    if me["process_start"] is None:
        pytest.skip("no /proc: process start times are unknown here")
    assert not run_lock._alive({**me, "process_start": "1"})
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 30
    while run_lock._process_start(zombie.pid) != "zombie" and time.time() < deadline:
        time.sleep(0.05)
    assert not run_lock._alive({"pid": zombie.pid, "process_start": None})
    zombie.wait()
    assert not run_lock._alive({"pid": zombie.pid, "process_start": None})


def test_a_run_that_another_run_used_the_folder_before_it_started_is_refused(tmp_path):
    """The folder's checks run again under the lock: a trainer built while the folder was
    empty may not start after another run has written its checkpoints there."""
    late = Trainer(tiny_llama(), Plan.from_dict(PLAN), _cfg(tmp_path, steps=2))
    train(tiny_llama(), PLAN, _cfg(tmp_path, steps=1, seed=3))
    with pytest.raises(RunIdentityError, match="holds the checkpoints of another run"):
        late.run()
    assert json.loads((tmp_path / "run.json").read_text())["seed"] == 3
    assert not (tmp_path / LOCK_FILE).exists()


def _refused_on_every_rank(rank: int, world: int, out: str) -> None:
    """The folder is held (here by rank 0 itself, a live process) when the trainer is built,
    then when it runs: rank 0 sees it, and every rank raises its refusal."""
    torch.manual_seed(0)
    cfg = TrainConfig(steps=2, batch_size=4, seq_len=8, out=out, plots=False, device="cpu")
    plan = Plan.from_dict({**PLAN, "parallel": {"dp": 2, "ep": 2}})
    holder = [os.getpid() if rank == 0 else None]
    dist.broadcast_object_list(holder)
    refused = f"is in use by another run.*held by pid {holder[0]} "

    def held_by_rank_0(then) -> None:
        held = lock_run_dir(Path(out), print) if rank == 0 else None
        dist.barrier()
        with pytest.raises(RunLockError, match=refused):
            then()  # on rank 1 too: none waits for the others in a collective
        dist.barrier()
        if held is not None:
            held.release()

    held_by_rank_0(lambda: Trainer(tiny_llama(2), plan, cfg))
    trainer = Trainer(tiny_llama(2), plan, cfg)
    held_by_rank_0(trainer.run)


@pytest.mark.slow
def test_in_a_job_rank_0_takes_the_lock_and_every_rank_raises_its_refusal(tmp_path):
    spawn(_refused_on_every_rank, 2, str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # nothing written, the lock released


@pytest.mark.slow
def test_two_cli_runs_into_one_folder_then_kill_9_and_resume(tmp_path):
    """A second ``moec train`` into a folder a running one holds exits 2 in one line naming
    it and writes nothing; once the holder is killed (-9), ``--resume`` takes the stale lock
    over, says so, and continues the first run's metrics."""
    model = _write_factory(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "run"

    def command(*extra: str) -> list[str]:
        return [sys.executable, "-m", "moec", *_train_args(model, tmp_path, out, *extra)]

    first = subprocess.Popen(
        command("--steps", "100000", "--checkpoint-every", "20"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(first, lambda: any(out.glob("checkpoints/step_*/manifest.json")))
        second = subprocess.run(
            command("--steps", "3", "--seed", "5"), env=env, capture_output=True, text=True
        )
        assert second.returncode == 2, second.stderr
        line = second.stderr.strip()
        assert "\n" not in line and line.startswith("moec: error: "), line
        assert f"is held by pid {first.pid} on {socket.gethostname()}" in line
        assert first.poll() is None  # the holder trains on
        assert json.loads((out / "run.json").read_text())["seed"] == 0
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert _lock(out)["pid"] == first.pid  # left behind by the killed run
    logged = [r["step"] for r in _metrics(out)]
    resumed = subprocess.run(
        command("--steps", str(logged[-1] + 2), "--resume"),
        env=env,
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr
    said = _unwrapped(resumed.stdout + resumed.stderr)  # the run's console
    assert _unwrapped(f"was left by pid {first.pid} on {socket.gethostname()}") in said
    assert _unwrapped("takes the folder over") in said
    steps = [r["step"] for r in _metrics(out)]
    assert steps == list(range(1, logged[-1] + 3))  # one run's history, continued
    assert not (out / LOCK_FILE).exists()


def _wait_for(proc: subprocess.Popen, done) -> None:
    """Until ``done()`` (``proc`` must still run)."""
    deadline = time.time() + 300
    while not done():
        assert proc.poll() is None, "the process ended first"
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


# --- runs extended on purpose -------------------------------------------------------------------


def _rates_of(trainer: Trainer, monkeypatch) -> list[float]:
    """The learning rate each step of ``trainer.run()`` trains at (filled as it runs)."""
    rates: list[float] = []
    step = trainer.train_step

    def recorded(eager: bool = False):
        rates.append(trainer.optimizer.param_groups[0]["lr"])
        return step(eager)

    monkeypatch.setattr(trainer, "train_step", recorded)
    return rates


@pytest.mark.parametrize("replan", [False, True])
def test_resume_with_more_steps_keeps_or_replans_the_schedule_and_says_which(
    tmp_path, monkeypatch, capsys, replan
):
    """A finished 4-step run resumed with ``steps=8``: by default the schedule planned over 4
    steps is kept (steps 5-8 at its final rate, not back at the peak); with
    ``replan_schedule`` it is planned over 8 from step 5. Either way the run says so."""
    train(tiny_llama(), PLAN, _cfg(tmp_path, steps=4))
    cfg = _cfg(tmp_path, steps=8, resume=True, replan_schedule=replan)
    trainer = Trainer(tiny_llama(), Plan.from_dict(PLAN), cfg)
    rates = _rates_of(trainer, monkeypatch)
    capsys.readouterr()
    trainer.run()
    said = _unwrapped(capsys.readouterr().err)
    factor = lr_factor(cfg, None if replan else 4)
    want = [cfg.lr * factor(step) for step in range(4, 8)]
    assert rates == want
    assert [r["lr"] for r in _metrics(tmp_path)[4:]] == [cfg.lr * factor(s) for s in range(5, 9)]
    if replan:
        assert want[0] == cfg.lr  # the rate goes back up: asked for
        assert _unwrapped("re-planned over 8: the rate of step 5 goes from 0.0003 to 0.003") in said
    else:
        assert want == pytest.approx([cfg.lr * cfg.min_lr_ratio] * 4)  # not back at the peak
        assert _unwrapped("so steps 5-8 train at its final rate 0.0003") in said
        assert _unwrapped("(--replan-schedule) re-plans the schedule over 8 steps") in said
    resumed = Trainer(tiny_llama(), Plan.from_dict(PLAN), _cfg(tmp_path, steps=10, resume=True))
    assert len(resumed.run().losses) == 2
    planned = 8 if replan else 4  # the plan the checkpoints carry forward
    assert _unwrapped(f"past the {planned} steps its learning-rate schedule") in _unwrapped(
        capsys.readouterr().err
    )


def test_resume_with_fewer_steps_stops_before_the_planned_decay_and_says_so(
    tmp_path, monkeypatch, capsys
):
    schedule = dict(decay_fraction=0.5, checkpoint_every=4)
    train(tiny_llama(), PLAN, _cfg(tmp_path, steps=8, **schedule))
    shutil.rmtree(tmp_path / "checkpoints" / "step_8")  # as if stopped at step 4 of 8
    cfg = _cfg(tmp_path, steps=6, resume=True, **schedule)
    trainer = Trainer(tiny_llama(), Plan.from_dict(PLAN), cfg)
    rates = _rates_of(trainer, monkeypatch)
    capsys.readouterr()
    trainer.run()
    planned = lr_factor(cfg, 8)
    assert rates == [cfg.lr * planned(step) for step in (4, 5)]
    assert rates != [cfg.lr * lr_factor(cfg)(step) for step in (4, 5)]  # not squeezed into 6
    said = _unwrapped(capsys.readouterr().err)
    assert _unwrapped("stops the run before the end of the 8 steps") in said
    assert _unwrapped("its decay is not finished (the rate of step 6: 0.00233)") in said


def test_the_replan_flag_reaches_the_config(monkeypatch):
    import moec.train.cli as train_cli

    seen = {}
    monkeypatch.setattr(train_cli, "_train_and_report", lambda m, p, cfg: seen.setdefault("c", cfg))
    for command in ("train", "demo"):
        args = build_parser().parse_args([command, "--resume", "--replan-schedule"])
        args.func(args)
        assert seen.pop("c").replan_schedule
