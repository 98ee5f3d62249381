"""Execution of compiled programs: the CompiledModel and (later) distributed runtimes."""

from moec.runtime.compiled import CompiledModel, compile

__all__ = ["CompiledModel", "compile"]
