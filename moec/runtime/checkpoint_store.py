"""Committed checkpoints of a run: written aside, sealed by a manifest, the newest K kept.

Layout under ``root`` (a run's ``checkpoints`` folder): ``step_N/`` is a committed checkpoint;
it holds what the writer wrote (DCP shards, ``.metadata``, trainer files) and ``manifest.json``,
``{"step": N, "files": {relative path: {"bytes": size, "sha256": hex digest}}}``, written last
and listing every other file of the folder. ``.step_N.partial/`` is a checkpoint being written;
it never counts and the next commit removes it. ``root`` and the folders in it are never links
(:mod:`moec.runtime.run_files`: a linked ``root`` is refused, a linked partial folder or
``step_N`` replaced, never written through).

:meth:`CheckpointStore.commit` (collective over the job where ``distributed``): rank 0 clears a
stale partial folder; every rank writes into it (``write(folder)``); the ranks agree that every
write succeeded, then each hashes (and fsyncs) its share of the files into
``manifest_rank{r}.json``; after a barrier rank 0 merges those into ``manifest.json`` (written to
a temporary name and renamed), renames the folder to ``step_N``, fsyncs ``root`` and deletes
all but the newest ``keep`` committed checkpoints. A crash at any point leaves every folder
named ``step_N`` complete.

:meth:`CheckpointStore.verified` walks the committed checkpoints newest first and yields
those that match their manifest, reporting each one skipped with the file and the reason.
Matching: the manifest lists at least one file; the folder holds exactly the files it lists
(an unlisted file, a missing one or a link fails: nothing the manifest does not vouch for is
ever read); each has the listed size and sha256 (the ranks split the hashing and agree). This
catches damage; it does not make a folder from someone else safe to unpickle (its manifest can
be re-sealed): :mod:`moec.runtime.safe_read` reads the verified files without running code.
A failed write raises :class:`CheckpointWriteError` naming the folder, the cause
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
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from moec.errors import MoecError
from moec.runtime import run_files

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

    def verified(self) -> Iterator[Committed]:
        """The committed checkpoints that match their manifests, newest first, each verified
        when asked for; every one skipped is reported with the file and the reason (see
        module). Collective where ``distributed``: every rank walks it in step."""
        for path in self.uncommitted():
            self.report(f"skipping checkpoint {path}: no {MANIFEST} (it was never committed)")
        for candidate in reversed(self.committed()):
            problem = self.agree(self.verify(candidate.path))
            if problem is None:
                yield candidate
            else:
                self.report(f"skipping checkpoint {candidate.path}: {problem}")

    def newest_verified(self) -> Committed | None:
        """The newest committed checkpoint whose files match its manifest (see module)."""
        return next(self.verified(), None)

    def verify(self, path: Path) -> str | None:
        """Why ``path`` does not match its manifest (the folder's list of files, and this rank's
        share of their sizes and checksums), or None."""
        if path.is_symlink():
            return f"{path} is a symbolic link (moec writes none)"
        files = _manifest_files(path)
        if isinstance(files, str):
            return files
        problem = _listing_problem(path, set(files))
        if problem:
            return problem
        for name in sorted(files)[self.rank :: self.world]:
            problem = _check_file(path / name, files[name])
            if problem:
                return problem
        return None

    def agree(self, problem: str | None) -> str | None:
        """``problem`` where this rank found one, else the first other rank's (``rank r:
        ...``), else None: where ``distributed``, the ranks exchange what they found, so every
        rank decides the same and rank 0, which reports, can name the cause."""
        if not self.distributed:
            return problem
        found: list[str | None] = [None] * self.world
        dist.all_gather_object(found, problem)
        if problem is not None:
            return problem
        return next((f"rank {r}: {p}" for r, p in enumerate(found) if p is not None), None)

    # --- writing -------------------------------------------------------------------------------

    def commit(self, step: int, write: Callable[[Path], None]) -> Committed:
        """Write a checkpoint with ``write(folder)`` and commit it as ``step_N`` (see module)."""
        partial = self.root / f".step_{step}.partial"
        final = self.root / f"step_{step}"
        if self.rank == 0:
            run_files.real_folder(self.root)
            _remove(partial)
        self._barrier()

        def write_files() -> None:
            write(run_files.real_folder(partial))

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
                _remove(partial)
            raise self._write_error(partial, failure) from failure

    def _write_partial_manifest(self, folder: Path) -> None:
        names = sorted(
            str(p.relative_to(folder))
            for p in folder.rglob("*")
            # the ranks' manifests, and a faster rank's being written (run_files' ".NAME...")
            if p.is_file() and not p.name.startswith(("manifest", ".manifest"))
        )
        share = {name: _describe(folder / name) for name in names[self.rank :: self.world]}
        _write_json(folder / f"manifest_rank{self.rank}.json", share)

    def _seal(self, partial: Path, final: Path, step: int) -> None:
        files: dict[str, Any] = {}
        for part in sorted(partial.glob("manifest_rank*.json")):
            files.update(json.loads(part.read_text()))
            part.unlink()
        _write_json(partial / MANIFEST, {"step": step, "files": files})
        _remove(final)  # a checkpoint of this step from before a resume: replaced
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


def _manifest_files(path: Path) -> dict[str, dict[str, Any]] | str:
    """The ``files`` of ``path``'s manifest, or why it cannot be used."""
    where = path / MANIFEST
    try:
        files = json.loads(where.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{where} cannot be read ({type(exc).__name__}: {exc})"
    if not isinstance(files, dict) or not files:
        return f"{where} lists no files"
    for name, entry in files.items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and isinstance(entry.get("sha256"), str)
        ):
            return f"{where}: the entry of {name!r} is not {{bytes: int, sha256: hex}}"
    return files


def _listing_problem(path: Path, listed: set[str]) -> str | None:
    """Where ``path`` does not hold exactly the files ``listed`` (besides its manifest): an
    unlisted file, a missing one, a link or anything but a file."""
    present = set()
    for folder, dirs, names in os.walk(path):  # links to folders are listed, not followed
        for name in dirs + names:
            entry = Path(folder) / name
            relative = str(entry.relative_to(path))
            if entry.is_symlink():
                return f"{entry} is a symbolic link (moec writes none)"
            if name in names and relative != MANIFEST:
                if not stat.S_ISREG(entry.lstat().st_mode):
                    return f"{entry} is not a regular file"
                present.add(relative)
    extra = sorted(present - listed)
    if extra:
        return f"{path / extra[0]} is not listed in its manifest (moec reads only listed files)"
    missing = sorted(listed - present)
    if missing:
        return f"{path / missing[0]} is missing"
    return None


def _check_file(path: Path, want: dict[str, Any]) -> str | None:
    try:
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{path} has {size} bytes, its manifest says {want['bytes']} (truncated?)"
        if _describe(path)["sha256"] != want["sha256"]:
            return f"{path} does not match its manifest's sha256 (corrupted)"
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    return None


def _write_json(path: Path, value: Any) -> None:
    run_files.write_text(path, json.dumps(value, indent=1, sort_keys=True), fsync=True)


def _remove(path: Path) -> None:
    """Remove the folder ``path`` (a link there: the link, not what it points to)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


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
