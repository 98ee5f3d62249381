"""Lazy package exports (PEP 562): a package names what it exports and where each name lives,
and the module holding it is imported on first use, so importing the package (``moec``, or
``moec.cli`` to print ``moec --help``) does not import torch.

    __getattr__, __dir__ = lazy_exports(globals(), {"Plan": "moec.plan", ...})
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], exports: dict[str, str], before: Iterable[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package whose ``globals()`` is ``namespace``:
    ``exports`` maps each exported name to the module defining it, imported (after the modules
    ``before``) when the name is first read, then cached in the package. Any other name is tried
    as a submodule (``moec.ops`` after ``import moec``), else it is an :class:`AttributeError`."""
    package = namespace["__name__"]
    before = tuple(before)

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # introspection (copy, pickle, pytest) must not import torch
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        for module in before:
            importlib.import_module(module)
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            namespace[name] = value
            return value
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__


def lazy_command(ref: str) -> Callable[[Any], int]:
    """A command's function for its parser (``set_defaults(func=...)``): the function ``ref``
    (``module.path:name``) imported when the command runs, its exit status (None: 0)."""
    module, _, name = ref.partition(":")

    def run(args: Any) -> int:
        return getattr(importlib.import_module(module), name)(args) or 0

    run.__qualname__ = run.__name__ = name
    return run
