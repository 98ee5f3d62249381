"""The shipped tile table (:mod:`moec.kernels.tuning`) is consulted before autotuning.

A real Triton autotuner around a real kernel, with its entry point (``Autotuner.run``) and the
kernel's launch (``JITFunction.run``) instrumented: each records its call and launches nothing,
so the tests run on the CPU without the interpreter.
"""

from __future__ import annotations

import json

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from moec import cache as moec_cache  # noqa: E402
from moec.kernels import activation, grouped_gemm, grouped_tma, tuning  # noqa: E402

FAMILY = {"H100": "sm90", "H200": "sm90", "B200": "sm100", "B300": "sm100"}
"""The config family of each product in the table."""


@triton.jit
def _double_kernel(x_ptr, out_ptr, R, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < R
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2, mask=mask)


CONFIGS = [triton.Config({"BLOCK": 16}, num_warps=4), triton.Config({"BLOCK": 32}, num_warps=4)]


class Launches:
    """The kernel, table-first, and what its launches did: the tile each launched with, and
    the calls that reached the autotuner (which picks the first candidate, benchmarking
    nothing)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.blocks: list[int] = []
        self.autotuned = 0
        tuned = triton.autotune(configs=CONFIGS, key=["R"])(_double_kernel)
        self.kernel = tuning.TableFirst("test.double", tuned)

        def autotune(autotuner, *args, **kwargs):
            self.autotuned += 1
            autotuner.best_config = autotuner.configs[0]
            return autotuner.fn.run(*args, **kwargs, **autotuner.configs[0].all_kwargs())

        def launch(fn, *args, grid, warmup, **kwargs):
            self.blocks.append(kwargs["BLOCK"])

        monkeypatch.setattr(type(tuned), "run", autotune)
        monkeypatch.setattr(type(_double_kernel), "run", launch)

    def __call__(self, rows: int) -> None:
        x = torch.empty(rows)
        self.kernel[(1,)](x, torch.empty_like(x), rows)


@pytest.fixture
def launches(monkeypatch, tmp_path) -> Launches:
    monkeypatch.setattr(tuning, "product", lambda device: "H100")
    monkeypatch.setattr(moec_cache, "tuning_record", lambda: tmp_path / "record.json")
    return Launches(monkeypatch)


def _table(monkeypatch, entries: dict) -> None:
    monkeypatch.setattr(tuning, "table", lambda: {"H100": {"test.double": entries}})


def test_a_table_hit_launches_its_tile_without_autotuning(launches, monkeypatch):
    _table(monkeypatch, {"R<=128,dtype=float32": tuning.config_entry(CONFIGS[1])})
    hits = tuning.table_hits
    launches(100)
    launches(70)  # the same bucket
    assert launches.autotuned == 0 and launches.blocks == [32, 32]
    assert tuning.table_hits == hits + 2


def test_outside_the_table_it_autotunes_and_records_the_choice(launches, monkeypatch, tmp_path):
    _table(monkeypatch, {"R<=4096,dtype=float32": tuning.config_entry(CONFIGS[1])})
    launches(100)
    launches(100)
    assert launches.autotuned == 2 and launches.blocks == [16, 16]
    record = json.loads((tmp_path / "record.json").read_text())
    chosen = tuning.config_entry(CONFIGS[0])
    assert record == {"H100": {"test.double": {"R<=128,dtype=float32": chosen}}}


def test_an_entry_that_is_no_candidate_is_ignored(launches, monkeypatch):
    stale = triton.Config({"BLOCK": 64}, num_warps=4)
    _table(monkeypatch, {"R<=128,dtype=float32": tuning.config_entry(stale)})
    launches(100)
    assert launches.autotuned == 1 and launches.blocks == [16]


def test_the_table_can_be_switched_off(launches, monkeypatch):
    _table(monkeypatch, {"R<=128,dtype=float32": tuning.config_entry(CONFIGS[1])})
    monkeypatch.setenv("MOEC_TUNING_TABLE", "0")
    launches(100)
    assert launches.autotuned == 1


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
            if kernel.startswith("quack-"):  # quack's records: its own candidates, by its key
                assert all(tuning.QUACK_RECORD.fullmatch(path) for path in buckets), kernel
                assert all(len(r["configs_timings"]) == 1 for r in buckets.values()), kernel
                continue
            entries = [tuning.config_entry(c) for c in _candidates(kernel, FAMILY[product])]
            for bucket, entry in buckets.items():
                assert entry in entries, (product, kernel, bucket)


RECORD = "MFRGGZDFMZTWQ2LKNNWG23TPOBYXE43UOV3HO6DZPJQXE/gemm_tuned.autotune.json"
"""A path of quack's form: its key digest (base32), the tuned function's name."""


def _quack_record(timings: list[tuple[str, list[float]]]) -> dict:
    return {"key": "(4, (8, 16), (2, 1), torch.bfloat16)", "configs_timings": timings}


def test_quack_records_are_cut_to_their_winner_and_seeded_where_absent(tmp_path, monkeypatch):
    """A record from quack's cache keeps the config quack would take from it (least timings);
    seeding writes the table's records for this product and quack version where no file is,
    leaves a file that is there alone, skips a path not of quack's form, and writes nothing with
    the table switched off."""
    measured = tmp_path / "measured"
    record = _quack_record([("tile_m: 128", [0.2, 0.3]), ("tile_m: 256", [0.1, 0.4])])
    (measured / RECORD).parent.mkdir(parents=True)
    (measured / RECORD).write_text(json.dumps(record))
    (measured / "notes.txt").write_text("not a record")
    records = tuning.quack_records(measured)
    assert records == {RECORD: _quack_record([["tile_m: 256", [0.1, 0.4]]])}

    other = "ABC/gemm_act_tuned.autotune.json"
    outside = "../escape.autotune.json"
    shipped = {**records, other: _quack_record([]), outside: _quack_record([])}
    table = {"H100": {tuning.quack_kernel("0.6.5"): shipped}}
    monkeypatch.setattr(tuning, "table", lambda: table)
    cache = tmp_path / "cache"
    (cache / other).parent.mkdir(parents=True)
    (cache / other).write_text("theirs")
    assert tuning.seed_quack("H200", cache, "0.6.5") == 0  # another product's
    assert tuning.seed_quack("H100", cache, "0.7.0") == 0  # another version's
    monkeypatch.setenv("MOEC_TUNING_TABLE", "0")
    assert tuning.seed_quack("H100", cache, "0.6.5") == 0
    monkeypatch.delenv("MOEC_TUNING_TABLE")
    assert tuning.seed_quack("H100", cache, "0.6.5") == 1
    assert json.loads((cache / RECORD).read_text()) == records[RECORD]
    assert (cache / other).read_text() == "theirs"
    assert not (tmp_path / "escape.autotune.json").exists()


def test_quacks_autotuner_takes_a_seeded_record_and_benchmarks_nothing(tmp_path, monkeypatch):
    """quack's own autotuner (on CPU tensors, its benchmark stubbed): the record one process
    measured, cut by :func:`tuning.quack_records` and seeded into an empty cache, makes a fresh
    autotuner in another cache launch the measured winner without benchmarking."""
    autotuner = pytest.importorskip("quack.autotuner")
    from moec.kernels import cute_gemm

    tiles: list[int] = []

    def double(x: torch.Tensor, n: int, tile: int) -> torch.Tensor:
        tiles.append(tile)
        return x * 2

    def tuned():
        configs = [autotuner.AutotuneConfig(tile=t) for t in (16, 32, 64)]
        return autotuner.autotune(configs, key=["n"], do_bench=lambda *a, **k: None)(double)

    timings = {16: [0.5, 0.6], 32: [0.2, 0.3], 64: [0.4, 0.4]}
    benched: list[int] = []

    def bench(self, *args, config, **kwargs):
        benched.append(config.kwargs["tile"])
        return timings[config.kwargs["tile"]]

    monkeypatch.setattr(autotuner, "_gpu_warmup", lambda *a, **k: None)
    monkeypatch.setattr(autotuner.Autotuner, "_bench", bench)
    measured, fresh = tmp_path / "measured", tmp_path / "fresh"
    monkeypatch.setenv("QUACK_CACHE_DIR", str(measured))
    tuned()(torch.ones(4), n=4)
    assert sorted(benched) == [16, 32, 64] and tiles == [32]

    version = autotuner.VERSION
    records = tuning.quack_records(measured)
    monkeypatch.setattr(tuning, "table", lambda: {"H100": {tuning.quack_kernel(version): records}})
    assert tuning.seed_quack("H100", fresh, version) == 1
    monkeypatch.setenv("QUACK_CACHE_DIR", str(fresh))
    benched.clear()
    tuned()(torch.ones(4), n=4)
    assert benched == [] and tiles == [32, 32]

    seeded: list[bool] = []  # moec seeds before quack's first GEMM
    monkeypatch.setattr(tuning, "seed_quack_cache", lambda: seeded.append(True))
    cute_gemm._quack.__wrapped__()  # the first call (later ones are cached)
    assert seeded == [True]
