"""The identity of a training run, recorded in its directory as ``run.json``.

A run is identified by its resolved plan (without ``parallel``: checkpoints load at any
data/expert-parallel degree), its model (class, parameter count and a fingerprint of every
parameter's name, shape and dtype), its data (batch size, sequence length, source, vocabulary)
and its seed: two runs with the same identity see the same batches and build the same
program, so one can continue the other's checkpoints. The model's configuration is recorded
beside them as data (``model.config``: a transformers model's ``config.to_dict()``, a bundled
moec model's config dataclass), for ``moec export`` to rebuild the architecture from without
running code; it is not compared (the fingerprint identifies the model, and another
transformers version may write a config's bookkeeping fields differently).

:func:`check_run_dir` decides what a run may do with a directory before anything is written:

- ``resume``: continue only a run whose recorded identity equals this one
  (:class:`RunIdentityError` lists each differing field otherwise); a directory with
  checkpoints but no ``run.json`` is refused too. ``force`` overrides both.
- a new run: refused where the directory holds checkpoints (another run's, or this run's
  that a resume would continue), unless ``force``, with which the new run replaces them.

:func:`record` writes ``run.json`` (atomically: a crash leaves the old file or the new one; a
link there is replaced, never written through).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from torch import nn

from moec.errors import MoecError
from moec.plan import Plan
from moec.runtime import run_files

RUN_FILE = "run.json"
CHECKPOINTS = "checkpoints"


class RunIdentityError(MoecError):
    """A run directory that this run may not write into or resume from."""


def run_identity(
    model: nn.Module,
    plan: Plan,
    *,
    batch_size: int,
    seq_len: int,
    synthetic: bool,
    vocab: int,
    seed: int,
) -> dict[str, Any]:
    """The JSON-able identity of a run (see module)."""
    resolved = {k: v for k, v in plan.to_dict().items() if k != "parallel"}
    data = {
        "batch_size": batch_size,
        "seq_len": seq_len,
        "source": "synthetic" if synthetic else "text",
        "vocab": vocab,
    }
    identity = {"plan": resolved, "model": model_spec(model), "data": data, "seed": seed}
    return json.loads(json.dumps(identity, default=str))  # tuples as lists, as read back


def model_spec(model: nn.Module) -> dict[str, Any]:
    """The model's class, parameter count and a fingerprint of its parameters' names, shapes
    and dtypes (not their values: those are the seed's and the checkpoint's)."""
    digest = hashlib.sha256()
    count = 0
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
        count += param.numel()
    kind = type(model)
    spec = {
        "class": f"{kind.__module__}.{kind.__qualname__}",
        "parameters": count,
        "fingerprint": digest.hexdigest()[:16],
    }
    config = model_config(model)
    return spec if config is None else {**spec, CONFIG: config}


CONFIG = "config"
"""The key of ``model_spec``'s configuration, recorded but not compared (see module)."""


def model_config(model: nn.Module) -> dict[str, Any] | None:
    """The model's configuration as data: a transformers model's ``config.to_dict()``, a
    dataclass ``cfg`` (moec's bundled models) as a dict; None for other models."""
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_dict", None)):
        return json.loads(json.dumps(config.to_dict(), default=str))
    cfg = getattr(model, "cfg", None)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    return None


def compared(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` (a model spec) without what is recorded but not compared."""
    return {k: v for k, v in spec.items() if k != CONFIG}


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``field: recorded value -> this run's value`` for every dotted field that differs."""
    recorded, current = _comparable(recorded), _comparable(current)
    flat_old, flat_new = _flatten(recorded), _flatten(current)
    return [
        f"{key}: {flat_old.get(key, '<absent>')!r} -> {flat_new.get(key, '<absent>')!r}"
        for key in sorted(flat_old.keys() | flat_new.keys())
        if flat_old.get(key, "<absent>") != flat_new.get(key, "<absent>")
    ]


def check_run_dir(out: Path, identity: dict[str, Any], *, resume: bool, force: bool) -> None:
    """Raise :class:`RunIdentityError` where this run may not use ``out`` (see module), and
    :class:`~moec.runtime.run_files.RunFolderError` where its checkpoints folder is a link."""
    run_files.refuse_link(out / CHECKPOINTS)
    if force:
        return
    checkpoints = sorted(p.name for p in (out / CHECKPOINTS).glob("step_*"))
    if not checkpoints:
        return
    if not resume:
        raise RunIdentityError(
            f"{out} holds the checkpoints of another run ({', '.join(checkpoints[-3:])}): "
            "continue it with --resume (TrainConfig.resume), write to another --out, or "
            "replace it with --force"
        )
    recorded = read(out)
    if recorded is None:
        raise RunIdentityError(
            f"{out} holds checkpoints but no {RUN_FILE}, so this run cannot tell whether they "
            "are its own: resume them anyway with --force, or use another --out"
        )
    diff = differences(recorded, identity)
    if diff:
        raise RunIdentityError(
            f"--resume: the run in {out} differs from this one in "
            + "; ".join(diff)
            + f" ({out / RUN_FILE} -> this run): resume with the recorded settings, write to "
            "another --out, or override with --force"
        )


def read(out: Path) -> dict[str, Any] | None:
    """The identity recorded in ``out``, or None where there is none."""
    path = out / RUN_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RunIdentityError(
            f"{path} cannot be read ({exc}): restore it, or override with --force"
        ) from exc


def record(out: Path, identity: dict[str, Any]) -> None:
    """Write ``identity`` to ``out/run.json``, replacing it (a link there too) in one rename."""
    run_files.write_text(out / RUN_FILE, json.dumps(identity, indent=2, sort_keys=True))


def _comparable(identity: dict[str, Any]) -> dict[str, Any]:
    """``identity`` without the model's configuration (see module)."""
    model = identity.get("model")
    return {**identity, "model": compared(model)} if isinstance(model, dict) else identity


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(value, dict):
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, item in value.items():
        flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat
