"""Resolve a reference ``module.path:name`` or ``path/to/file.py:name`` to the object it names.

Used for user code named in plans (``moe.activations``, loaded when a model is compiled with
the plan, never when a plan is only read) and model specs. A ``.py`` file is loaded as a fresh
module each time; a module path is imported (and cached) as usual. Failures raise
:class:`ValueError` with a one-line reason; callers wrap it in their own error, which names the
plan field or spec.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType


def split_ref(ref: str) -> tuple[str, str]:
    """``(where, name)`` of ``ref``, checked for its form only: nothing is imported or run."""
    where, sep, name = ref.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"{ref!r} is not of the form module.path:name or path/to/file.py:name")
    return where, name


def load_object(ref: str) -> object:
    """The attribute ``name`` of the module or file that ``ref`` (``where:name``) names: the
    module is imported, the file run."""
    where, name = split_ref(ref)
    module = _load_file(Path(where)) if where.endswith(".py") else _import(where)
    if not hasattr(module, name):
        raise ValueError(f"{where} has no attribute {name!r}")
    return getattr(module, name)


def _import(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except Exception as exc:
        raise ValueError(f"importing {module} failed: {type(exc).__name__}: {exc}") from exc


def _load_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise ValueError(f"file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"moec_user_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
