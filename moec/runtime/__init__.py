"""Execution of compiled programs: the CompiledModel, the distributed and pipeline runtimes,
checkpoints. Receives :class:`moec.program.Program` objects; imports no pass."""

from moec.ops.ep import RowwiseTransport, register_rowwise_transport
from moec.runtime.compiled import CompiledModel


def _rowwise_transport() -> RowwiseTransport:
    """The symmetric-memory EP transport, imported when a ``rowwise`` EP op first runs."""
    from moec.runtime import ep_rowwise

    return ep_rowwise


register_rowwise_transport(_rowwise_transport)

__all__ = ["CompiledModel"]
