"""Fault injection on run folders (issue 49: 1, 7, 8): payloads in a checkpoint never run on
``moec train --resume`` nor on ``moec export``; every checkpoint that fails to verify or to
load is skipped with its reason and the next one is tried; ``run.json`` changes only once a
resume has loaded; moec writes no file through a link out of ``--out``; code a plan names
runs only when a model is compiled with a plan the user gave.

The payload is harmless: unpickling it creates a marker file (``exec`` of one ``open``)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from transformers import LlamaConfig

from moec.cli import main
from moec.runtime.checkpoint_store import CheckpointStore
from moec.runtime.run_files import replacing
from moec.runtime.safe_read import MetadataUnpickler, read_metadata
from tests.test_run_reliability import _train_args, _write_factory

STEPS = ("--steps", "6", "--checkpoint-every", "2", "--keep-checkpoints", "4")


class Payload:
    """Unpickled, it creates ``marker``: what an attacker's code would do, harmlessly."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, str]:
    """A CLI run of 6 steps with checkpoints at steps 2, 4 and 6, and its model spec."""
    base = tmp_path_factory.mktemp("trained")
    model = _write_factory(base)
    assert main(_train_args(model, base, base / "run", *STEPS)) == 0
    return base, model


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run as if killed after step 5: its step_6 gone."""
    base, _ = trained
    shutil.copytree(base / "run", tmp_path / "run", symlinks=True)
    shutil.copy(base / "plan.yaml", tmp_path / "plan.yaml")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_6")
    return tmp_path / "run"


@pytest.fixture
def exportable(tmp_path) -> Path:
    """A run folder made without training: ``run.json`` with a plan, and two committed DCP
    checkpoints of one tensor (all an export reads before the model's tensors)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"plan": {"moe": {"num_experts": 4}}}))
    store = CheckpointStore(run / "checkpoints", keep=2)

    def write(folder: Path) -> None:
        with warnings.catch_warnings():  # DCP: no process group, one process assumed
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.zeros(3)}, checkpoint_id=folder)

    for step in (2, 4):
        store.commit(step, write)
    return run


def _resume(trained, run: Path, capsys, *extra: str) -> tuple[int, str]:
    """``moec train --resume`` of ``run``: exit status and what it printed, on one line."""
    capsys.readouterr()
    code = main(_train_args(trained[1], run.parent, run, *STEPS, "--resume", *extra))
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


def _reseal(step: Path, name: str) -> None:
    """Make ``step``'s manifest vouch for ``name`` as it is now (as its author could)."""
    manifest = json.loads((step / "manifest.json").read_text())
    data = (step / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))


def _unlist(step: Path, name: str) -> None:
    manifest = json.loads((step / "manifest.json").read_text())
    del manifest["files"][name]
    (step / "manifest.json").write_text(json.dumps(manifest))


def _poison_trainer_file(step: Path, marker: Path) -> None:
    """The real trainer.pt with a payload beside its entries (its old loader ran it and went
    on)."""
    state = torch.load(step / "trainer.pt", weights_only=True)
    torch.save({**state, "note": Payload(marker)}, step / "trainer.pt")


def _poison_metadata(step: Path, marker: Path) -> None:
    """The real ``.metadata`` with a payload in its planner data (which DCP ignores)."""
    with (step / ".metadata").open("rb") as f:
        metadata = pickle.load(f)
    metadata.planner_data["note"] = Payload(marker)
    with (step / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)


# --- payloads never run on --resume -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("how", ["resealed", "unlisted"])
def test_a_payload_in_trainer_pt_never_runs_on_resume(trained, run, tmp_path, capsys, how):
    marker = tmp_path / "payload_ran"
    step = run / "checkpoints" / "step_4"
    _poison_trainer_file(step, marker)
    (_reseal if how == "resealed" else _unlist)(step, "trainer.pt")
    code, out = _resume(trained, run, capsys)
    assert not marker.exists()
    assert code == 0, out
    reason = (
        f"{step / 'trainer.pt'} holds objects other than tensors, numbers and containers"
        if how == "resealed"
        else "trainer.pt is not listed in its manifest"
    )
    assert f"skipping checkpoint {step}" in out and reason in out, out
    assert "resumed from step 2" in out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["resealed", "unlisted"])
def test_a_payload_in_dcp_metadata_never_runs_on_resume(trained, run, tmp_path, capsys, how):
    marker = tmp_path / "payload_ran"
    step = run / "checkpoints" / "step_4"
    _poison_metadata(step, marker)
    (_reseal if how == "resealed" else _unlist)(step, ".metadata")
    code, out = _resume(trained, run, capsys)
    assert not marker.exists()
    assert code == 0, out
    reason = "names builtins.exec" if how == "resealed" else ".metadata is not listed"
    assert f"skipping checkpoint {step}" in out and reason in out, out
    assert "resumed from step 2" in out


@pytest.mark.slow
def test_a_payload_among_dcp_entries_never_runs_on_resume(trained, run, tmp_path, capsys):
    """An optimizer setting (a DCP byte entry, which DCP's own planner reads with
    weights_only=False) pointed at a payload in a new shard, metadata and manifest re-sealed."""
    marker = tmp_path / "payload_ran"
    step = run / "checkpoints" / "step_4"
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    (step / "extra.distcp").write_bytes(payload.getvalue())
    with (step / ".metadata").open("rb") as f:
        metadata = pickle.load(f)
    index = next(i for i in metadata.storage_data if i.fqn.startswith("optim.param_groups."))
    metadata.storage_data[index] = dataclasses.replace(
        metadata.storage_data[index],
        relative_path="extra.distcp",
        offset=0,
        length=len(payload.getvalue()),
    )
    with (step / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)
    _reseal(step, ".metadata")
    _reseal(step, "extra.distcp")
    code, out = _resume(trained, run, capsys)
    assert not marker.exists()
    assert code == 0, out
    assert f"the entry {index.fqn} holds objects other than tensors" in out, out
    assert "resumed from step 2" in out


@pytest.mark.slow
def test_an_unlisted_file_fails_verification(trained, run, capsys):
    step = run / "checkpoints" / "step_4"
    (step / "extra.pt").write_bytes(b"anything")
    code, out = _resume(trained, run, capsys)
    assert code == 0, out
    assert f"{step / 'extra.pt'} is not listed in its manifest" in out
    assert "resumed from step 2" in out


# --- every failed read is a skip, then the next verified checkpoint -----------------------------


@pytest.mark.slow
def test_a_manifest_listing_no_files_and_a_truncated_shard_fall_back(trained, run, capsys):
    step = run / "checkpoints" / "step_4"
    (step / "manifest.json").write_text(json.dumps({"step": 4, "files": {}}))
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    code, out = _resume(trained, run, capsys)
    assert code == 0, out
    assert "manifest.json lists no files" in out and "resumed from step 2" in out


@pytest.mark.slow
def test_a_dcp_read_failure_is_a_skip_whatever_its_exception_class(trained, run, capsys):
    """A truncated shard under a re-sealed manifest verifies; DCP's read raises its
    CheckpointException (a BaseException)."""
    step = run / "checkpoints" / "step_4"
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    _reseal(step, shard.name)
    code, out = _resume(trained, run, capsys)
    assert code == 0, out
    assert f"skipping checkpoint {step}: it does not load (rank 0:" in out
    assert "resumed from step 2" in out


@pytest.mark.slow
def test_a_resume_that_loads_nothing_leaves_run_json_as_it_was(trained, run, capsys):
    before = (run / "run.json").read_bytes()
    other = run.parent / "other.yaml"
    other.write_text("moe: {num_experts: 2, top_k: 1, init: random, dense_first: 1}\n")
    argv = _train_args(trained[1], run.parent, run, *STEPS, "--resume", "--force")
    argv[argv.index("--plan") + 1] = str(other)  # another plan: its experts do not load
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no checkpoint in" in err and "loads into this program" in err
    assert len(err.strip().splitlines()) == 1
    assert (run / "run.json").read_bytes() == before
    code, out = _resume(trained, run, capsys)  # the run's own command still resumes it
    assert code == 0 and "resumed from step 4" in out, out


# --- moec export --------------------------------------------------------------------------------


def _export(source: Path, tmp_path: Path, capsys) -> tuple[int, str]:
    """``moec export SOURCE`` with a dense Llama config: exit status and stderr."""
    LlamaConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2
    ).save_pretrained(tmp_path)
    capsys.readouterr()
    argv = ["export", str(source), "--to", str(tmp_path / "hf"), "--config", str(tmp_path)]
    return main(argv), capsys.readouterr().err


@pytest.mark.parametrize("how", ["resealed", "unlisted", "step folder"])
def test_a_payload_in_dcp_metadata_never_runs_on_export(exportable, tmp_path, capsys, how):
    marker = tmp_path / "payload_ran"
    for name in ("step_2", "step_4"):
        step = exportable / "checkpoints" / name
        _poison_metadata(step, marker)
        (_unlist if how == "unlisted" else _reseal)(step, ".metadata")
    code, err = _export(step if how == "step folder" else exportable, tmp_path, capsys)
    assert not marker.exists()
    assert code == 2
    expected = "not listed in its manifest" if how == "unlisted" else "names builtins.exec"
    assert expected in err, err


def test_export_refuses_a_step_folder_that_does_not_verify(exportable, tmp_path, capsys):
    step = exportable / "checkpoints" / "step_4"
    (step / "extra.pt").write_bytes(b"anything")
    code, err = _export(step, tmp_path, capsys)
    assert code == 2 and "extra.pt is not listed in its manifest" in err, err


def test_export_never_runs_code_named_by_the_runs_plan(exportable, tmp_path, capsys):
    marker = tmp_path / "plan_code_ran"
    acts = tmp_path / "acts.py"
    acts.write_text(f"open({str(marker)!r}, 'w').close()\n\ndef f(x):\n    return x\n")
    recorded = {"plan": {"moe": {"activations": {"mine": f"{acts}:f"}}}}
    (exportable / "run.json").write_text(json.dumps(recorded))
    code, err = _export(exportable, tmp_path, capsys)
    assert code == 2 and "token embedding" in err, err  # got past the plan: to the tensors
    assert not marker.exists()


# --- code a plan names --------------------------------------------------------------------------


def test_plan_show_runs_no_code_the_plan_names(tmp_path, capsys):
    marker = tmp_path / "plan_code_ran"
    acts = tmp_path / "acts.py"
    acts.write_text(f"open({str(marker)!r}, 'w').close()\n\ndef f(x):\n    return x\n")
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"moe:\n  num_experts: 2\n  activations:\n    mine: {acts}:f\n")
    assert main(["plan", "show", str(plan)]) == 0
    assert main(["plan", "show", str(plan), "--model", "llama"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "moe.activations (mine) is not loaded" in out
    assert not marker.exists()


# --- links out of --out -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_writes_no_file_through_a_link_out_of_its_folder(trained, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "run"
    out.mkdir()
    names = ("summary.json", "metrics.jsonl", "run.json", "loss.png")
    for name in names:
        (outside / name).write_text("theirs")
        (out / name).symlink_to(outside / name)
    (outside / "partial").mkdir()
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / ".step_2.partial").symlink_to(outside / "partial")
    shutil.copy(trained[0] / "plan.yaml", tmp_path / "plan.yaml")
    args = _train_args(trained[1], tmp_path, out, "--steps", "2", "--checkpoint-every", "2")
    assert main(args) == 0
    assert all((outside / name).read_text() == "theirs" for name in names)
    assert list((outside / "partial").iterdir()) == []
    for name in names:
        assert (out / name).is_file() and not (out / name).is_symlink()
    assert not (out / "checkpoints" / "step_2").is_symlink()


def test_a_linked_checkpoints_folder_is_refused_in_one_line(tmp_path, capsys):
    model = _write_factory(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").symlink_to(tmp_path / "elsewhere")
    capsys.readouterr()
    assert main(_train_args(model, tmp_path, out, "--steps", "2", "--force")) == 2
    err = capsys.readouterr().err
    assert "checkpoints is a symbolic link" in err and len(err.strip().splitlines()) == 1
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_replacing_replaces_a_link_and_leaves_its_target(tmp_path):
    (tmp_path / "target").write_text("theirs")
    (tmp_path / "file").symlink_to(tmp_path / "target")
    with replacing(tmp_path / "file") as partial:
        partial.write_text("ours")
    assert (tmp_path / "target").read_text() == "theirs"
    assert (tmp_path / "file").read_text() == "ours" and not (tmp_path / "file").is_symlink()
    with pytest.raises(RuntimeError), replacing(tmp_path / "file") as partial:
        raise RuntimeError  # a failed write leaves the file and no partial one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "target"]


# --- verification and the metadata unpickler, on their own ---------------------------------------


def _store_with_one_checkpoint(tmp_path: Path) -> tuple[CheckpointStore, Path]:
    store = CheckpointStore(tmp_path / "checkpoints", keep=2, report=lambda _: None)

    def write(folder: Path) -> None:
        (folder / "a.bin").write_bytes(b"a" * 10)
        (folder / "sub").mkdir()
        (folder / "sub" / "b.bin").write_bytes(b"b" * 5)

    return store, store.commit(1, write).path


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda p: (p / "c.bin").write_bytes(b"c"), "c.bin is not listed in its manifest"),
        (lambda p: (p / "sub" / "b.bin").unlink(), "b.bin is missing"),
        (lambda p: (p / "a.bin").write_bytes(b"A" * 10), "a.bin does not match"),
        (lambda p: (p / "a.bin").write_bytes(b"a"), "a.bin has 1 bytes"),
        (lambda p: os.symlink(p / "a.bin", p / "l.bin"), "l.bin is a symbolic link"),
        (
            lambda p: (p / "manifest.json").write_text('{"step": 1, "files": {}}'),
            "lists no files",
        ),
        (
            lambda p: (p / "manifest.json").write_text('{"files": {"a.bin": 3}}'),
            "the entry of 'a.bin' is not",
        ),
    ],
)
def test_verification_fails_on_what_the_manifest_does_not_vouch_for(tmp_path, damage, problem):
    store, step = _store_with_one_checkpoint(tmp_path)
    assert store.verify(step) is None
    damage(step)
    assert problem in (store.verify(step) or "")
    assert store.newest_verified() is None


def test_the_metadata_unpickler_reads_dcp_metadata_and_refuses_anything_else(exportable, tmp_path):
    step = exportable / "checkpoints" / "step_4"
    with (step / ".metadata").open("rb") as f:
        plain = pickle.load(f)
    assert read_metadata(step).state_dict_metadata == plain.state_dict_metadata
    marker = tmp_path / "payload_ran"
    with (tmp_path / "bad").open("wb") as f:
        pickle.dump({"x": Payload(marker)}, f)
    with (tmp_path / "bad").open("rb") as f, pytest.raises(pickle.UnpicklingError, match="exec"):
        MetadataUnpickler(f).load()
    assert not marker.exists()


def _agree_worker(rank: int, world: int, root: str, report: str) -> None:
    reports: list[str] = []
    store = CheckpointStore(Path(root), keep=2, distributed=True, report=reports.append)

    def write(folder: Path) -> None:
        (folder / f"rank{rank}.bin").write_bytes(bytes([rank]) * 8)

    step = store.commit(1, write).path
    dist.barrier()
    if rank == 1:  # a file in rank 1's share of the hashing: sorted names, every other one
        name = sorted(json.loads((step / "manifest.json").read_text())["files"])[1]
        (step / name).write_bytes(b"x" * 8)
    dist.barrier()
    assert store.newest_verified() is None  # every rank skips it
    if rank == 0:
        Path(report).write_text("\n".join(reports))


@pytest.mark.slow
def test_ranks_agree_on_a_checkpoint_and_rank_0_names_another_ranks_problem(tmp_path):
    from tests.distributed import spawn

    spawn(_agree_worker, 2, str(tmp_path / "checkpoints"), str(tmp_path / "report"))
    report = (tmp_path / "report").read_text()
    assert "rank 1: " in report and "rank1.bin does not match its manifest" in report, report
