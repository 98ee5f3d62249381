"""Training data that needs no download: English text from the Python standard library.

The corpus is the docstrings of ~100 standard-library modules and their public classes and
functions (about 0.7 MB of real prose and examples), tokenized as bytes (token ids 0-255, so
any model with a vocabulary of at least 256 reads it; a smaller one is a :class:`DataError`).
Synthetic batches draw uniform tokens over the model's whole vocabulary. Batches are a pure
function of (seed, step) (the batch size may be a function of the step: batch-size warmup), so a
resumed run sees exactly the batches the uninterrupted run would have seen. Your own corpora
(token files, ``datasets`` folders) are :mod:`moec.corpus`.

:class:`Prefetcher` loads the next batches in a background thread (into pinned memory on CUDA)
while the device runs the current step.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Protocol

from moec.errors import MoecError

if typing.TYPE_CHECKING:  # imported where tensors are made: moec data build --help needs none
    import torch

BYTE_VOCAB = 256

_MODULES = (
    "argparse abc array asyncio base64 bisect bz2 calendar cmath cmd codecs collections colorsys "
    "configparser contextlib copy cProfile csv ctypes dataclasses datetime decimal difflib "
    "doctest email enum filecmp fnmatch fractions ftplib functools getopt gettext glob graphlib "
    "gzip hashlib heapq hmac http.client imaplib inspect io ipaddress itertools json locale "
    "logging lzma math mmap netrc numbers operator optparse os pathlib pickle platform plistlib "
    "poplib pprint queue random re sched secrets selectors shlex shutil signal smtplib socket "
    "sqlite3 ssl stat statistics string struct subprocess sysconfig tarfile tempfile textwrap "
    "threading timeit trace types typing unittest urllib.request uuid warnings wave weakref "
    "xml.etree.ElementTree zipfile zlib zoneinfo"
).split()


def _docstrings(module_name: str) -> list[str]:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return []
    docs = [inspect.getdoc(module) or ""]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        docs.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            docs += [
                inspect.getdoc(member) or ""
                for member_name, member in sorted(vars(obj).items())
                if not member_name.startswith("_") and callable(member)
            ]
    return [d for d in docs if d]


@lru_cache(maxsize=1)
def corpus_bytes() -> torch.Tensor:
    """The corpus as a uint8 tensor (byte-level tokens)."""
    import torch

    text = "\n\n".join(doc for name in _MODULES for doc in _docstrings(name))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


class DataError(MoecError):
    """Data that does not fit the model (its vocabulary)."""


class TextBatches:
    """Random windows of the corpus (or uniform random tokens with ``synthetic=True``).

    ``batch(step)`` returns (inputs, targets) of shape (batch, seq_len), int64, next-token pairs;
    ``batch_size`` is a number or a function of the step. A held-out tail (the last 5%) is kept
    out of training windows for ``eval_batch(index)``.
    """

    def __init__(
        self,
        batch_size: int | Callable[[int], int],
        seq_len: int,
        seed: int = 0,
        synthetic: bool = False,
        vocab_size: int = BYTE_VOCAB,
    ):
        if not synthetic and vocab_size < BYTE_VOCAB:
            raise DataError(
                f"the offline text is byte tokens (ids 0-{BYTE_VOCAB - 1}) but the model's "
                f"vocabulary has {vocab_size}: train it on synthetic data (--synthetic), or "
                f"give the model a vocabulary of at least {BYTE_VOCAB}"
            )
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.synthetic, self.vocab_size = synthetic, vocab_size
        if not synthetic:
            data = corpus_bytes().long()
            split = int(len(data) * 0.95)
            self.train_data, self.eval_data = data[:split], data[split:]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._windows(step, None if self.synthetic else self.train_data)

    def eval_batch(self, index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch ``index``, a pure function of (seed, index): windows of the held-out
        tail, which no training batch reads (uniform tokens when ``synthetic``)."""
        return self._windows(-1 - index, None if self.synthetic else self.eval_data)

    def _windows(self, step: int, data: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 1)
        size = batch_size_at(self.batch_size, max(step, 0))
        if data is None:
            tokens = torch.randint(0, self.vocab_size, (size, self.seq_len + 1), generator=gen)
        else:
            starts = torch.randint(0, len(data) - self.seq_len - 1, (size,), generator=gen)
            tokens = torch.stack([data[s : s + self.seq_len + 1] for s in starts.tolist()])
        return tokens[:, :-1], tokens[:, 1:]


def batch_size_at(batch_size: int | Callable[[int], int], step: int) -> int:
    """A fixed batch size, or a schedule's size at ``step``."""
    return batch_size if isinstance(batch_size, int) else batch_size(step)


class Batches(Protocol):
    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class Prefetcher:
    """``batch(step)`` of ``batches`` on ``device``, loaded ``depth`` steps ahead by one
    background thread (pinned there on CUDA, then copied without blocking the host). Asking for
    another step than the next one (a resume) restarts the read-ahead there; an error in
    loading (a bad token, say) is raised by the ``batch`` call of its step. The batches are
    ``batches``' own, so a pure function of the step stays one. ``stalls`` counts the calls
    whose batch was not loaded yet (the step waited for the data; 0 in a steady run)."""

    def __init__(self, batches: Batches, device: torch.device, depth: int = 2):
        self.batches, self.device, self.depth = batches, device, depth
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moec-data") if depth else None
        self._ahead: deque[tuple[int, Future]] = deque()
        self.stalls = 0

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pool is None:
            return self._to_device(self._load(step))
        if not self._ahead or self._ahead[0][0] != step:  # the first call, or a jump: no stall
            self._cancel()
            self._ahead.extend(
                (s, self._pool.submit(self._load, s)) for s in range(step, step + self.depth)
            )
        elif not self._ahead[0][1].done():
            self.stalls += 1
        _, future = self._ahead.popleft()
        last = self._ahead[-1][0] if self._ahead else step
        self._ahead.append((last + 1, self._pool.submit(self._load, last + 1)))
        return self._to_device(future.result())

    def close(self) -> None:
        """Stop reading ahead (the thread ends after the batch it is loading)."""
        self._cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _cancel(self) -> None:
        for _, future in self._ahead:
            future.cancel()
        self._ahead.clear()

    def _load(self, step: int) -> tuple[torch.Tensor, ...]:
        pair = self.batches.batch(step)
        if self.device.type == "cuda":
            return tuple(t.pin_memory() for t in pair)
        return pair

    def _to_device(self, pair: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.device.type != "cuda":
            return pair[0], pair[1]
        inputs, targets = (t.to(self.device, non_blocking=True) for t in pair)
        return inputs, targets
