"""``python -m benchmarks.suite``: every entry lists, names a RESULTS.md section, and runs a
script that exists and declares each flag the entry passes; the runner's logging, failure and
time-limit rules, on the CPU (no GPU work runs here)."""

from __future__ import annotations

import ast
import glob
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

from benchmarks import suite

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = [(e.name, i, c) for e in suite.ENTRIES for i, c in enumerate(e.commands)]


def target_file(command: suite.Command) -> Path:
    """The file a command runs: the script, the module (``-m``) or its package's __main__."""
    if command.launcher in ("python", "torchrun"):
        return ROOT / command.target
    module = ROOT / command.target.replace(".", "/")
    return module / "__main__.py" if module.is_dir() else module.with_suffix(".py")


@cache
def declared_flags(path: Path) -> frozenset[str]:
    """The option strings a script's ``add_argument`` calls declare."""
    flags = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags.update(a.value for a in node.args if isinstance(a, ast.Constant))
    return frozenset(f for f in flags if isinstance(f, str) and f.startswith("-"))


def test_list_names_every_entry_its_section_and_commands(capsys):
    assert suite.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for entry in suite.ENTRIES:
        assert re.search(rf"^  {re.escape(entry.name)} ", listed, flags=re.M), entry.name
        if entry.kind != "setup":
            assert f"[RESULTS.md: {entry.section}]" in listed
        for command in entry.commands:
            assert suite.shown(command.argv("OUT", "GPUS")) in listed
    for group in suite.GROUPS:
        assert re.search(rf"^  {group} ", listed, flags=re.M)


def test_every_section_an_entry_feeds_is_a_results_heading():
    headings = set(re.findall(r"^## (.+)$", (ROOT / "benchmarks/RESULTS.md").read_text(), re.M))
    fed = {e.section for e in suite.ENTRIES if e.kind != "setup"}
    assert fed <= headings, fed - headings


@pytest.mark.parametrize("name,index,command", COMMANDS, ids=[f"{n}-{i}" for n, i, _ in COMMANDS])
def test_each_command_runs_a_file_that_exists_with_flags_it_declares(name, index, command):
    if command.launcher == "pytest":
        assert glob.glob(command.target, root_dir=ROOT), command.target
        return
    path = target_file(command)
    assert path.is_file(), f"{name}: {path} does not exist"
    if path.parent.name != "benchmarks":  # moec's CLI: its --help runs in the slow test
        return
    flags = {a.split("=")[0] for a in command.args if a.startswith("--")}
    unknown = flags - declared_flags(path)
    assert not unknown, f"{name}: {path.name} declares no {sorted(unknown)}"


def test_groups_expand_in_order_and_unknown_names_are_refused():
    names = [e.name for e in suite.resolve(["e2e", "gpu-tests", "table49"])]
    assert names == ["e2e", "gpu-tests-1", "gpu-tests-2", "gpu-tests-3", "table49"]
    with pytest.raises(ValueError, match="'nope'.*known: wheel-part"):
        suite.resolve(["nope"])
    with pytest.raises(SystemExit):
        suite.main(["nope"])


def test_dry_run_fills_the_placeholders_and_runs_nothing(capsys, tmp_path):
    out = tmp_path / "out"
    assert suite.main(["--dry-run", "--gpus", "4", "--out", str(out), "scaling", "quality"]) == 0
    printed = capsys.readouterr().out
    assert "{" not in printed and "--nproc-per-node 4" in printed and "--ep 4" in printed
    assert f"--single {out}/e2e_single.json" in printed
    assert not out.exists()


def _entry(tmp_path: Path, *codes: str) -> suite.Entry:
    """An entry of one python command per snippet, each a script under ``tmp_path``."""
    commands = []
    for i, code in enumerate(codes):
        script = tmp_path / f"step{i}.py"
        script.write_text(code)
        commands.append(suite.Command("python", str(script), ("{out}/x{gpus}",)))
    return suite.Entry("probe", "a CPU probe", "-", tuple(commands), gpus=0)


def test_an_entry_logs_its_commands_and_stops_at_the_first_failure(tmp_path):
    write = "import sys, os; open(sys.argv[1], 'w').write(os.environ['NCCL_NVLS_ENABLE'])\n"
    entry = _entry(tmp_path, write, "print('bad'); raise SystemExit(3)\n", write + "# never\n")
    assert suite.run_entry(entry, tmp_path, gpus=2, limit=60) == 3
    assert (tmp_path / "x2").read_text() == "0"  # placeholders filled, multicast off
    log = (tmp_path / "probe.log").read_text()
    assert log.count("$ python") == 2 and "bad" in log and "step2.py" not in log


def test_a_command_past_its_limit_is_stopped_with_124(tmp_path):
    entry = _entry(tmp_path, "import time; print('started', flush=True); time.sleep(60)\n")
    assert suite.run_entry(entry, tmp_path, gpus=0, limit=1) == 124
    assert "stopped after 1 s" in (tmp_path / "probe.log").read_text()


def test_main_skips_entries_that_need_more_gpus(tmp_path, capsys):
    assert suite.main(["--gpus", "0", "--out", str(tmp_path), "ep"]) == 0
    assert "== ep skipped: needs 2 GPUs, this machine has 0" in capsys.readouterr().out
    assert (tmp_path / "device.txt").is_file() and not (tmp_path / "ep.log").exists()


def test_clock_summary_counts_only_busy_samples(tmp_path):
    csv = tmp_path / "clocks.csv"
    csv.write_text(
        "0, 2026/12/07 05:00:00.000, 1980, 120.5, 40\n"  # idle: left out
        "0, 2026/12/07 05:00:00.200, 1500, 690.0, 60\n"
        "0, 2026/12/07 05:00:00.400, 1830, 705.2, 61\n"
        "garbled\n"
    )
    assert suite.clock_summary(csv) == (
        "SM clock while busy (> 300 W) 1500-1830 MHz, power up to 705 W (2 samples)"
    )
    assert suite.clock_summary(tmp_path / "missing.csv") == ""


def _help(target: tuple[str, str]) -> tuple[tuple[str, str], subprocess.CompletedProcess]:
    command = suite.Command(*target)
    argv = [sys.executable, command.target] if target[0] == "torchrun" else command.argv("O", 1)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # as the suite runs it
    done = subprocess.run(
        [*argv, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    return target, done


@pytest.mark.slow
def test_every_command_target_parses_help():
    """Each benchmark script (and moec's CLI) imports and prints its --help on the CPU."""
    targets = sorted({(c.launcher, c.target) for _, _, c in COMMANDS if c.launcher != "pytest"})
    with ThreadPoolExecutor(max_workers=4) as pool:  # each import of torch is ~10 s of CPU
        for target, done in pool.map(_help, targets):
            assert done.returncode == 0, f"{target}: {done.stderr[-2000:]}"
