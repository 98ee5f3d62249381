"""The ``rowwise`` EP path reaches its transport through a registry of the op layer, filled by
the runtime (the ops import no runtime): what is registered runs, a missing transport or missing
dependencies raise :class:`~moec.ops.ep.EPPathError` naming the path to use instead."""

from __future__ import annotations

import types

import pytest

import moec.runtime  # noqa: F401  (registers the transport)
from moec.ops import ep as ep_ops


def test_the_runtime_registers_its_symmetric_memory_transport():
    pytest.importorskip("triton")
    from moec.runtime import ep_rowwise

    assert ep_ops._rowwise() is ep_rowwise


def test_the_path_uses_the_registered_transport(monkeypatch):
    monkeypatch.setattr(ep_ops, "_load_rowwise", None)
    transport = types.SimpleNamespace(check_available=print, send=print)
    ep_ops.register_rowwise_transport(lambda: transport)
    assert ep_ops._rowwise() is transport


def test_without_a_transport_the_error_names_the_fallback(monkeypatch):
    monkeypatch.setattr(ep_ops, "_load_rowwise", None)
    with pytest.raises(ep_ops.EPPathError, match=r"import moec.runtime.*ep_path='a2a_capacity'"):
        ep_ops._rowwise()

    def missing_dependency():
        raise ImportError("No module named 'triton'")

    ep_ops.register_rowwise_transport(missing_dependency)
    with pytest.raises(ep_ops.EPPathError, match=r"triton'\); use ep_path='a2a_capacity'"):
        ep_ops._rowwise()
