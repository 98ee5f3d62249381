"""Committed checkpoints of a run: written aside, sealed by a manifest, the newest K kept.

Layout under ``root`` (a run's ``checkpoints`` folder): ``step_N/`` is a committed checkpoint;
it holds what the writer wrote (DCP shards, ``.metadata``, trainer files) and ``manifest.json``,
``{"step": N, "files": {relative path: {"bytes": size, "sha256": hex digest}}}``, written last.
``.step_N.partial/`` is a checkpoint being written; it never counts and the next commit
removes it.

:meth:`CheckpointStore.commit` (collective over the job where ``distributed``): rank 0 clears a
stale partial folder; every rank writes into it (``write(folder)``); the ranks agree that every
write succeeded, then each hashes (and fsyncs) its share of the files into
``manifest_rank{r}.json``; after a barrier rank 0 merges those into ``manifest.json`` (written to
a temporary name and renamed), renames the folder to ``step_N``, fsyncs ``root`` and deletes
all but the newest ``keep`` committed checkpoints. A crash at any point leaves every folder
named ``step_N`` complete.

:meth:`CheckpointStore.newest_verified` walks the committed checkpoints newest first and
returns the first whose files all match the manifest (present, same size, same checksum;
the ranks split the files and agree), reporting each one skipped with the file and the
reason. A failed write raises :class:`CheckpointWriteError` naming the folder, the cause
("disk full", "permission denied") and the bytes needed against the bytes free; the partial
folder is removed.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from moec.errors import MoecError

MANIFEST = "manifest.json"
_STEP = re.compile(r"step_(\d+)")
_CHUNK = 1 << 22


class CheckpointWriteError(MoecError):
    """A checkpoint that could not be written (disk full, permission denied, ...)."""


class CheckpointSpaceError(CheckpointWriteError):
    """Predicted before the first write: the checkpoint does not fit on the disk."""


@dataclasses.dataclass(frozen=True)
class Committed:
    step: int
    path: Path


class CheckpointStore:
    def __init__(
        self,
        root: Path,
        keep: int,
        *,
        distributed: bool = False,
        device: torch.device | None = None,
        report: Callable[[str], None] = print,
    ):
        self.root, self.keep = root, keep
        self.distributed = distributed
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size() if distributed else 1
        self.device = device or torch.device("cpu")
        self.report = report if self.rank == 0 else _silent
        self.expected_bytes: int | None = None
        """What one checkpoint is predicted to take (for the messages of failed writes)."""

    # --- listing and verification --------------------------------------------------------------

    def committed(self) -> list[Committed]:
        """Folders named ``step_N`` that hold a manifest, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _STEP.fullmatch(path.name)
            if match and path.is_dir() and (path / MANIFEST).exists():
                found.append(Committed(int(match.group(1)), path))
        return sorted(found, key=lambda c: c.step)

    def uncommitted(self) -> list[Path]:
        """``step_N`` folders without a manifest (never committed, or an older moec's)."""
        if not self.root.is_dir():
            return []
        return sorted(
            p
            for p in self.root.iterdir()
            if _STEP.fullmatch(p.name) and p.is_dir() and not (p / MANIFEST).exists()
        )

    def newest_verified(self) -> Committed | None:
        """The newest committed checkpoint whose files match its manifest (see module)."""
        for path in self.uncommitted():
            self.report(f"skipping checkpoint {path}: no {MANIFEST} (it was never committed)")
        for candidate in reversed(self.committed()):
            problem = self._agree_problem(self.verify(candidate.path))
            if problem is None:
                return candidate
            self.report(f"skipping checkpoint {candidate.path}: {problem}")
        return None

    def verify(self, path: Path) -> str | None:
        """Why ``path`` does not match its manifest (this rank's share of the files), or None."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            files = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"{path / MANIFEST} cannot be read ({exc})"
        for name in sorted(files)[self.rank :: self.world]:
            problem = _check_file(path / name, files[name])
            if problem:
                return problem
        return None

    def _agree_problem(self, problem: str | None) -> str | None:
        """Every rank verified its share: a problem on any rank is a problem for all."""
        if not self.distributed:
            return problem
        bad = torch.tensor([0 if problem is None else 1], device=self.device)
        dist.all_reduce(bad)
        if problem is None and int(bad.item()):
            return "another rank found a file that does not match the manifest"
        return problem

    # --- writing -------------------------------------------------------------------------------

    def commit(self, step: int, write: Callable[[Path], None]) -> Committed:
        """Write a checkpoint with ``write(folder)`` and commit it as ``step_N`` (see module)."""
        partial = self.root / f".step_{step}.partial"
        final = self.root / f"step_{step}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        self._barrier()

        def write_files() -> None:
            partial.mkdir(parents=True, exist_ok=True)
            write(partial)

        # each stage ends in an all-reduce of the ranks' failures: all go on, or all raise
        self._stage(partial, write_files)
        self._stage(partial, lambda: self._write_partial_manifest(partial))
        self._stage(partial, lambda: self._seal(partial, final, step) if self.rank == 0 else None)
        if self.rank == 0:
            self._retain()
        self._barrier()
        return Committed(step, final)

    def _stage(self, partial: Path, action: Callable[[], None]) -> None:
        failure = None
        try:
            action()
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            failure = exc
        if self._any_failed(failure is not None):
            if self.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise self._write_error(partial, failure) from failure

    def _write_partial_manifest(self, folder: Path) -> None:
        names = sorted(
            str(p.relative_to(folder))
            for p in folder.rglob("*")
            if p.is_file() and not p.name.startswith("manifest")
        )
        share = {name: _describe(folder / name) for name in names[self.rank :: self.world]}
        _write_json(folder / f"manifest_rank{self.rank}.json", share)

    def _seal(self, partial: Path, final: Path, step: int) -> None:
        files: dict[str, Any] = {}
        for part in sorted(partial.glob("manifest_rank*.json")):
            files.update(json.loads(part.read_text()))
            part.unlink()
        _write_json(partial / MANIFEST, {"step": step, "files": files})
        if final.exists():  # a checkpoint of this step from before a resume: replaced
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(self.root)

    def _retain(self) -> None:
        for old in self.committed()[: -self.keep]:
            shutil.rmtree(old.path, ignore_errors=True)

    def _write_error(self, partial: Path, failure: BaseException | None) -> CheckpointWriteError:
        final = self.root / partial.name.removeprefix(".").removesuffix(".partial")
        if failure is None:
            return CheckpointWriteError(
                f"checkpoint {final} was not written: another rank failed to write its part "
                "(its error names the cause)"
            )
        os_error = _os_error(failure)
        if os_error is None:
            return CheckpointWriteError(f"checkpoint {final} was not written: {failure!r}")
        free = free_bytes(self.root)
        need = "unknown" if self.expected_bytes is None else _size(self.expected_bytes)
        cause = {
            errno.ENOSPC: "disk full",
            errno.EDQUOT: "disk quota exceeded",
            errno.EACCES: "permission denied",
            errno.EPERM: "permission denied",
            errno.EROFS: "read-only file system",
        }.get(os_error.errno, os_error.strerror or str(os_error))
        return CheckpointWriteError(
            f"checkpoint {final} was not written: {cause} ({os_error}); one checkpoint needs "
            f"about {need}, {_size(free)} free on that disk: free space, write to another "
            "--out, or keep fewer checkpoints (--keep-checkpoints)"
        )

    # --- space ---------------------------------------------------------------------------------

    def space_problem(self, needed: int) -> tuple[str, bool] | None:
        """A message where the checkpoints are predicted not to fit, and whether even one does
        not (the newest ``keep`` stay on disk while the next one is written)."""
        self.expected_bytes = needed
        free = free_bytes(self.root)
        existing = sum(_tree_bytes(c.path) for c in self.committed())
        peak = needed * (self.keep + 1) - min(existing, needed * self.keep)
        if free >= peak:
            return None
        return (
            f"checkpoints under {self.root} need about {_size(needed)} each "
            f"(parameters and optimizer state; {self.keep} kept plus the one being written), "
            f"{_size(free)} free on that disk",
            free < needed,
        )

    # --- collectives ---------------------------------------------------------------------------

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _any_failed(self, failed: bool) -> bool:
        if not self.distributed:
            return failed
        flag = torch.tensor([int(failed)], device=self.device)
        dist.all_reduce(flag)
        return bool(flag.item())


def _silent(message: str) -> None:
    """Ranks other than 0 report nothing (rank 0 reports what every rank found)."""


def free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds ``path`` (or its nearest existing parent)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _describe(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _check_file(path: Path, want: dict[str, Any]) -> str | None:
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != want["bytes"]:
        return f"{path} has {size} bytes, its manifest says {want['bytes']} (truncated?)"
    if _describe(path)["sha256"] != want["sha256"]:
        return f"{path} does not match its manifest's sha256 (corrupted)"
    return None


def _write_json(path: Path, value: Any) -> None:
    partial = path.with_name(path.name + ".partial")
    with partial.open("w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: itself, its cause/context, or (DCP's CheckpointException)
    one of the ranks' failures."""
    seen: set[int] = set()
    pending: list[Any] = [exc]
    while pending:
        item = pending.pop()
        if isinstance(item, tuple):  # DCP's (exception, traceback) pairs
            pending += [x for x in item if isinstance(x, BaseException)]
            continue
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno is not None:
            return item
        pending += [item.__cause__, item.__context__]
        pending += list(getattr(item, "failures", {}).values())
    return None


def _size(n: int) -> str:
    """``n`` bytes for a message: 812 B, 3.4 MB, 80.2 GB."""
    units = ("B", "KB", "MB", "GB", "TB")
    power = 0
    while n >= 1024 ** (power + 1) and power < len(units) - 1:
        power += 1
    return f"{n} B" if power == 0 else f"{n / 1024**power:.1f} {units[power]}"
