"""Time to the first step (``first_step`` in the summary) and moec's compile cache."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moec import cache, compiler
from moec.kernels import compile_clock, tuning
from moec.train import TrainConfig, train
from moec.train.timing import FirstStepClock, format_first_step
from tests.models import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
TINY_PLAN = {"moe": {"num_experts": 4, "top_k": 2, "init": "random", "dense_first": 1}}


def _parts(first: dict) -> list[float]:
    """The disjoint parts of the time to the first step."""
    kernels = [k[name] for k in first["kernels"].values() for name in ("jit_s", "autotune_s")]
    named = ("target_s", "capture_s", "passes_s", "materialize_s", "inductor_s", "step_s")
    named += ("other_s",)
    return [first[name] for name in named] + kernels


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_first_step_clock_parts_are_disjoint_and_sum_to_the_total():
    clock = FirstStepClock(torch.device("cpu"))
    compiler.default_target((torch.zeros(1),), {})  # the machine's detection: part "target"
    with compiler.timed("capture"):
        _busy(0.01)
    with compiler.timed("passes"):
        _busy(0.01)
    step_start = time.perf_counter()
    clock.step_starts()
    start = time.perf_counter()
    _busy(0.01)  # a kernel compiled inside the step, reported by the listeners' path
    compile_clock._each_clock("jit", "triton", time.perf_counter() - start, False)
    _busy(0.01)
    first = clock.finish()
    step_wall = time.perf_counter() - step_start
    assert clock.finish() is first
    parts = _parts(first)
    assert all(p >= 0 for p in parts) and sum(parts) <= first["total_s"] + 1e-9, first
    assert first["capture_s"] > 0 and first["passes_s"] > 0 and first["step_s"] > 0
    assert first["target_s"] > 0
    assert first["kernels"]["triton"]["kernels_compiled"] == 1
    # the kernel's JIT is not counted again in the step
    assert first["step_s"] + first["kernels"]["triton"]["jit_s"] <= step_wall
    assert "triton JIT" in format_first_step(first)
    before = first["process_start_to_first_step_s"]
    assert before is None or before >= first["total_s"]
    # a stopped clock counts nothing more
    compile_clock._each_clock("jit", "triton", 1.0, False)
    assert clock.kernels.times["triton"].kernels_compiled == 1


@pytest.mark.slow
def test_summary_splits_the_time_to_the_first_step(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEC_CACHE_DIR", str(tmp_path / "cache"))
    cfg = TrainConfig(steps=2, batch_size=2, seq_len=16, log_every=1, out=str(tmp_path / "run"))
    result = train(tiny_llama(), TINY_PLAN, cfg)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    first = summary["first_step"]
    assert summary["first_step_s"] == first["total_s"] == result.summary["first_step_s"]
    parts = _parts(first)
    assert all(math.isfinite(p) and p >= 0 for p in parts), first
    assert sum(parts) <= first["total_s"] + 1e-6, first
    # capture and passes ran, a step ran
    assert first["capture_s"] > 0 and first["passes_s"] > 0 and first["step_s"] > 0
    assert set(first["kernels"]) == {"triton", "cute"}
    assert first["graphs_compiled"] == first["graphs_cached"] == 0  # eager on the CPU


FACTORY = """
import torch
from moec.models import Llama, LlamaConfig


def tiny():
    model = Llama(LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64))
    return model, (torch.randint(0, 256, (2, 16)),)
"""
PLAN = """
moe: {num_experts: 4, top_k: 2, init: random, dense_first: 0}
lowering: {inductor: true}
"""


def _job(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """A plan through Inductor on the CPU, its model factory, and an environment whose caches
    are all under ``tmp_path/cache`` (none inherited from this process)."""
    (tmp_path / "tiny.py").write_text(FACTORY)
    (tmp_path / "plan.yaml").write_text(PLAN)
    env = {k: v for k, v in os.environ.items() if k not in cache.TOOL_DIRS}
    env.update(MOEC_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    return ["plan.yaml", "--model", "tiny.py:tiny"], env


def _moec(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "moec", *args], cwd=cwd, env=env, stderr=subprocess.PIPE, text=True
    )


def _finish(process: subprocess.Popen) -> None:
    _, err = process.communicate(timeout=1800)
    assert process.returncode == 0, err


@pytest.mark.slow
def test_warmup_fills_the_cache_that_the_next_launch_compiles_nothing_from(tmp_path):
    plan, env = _job(tmp_path)
    shape = ["--batch", "2", "--seq", "16"]
    _finish(_moec(["warmup", *plan, *shape, "--json", "warm.json"], env, tmp_path))
    warm = json.loads((tmp_path / "warm.json").read_text())
    assert warm["first_step"]["graphs_compiled"] > 0 and warm["cache"].startswith(str(tmp_path))
    train_args = ["train", "--plan", *plan, "--batch-size", "2", "--seq-len", "16"]
    _finish(_moec([*train_args, "--steps", "1", "--synthetic", "--out", "run"], env, tmp_path))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    first = summary["first_step"]
    # Inductor found every graph the warmup compiled: no FX graph compiled, no Triton kernel
    assert first["graphs_compiled"] == 0 and first["graphs_cached"] > 0, first
    assert first["kernels"]["triton"]["kernels_compiled"] == 0
    assert summary["first_loss"] == warm["loss"]  # the same program on the same batch


@pytest.mark.slow
def test_two_processes_fill_one_empty_cache_at_once(tmp_path):
    plan, env = _job(tmp_path)
    runs = [
        _moec(
            ["warmup", *plan, "--batch", "2", "--seq", "16", "--json", f"{i}.json"], env, tmp_path
        )
        for i in range(2)
    ]
    for process in runs:
        _finish(process)
    reports = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
    assert reports[0]["loss"] == reports[1]["loss"] and math.isfinite(reports[0]["loss"])
    # and what they wrote is whole: a third launch compiles nothing and agrees
    _finish(
        _moec(["warmup", *plan, "--batch", "2", "--seq", "16", "--json", "3.json"], env, tmp_path)
    )
    third = json.loads((tmp_path / "3.json").read_text())
    assert third["first_step"]["graphs_compiled"] == 0 and third["loss"] == reports[0]["loss"]


@pytest.fixture
def fresh_cache(monkeypatch):
    """No cache set up in this process, and every variable :func:`cache.setup` sets restored
    after the test."""
    monkeypatch.setattr(cache, "_ACTIVE", None)
    for variable in [*cache.TOOL_DIRS, *cache.SWITCHES, cache.CACHE_ENV, "XDG_CACHE_HOME"]:
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def test_cache_root_is_moec_cache_dir_else_under_the_cache_home(fresh_cache, tmp_path):
    fresh_cache.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_root() == tmp_path / "home" / ".cache" / "moec"
    fresh_cache.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "moec"
    fresh_cache.setenv("MOEC_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.cache_root() == tmp_path / "mine"


def test_setup_points_every_tool_into_one_namespace_and_keeps_the_users_own(fresh_cache, tmp_path):
    fresh_cache.setenv("MOEC_CACHE_DIR", str(tmp_path / "moec"))
    fresh_cache.setenv("TRITON_CACHE_DIR", str(tmp_path / "users_triton"))
    dirs = cache.setup()
    assert cache.setup() is dirs and cache.active() is dirs
    folder = tmp_path / "moec" / cache.namespace()
    assert dirs.folder == folder
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "users_triton")
    assert not dirs.ours["TRITON_CACHE_DIR"]
    for variable, sub in cache.TOOL_DIRS.items():
        if variable != "TRITON_CACHE_DIR":
            assert os.environ[variable] == str(folder / sub) and (folder / sub).is_dir()
    assert os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1"
    assert cache.tuning_record() == folder / "tuning_choices.json"


def test_setup_replaces_the_folders_torch_chose_itself(fresh_cache, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    fresh_cache.setenv("MOEC_CACHE_DIR", str(tmp_path / "moec"))
    # what importing Inductor's config and its first kernel write, without the user
    fresh_cache.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    fresh_cache.setenv("TRITON_CACHE_DIR", os.path.join(default_cache_dir(), "triton", "0"))
    dirs = cache.setup()
    assert dirs.ours["TORCHINDUCTOR_CACHE_DIR"] and dirs.ours["TRITON_CACHE_DIR"]
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(dirs.folder / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(dirs.folder / "triton")


def test_namespace_separates_devices_and_versions():
    import torch

    h100 = cache.namespace("NVIDIA H100 80GB HBM3", (9, 0))
    assert h100.startswith("sm90-nvidia-h100-80gb-hbm3/torch-")
    assert f"torch-{torch.__version__}" in h100 and f"_moec-{cache.moec_key()}" in h100
    assert h100 != cache.namespace("NVIDIA H200", (9, 0))


def test_write_atomic_replaces_the_whole_file(tmp_path):
    path = tmp_path / "sub" / "record.json"
    cache.write_atomic(path, "first")
    cache.write_atomic(path, "second")
    assert path.read_text() == "second" and [p.name for p in path.parent.iterdir()] == [path.name]


@pytest.mark.slow
def test_first_step_benchmark_runs_two_launches_at_a_tiny_shape(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in cache.TOOL_DIRS}
    env["PYTHONPATH"] = str(ROOT)
    report = tmp_path / "first_step.json"
    script = [sys.executable, str(ROOT / "benchmarks" / "first_step.py"), "--tiny"]
    args = ["--steps", "1", "--warmup", "0", "--cache", str(tmp_path / "cache")]
    proc = subprocess.run(
        [*script, *args, "--json", str(report)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    launches = json.loads(report.read_text())["launches"]["moec"]
    assert len(launches) == 2 and launches[0]["cache"] == launches[1]["cache"]
    assert launches[0]["cache"].startswith(str(tmp_path / "cache"))
    for launch in launches:
        first = launch["first_step"]
        assert all(p >= 0 for p in _parts(first)) and sum(_parts(first)) <= first["total_s"]
        assert launch["launch_to_first_step_s"] >= first["total_s"]
        assert launch["steady_step_s"] > 0
    assert "launch 2 / launch 1" in proc.stdout
    # the second launch loaded the program the first built: it ran no pass
    assert [launch["first_step"]["programs_cached"] for launch in launches] == [0, 1]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="it tunes where a GPU is")
def test_tune_table_refuses_to_run_without_a_gpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = str(ROOT / "benchmarks" / "tune_table.py")
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "autotunes on a GPU" in proc.stderr


@pytest.mark.slow
def test_tune_table_merges_a_recorded_run_into_a_new_table_file(tmp_path):
    """``--record`` writes a run's recorded choices under their product, keeping the shipped
    table's other entries, and refuses a product the table does not hold (writing nothing)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = str(ROOT / "benchmarks" / "tune_table.py")
    config = {"kwargs": {"BLOCK_R": 64}, "num_warps": 4, "num_stages": 3}
    record = tmp_path / "tuning_choices.json"
    record.write_text(json.dumps({"H200": {"glu": {"R=1024": config}}}))
    table = tmp_path / "tuning.json"
    argv = [sys.executable, script, "--record", str(record), "--table", str(table)]
    subprocess.run(argv, env=env, check=True, capture_output=True)
    written = json.loads(table.read_text())
    assert written["H200"]["glu"]["R=1024"] == config
    assert set(written) == set(json.loads(tuning.TABLE.read_text()))

    record.write_text(json.dumps({"A100": {"glu": {"R=1024": config}}}))
    refused = tmp_path / "refused.json"
    argv[-1] = str(refused)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "'A100' is none of" in proc.stderr
    assert not refused.exists()


@pytest.mark.slow
def test_tune_table_merges_a_quack_cache_as_records_moec_seeds_back(tmp_path):
    """``--quack-records`` writes the records of a quack cache folder, cut to their winners,
    under ``quack-<version>`` of the product given, which :func:`tuning.seed_quack` writes back
    into an empty cache as quack reads them; without the product and version it refuses."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = str(ROOT / "benchmarks" / "tune_table.py")
    path = "MFRGGZDFMZTWQ2LK/gemm_tuned.autotune.json"
    measured = tmp_path / "quack"
    (measured / path).parent.mkdir(parents=True)
    timings = [["tile: 128", [0.3]], ["tile: 256", [0.2]]]
    (measured / path).write_text(json.dumps({"key": "(8,)", "configs_timings": timings}))
    table = tmp_path / "tuning.json"
    argv = [sys.executable, script, "--quack-records", str(measured), "--table", str(table)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "--product and --quack-version" in proc.stderr
    argv += ["--product", "H100", "--quack-version", "0.6.5"]
    subprocess.run(argv, env=env, check=True, capture_output=True)
    written = json.loads(table.read_text())
    shipped = tuning.table()["H100"]
    merged = {path: {"key": "(8,)", "configs_timings": timings[1:]}}
    assert written["H100"]["quack-0.6.5"] == {**shipped.get("quack-0.6.5", {}), **merged}
    assert written["H100"]["activation.act"] == shipped["activation.act"]
