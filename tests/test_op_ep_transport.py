"""The ``rowwise`` EP path reaches its transport through a registry of the op layer, filled by
the runtime (the ops import no runtime): what is registered runs, a missing transport or missing
dependencies raise :class:`~moec.ops.ep.EPPathError` naming the path to use instead; the
transport's copy kernel with a capped grid (the split exchanges') writes what the full grid
writes."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import moec.runtime  # noqa: F401  (registers the transport)
from moec.ops import ep as ep_ops


def test_the_runtime_registers_its_symmetric_memory_transport():
    pytest.importorskip("triton")
    from moec.runtime import ep_rowwise

    assert ep_ops.rowwise_transport() is ep_rowwise


def test_the_path_uses_the_registered_transport(monkeypatch):
    monkeypatch.setattr(ep_ops.exchange, "_load_rowwise", None)
    transport = types.SimpleNamespace(check_available=print, send=print)
    ep_ops.register_rowwise_transport(lambda: transport)
    assert ep_ops.rowwise_transport() is transport


def test_without_a_transport_the_error_names_the_fallback(monkeypatch):
    monkeypatch.setattr(ep_ops.exchange, "_load_rowwise", None)
    with pytest.raises(ep_ops.EPPathError, match=r"import moec.runtime.*ep_path='a2a_capacity'"):
        ep_ops.rowwise_transport()

    def missing_dependency():
        raise ImportError("No module named 'triton'")

    ep_ops.register_rowwise_transport(missing_dependency)
    with pytest.raises(ep_ops.EPPathError, match=r"triton'\); use ep_path='a2a_capacity'"):
        ep_ops.rowwise_transport()


_CAPPED_PUSH = """
import torch
from moec.kernels import ep_push

torch.manual_seed(0)
tokens, top_k, dim, cap = 9, 2, 600, 12
routes = tokens * top_k
x, weights = torch.randn(tokens, dim), torch.rand(routes)
address = torch.cat([torch.randperm(2 * cap)[: routes - 3], torch.full((3,), -1)])
address = address[torch.randperm(routes)]


def push(programs):
    peers_rows = [torch.full((cap, dim), float("nan")) for _ in range(2)]
    peers = torch.tensor([b.data_ptr() for b in peers_rows])
    ep_push.push_rows(x, address, peers, cap, top_k, weights, programs=programs)
    return torch.cat(peers_rows)


full = push(None)
for programs in (1, 2, 4):  # 5 route tiles: each program loops over its tiles
    assert torch.equal(push(programs).isnan(), full.isnan())
    torch.testing.assert_close(push(programs).nan_to_num(), full.nan_to_num(), rtol=0, atol=0)
print("capped push ok")
"""


@pytest.mark.slow
def test_push_rows_with_capped_programs_writes_what_one_program_per_tile_writes():
    """The split exchanges' copy (fewer programs than route tiles, each looping) equals the
    default grid, under Triton's interpreter (a subprocess: it is chosen at import)."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", _CAPPED_PUSH], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "capped push ok" in proc.stdout, proc.stderr[-3000:]
