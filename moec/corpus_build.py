"""``moec data build DIR``: a real corpus with no download, from the text already on the machine.

**Sources.** The folders (or single files) of ``BuildOptions.sources`` (``--source``); by default
the installed Python packages (``site.getsitepackages()``). The ``.py``, ``.md``, ``.rst`` and
``.txt`` files under a folder, and a file given itself, are the documents, one document a file.
Left out, and counted by reason in the manifest's ``skipped``: files over ``max_file_bytes``
(generated tables), empty or blank files, files with a NUL byte or that are not UTF-8,
unreadable files, and exact copies of a file already taken (the same sha256: vendored
packages). Symbolic links, ``__pycache__`` and hidden folders, and DIR itself (when it lies under
a source) are not walked.

**Selection.** The files are taken in the order of the sha256 of their path relative to their
source (a fixed shuffle, so that a ``max_bytes`` cap samples every package rather than the first
ones alphabetically) until the next one would pass ``max_bytes``.

**Split.** A file is in the eval split when the first 8 bytes of the sha256 of its content, read
as a fraction of 2^64, are below ``eval_fraction``. A file's split depends on its content alone:
adding or removing other files moves no file between the splits, and identical files never
straddle them.

**Tokenizer.** A byte-level BPE (GPT-2's pre-tokenization over the 256 bytes, so every text
encodes and ``decode(encode(text)) == text``) trained by the ``tokenizers`` library (which
``transformers`` installs) on the train split's files in selection order, up to
``tokenizer_sample_bytes``, to at most ``vocab_size`` ids (fewer where the sample holds fewer
merges); ``<|endoftext|>`` is id 0, the document separator. ``DIR/tokenizer.json`` loads with
``tokenizers.Tokenizer.from_file``; ``DIR/tokenizer_config.json`` makes ``DIR`` a ``transformers``
tokenizer folder (``AutoTokenizer.from_pretrained(DIR)``).

**Token files.** Per split, the documents in (source, relative path) order, each followed by the
EOS id, as raw ids (uint16 where the vocabulary fits, else uint32): ``DIR/train/tokens.bin`` and
``DIR/eval/tokens.bin``, what :mod:`moec.corpus` reads (``moec train --data DIR`` reads the train
split). A literal ``<|endoftext|>`` inside a document is encoded as text, so the EOS id only ever
separates documents.

**Manifest** (``DIR/manifest.json``, written last: a folder without one is no corpus): the
equivalent command and options, the moec and ``tokenizers`` versions, the sources with the
versions of the packages installed there, what was skipped, bytes, documents and tokens per
split, each token file's dtype, size and sha256, the tokenizer's sha256 and vocabulary, and every
file (source, relative path, bytes, sha256, split). The outputs are a function of the options and
the files read: two builds from the same files (with the same ``tokenizers``) are identical byte
for byte. Machines with other packages build other corpora; runs compare on the same token-file
sha256s (``moec train`` records them in the run's identity).

**DIR** is created if missing. A DIR that is not empty is refused unless ``force``, which replaces
the build's own files (the manifest first, so an interrupted rebuild leaves no manifest) and
leaves every other file alone. Nothing is written outside DIR.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import shlex
import site
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from moec.corpus import MANIFEST, SPLITS, CorpusError
from moec.flags import flag, option

EOS = "<|endoftext|>"
TEXT_SUFFIXES = (".md", ".py", ".rst", ".txt")
MB = 10**6
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKEN_FILE = "tokens.bin"
BYTE_ALPHABET = 256
_ENCODE_BATCH_BYTES = 4 * MB  # text per encode_batch call: enough documents for every thread
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}

Say = Callable[[str], None]


class CorpusBuildError(CorpusError):
    """Options, sources or an output folder that ``moec data build`` cannot build from or into."""


def parse_bytes(text: str) -> int:
    """A byte count from the command line: ``300M``, ``1.5G``, ``64k`` or ``20000000`` (decimal
    units: k = 10^3, M = 10^6, G = 10^9)."""
    number, unit = text.strip(), ""
    if number[-1:].lower() in ("k", "m", "g"):
        number, unit = number[:-1], number[-1].lower()
    try:
        return round(float(number) * _UNITS[unit])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r}: not a size; give bytes, or a number with k, M or G (e.g. 300M)"
        ) from exc


def size_text(count: int) -> str:
    """A byte count as the size flags take it, exactly (:func:`parse_bytes` reads it back):
    ``300M``, ``4k``, or the bytes where neither unit divides it."""
    for unit, size in (("M", MB), ("k", 10**3)):
        if count and count % size == 0:
            return f"{count // size}{unit}"
    return str(count)


SIZE = {"metavar": "SIZE", "parse": parse_bytes, "shown": size_text}
"""How a size field's flag reads (``300M``, :func:`parse_bytes`) and shows its default."""


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """What ``moec data build`` reads and makes (see module); each field is declared with the
    flag that sets it, its help and its default (:func:`moec.flags.option`): ``max_bytes`` is
    ``--max-bytes``, ``sources`` the repeatable ``--source``; sizes read as ``300M``."""

    sources: tuple[str, ...] = option(
        (),
        "a folder or file of text (repeatable); default: the installed Python packages",
        flag="--source",
        metavar="PATH",
    )
    """Folders or files; empty: the installed Python packages (``site.getsitepackages()``)."""
    max_bytes: int = option(300 * MB, "text taken at most, e.g. 300M", **SIZE)
    """Text taken at most, over both splits."""
    max_file_bytes: int = option(MB, "larger files are left out", **SIZE)
    """Larger files (generated tables, vendored bundles) are left out."""
    tokenizer_sample_bytes: int = option(
        20 * MB, "train-split text the tokenizer is trained on", **SIZE
    )
    """Train-split text the tokenizer is trained on at most."""
    eval_fraction: float = option(0.01, "share of the files, by content hash, in the eval split")
    vocab_size: int = option(8192, "the tokenizer's vocabulary at most")
    """The tokenizer's vocabulary at most (EOS and the 256 bytes included)."""

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_file_bytes", "tokenizer_sample_bytes"):
            if getattr(self, name) <= 0:
                raise CorpusBuildError(f"{_flag(name)} {getattr(self, name)}: must be > 0")
        if not 0 < self.eval_fraction < 1:
            raise CorpusBuildError(
                f"{_flag('eval_fraction')} {self.eval_fraction}: must be in (0, 1), e.g. 0.01"
            )
        if not BYTE_ALPHABET + 1 <= self.vocab_size <= 2**32:
            raise CorpusBuildError(
                f"{_flag('vocab_size')} {self.vocab_size}: must be in "
                f"[{BYTE_ALPHABET + 1}, 2^32] (the {BYTE_ALPHABET} bytes and EOS, then the merges)"
            )

    def command(self, out: str | Path) -> str:
        """The ``moec data build`` command line that builds these options into ``out``."""
        words = ["moec", "data", "build", str(out)]
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            for item in value if isinstance(value, (tuple, list)) else (value,):
                words += [_flag(field.name), str(item)]
        return shlex.join(words)


def _flag(field: str) -> str:
    return flag(BuildOptions, field)


@dataclasses.dataclass
class _File:
    """One document: ``path`` relative to source ``source``; ``sha256`` and ``split`` are set
    once it is read."""

    source: int
    path: str
    file: Path
    bytes: int
    sha256: str = ""
    split: str = ""


def default_sources() -> list[Path]:
    """The folders of the installed Python packages that exist, each once."""
    found = (Path(p).resolve() for p in site.getsitepackages())
    return sorted({p for p in found if p.is_dir()})


@dataclasses.dataclass
class _Selection:
    """The documents of a build: its source roots, the files per split, what was left out."""

    roots: list[Path]
    splits: dict[str, list[_File]]
    skipped: Counter[str]

    def bytes(self, split: str) -> int:
        return sum(d.bytes for d in self.splits[split])


def build_corpus(
    out: str | Path,
    options: BuildOptions | None = None,
    *,
    force: bool = False,
    say: Say | None = None,
) -> dict[str, Any]:
    """Build the corpus of ``options`` into the folder ``out`` (see module) and return its
    manifest; ``say`` receives a line at each phase. Options, sources and folders that cannot
    build a corpus are a :class:`CorpusBuildError` before anything is written; a write that
    fails (a full disk) is one naming the folder."""
    options = options or BuildOptions()
    say = say or (lambda _: None)
    folder = _check_out(Path(out), force)
    chosen = _choose(options, folder, say)
    sample = _sample(chosen.splits["train"], options.tokenizer_sample_bytes)
    trained_on = {"files": len(sample), "bytes": sum(d.bytes for d in sample)}
    say(f"training the tokenizer on {_mb(trained_on['bytes'])} ({len(sample):,} files)")
    tokenizer = train_tokenizer((_read(d) for d in sample), options.vocab_size)
    try:
        token_files = _write(folder, tokenizer, chosen, say)
        manifest = _manifest(out, options, chosen, tokenizer, trained_on, token_files, folder)
        _write_json(folder / MANIFEST, manifest)
        size = _folder_bytes(folder)
    except OSError as exc:
        raise CorpusBuildError(f"DIR {folder}: writing the corpus failed ({exc})") from exc
    tokens, dtype = manifest["tokens"], token_files["train"]["dtype"]
    say(
        f"wrote {folder}: {tokens['train']:,} train and {tokens['eval']:,} eval tokens "
        f"({dtype}), a {tokenizer.get_vocab_size()}-id tokenizer, {_mb(size)} on disk"
    )
    return manifest


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE tokenizer (``tokenizers.Tokenizer``) trained on ``texts`` to at most
    ``vocab_size`` ids, EOS (``<|endoftext|>``) id 0, decoding back to the exact text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def tokenizer_config() -> dict[str, Any]:
    """``tokenizer_config.json``: ``DIR/tokenizer.json`` as a ``transformers`` fast tokenizer
    with its EOS, decoding without clean-up (which would change the text)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "clean_up_tokenization_spaces": False,
    }


# --- sources and selection ----------------------------------------------------------------------


def _check_out(out: Path, force: bool) -> Path:
    """``out`` resolved, checked (nothing is created yet)."""
    if out.exists() and not out.is_dir():
        raise CorpusBuildError(f"DIR {out}: is a file; give a folder for the corpus")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise CorpusBuildError(
            f"DIR {out}: not empty; give an empty or new folder, or --force to replace the "
            f"corpus files in it ({', '.join(_outputs())}; other files are left alone)"
        )
    return out.resolve()


def _choose(options: BuildOptions, out: Path, say: Say) -> _Selection:
    """The documents of the build (see module), checked to fill both splits."""
    roots = _roots(options.sources)
    say(f"reading {', '.join(map(str, roots))}")
    skipped: Counter[str] = Counter()
    candidates = [
        f for i, root in enumerate(roots) for f in _candidates(i, root, out, options, skipped)
    ]
    docs = _select(candidates, options, skipped)
    chosen = _Selection(roots, {s: [d for d in docs if d.split == s] for s in SPLITS}, skipped)
    _check_splits(chosen, options)
    train, held_out = chosen.bytes("train"), chosen.bytes("eval")
    say(
        f"took {len(docs):,} files, {_mb(train + held_out)} (train {_mb(train)}, eval "
        f"{_mb(held_out)}); left out {_describe(skipped)}"
    )
    return chosen


def _roots(sources: tuple[str, ...]) -> list[Path]:
    if not sources:
        roots = default_sources()
        if not roots:
            raise CorpusBuildError(
                "no installed Python packages folder (site.getsitepackages()) exists here; "
                "give the text to read with --source PATH"
            )
        return roots
    roots = []
    for source in sources:
        path = Path(source).expanduser()
        if not path.exists():
            raise CorpusBuildError(f"--source {source}: no such folder or file")
        if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
            raise CorpusBuildError(f"--source {source}: not readable (permissions)")
        roots.append(path.resolve())
    return roots


def _candidates(
    index: int, root: Path, out: Path, options: BuildOptions, skipped: Counter[str]
) -> list[_File]:
    """The text files under ``root`` (or ``root`` itself, a file) within the size limits."""
    if root.is_file():
        listed = [(root.name, root)]
    else:
        listed = []
        for folder, dirs, files in os.walk(root):
            here = Path(folder)
            dirs[:] = [
                d for d in dirs if not d.startswith(".") and d != "__pycache__" and here / d != out
            ]
            listed += [
                ((here / f).relative_to(root).as_posix(), here / f)
                for f in files
                if f.endswith(TEXT_SUFFIXES) and not (here / f).is_symlink()
            ]
    found = []
    for rel, file in listed:
        size = file.stat().st_size
        if size > options.max_file_bytes:
            skipped["over_max_file_bytes"] += 1
        elif size == 0:
            skipped["empty"] += 1
        else:
            found.append(_File(index, rel, file, size))
    return found


def _select(candidates: list[_File], options: BuildOptions, skipped: Counter[str]) -> list[_File]:
    """The documents in selection order (see module), read, hashed and split."""
    ordered = sorted(candidates, key=lambda f: (hashlib.sha256(f.path.encode()).digest(), f.source))
    taken, seen, total = [], set(), 0
    for position, doc in enumerate(ordered):
        if total + doc.bytes > options.max_bytes:
            skipped["over_max_bytes"] += len(ordered) - position
            break
        reason = _unusable(doc, seen)
        if reason:
            skipped[reason] += 1
            continue
        seen.add(doc.sha256)
        fraction = int(doc.sha256[:16], 16) / 2**64
        doc.split = "eval" if fraction < options.eval_fraction else "train"
        taken.append(doc)
        total += doc.bytes
    return taken


def _unusable(doc: _File, seen: set[str]) -> str | None:
    """Why ``doc`` is left out (a ``skipped`` key), or None; sets its sha256 and size."""
    try:
        data = doc.file.read_bytes()
    except OSError:
        return "unreadable"
    doc.bytes, doc.sha256 = len(data), hashlib.sha256(data).hexdigest()
    if b"\0" in data:
        return "binary"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not_utf8"
    if not text.strip():
        return "empty"
    return "duplicate" if doc.sha256 in seen else None


def _check_splits(chosen: _Selection, options: BuildOptions) -> None:
    where, by_split = ", ".join(map(str, chosen.roots)), chosen.splits
    if not any(by_split.values()):
        raise CorpusBuildError(
            f"--source {where}: no text to build a corpus from (no non-empty UTF-8 "
            f"{'/'.join(TEXT_SUFFIXES)} file within --max-file-bytes {options.max_file_bytes} "
            f"and --max-bytes {options.max_bytes}; left out {_describe(chosen.skipped)})"
        )
    for split, docs in by_split.items():
        if not docs:
            taken = sum(map(len, by_split.values()))
            raise CorpusBuildError(
                f"--source {where}: the {split} split is empty ({taken} files, --eval-fraction "
                f"{options.eval_fraction} of them by content hash); add files or change "
                "--eval-fraction"
            )


def _sample(train: list[_File], limit: int) -> list[_File]:
    """The tokenizer's training files: the train split in selection order up to ``limit``
    bytes (at least one file)."""
    running = itertools.accumulate(d.bytes for d in train)
    return [
        d
        for i, (d, total) in enumerate(zip(train, running, strict=True))
        if i == 0 or total <= limit
    ]


def _read(doc: _File) -> str:
    """``doc``'s text, checked to be what the selection read."""
    data = doc.file.read_bytes()
    if hashlib.sha256(data).hexdigest() != doc.sha256:
        raise CorpusBuildError(f"--source: {doc.file} changed during the build; build again")
    return data.decode("utf-8")


def _order(doc: _File) -> tuple[int, str]:
    return doc.source, doc.path


# --- writing ------------------------------------------------------------------------------------


def _write(folder: Path, tokenizer, chosen: _Selection, say: Say) -> dict[str, dict[str, Any]]:
    """Write the tokenizer and each split's token file into ``folder`` (the manifest removed
    first: an interrupted build leaves none); each token file's entry in the manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).unlink(missing_ok=True)
    tokenizer.save(str(folder / TOKENIZER_FILE))
    _write_json(folder / TOKENIZER_CONFIG, tokenizer_config())
    dtype = "uint16" if tokenizer.get_vocab_size() <= 2**16 else "uint32"
    tokenizer.encode_special_tokens = True  # a literal EOS in a document is text (not saved)
    token_files = {}
    for split, docs in chosen.splits.items():
        path = folder / split / TOKEN_FILE
        path.parent.mkdir(exist_ok=True)
        say(f"encoding {split}: {_mb(chosen.bytes(split))} ({len(docs):,} files) -> {path}")
        entry = _encode(tokenizer, sorted(docs, key=_order), path, dtype)
        token_files[split] = {"path": f"{split}/{TOKEN_FILE}", **entry}
    return token_files


def _encode(tokenizer, docs: list[_File], path: Path, dtype: str) -> dict[str, Any]:
    """Write ``docs``' ids, each document followed by EOS, to ``path``; its dtype, token count
    and sha256."""
    eos = tokenizer.token_to_id(EOS)
    digest, count = hashlib.sha256(), 0
    with path.open("wb") as out:
        for batch in _batches(docs, _ENCODE_BATCH_BYTES):
            encodings = tokenizer.encode_batch_fast(
                [_read(d) for d in batch], add_special_tokens=False
            )
            ids = np.fromiter(
                itertools.chain.from_iterable(itertools.chain(e.ids, (eos,)) for e in encodings),
                dtype=dtype,
            ).tobytes()
            out.write(ids)
            digest.update(ids)
            count += len(ids) // np.dtype(dtype).itemsize
    return {"dtype": dtype, "tokens": count, "sha256": digest.hexdigest()}


def _batches(docs: list[_File], limit: int) -> Iterator[list[_File]]:
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += doc.bytes
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _manifest(
    out: str | Path,
    options: BuildOptions,
    chosen: _Selection,
    tokenizer,
    trained_on: dict[str, int],
    token_files: dict[str, dict[str, Any]],
    folder: Path,
) -> dict[str, Any]:
    import tokenizers

    import moec

    sizes = {split: chosen.bytes(split) for split in SPLITS}
    docs = sorted((d for split in chosen.splits.values() for d in split), key=_order)
    return {
        "format": "moec-corpus-1",
        "command": options.command(out),
        "options": {**dataclasses.asdict(options), "sources": [str(r) for r in chosen.roots]},
        "moec_version": moec.__version__,
        "tokenizers_version": tokenizers.__version__,
        "sources": [{"path": str(root), "packages": _packages(root)} for root in chosen.roots],
        "skipped": dict(sorted(chosen.skipped.items())),
        "bytes": {**sizes, "total": sum(sizes.values())},
        "documents": {split: len(files) for split, files in chosen.splits.items()},
        "tokens": {split: entry["tokens"] for split, entry in token_files.items()},
        "token_files": token_files,
        "tokenizer": {
            "path": TOKENIZER_FILE,
            "sha256": _sha256(folder / TOKENIZER_FILE),
            "kind": "byte-level BPE (tokenizers)",
            "vocab_size": tokenizer.get_vocab_size(),
            "eos": EOS,
            "eos_id": tokenizer.token_to_id(EOS),
            "trained_on": trained_on,
        },
        "files": [
            {
                "source": d.source,
                "path": d.path,
                "bytes": d.bytes,
                "sha256": d.sha256,
                "split": d.split,
            }
            for d in docs
        ],
    }


def _packages(root: Path) -> dict[str, str]:
    """The distributions installed in ``root`` (a site-packages folder), name -> version."""
    if not root.is_dir():
        return {}
    found = ((d.metadata["Name"], d.version) for d in metadata.distributions(path=[str(root)]))
    return dict(sorted((str(name), str(version)) for name, version in found if name))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _outputs() -> list[str]:
    """The files a build writes, relative to its folder."""
    return [MANIFEST, TOKENIZER_FILE, TOKENIZER_CONFIG, *(f"{s}/{TOKEN_FILE}" for s in SPLITS)]


def _folder_bytes(folder: Path) -> int:
    return sum((folder / name).stat().st_size for name in _outputs())


def _mb(n: int) -> str:
    return f"{n / MB:,.1f} MB"


def _describe(skipped: Counter[str]) -> str:
    return ", ".join(f"{n:,} {reason}" for reason, n in sorted(skipped.items())) or "nothing"
