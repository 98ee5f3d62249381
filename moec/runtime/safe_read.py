"""Reading checkpoint files without running code from them.

Trust model. A checkpoint folder is data: moec reads tensors, numbers and DCP's index from it,
and never runs code it holds. Two layers, for two different risks:

- **Damage** (a crash, a full disk, a bad copy): :class:`moec.runtime.checkpoint_store.
  CheckpointStore` verifies every file of a checkpoint against its ``manifest.json`` (size and
  sha256; an unlisted, missing or linked file fails) before anything reads it.
- **Someone else's folder**: its author can write any bytes and re-seal the manifest, so the
  manifest proves nothing about intent. What is read is therefore read by loaders that cannot
  run code whatever the bytes: DCP's ``.metadata`` (a pickle) by :class:`MetadataUnpickler`,
  which resolves only DCP's metadata classes, ``torch.Size``, torch dtypes and layouts and
  ``pathlib`` paths; DCP's non-tensor entries (optimizer settings) and the trainer files by
  ``torch.load(weights_only=True)``; DCP's tensor shards are read with ``weights_only=True``
  by DCP itself. A pickle naming anything else fails with :class:`pickle.UnpicklingError`
  before that name is resolved, and the caller skips the checkpoint.

:func:`dcp_load` and :func:`read_metadata` are DCP's ``load`` and ``read_metadata`` with these
loaders; :func:`failure_reason` makes one line of whatever a read raised (DCP's
``CheckpointException``, a ``BaseException``, carries each rank's failure and traceback).
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

METADATA = ".metadata"
"""DCP's index of a checkpoint (written by the coordinating rank)."""

_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by its name
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
}
"""What a ``.metadata`` pickle may name: DCP's metadata dataclasses and the plain values they
hold (every one builds data; none runs anything given other arguments)."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``, resolving only the names in ``_METADATA_GLOBALS`` and
    torch's dtypes, layouts, memory formats and ``torch.Size``; any other name raises
    :class:`pickle.UnpicklingError` before it is imported."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(
                value, (torch.dtype, torch.layout, torch.memory_format)
            ):
                return value
        raise pickle.UnpicklingError(
            f"it names {module}.{name}, which is not one of DCP's metadata classes (moec "
            "unpickles nothing else from a checkpoint)"
        )


class SafeReader(FileSystemReader):
    """DCP's file-system reader with ``.metadata`` read by :class:`MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        path = Path(self.path) / name
        with path.open("rb") as f:
            try:
                metadata = MetadataUnpickler(f).load()
            except pickle.UnpicklingError as exc:
                raise pickle.UnpicklingError(f"{path}: {exc}") from None
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(
                f"{path} holds a {type(metadata).__name__}, not DCP's Metadata"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner with its non-tensor entries read by
    ``torch.load(weights_only=True)`` (the default planner reads them with
    ``weights_only=False``)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = _load_plain(value, f"the entry {read_item.dest_index.fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def dcp_load(state: dict[str, Any], path: str | os.PathLike) -> None:
    """``torch.distributed.checkpoint.load(state, checkpoint_id=path)`` through
    :class:`SafeReader` and :class:`SafePlanner` (collective where a process group exists)."""
    with warnings.catch_warnings():  # DCP warns that no process group exists: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner())


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The DCP index of the checkpoint folder ``path``, read by :class:`SafeReader`."""
    return SafeReader(path).read_metadata()


def load_plain(path: Path) -> Any:
    """A ``torch.save`` file of tensors, numbers and containers (``weights_only=True``)."""
    return _load_plain(path, str(path))


def _load_plain(source: Path | io.BytesIO, what: str) -> Any:
    """``torch.load(source, weights_only=True)``; a refused object raises
    :class:`pickle.UnpicklingError` naming ``what`` and the object in one line."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message: paragraphs of advice (to trust the file) around the line naming it
        named = [line for line in str(exc).splitlines() if "GLOBAL" in line]
        refused = f" ({named[0].strip().split('. ')[0]})" if named else ""
        raise pickle.UnpicklingError(
            f"{what} holds objects other than tensors, numbers and containers{refused}, "
            "which moec does not load"
        ) from None


def failure_reason(exc: BaseException) -> str:
    """One line saying why a read failed: DCP's ``CheckpointException`` by its first rank's
    failure, anything else by its first line."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, failure = next(iter(exc.failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {failure_reason(inner)}"
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
