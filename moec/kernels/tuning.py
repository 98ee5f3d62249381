"""Shipped tile choices for moec's autotuned Triton kernels, consulted before autotuning.

The table (``tuning.json`` beside this module) gives, per GPU product (:data:`PRODUCTS`) and
kernel, the config measured fastest for a shape bucket: the autotuner's key with the row count
``R`` rounded up to a power of two (rows follow the batch; widths and expert counts are the
model's), and the operands' dtype. :class:`TableFirst` wraps an autotuned kernel: a launch
whose product and bucket are in the table runs that config at once, without benchmarking; any
other launch autotunes as before (Triton's autotuner, whose choice Triton keeps in its disk
cache under moec's cache, :mod:`moec.cache`) and its choice is recorded in moec's cache
(:func:`moec.cache.tuning_record`), from which ``benchmarks/tune_table.py`` writes table
entries on a GPU.

A table entry must be one of the kernel's candidates, else it is ignored (the candidates
changed since it was measured). The table is not consulted where the kernel has a single
candidate (``MOEC_AUTOTUNE=0``, the interpreter) or ``MOEC_TUNING_TABLE=0`` (to tune again).
Entries are shipped only from measured runs (``tune_table.py``'s output, recorded with the
device and commit in ``benchmarks/RESULTS.md``); a product without any autotunes everywhere.

quack's GEMMs autotune in quack's own autotuner, which moec cannot hand a tile (its plain
``gemm`` takes ``tuned`` alone). It keeps each choice in its disk cache, a file per launch
key: quack's version, the launch's shapes, strides and dtypes, and its candidate configs. The
table ships those files as measured, under the kernel name ``quack-<version>`` (file path ->
the winning config and its timings), and :func:`seed_quack` writes them into moec's quack
cache where absent before quack's first GEMM: a launch with a shipped key then benchmarks
nothing. A file of other shapes, candidates or version is never read (its key differs).
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
import triton

TABLE = Path(__file__).with_name("tuning.json")
PRODUCTS = ("H100", "H200", "B200", "B300")
"""GPU products the table may hold, matched in the device's name."""
ROW_KEYS = frozenset({"R"})
"""Autotune keys that count rows: bucketed by the next power of two."""

QUACK_RECORD = re.compile(r"[A-Z2-7]+/[A-Za-z0-9_]+\.autotune\.json")
"""A quack autotuning record's path in its cache: ``<key digest>/<fn>.autotune.json``."""

table_hits = 0
"""Launches that ran a table config instead of autotuning, in this process."""


def product(device: torch.device) -> str | None:
    """The product in :data:`PRODUCTS` this CUDA device is, by its name (None otherwise)."""
    if device.type != "cuda":
        return None
    return _product(torch.cuda.get_device_name(device))


@functools.cache
def _product(name: str) -> str | None:
    return next((p for p in reversed(PRODUCTS) if p in name.upper()), None)


@functools.cache
def table() -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """The shipped table: product -> kernel -> bucket -> config (see :func:`config_entry`)."""
    return json.loads(TABLE.read_text())


def bucket(keys: list[str], named: dict[str, Any]) -> str:
    """The shape bucket of a launch: ``keys`` (the autotuner's) as ``name=value``, row counts
    as ``R<=2^n``, then the first tensor's dtype."""
    parts = []
    for key in (k for k in keys if k in named):  # as the autotuner reads its key
        value = named[key]
        rows = key in ROW_KEYS
        parts.append(f"{key}<={triton.next_power_of_2(value)}" if rows else f"{key}={value}")
    tensor = next((v for v in named.values() if isinstance(v, torch.Tensor)), None)
    if tensor is not None:
        parts.append(f"dtype={str(tensor.dtype).removeprefix('torch.')}")
    return ",".join(parts)


def config_entry(config: triton.Config) -> dict[str, Any]:
    """A config as the table stores it."""
    warps, stages = config.num_warps, config.num_stages
    return {"kwargs": dict(config.kwargs), "num_warps": warps, "num_stages": stages}


def lookup(
    where: str | None, kernel: str, key: str, candidates: list[triton.Config]
) -> triton.Config | None:
    """The candidate the table gives for ``kernel`` at bucket ``key`` on product ``where``."""
    if where is None or os.environ.get("MOEC_TUNING_TABLE", "1") == "0":
        return None
    entry = table().get(where, {}).get(kernel, {}).get(key)
    return next((c for c in candidates if entry == config_entry(c)), None)


class TableFirst:
    """An autotuned kernel launched as ``kernel[grid](*args, **kwargs)`` that consults the
    table first (see module); ``name`` identifies it in the table. The decision is made once
    per device, dtype and autotune key: later launches cost one dict lookup more than the
    autotuner's own."""

    def __init__(self, name: str, autotuner: triton.runtime.Autotuner) -> None:
        self.name, self.autotuner = name, autotuner
        self._decided: dict[tuple, triton.Config | None] = {}
        self._recorded: set[tuple] = set()

    def __getitem__(self, grid: Any) -> Any:
        return functools.partial(self.run, grid)

    def run(self, grid: Any, *args: Any, **kwargs: Any) -> Any:
        tuner = self.autotuner
        if len(tuner.configs) == 1:
            return tuner[grid](*args, **kwargs)
        named = dict(zip(tuner.arg_names, args))
        named.update(kwargs)
        first = next(v for v in named.values() if isinstance(v, torch.Tensor))
        launch = (first.device, first.dtype, *(named.get(k) for k in tuner.keys))
        if launch not in self._decided:
            key = bucket(tuner.keys, named)
            self._decided[launch] = lookup(product(first.device), self.name, key, tuner.configs)
        config = self._decided[launch]
        if config is not None:
            global table_hits
            table_hits += 1
            return tuner.fn[grid](*args, **kwargs, **config.all_kwargs())
        out = tuner[grid](*args, **kwargs)
        if launch not in self._recorded:
            self._recorded.add(launch)
            key = bucket(tuner.keys, named)
            _record(product(first.device), self.name, key, tuner.best_config)
        return out


def _record(where: str | None, kernel: str, key: str, config: triton.Config) -> None:
    """Add the autotuner's choice to moec's record, merged with what other processes
    recorded (a concurrent writer's entry may be lost: the record is advice, and Triton's own
    disk cache holds every choice)."""
    from moec import cache

    path = cache.tuning_record()
    if where is None or path is None:
        return
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = {}
    record.setdefault(where, {}).setdefault(kernel, {})[key] = config_entry(config)
    cache.write_atomic(path, json.dumps(record, indent=1, sort_keys=True))


def quack_kernel(version: str) -> str:
    """The table's kernel name for quack ``version``'s records."""
    return f"quack-{version}"


def seed_quack(where: str | None, folder: Path | None, version: str) -> int:
    """Write the table's records of quack ``version`` on product ``where`` into quack's cache
    ``folder`` (see module) where no file is; return how many were written. Nothing where the
    table is switched off (``MOEC_TUNING_TABLE=0``: tune again) or there is no folder."""
    if where is None or folder is None or os.environ.get("MOEC_TUNING_TABLE", "1") == "0":
        return 0
    from moec import cache

    written = 0
    for path, record in table().get(where, {}).get(quack_kernel(version), {}).items():
        target = folder / path
        if QUACK_RECORD.fullmatch(path) and not target.exists():
            cache.write_atomic(target, json.dumps(record))
            written += 1
    return written


@functools.cache
def seed_quack_cache() -> int:
    """:func:`seed_quack` for this process's GPU into moec's own quack cache (none where the
    user chose quack's folder, or before :func:`moec.cache.setup`), once; quack's first GEMM
    must come after it."""
    import quack

    from moec import cache

    where = product(torch.device("cuda")) if torch.cuda.is_available() else None
    return seed_quack(where, cache.owned_folder("QUACK_CACHE_DIR"), quack.__version__)


def quack_records(folder: Path) -> dict[str, dict[str, Any]]:
    """The autotuning records in quack's cache ``folder``, each cut to its winning config (the
    one quack takes from a record: the least timings), by path, for the table."""
    records = {}
    for file in sorted(folder.glob("*/*.autotune.json")):
        path = file.relative_to(folder).as_posix()
        if QUACK_RECORD.fullmatch(path):
            record = json.loads(file.read_text())
            best = min(record["configs_timings"], key=lambda entry: entry[1])
            records[path] = {"key": record["key"], "configs_timings": [best]}
    return records
