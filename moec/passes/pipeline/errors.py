"""The ``pipeline`` pass's error."""

from __future__ import annotations

from moec.errors import MoecError


class PipelinePassError(MoecError, RuntimeError):
    """The graph cannot be split; the message names the node or parameter that stopped it."""
