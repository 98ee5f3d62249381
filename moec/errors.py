"""The base of every error a user can act on.

A :class:`MoecError`'s message names what is wrong, where (the plan field, graph node, module or
file) and what would be accepted. The ``moec`` command line prints such an error as one line and
exits with its ``exit_code`` (``--debug`` shows the traceback); any other exception is a bug in
moec and keeps its traceback.
"""

from __future__ import annotations


class MoecError(Exception):
    """An error in what the user gave moec (model, plan, inputs, files, environment)."""

    exit_code: int = 2


def one_line(message: str) -> str:
    """``message`` folded onto one line (its lines joined, runs of blanks made one space)."""
    return " ".join(message.split())
