"""Training on your own tokens: ``TrainConfig.data`` (``moec train --data SPEC``).

Sources:

- flat token files as nanoGPT and OLMo-core write them, memory-mapped (never read whole):
  ``.bin`` raw token ids (``--data-dtype``, uint16 by default), ``.npy`` in NumPy's format
  (its header carries the dtype) or, without that header, raw ids as OLMo-core writes them
  (``--data-dtype``);
- a folder written by Hugging Face ``datasets``' ``save_to_disk`` (Arrow on disk; a
  ``DatasetDict``'s ``train`` split), whose ``--text-column`` is tokenized with a
  ``transformers`` tokenizer (``--tokenizer NAME_OR_PATH``) when the run starts: each document's
  ids (without special tokens) followed by the tokenizer's EOS, documents concatenated;
- a folder of token files (every ``.bin``/``.npy`` in it);
- a corpus ``moec data build`` wrote (a folder holding its ``manifest.json``,
  :mod:`moec.corpus_build`): its train split, never its eval split. :func:`built_corpus` gives
  both splits and the tokenizer's vocabulary; a model whose vocabulary is smaller than the
  tokenizer's is a :class:`CorpusError` naming both, before any batch is read.

SPEC is ``PATH[:WEIGHT],PATH[:WEIGHT],...`` where PATH may be a glob (``shards/*.npy``), or a
``.json``/``.yaml`` file holding ``{"sources": [{"path": ..., "weight": ..., "dtype": ...}]}``
(relative paths from the file's folder). Without weights every window of every file is equally
likely (the sources in proportion to their size); with weights (given for every source, any
positive numbers, normalized) a sequence comes from a source with that probability, and within a
source from its files in proportion to their size.

Each source is cut into packed windows of ``seq_len + 1`` tokens (a window may span documents:
packing without attention masking, as nanoGPT and OLMo-core train); a file shorter than one
window is left out, a source with no window is a :class:`CorpusError`. A batch is a pure
function of (seed, step, data-parallel rank, batch size): each sequence draws a source, a file
and a window from a generator seeded by them, so a resumed run reads the batches the
uninterrupted run would have read. Windows are drawn with replacement (as nanoGPT samples), not
as epochs.

Token ids are checked on the host, per batch, before the batch goes to the device (a min and
a max over each window, in its file's own dtype, so a uint64 id >= 2^63 is never read as a
negative int64; a one-time scan of a multi-gigabyte memmap would read the whole corpus at
start): an id < 0 or >= the model's vocabulary is a :class:`CorpusError` naming the file, the
token offset and window, the step and the id. A ``.npy`` is read without unpickling (a file of
Python objects, or of non-integer numbers, is a :class:`CorpusError` naming it), and a data
spec's fields are checked by type.
"""

from __future__ import annotations

import dataclasses
import glob as globbing
import json
import math
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from moec.data import DataError, batch_size_at

if typing.TYPE_CHECKING:  # imported where batches are made: moec data build --help needs none
    import torch

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
TOKEN_SUFFIXES = (".bin", ".npy")
SPEC_SUFFIXES = (".json", ".yaml", ".yml")
_NPY_MAGIC = b"\x93NUMPY"
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
MANIFEST = "manifest.json"
"""The file that makes a folder a built corpus (``moec data build``)."""
SPLITS = ("train", "eval")


class CorpusError(DataError):
    """A ``--data`` corpus that cannot be read or does not fit the model."""


@dataclasses.dataclass(frozen=True)
class BuiltSplit:
    """A split of a corpus ``moec data build`` wrote, as its manifest records it."""

    corpus: str
    """The corpus folder (holding ``manifest.json`` and ``tokenizer.json``)."""
    split: str
    """``train`` or ``eval``."""
    sha256: str
    """The split's token file's."""
    vocab_size: int
    """The tokenizer's: every id is below it."""
    tokenizer_sha256: str


@dataclasses.dataclass
class SourceSpec:
    """One entry of ``--data``: a path or glob, its sampling weight (None: by size), the
    dtype of its raw token files, and the built corpus split it is (None: any other file)."""

    path: str
    weight: float | None = None
    dtype: str = "uint16"
    built: BuiltSplit | None = None


class BuiltCorpus(NamedTuple):
    """A corpus ``moec data build`` wrote: its two splits as sources and the tokenizer's
    vocabulary."""

    train: SourceSpec
    eval: SourceSpec
    vocab_size: int


@dataclasses.dataclass
class _Part:
    """One memory-mapped file (or one tokenized dataset) of a source."""

    name: str
    tokens: np.ndarray
    windows: int


def parse_spec(spec: str, dtype: str = "uint16") -> list[SourceSpec]:
    """``--data`` as a list of sources (see module); ``dtype`` is ``--data-dtype``. A built
    corpus folder becomes its train split (with its weight)."""
    return [_train_split(source) for source in _parse(spec, dtype)]


def _train_split(source: SourceSpec) -> SourceSpec:
    folder = Path(source.path).expanduser()
    if not (folder / MANIFEST).is_file():
        return source
    return dataclasses.replace(built_corpus(folder).train, weight=source.weight)


def built_vocab(sources: list[SourceSpec]) -> int | None:
    """The vocabulary of the tokenizer the built corpora among ``sources`` were tokenized
    with; None where no source is a built corpus. Built corpora of different tokenizers (their
    ids mean different things) are a :class:`CorpusError`."""
    built = [s.built for s in sources if s.built is not None]
    tokenizers = {b.tokenizer_sha256: b for b in built}
    if len(tokenizers) > 1:
        a, b = list(tokenizers.values())[:2]
        raise CorpusError(
            f"--data: {a.corpus} and {b.corpus} were tokenized by different tokenizers (their "
            "tokenizer.json differ), so their ids mean different things; train on one, or "
            "build one corpus from both (moec data build DIR --source A --source B)"
        )
    return built[0].vocab_size if built else None


def built_corpus(folder: str | Path) -> BuiltCorpus:
    """The corpus ``moec data build`` wrote in ``folder``, read from its manifest (see
    :mod:`moec.corpus_build`); each token file's size is checked against the manifest, a
    :class:`CorpusError` naming the file where they differ."""
    folder = Path(folder).expanduser()
    path = folder / MANIFEST
    if not path.is_file():
        raise CorpusError(
            f"--data {folder}: no {MANIFEST}, so not a corpus moec data build wrote (build one "
            "with moec data build DIR)"
        )
    try:
        manifest = json.loads(path.read_text())
        tokenizer = manifest["tokenizer"]
        vocab, tokenizer_sha = int(tokenizer["vocab_size"]), str(tokenizer["sha256"])
        files = [manifest["token_files"][split] for split in SPLITS]
        entries = [
            (str(f["path"]), str(f["dtype"]), int(f["tokens"]), str(f["sha256"])) for f in files
        ]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorpusError(
            f"--data {folder}: {MANIFEST} is not a manifest moec data build writes ({exc!r}); "
            "rebuild the corpus (moec data build DIR --force)"
        ) from exc
    splits = [
        _built_source(BuiltSplit(str(folder), split, sha, vocab, tokenizer_sha), name, dtype, n)
        for split, (name, dtype, n, sha) in zip(SPLITS, entries, strict=True)
    ]
    return BuiltCorpus(*splits, vocab)


def _built_source(built: BuiltSplit, name: str, dtype: str, tokens: int) -> SourceSpec:
    """The split ``built`` as a source: its token file ``name`` (relative to the corpus), whose
    size must be ``tokens`` ids of ``dtype``."""
    folder = Path(built.corpus)
    _check_dtype(dtype, f"--data {folder / MANIFEST}: token_files.{built.split}.dtype")
    file = folder / name
    expected = tokens * np.dtype(TOKEN_DTYPES[dtype]).itemsize
    size = file.stat().st_size if file.is_file() else None
    if size != expected:
        found = "is missing" if size is None else f"has {size} bytes"
        raise CorpusError(
            f"--data {folder}: {file} {found}, but the manifest records {tokens} {dtype} ids "
            f"({expected} bytes): the corpus changed after it was built; rebuild it "
            "(moec data build DIR --force)"
        )
    return SourceSpec(str(file), None, dtype, built)


def _parse(spec: str, dtype: str) -> list[SourceSpec]:
    _check_dtype(dtype, "--data-dtype")
    if not spec or not spec.strip():
        raise CorpusError("--data is empty: give PATH[:WEIGHT],... or a .json/.yaml data spec")
    if Path(spec).suffix in SPEC_SUFFIXES:
        return _spec_file(Path(spec), dtype)
    sources = []
    for entry in spec.split(","):
        entry = entry.strip()
        path, _, weight = entry.rpartition(":")
        if not path or not _is_number(weight):  # no weight (or a colon that is part of a path)
            path, weight = entry, ""
        sources.append(SourceSpec(path, float(weight) if weight else None, dtype))
    _check_weights(sources, "--data")
    return sources


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _spec_file(path: Path, dtype: str) -> list[SourceSpec]:
    if not path.is_file():
        raise CorpusError(f"--data {path}: no such data spec file")
    text = path.read_text()
    import yaml

    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:  # json.JSONDecodeError is a ValueError
        problem = " ".join(str(exc).split())
        raise CorpusError(f"--data {path}: not valid {path.suffix[1:].upper()}: {problem}") from exc
    entries = data.get("sources") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise CorpusError(
            f"--data {path}: expected a list of sources, or {{'sources': [...]}}, each "
            "{'path': ..., 'weight': ..., 'dtype': ...} (weight and dtype optional)"
        )
    sources = []
    for i, entry in enumerate(entries):
        entry = {"path": entry} if isinstance(entry, str) else entry
        unknown = set(entry) - {"path", "weight", "dtype"} if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or "path" not in entry or unknown:
            raise CorpusError(
                f"--data {path}: source {i} is {entry!r}; a source is a path or "
                "{'path': ..., 'weight': ..., 'dtype': ...} (weight and dtype optional)"
            )
        where = f"--data {path}: source {i}"
        if not isinstance(entry["path"], str) or not entry["path"]:
            raise CorpusError(f"{where} path = {entry['path']!r}: must be a file, folder or glob")
        file = Path(entry["path"]).expanduser()
        file = file if file.is_absolute() else path.parent / file
        weight = entry.get("weight")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, int | float)):
            raise CorpusError(f"{where} weight = {weight!r}: must be a number > 0 (or absent)")
        source_dtype = entry.get("dtype", dtype)
        _check_dtype(source_dtype, f"{where} dtype")
        sources.append(
            SourceSpec(str(file), None if weight is None else float(weight), source_dtype)
        )
    _check_weights(sources, f"--data {path}")
    return sources


def _check_dtype(dtype: str, where: str) -> None:
    if not isinstance(dtype, str) or dtype not in TOKEN_DTYPES:
        raise CorpusError(f"{where} = {dtype!r}: must be one of {', '.join(TOKEN_DTYPES)}")


def _check_weights(sources: list[SourceSpec], where: str) -> None:
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        raise CorpusError(
            f"{where}: a weight is given for some sources but not all; give every source a "
            "weight (PATH:WEIGHT) or none (sampled in proportion to their size)"
        )
    for s in sources:
        if s.weight is not None and not (s.weight > 0 and math.isfinite(s.weight)):
            raise CorpusError(f"{where}: source {s.path!r} has weight {s.weight}: must be > 0")


class TokenCorpus:
    """Batches of packed windows from ``--data`` sources (see module).

    ``batch(step)`` returns (inputs, targets), int64, (batch, seq_len); ``batch_size`` is a
    number or a function of the step (batch-size warmup).
    """

    def __init__(
        self,
        sources: list[SourceSpec],
        batch_size: int | Callable[[int], int],
        seq_len: int,
        vocab_size: int,
        seed: int = 0,
        *,
        tokenizer: str | None = None,
        text_column: str = "text",
    ):
        self.batch_size, self.seq_len = batch_size, seq_len
        self.vocab_size, self.seed = vocab_size, seed
        self.tokenizer_name, self.text_column = tokenizer, text_column
        self.built = [s.built for s in sources if s.built is not None]
        _check_built_vocab(sources, vocab_size)
        window = seq_len + 1
        self.sources: list[list[_Part]] = []
        for spec in sources:
            parts = [
                _Part(name, tokens, len(tokens) // window) for name, tokens in self._open(spec)
            ]
            total = sum(len(p.tokens) for p in parts)
            if total < window:
                raise CorpusError(
                    f"--data {spec.path}: {total} tokens, fewer than one sequence of "
                    f"--seq-len {seq_len} + 1; add data or shorten --seq-len"
                )
            if not any(p.windows for p in parts):
                raise CorpusError(
                    f"--data {spec.path}: no file holds one sequence of --seq-len {seq_len} + 1 "
                    f"tokens (the longest has {max(len(p.tokens) for p in parts)}); windows do "
                    "not span files: concatenate them or shorten --seq-len"
                )
            self.sources.append([p for p in parts if p.windows])
        sizes = [sum(p.windows for p in parts) for parts in self.sources]
        if all(s.weight is None for s in sources):
            weights = [float(s) for s in sizes]
        else:
            weights = [float(s.weight) for s in sources]
        import torch

        self.source_probs = torch.tensor(weights, dtype=torch.float64) / sum(weights)
        # a source's files in proportion to their windows: cumulative shares for a search
        self.part_cumulative = [
            np.cumsum([p.windows for p in parts]) / sum(p.windows for p in parts)
            for parts in self.sources
        ]

    def describe(self) -> dict[str, Any]:
        """The corpus for the run's identity: every file with its size, and the weights."""
        described = {
            "files": [[p.name, len(p.tokens)] for parts in self.sources for p in parts],
            "weights": [round(float(w), 12) for w in self.source_probs],
            "tokenizer": self.tokenizer_name,
        }
        if self.built:  # what the files hold (their sha256), as their manifest records it
            described["built"] = [dataclasses.asdict(b) for b in self.built]
        return described

    @property
    def tokens(self) -> int:
        return sum(len(p.tokens) for parts in self.sources for p in parts)

    # --- opening sources -----------------------------------------------------------------------

    def _open(self, spec: SourceSpec) -> list[tuple[str, np.ndarray]]:
        path = Path(spec.path).expanduser()
        if path.is_dir() and any((path / m).is_file() for m in _HF_MARKERS):
            return [(str(path), self._tokenize_dataset(path))]
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in TOKEN_SUFFIXES)
            if not files:
                raise CorpusError(
                    f"--data {spec.path}: a folder with no .bin/.npy token files and no "
                    "datasets save_to_disk files (dataset_info.json, state.json)"
                )
        elif any(c in spec.path for c in "*?["):
            files = sorted(Path(p) for p in globbing.glob(str(path), recursive=True))
            if not files:
                raise CorpusError(f"--data {spec.path}: the pattern matches no file")
        elif path.is_file():
            files = [path]
        else:
            raise CorpusError(f"--data {spec.path}: no such file or folder")
        return [(str(f), _memmap(f, spec.dtype)) for f in files]

    def _tokenize_dataset(self, path: Path) -> np.ndarray:
        if self.tokenizer_name is None:
            raise CorpusError(
                f"--data {path}: a datasets folder holds text; give the tokenizer that turns "
                "it into ids with --tokenizer NAME_OR_PATH (a transformers tokenizer)"
            )
        dataset = load_dataset(path)
        if self.text_column not in dataset.column_names:
            raise CorpusError(
                f"--data {path}: no column {self.text_column!r} (--text-column); the dataset "
                f"has {', '.join(dataset.column_names)}"
            )
        tokenizer = load_tokenizer(self.tokenizer_name)
        eos = tokenizer.eos_token_id
        if eos is None:
            raise CorpusError(
                f"--tokenizer {self.tokenizer_name}: has no EOS token, which separates packed "
                "documents; use a tokenizer with eos_token set"
            )
        chunks = []
        for rows in dataset.select_columns([self.text_column]).iter(batch_size=1024):
            for ids in tokenizer(rows[self.text_column], add_special_tokens=False)["input_ids"]:
                chunks.append(np.asarray([*ids, eos], dtype=np.int64))
        tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
        dtype = np.uint16 if tokens.size and tokens.max() < 2**16 else np.uint32
        return tokens.astype(dtype)

    # --- batches -------------------------------------------------------------------------------

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        batch_size = batch_size_at(self.batch_size, step)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 1)
        which = torch.multinomial(self.source_probs, batch_size, replacement=True, generator=gen)
        # host tensors on the loader thread: these reads never touch the device
        draws = torch.rand(batch_size, 2, generator=gen, dtype=torch.float64).tolist()
        window = self.seq_len + 1
        picked: list[tuple[_Part, int]] = []
        for source, (u_part, u_window) in zip(which.tolist(), draws, strict=True):
            parts, cumulative = self.sources[source], self.part_cumulative[source]
            part = parts[
                min(int(np.searchsorted(cumulative, u_part, side="right")), len(parts) - 1)
            ]
            picked.append((part, min(int(u_window * part.windows), part.windows - 1)))
        windows = [p.tokens[i * window : (i + 1) * window] for p, i in picked]
        for ids, (part, index) in zip(windows, picked, strict=True):
            self._check_ids(ids, part, index, step)
        tokens = torch.from_numpy(np.stack([np.asarray(w, np.int64) for w in windows]))
        return tokens[:, :-1], tokens[:, 1:]

    def _check_ids(self, ids: np.ndarray, part: _Part, index: int, step: int) -> None:
        """Raise :class:`CorpusError` where window ``index`` of ``part`` (``ids``, in the
        file's own dtype: compared without conversion, so nothing wraps) holds an id outside
        the vocabulary, naming the file, the id's token offset, the window and the step."""
        if int(ids.min()) >= 0 and int(ids.max()) < self.vocab_size:
            return
        position = int(np.argmax((ids < 0) | (ids >= self.vocab_size)))
        offset = index * (self.seq_len + 1) + position
        raise CorpusError(
            f"--data: {part.name} holds token id {int(ids[position])} at token offset {offset} "
            f"(window {index}, read at step {step}), but the model's vocabulary has "
            f"{self.vocab_size} ids (0-{self.vocab_size - 1}): the corpus was tokenized for "
            "another vocabulary, or its --data-dtype is wrong"
        )


def _check_built_vocab(sources: list[SourceSpec], vocab_size: int) -> None:
    """A :class:`CorpusError` where the built corpora among ``sources`` were tokenized for more
    ids than the model's ``vocab_size``."""
    needed = built_vocab(sources)
    if needed is not None and needed > vocab_size:
        corpus = next(s.built.corpus for s in sources if s.built is not None)
        raise CorpusError(
            f"--data {corpus}: its tokenizer ({corpus}/tokenizer.json) has {needed} ids, but the "
            f"model's vocabulary has {vocab_size}: give the model vocab_size >= {needed} (moec "
            "train sizes its named models, --model llama etc., to the corpus)"
        )


def _memmap(path: Path, dtype: str) -> np.ndarray:
    """``path``'s tokens, memory-mapped: a NumPy ``.npy`` by its header, else raw ids."""
    with path.open("rb") as f:
        is_npy = f.read(len(_NPY_MAGIC)) == _NPY_MAGIC
    if is_npy:
        try:  # never unpickles: an array of Python objects cannot be memory-mapped
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise CorpusError(
                f"--data {path}: not a .npy of integer token ids that can be memory-mapped ({exc})"
            ) from exc
        if tokens.dtype.kind not in "ui":
            raise CorpusError(
                f"--data {path}: a .npy of {tokens.dtype}; token files hold integer ids"
            )
        return tokens.reshape(-1)
    itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise CorpusError(
            f"--data {path}: {size} bytes is not a whole number of {dtype} ids (--data-dtype); "
            f"accepted: {', '.join(TOKEN_DTYPES)}"
        )
    if size == 0:
        return np.zeros(0, dtype=TOKEN_DTYPES[dtype])
    return np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")


def load_dataset(path: Path):
    """A ``save_to_disk`` folder as one ``datasets.Dataset`` (a DatasetDict's ``train``)."""
    try:
        import datasets
    except ImportError as exc:
        raise CorpusError(
            f"--data {path}: reading a datasets folder needs the datasets package "
            "(pip install datasets)"
        ) from exc
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise CorpusError(
                f"--data {path}: a DatasetDict without a 'train' split (it has "
                f"{', '.join(data)}); give the folder of one split (path/SPLIT)"
            )
        data = data["train"]
    return data


def load_tokenizer(name: str):
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise CorpusError(
            f"--tokenizer {name}: needs the transformers package (pip install transformers)"
        ) from exc
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise CorpusError(
            f"--tokenizer {name}: not a transformers tokenizer name or folder ({exc})"
        ) from exc
