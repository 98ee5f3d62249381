"""Command-line flags made from a dataclass's fields: one flag per field, its default the field's.

Each field is declared once with :func:`option` (its default, its help, how its flag reads);
:func:`add_flags` adds the flags to a parser and :func:`from_flags` builds the dataclass back
from the parsed arguments, so a flag and its field never disagree. ``moec train``'s flags come
from :class:`~moec.train.config.TrainConfig`, ``moec data build``'s from
:class:`~moec.corpus_build.BuildOptions`.

A field's flag is ``--`` and its name with dashes (``max_bytes``: ``--max-bytes``), or
``--no-...`` for a bool field that defaults to True, or the ``flag`` its option names. A bool
field is a switch; a ``tuple[T, ...]`` field a repeatable flag (``--source A --source B``); a
field with a ``parse`` reads its text with it, and its default is shown as ``shown`` writes it
(``300M``); a field that also takes a ``str`` is given as one, which the dataclass parses.

This module imports nothing beyond the standard library (``moec COMMAND --help`` reads it).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

METAVARS = {int: "N", float: "X", str: "TEXT"}
"""A flag's metavar by the type its text converts to, where its option names none."""


def option(
    default: Any,
    help: str,
    *,
    section: str | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    shown: Callable[[Any], str] | None = None,
) -> Any:
    """A dataclass field with a flag: its ``default`` and ``help`` (the field's documentation and
    its flag's help), the help ``section`` (a key of the ``sections`` given to :func:`add_flags`;
    None: the parser's own options), the flag's ``metavar``, ``choices`` and name (``flag``;
    None: the field's name with dashes), ``parse`` (what reads the flag's text; None: the
    field's type) and ``shown`` (the default as the flag takes it, which ``parse`` reads back;
    None: as it is)."""
    meta = {
        "help": help,
        "section": section,
        "metavar": metavar,
        "choices": choices,
        "flag": flag,
        "parse": parse,
        "shown": shown,
    }
    return dataclasses.field(default=default, metadata=meta)


def declared_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of the dataclass ``cls`` by name, each checked to be declared by
    :func:`option` (its flag's help comes from there)."""
    fields = {field.name: field for field in dataclasses.fields(cls)}
    for name, field in fields.items():
        if "help" not in field.metadata:
            raise TypeError(f"{cls.__name__}.{name}: declare it with option(default, help)")
    return fields


def flag(cls: type, name: str) -> str:
    """The flag that sets the field ``name`` of ``cls`` (see module)."""
    field = declared_fields(cls)[name]
    if field.metadata["flag"]:
        return field.metadata["flag"]
    dashed = name.replace("_", "-")
    return f"--no-{dashed}" if field.default is True else f"--{dashed}"


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    fields: Iterable[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    sections: Mapping[str, str] | None = None,
) -> None:
    """Add to ``parser`` the flag of each field of ``cls`` (``fields``; None: every one), in the
    argument group titled ``sections[section]`` of the field's section, its default the
    field's (or ``defaults[name]``)."""
    declared = declared_fields(cls)
    chosen = set(declared) if fields is None else set(fields)
    unknown = chosen - set(declared)
    if unknown:
        raise ValueError(f"not {cls.__name__} fields: {', '.join(sorted(unknown))}")
    defaults, sections = defaults or {}, sections or {}
    hints = typing.get_type_hints(cls)
    groups: dict[str | None, Any] = {None: parser}
    for name, field in declared.items():
        if name not in chosen:
            continue
        section = field.metadata["section"]
        if section not in groups:
            groups[section] = parser.add_argument_group(sections[section])
        default = defaults.get(name, field.default)
        arguments = _arguments(cls, field, hints[name], default)
        groups[section].add_argument(flag(cls, name), dest=name, **arguments)


def _arguments(cls: type, field: dataclasses.Field, hint: Any, default: Any) -> dict[str, Any]:
    """``add_argument``'s keywords (but the flag and ``dest``) for ``field``, whose flag
    defaults to ``default``."""
    meta = field.metadata
    common = {"help": meta["help"].replace("%", "%%")}  # argparse %-formats help
    if isinstance(field.default, bool):
        action = "store_false" if field.default else "store_true"
        return {**common, "action": action, "default": default}
    if meta["parse"] is not None:  # a text default is read by parse (argparse does that)
        shown = meta["shown"](default) if meta["shown"] else default
        return {**common, "type": meta["parse"], "metavar": meta["metavar"], "default": shown}
    kind, repeated = _flag_type(cls, field.name, hint)
    metavar = meta["metavar"] or (None if meta["choices"] else METAVARS[kind])
    common.update(type=kind, metavar=metavar, choices=meta["choices"])
    if repeated:  # argparse appends to the default: a repeatable flag's must be empty
        if default:
            raise TypeError(f"{cls.__name__}.{field.name}: a repeatable flag defaults to ()")
        return {**common, "action": "append", "default": []}
    return {**common, "default": default}


def from_flags(cls: type, args: argparse.Namespace, **fixed: Any) -> Any:
    """The ``cls`` of the flags :func:`add_flags` added to ``args``'s parser (a repeatable flag's
    values as a tuple), over the fields ``fixed`` (those the command has no flag for)."""
    given = {}
    for name in declared_fields(cls):
        if hasattr(args, name):
            value = getattr(args, name)
            given[name] = tuple(value) if isinstance(value, list) else value
    return cls(**{**fixed, **given})


def shown_default(value: Any) -> str | None:
    """A default as ``--help`` shows it, in the form the flag takes (``embeddings,norms``,
    ``8:0,16:100``); None where there is nothing to show (None, a switch, an empty value)."""
    if value is None or isinstance(value, bool) or value in ((), "", []):
        return None
    if isinstance(value, (tuple, list)):
        return ",".join(
            ":".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v) for v in value
        )
    return str(value)


def _flag_type(cls: type, name: str, hint: Any) -> tuple[type, bool]:
    """What a flag's text converts to (the field's type less None; str for a field that also
    takes a string; ``T`` of a ``tuple[T, ...]``), and whether the flag repeats (a
    ``tuple[T, ...]``)."""
    if typing.get_origin(hint) is tuple and typing.get_args(hint)[1:] == (Ellipsis,):
        return typing.get_args(hint)[0], True
    kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds = tuple(k for k in kinds if k is not type(None))
    if str in kinds or kinds in ((int,), (float,)):
        return (str if str in kinds else kinds[0]), False
    raise TypeError(f"{cls.__name__}.{name}: {hint} has no flag type; let the field take a str")
