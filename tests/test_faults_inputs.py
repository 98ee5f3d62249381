"""Fault injection on what users hand moec (issue #49, items 4, 6 and 8): a plan far over the
memory limit is refused before anything is allocated, bad token files and data specs are one
line naming the file, a bad id found mid-run leaves a checkpoint that ``--resume`` continues
once the data is fixed, and an ``--out`` that cannot be written is one line naming it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import moec
from moec.analysis.rank_memory import rank_memory
from moec.cli import main
from moec.corpus import CorpusError, TokenCorpus, parse_spec
from moec.errors import MoecError
from moec.plan import Plan
from moec.train import LanguageModelWithLoss, MemoryPlanError, Trainer, train
from tests.test_run_reliability import PLAN, _committed, tiny_llama
from tests.test_run_reliability import _cfg as synthetic_cfg

HUGE = {"moe": {"num_experts": 4, "top_k": 2, "init": "random", "expert_width": 2**50}}
"""Routed experts 2^50 wide: petabytes each, which no allocator grants (it fails at once), so
only a build on the meta device can get as far as the memory check."""

TINY_MODEL = """
import torch
from moec.models import Llama, LlamaConfig


def make():
    cfg = LlamaConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32)
    return Llama(cfg), (torch.randint(0, 256, (2, 8)),)
"""

WINDOW = 17  # seq_len 16 + 1: the corpus' packed windows
GOOD, BAD = 7, 300  # tiny_llama's vocabulary has 256 ids


def _error_line(capsys) -> str:
    """The one line ``moec`` wrote to stderr (asserting it is one line)."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("moec: error: ")
    return lines[0]


def _train_argv(tmp_path: Path, *flags: str) -> list[str]:
    """``moec train`` of a one-block Llama on synthetic tokens, for 2 steps on the CPU."""
    model = tmp_path / "tiny_model.py"
    model.write_text(TINY_MODEL)
    base = ["train", "--model", f"{model}:make", "--steps", "2", "--batch-size", "2"]
    return [*base, "--seq-len", "8", "--device", "cpu", "--synthetic", *flags]


# --- item 4: the memory check before any allocation ------------------------------------------


def test_a_compile_check_sees_the_plan_on_shapes_before_anything_is_allocated():
    """Before: the experts were allocated before ``check`` ran (here: an allocator error)."""
    ids = torch.randint(0, 256, (2, 17))
    model = LanguageModelWithLoss(tiny_llama())
    predicted = []

    def refuse(program) -> None:
        predicted.append(rank_memory(program, 1, 2, 16))
        raise MoecError("over the limit")

    with pytest.raises(MoecError, match="over the limit"):
        moec.compile(model, HUGE, (ids[:, :-1], ids[:, 1:]), check=refuse)
    assert predicted[0].parameters > 2**50  # the petabyte experts, counted on shapes
    assert all(p.device.type == "cpu" for p in model.parameters())  # the model is untouched


def test_a_check_that_passes_leaves_the_program_as_without_it():
    ids = torch.randint(0, 256, (2, 17))
    args = (ids[:, :-1], ids[:, 1:])
    torch.manual_seed(0)
    plain = moec.compile(LanguageModelWithLoss(tiny_llama()), PLAN, args)
    torch.manual_seed(0)
    checked = []  # whether the program was on the meta device when checked

    def check(program) -> None:
        checked.append(program.graph.get_parameter("model.embed.weight").is_meta)

    compiled = moec.compile(LanguageModelWithLoss(tiny_llama()), PLAN, args, check=check)
    assert checked == [True]
    mine, theirs = compiled.state_dict(), plain.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(compiled(*args), plain(*args))


def test_the_trainer_refuses_a_plan_over_the_limit_before_it_allocates(tmp_path):
    cfg = synthetic_cfg(tmp_path, memory_limit_gib=1)
    with pytest.raises(MemoryPlanError, match=r"GiB per rank, more than the 1 GiB available"):
        Trainer(tiny_llama(), Plan.from_dict(HUGE), cfg)


def test_moec_train_refuses_a_plan_over_the_limit_in_one_line(tmp_path, capsys):
    plan = tmp_path / "huge.yaml"
    plan.write_text(json.dumps(HUGE))
    argv = _train_argv(tmp_path, "--plan", str(plan), "--memory-limit-gib", "1")
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    line = _error_line(capsys)
    assert "GiB per rank, more than the 1 GiB available" in line and "parallel.ep" in line


# --- item 6: data ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["objects", "negative", "heavy"])
def test_moec_train_on_bad_data_is_one_line_naming_the_file(tmp_path, capsys, kind):
    """A .npy of Python objects, negative ids (read in the capture's first batch) and a data
    spec weighting a source ``heavy``. Before: tracebacks, or an IndexError in the step."""
    data = tmp_path / "ids.npy"
    if kind == "objects":
        np.save(data, np.array([1, "two", None] * 40, dtype=object), allow_pickle=True)
    else:
        np.save(data, np.full(100, -1 if kind == "negative" else GOOD, dtype=np.int64))
    if kind == "heavy":
        spec = tmp_path / "data.yaml"
        spec.write_text(f"sources:\n  - {{path: {data}, weight: heavy}}\n")
        data = spec
    argv = _train_argv(tmp_path, "--out", str(tmp_path / "run"))
    argv.remove("--synthetic")
    assert main([*argv, "--data", str(data)]) == 2
    line = _error_line(capsys)
    assert str(data) in line
    assert {"objects": "integer token ids", "negative": "token id -1", "heavy": "weight"}[
        kind
    ] in line


def _first_failing_step(data: Path, cfg) -> tuple[int, int]:
    """(window, step): a window the run's corpus first reads at a step in 2..9 (never before).
    Window w of ``data`` starts with id w, so a batch's first column names its windows."""
    tokens = np.full(WINDOW * 64, GOOD, dtype=np.uint16)
    tokens[::WINDOW] = np.arange(64)
    tokens.tofile(data)
    corpus = TokenCorpus(parse_spec(str(data)), cfg.batch_size, cfg.seq_len, 256, cfg.seed)
    seen: set[int] = set()
    for step in range(10):
        drawn = set(corpus.batch(step)[0][:, 0].tolist())
        fresh = drawn - seen
        if step >= 2 and fresh:
            return min(fresh), step
        seen |= drawn
    raise AssertionError("no window is first read at steps 2..9")


def _set_id(data: Path, offset: int, value: int) -> None:
    tokens = np.fromfile(data, dtype=np.uint16)
    tokens[offset] = value
    tokens.tofile(data)


@pytest.mark.slow
def test_a_bad_id_mid_run_leaves_a_checkpoint_that_resumes_after_the_fix(tmp_path):
    """Before: the run stopped without a checkpoint, so --resume restarted from step 0."""
    data = tmp_path / "tokens.bin"
    kw = dict(steps=12, checkpoint_every=100, synthetic=False, data=str(data))
    window, step = _first_failing_step(data, synthetic_cfg(tmp_path, **kw))
    offset = window * WINDOW + 5
    _set_id(data, offset, BAD)
    torch.manual_seed(0)
    with pytest.raises(CorpusError) as info:
        train(tiny_llama(), PLAN, synthetic_cfg(tmp_path / "run", **kw))
    message = str(info.value)
    assert f"tokens.bin holds token id {BAD} at token offset {offset} (window {window}" in message
    assert f"read at step {step})" in message and f"checkpoints/step_{step}" in message
    assert "fix the data, then --resume" in message
    assert _committed(tmp_path / "run") == [f"step_{step}"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert f"step_{step}" in summary["error"]

    _set_id(data, offset, GOOD)  # the fix: same file, same size
    torch.manual_seed(1234)  # the checkpoint decides where the resumed run starts
    resumed = train(tiny_llama(), PLAN, synthetic_cfg(tmp_path / "run", resume=True, **kw))
    torch.manual_seed(0)
    straight = train(tiny_llama(), PLAN, synthetic_cfg(tmp_path / "straight", **kw))
    assert len(resumed.losses) == 12 - step
    assert resumed.losses == straight.losses[step:]


def test_a_bad_id_mid_run_under_checkpoint_every_0_says_nothing_was_kept(tmp_path):
    data = tmp_path / "tokens.bin"
    kw = dict(steps=12, checkpoint_every=0, synthetic=False, data=str(data))
    window, step = _first_failing_step(data, synthetic_cfg(tmp_path, **kw))
    _set_id(data, window * WINDOW, BAD)
    with pytest.raises(CorpusError, match=rf"stopped at step {step}; no checkpoint was written"):
        train(tiny_llama(), PLAN, synthetic_cfg(tmp_path / "run", **kw))
    assert _committed(tmp_path / "run") == []


# --- item 8: output folders ------------------------------------------------------------------


def _unwritable(folder: Path) -> bool:
    try:
        (folder / ".probe").touch()
    except OSError:
        return True
    (folder / ".probe").unlink()
    return False


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder no one can write in: mode 0o555, and for root (whom modes do not stop)
    immutable (``chattr +i``); skipped where neither holds."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    immutable = False
    if not _unwritable(folder) and shutil.which("chattr"):
        immutable = (
            subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
        )
    try:
        if not _unwritable(folder):
            pytest.skip("no way to make a read-only folder here")
        yield folder
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


@pytest.mark.parametrize("under", ["", "run"])
def test_moec_train_into_a_read_only_folder_is_one_line(tmp_path, capsys, read_only_folder, under):
    """Before: a PermissionError traceback once the model was compiled."""
    out = read_only_folder / under if under else read_only_folder
    assert main([*_train_argv(tmp_path), "--out", str(out)]) == 2
    line = _error_line(capsys)
    assert f"--out) = {str(out)!r}: moec cannot create this folder or write in it" in line


@pytest.mark.parametrize("command", ["train", "debug"])
@pytest.mark.parametrize("under", ["", "run"])
def test_an_out_under_a_file_is_one_line(tmp_path, capsys, command, under):
    """``--out FILE`` and ``--out FILE/run``. Before: FileExistsError / NotADirectoryError."""
    file = tmp_path / "a_file"
    file.write_text("not a folder")
    out = file / under if under else file
    if command == "train":
        argv = [*_train_argv(tmp_path), "--out", str(out)]
    else:
        argv = ["debug", "llama", "--out", str(out)]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert f"{str(out)!r}: moec cannot create this folder" in line
    assert ("it is a file" if not under else "a folder above it is a file") in line
    assert file.read_text() == "not a folder"
    assert os.path.isfile(file)
