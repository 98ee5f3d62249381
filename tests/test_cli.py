"""The ``moec`` command line itself: ``moec train``'s flags are made from ``TrainConfig`` and
``moec data build``'s from ``BuildOptions`` (one flag per field, its default the field's, shown
in ``--help``), and building the parser or printing any command's ``--help`` imports no torch
(so that it starts at once)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys

import pytest

import moec.flags as flags
from moec.cli import build_parser, main
from moec.corpus_build import BuildOptions, parse_bytes, size_text
from moec.train.cli import DEMO_CONFIG, DEMO_FLAGS
from moec.train.config import TrainConfig, flag, from_flags
from tests.test_run_reliability import _train_args, _write_factory

FIELDS = dataclasses.fields(TrainConfig)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> list[tuple]:
    """Every command line that selects a (sub)command, the bare ``moec`` first."""
    found = [words]
    for name, sub in _subparsers(parser).items():
        found += _commands(sub, (*words, name))
    return found


def _options(parser: argparse.ArgumentParser, dest: str) -> list[argparse.Action]:
    return [a for a in parser._actions if a.dest == dest and a.option_strings]


def _help_entries(text: str) -> dict[str, str]:
    """``--help`` output as {first option string: its entry, whitespace collapsed}."""
    entries = re.split(r"\n  (?=-)", text)
    return {e.split()[0].rstrip(","): " ".join(e.split()) for e in entries[1:]}


def _help(words: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as done:
        main([*words, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_every_train_config_field_has_one_train_flag_defaulting_to_the_field():
    train = _subparsers(build_parser())["train"]
    for field in FIELDS:
        options = _options(train, field.name)
        assert len(options) == 1, f"TrainConfig.{field.name}: {len(options)} flags"
        assert options[0].option_strings == [flag(field.name)]
        assert options[0].default == field.default, field.name
    assert from_flags(build_parser().parse_args(["train"])) == TrainConfig()


def test_train_help_shows_every_default(capsys, monkeypatch):
    entries = _help_entries(_help(["train"], capsys, monkeypatch))
    for field in FIELDS:
        shown = flags.shown_default(field.default)
        entry = entries[flag(field.name)]
        if shown is not None:
            assert f"(default: {shown})" in entry, entry
        else:
            assert "(default: " not in entry, entry
    assert "(default: 100)" in entries["--steps"]
    assert "microbatch_size where it fixes one, else 8" in entries["--batch-size"]
    assert "(default: embeddings,norms,biases)" in entries["--no-decay"]
    assert "(default: llama)" in entries["--model"]


def test_every_build_option_has_one_data_build_flag_defaulting_to_the_field(capsys, monkeypatch):
    """``moec data build``'s flags are BuildOptions' fields (the same names as when they were
    written by hand); parsed without flags they are BuildOptions(); sizes read and show as 60M."""
    build = _subparsers(_subparsers(build_parser())["data"])["build"]
    for field in dataclasses.fields(BuildOptions):
        options = _options(build, field.name)
        assert len(options) == 1, f"BuildOptions.{field.name}: {len(options)} flags"
        assert options[0].option_strings == [flags.flag(BuildOptions, field.name)]
    names = {s for a in build._actions for s in a.option_strings}
    assert names == {
        "-h", "--help", "--source", "--max-bytes", "--max-file-bytes", "--tokenizer-sample-bytes",
        "--eval-fraction", "--vocab-size", "--force",
    }  # fmt: skip
    parse = build_parser().parse_args
    assert flags.from_flags(BuildOptions, parse(["data", "build", "d"])) == BuildOptions()
    given = ["data", "build", "d", "--source", "a", "--source", "b", "--max-bytes", "60M"]
    assert flags.from_flags(BuildOptions, parse(given)) == BuildOptions(
        sources=("a", "b"), max_bytes=60 * 10**6
    )
    entries = _help_entries(_help(["data", "build"], capsys, monkeypatch))
    shown = {
        "--max-bytes": "300M", "--max-file-bytes": "1M", "--tokenizer-sample-bytes": "20M",
        "--eval-fraction": "0.01", "--vocab-size": "8192",
    }  # fmt: skip
    for name, default in shown.items():
        assert entries[name].endswith(f"(default: {default})"), entries[name]
    assert entries["--source"].endswith("(repeatable); default: the installed Python packages")
    for count in (300 * 10**6, 4000, 1_234_567, 1):
        assert parse_bytes(size_text(count)) == count


def test_demo_flags_default_to_the_demo_run(capsys, monkeypatch):
    demo = _subparsers(build_parser())["demo"]
    assert {a.dest for a in demo._actions if a.option_strings} == {"help", *DEMO_FLAGS}
    args = build_parser().parse_args(["demo"])
    for name in DEMO_FLAGS:
        field = next(f for f in FIELDS if f.name == name)
        assert getattr(args, name) == DEMO_CONFIG.get(name, field.default), name
    entries = _help_entries(_help(["demo"], capsys, monkeypatch))
    assert "(default: 200)" in entries["--steps"] and "(default: runs/demo)" in entries["--out"]


def test_new_optimizer_flags_reach_the_config_and_are_checked(tmp_path, capsys):
    args = build_parser().parse_args(
        ["train", "--betas", "0.8,0.99", "--grad-clip", "0.5", "--no-plots", "--min-lr-ratio", "0"]
    )
    cfg = from_flags(args)
    assert cfg.betas == (0.8, 0.99) and cfg.grad_clip == 0.5 and cfg.plots is False
    assert cfg.min_lr_ratio == 0
    run = ["train", "--synthetic", "--steps", "1", "--out", str(tmp_path / "run")]
    for bad, named in ((["--betas", "0.9"], "--betas"), (["--grad-clip", "0"], "--grad-clip")):
        assert main([*run, *bad]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith("moec: error: ") and named in line


@pytest.mark.parametrize("words", _commands(build_parser()), ids=lambda w: " ".join(w) or "moec")
def test_help_imports_no_torch(words):
    """``moec [COMMAND ...] --help`` for every command the parser has, in a fresh interpreter:
    the parser is built and the help printed without torch (nor transformers) imported."""
    code = (
        "import sys, moec.cli\n"
        f"try:\n    moec.cli.main({[*words, '--help']!r})\n"
        "except SystemExit as done:\n    assert done.code == 0, done.code\n"
        "heavy = sorted({'torch', 'transformers'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "usage: moec" in done.stdout


def test_import_moec_imports_no_torch_until_a_name_is_used():
    """``import moec`` is lazy; the first name read imports what ``import moec`` used to (the
    ops registered, every exported module, so ``moec.runtime.compiled`` is there)."""
    code = (
        "import sys, moec\n"
        "assert 'torch' not in sys.modules\n"
        "from moec import Plan\n"
        "import torch\n"
        "assert torch.ops.moec.route.default and torch.ops.moec.ep_combine.default\n"
        "assert callable(moec.compile) and 'compile' in dir(moec)\n"
        "assert moec.runtime.compiled.CompiledModel is moec.CompiledModel\n"
        "try:\n    moec.no_such_name\nexcept AttributeError:\n    pass\n"
        "else:\n    raise AssertionError('moec.no_such_name')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_no_plots_writes_none_and_blames_no_missing_matplotlib(tmp_path, capsys):
    run = tmp_path / "run"
    model = _write_factory(tmp_path)  # two blocks, dim 16: plots do not depend on the model
    assert main(_train_args(model, tmp_path, run, "--steps", "1", "--no-plots")) == 0
    assert not list(run.glob("*.png"))
    assert "matplotlib" not in capsys.readouterr().out
