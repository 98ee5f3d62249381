"""Writing into a run folder without following links out of it.

A run folder may come from someone else, or hold links a user left there: ``summary.json ->
~/.bashrc`` must not make a run overwrite ``~/.bashrc``. So moec writes each file of a run
folder (``run.json``, ``metrics.jsonl``, ``summary.json``, plots, manifests, profiles) under a
fresh name in its folder, created exclusively (never through an existing entry), and renames it
over the final name: a link there is replaced, never written through. The folders it writes
into below ``--out`` (``checkpoints/``, ``profile/``) must not be links: one is refused
(:class:`RunFolderError`, naming it and where it points). A checkpoint's files are written into
a partial folder the store has just made, after removing whatever had its name (a link: the
link itself; :mod:`moec.runtime.checkpoint_store`). ``--out`` itself may be a link: the user
named it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from moec.errors import MoecError


class RunFolderError(MoecError):
    """A folder under ``--out`` that is a link (which moec does not write through); an
    ``--out`` that cannot be written is :class:`moec.folders.OutputFolderError`."""


def refuse_link(path: Path) -> None:
    """Raise :class:`RunFolderError` where ``path`` is a link (see module)."""
    if path.is_symlink():
        raise RunFolderError(
            f"{path} is a symbolic link (to {os.readlink(path)}): moec writes only inside the "
            "run folder, never through links; remove the link, or give --out on that disk"
        )


def real_folder(path: Path) -> Path:
    """``path`` as a folder that is not a link (created if missing); a link is refused."""
    refuse_link(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A new empty file beside ``path`` for the block to write; renamed over ``path`` when the
    block ends without an error (an existing file or link at ``path`` is replaced, not
    followed), removed when it raises."""
    partial = _fresh(path)
    try:
        yield partial
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str, *, fsync: bool = False) -> None:
    """Write ``text`` to ``path`` in one rename (see :func:`replacing`); ``fsync``: on disk
    before the rename."""
    with replacing(path) as partial, partial.open("w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def open_log(path: Path, text: str) -> IO[str]:
    """``path`` holding ``text`` (written as :func:`write_text` does), open for appending; the
    open never follows a link (a link put there meanwhile fails it)."""
    write_text(path, text)
    flags = os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
    return os.fdopen(os.open(path, flags), "a")


def _fresh(path: Path) -> Path:
    """A new file ``.NAME.<random>.partial`` beside ``path``, created exclusively (an entry of
    that name, a link included, makes it try another name)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    while True:
        partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
        try:
            os.close(os.open(partial, flags, 0o666))
        except FileExistsError:
            continue
        return partial
