"""The shipped tile table (:mod:`moec.kernels.tuning`) is consulted before autotuning.

The launches run a small kernel under the Triton CPU interpreter: this module re-runs itself in
a subprocess with ``TRITON_INTERPRET=1`` (as ``tests/test_kernels_cpu.py``), where the
autotuner's entry point is instrumented.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from moec import cache as moec_cache  # noqa: E402
from moec.kernels import activation, grouped_gemm, grouped_tma, tuning  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET subprocess")
FAMILY = {"H100": "sm90", "H200": "sm90", "B200": "sm100", "B300": "sm100"}
"""The config family of each product in the table."""


@pytest.mark.skipif(INTERPRETED, reason="already interpreting")
def test_tuning_table_under_the_interpreter():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


@triton.jit
def _double_kernel(x_ptr, out_ptr, R, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < R
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2, mask=mask)


CONFIGS = [triton.Config({"BLOCK": 16}, num_warps=4), triton.Config({"BLOCK": 32}, num_warps=4)]


class Launches:
    """The kernel, table-first, and what its launches did: the tile each ran, and the calls
    that reached the autotuner (instrumented: it runs the first candidate, benchmarking
    nothing)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.blocks: list[int] = []
        self.autotuned: list[tuple] = []
        tuned = triton.autotune(configs=CONFIGS, key=["R"])(_double_kernel)
        self.kernel = tuning.TableFirst("test.double", tuned)

        def run(autotuner, *args, **kwargs):
            self.autotuned.append(args)
            autotuner.best_config = autotuner.configs[0]
            return autotuner.fn.run(*args, **kwargs, **autotuner.configs[0].all_kwargs())

        monkeypatch.setattr(type(tuned), "run", run)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)

        def grid(meta: dict) -> tuple[int]:
            self.blocks.append(meta["BLOCK"])
            return (triton.cdiv(x.numel(), meta["BLOCK"]),)

        self.kernel[grid](x, out, x.numel())
        return out


@pytest.fixture
def launches(monkeypatch, tmp_path) -> Launches:
    monkeypatch.setattr(tuning, "product", lambda device: "H100")
    monkeypatch.setattr(tuning, "_recorded", set())
    monkeypatch.setattr(moec_cache, "tuning_record", lambda: tmp_path / "record.json")
    return Launches(monkeypatch)


def _table(monkeypatch, entries: dict) -> None:
    monkeypatch.setattr(tuning, "table", lambda: {"H100": {"test.double": entries}})


@interpreted
def test_a_table_hit_runs_its_tile_without_autotuning(launches, monkeypatch):
    x = torch.randn(100)
    key = f"R<=128,dtype={str(x.dtype).removeprefix('torch.')}"
    _table(monkeypatch, {key: tuning.config_entry(CONFIGS[1])})
    hits = tuning.table_hits
    torch.testing.assert_close(launches(x), 2 * x)
    assert launches.autotuned == [] and launches.blocks == [32]
    assert tuning.table_hits == hits + 1
    y = torch.randn(70)  # the same bucket
    torch.testing.assert_close(launches(y), 2 * y)
    assert launches.autotuned == [] and launches.blocks == [32, 32]


@interpreted
def test_outside_the_table_it_autotunes_and_records_the_choice(launches, monkeypatch, tmp_path):
    x = torch.randn(100)
    _table(monkeypatch, {"R<=4096,dtype=float32": tuning.config_entry(CONFIGS[1])})
    torch.testing.assert_close(launches(x), 2 * x)
    assert len(launches.autotuned) == 1 and launches.blocks == [16]
    record = json.loads((tmp_path / "record.json").read_text())
    chosen = tuning.config_entry(CONFIGS[0])
    assert record == {"H100": {"test.double": {"R<=128,dtype=float32": chosen}}}


@interpreted
def test_an_entry_that_is_no_candidate_is_ignored(launches, monkeypatch):
    stale = triton.Config({"BLOCK": 64}, num_warps=4)
    _table(monkeypatch, {"R<=128,dtype=float32": tuning.config_entry(stale)})
    x = torch.randn(100)
    torch.testing.assert_close(launches(x), 2 * x)
    assert len(launches.autotuned) == 1


def test_moec_autotuned_kernels_consult_the_table():
    kernels = [grouped_gemm._tuned(k, "sm90") for k in ("gmm", "gmm2", "wgrad")]
    kernels += [grouped_tma._tuned(k, "sm90") for k in ("gmm", "gmm2")] + [activation._tuned()]
    assert all(isinstance(k, tuning.TableFirst) for k in kernels)


def _candidates(kernel: str, family: str) -> list:
    module, kind = kernel.split(".")
    if module == "activation":
        return list(activation.TILES)
    return {"grouped_gemm": grouped_gemm, "grouped_tma": grouped_tma}[module].configs(kind, family)


def test_shipped_entries_are_candidates_of_their_kernels():
    shipped = tuning.table()
    assert set(shipped) == set(tuning.PRODUCTS)
    for product, kernels in shipped.items():
        for kernel, buckets in kernels.items():
            entries = [tuning.config_entry(c) for c in _candidates(kernel, FAMILY[product])]
            for bucket, entry in buckets.items():
                assert entry in entries, (product, kernel, bucket)
