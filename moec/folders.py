"""The folders moec writes its outputs into (``moec train --out``, ``moec debug --out``).

:func:`writable_folder` makes the folder (with its parents) and writes and removes one empty
file in it before any work starts, so that a folder that cannot be written (read-only, on a
read-only file system, under a regular file, or a file itself) is one
:class:`OutputFolderError` naming it, not a traceback after the model was built.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from moec.errors import MoecError


class OutputFolderError(MoecError):
    """An output folder that cannot be created or written."""


def writable_folder(path: str | Path, where: str) -> Path:
    """``path`` as a folder moec can write in (made where missing); ``where`` names the
    setting that chose it (``--out``) in the error."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".moec-write-check-", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        problem = exc.strerror or type(exc).__name__
        if folder.exists() and not folder.is_dir():
            problem = "it is a file"
        elif isinstance(exc, NotADirectoryError):
            problem = "a folder above it is a file"
        raise OutputFolderError(
            f"{where} = {str(folder)!r}: moec cannot create this folder or write in it "
            f"({problem}); give a folder you can write to"
        ) from exc
    return folder
